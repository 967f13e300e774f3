"""The first-run profile: ``bicache_profile="auto"`` (server: ``--bicache-profile auto``).

In bicache mode, a model with no ``bicache_profile.json`` beside it and none given is calibrated at
start-up, before the engine sizes its cache and before the server's ready line, within
``calibration_budget_s`` seconds, and the result is cached on disk so that a restart does not
calibrate again. See docs/calibration.md ("A profile on first run") for the measurements behind
the choices below.

What is measured: the ``agreement`` criterion through the real runtime, on the engine's own
loaded model: the engine hands in ``measure_stack(**sizes)``, which builds a ``naive`` measurement
stack (pool, cache, scheduler) on that model, never a second copy of the weights (this module never
imports the engine); the ``first_request`` cached context (the state the runtime really stores).
The loop, its progress and its budget are the measurement driver's (``driver.Driver``). Two meters:

1. first step: the whole generation region unmasked in ONE step with ``ignore_eos``, i.e. the
   top-1 of the request's first forward at every generated position, at every depth 0..L (what
   the online audit checks; a model that answers EOS at once is still compared position by
   position);
2. decoding: greedy decoding with the engine's decode defaults at depths 0..b1 (b1: what step 1
   allows), the end-to-end check; it can only lower a bucket. A sample whose every output is
   empty (EOS at once) says nothing and is not counted.

Err safe, and exact (issue 34): in each bucket, per prompt shape (group), b = the largest d such
that every sample's output equals cache off's, token for token, at every depth 0..d (with
``bicache_tolerance`` > 0: the 95% upper bound on the flip rate is at most that,
``bicache.profile.tolerated``); the bucket takes the minimum over shapes and over the two meters;
the table is the running minimum from high r down (``safe_table``). Buckets are measured from
high r to low r, round by round, so a budget that runs out leaves the LOW buckets unmeasured;
they get depth 0 (and everything below a bucket is capped by it anyway).
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..bicache.policy import uses_profile
from ..bicache.profile import CRITERION_EXACT, PROFILE_AUTO, PROFILE_FILENAME, BicacheProfile, find_profile
from .data import DEFAULT_FRACTIONS, DataError, Record, Sample, gen_candidates, plan_tasks, read_data, tokenize
from .driver import Driver, Item, MeasureStack, Tally, by_rounds, items_for
from .measure import exact_bucket, first_flip, safe_table
from .profile_cache import CACHE_ENV, cache_dir, checkpoint_fingerprint, sha256_file
from .synth import SHAPES, synthesize

log = logging.getLogger(__name__)

__all__ = ["CACHE_ENV", "VERSION", "AutoCalibration", "cache_dir", "checkpoint_fingerprint", "resolve_profile", "stats"]

# part of the cache key: bump when what is measured changes (2: pairs keep their question whole;
# 3: four prompt shapes, chat and a shared head included; 4: the exact criterion, six shapes)
VERSION = 4
GEN_LENGTH = 32
PROMPTS_PER_GROUP = 4  # synthesised prompts of each shape (synth.SHAPES)
MAX_DATA_SAMPLES = 24  # samples used from --calibration-data
# A first-run profile measures a few samples per bucket within its budget: its bound on the flip
# rate is loose (0 of 11 samples: 24%), which is why it starts on probation (every reusing request
# audited and answered exact until its bucket earns trust). A shipped or offline-calibrated profile
# is held to bicache.profile.MAX_BOUND (5%) instead.
AUTO_MAX_BOUND = 0.25
DECODE_ROUNDS = 2  # decoding check: samples per (shape, bucket)
FIRST_STEP_SHARE = 0.5  # of the budget, for the first-step meter beyond its first round
UNINFORMATIVE_GIVE_UP = 8  # decoding check: stop after this many samples that all answered EOS at once

# counts for tests and logs: calibrations run, cached profiles used
stats = {"calibrations": 0, "cache_hits": 0}


def resolve_profile(cfg, loaded, measure_stack: Callable[..., MeasureStack] | None = None) -> BicacheProfile | None:
    """The profile the engine runs with. ``cfg``: the EngineConfig (``bicache_profile``,
    ``prefix_cache_kind``, ``calibration_budget_s``, ``calibration_data``, ``decode``,
    ``context_length``); ``loaded``: the loaded model (``model``, ``model_config``, ``model_path``,
    ``tokenizer``, ``device``, ``dtype``); ``measure_stack(max_running=, max_prefix_cache_tokens=,
    max_total_tokens=)``: builds the calibration's ``naive`` measurement stack on that same loaded
    model (``bicache_sgl.engine.engine.measurement_stack``); it may raise ``MemoryError``.

    ``None`` (default): the profile beside the model, else ``auto`` in bicache mode. ``"none"``:
    no profile. ``"auto"``: the cached first-run profile, else calibrate now. Anything else: that
    file. A profile of the ``exact`` criterion is served at ``cfg.bicache_tolerance`` (its table
    re-derived from its per-bucket counts, ``BicacheProfile.at_tolerance``)."""
    prof = _resolve(cfg, loaded, measure_stack)
    tol = float(getattr(cfg, "bicache_tolerance", 0.0) or 0.0)
    if prof is not None and tol > 0:
        prof = prof.at_tolerance(tol)
    return prof


def _resolve(cfg, loaded, measure_stack: Callable[..., MeasureStack] | None) -> BicacheProfile | None:
    choice = cfg.bicache_profile
    n_layers = loaded.model_config.n_layers
    bicache = uses_profile(cfg.prefix_cache)
    if choice is None:
        prof = find_profile(loaded.model_path, None, n_layers)
        if prof is not None or not bicache:
            return prof
        log.info("no %s beside %s and no --bicache-profile: using a first-run profile (--bicache-profile auto; "
                 "'none' for depth 0)", PROFILE_FILENAME, loaded.model_path)
        choice = PROFILE_AUTO
    if choice != PROFILE_AUTO:
        return find_profile(loaded.model_path, choice, n_layers)
    if not bicache:
        log.info("--bicache-profile auto: prefix cache mode %s uses no profile; not calibrating", cfg.prefix_cache)
        return None
    return AutoCalibration(cfg, loaded, measure_stack).profile()


def _now() -> float:
    """The budget's clock (looked up at each call, so that a test can replace this module's time)."""
    return time.monotonic()


class AutoCalibration:
    """One start-up calibration (or cache hit) of one model."""

    def __init__(self, cfg, loaded, measure_stack: Callable[..., MeasureStack] | None) -> None:
        self.cfg, self.loaded, self.measure_stack = cfg, loaded, measure_stack
        self.budget = float(cfg.calibration_budget_s)
        self.n_layers = loaded.model_config.n_layers
        mc = loaded.model_config
        self.max_len = min(mc.max_position_embeddings, cfg.context_length or mc.max_position_embeddings)
        self.block = cfg.decode.block_length
        self.gens = gen_candidates(GEN_LENGTH, self.block)
        self.fractions = [float(f) for f in DEFAULT_FRACTIONS]
        self.model_name = Path(loaded.model_path).resolve().name
        self.tolerance = float(getattr(cfg, "bicache_tolerance", 0.0) or 0.0)

    # ------------------------------------------------------------------------------------ cache
    def settings(self) -> dict[str, Any]:
        data = self.cfg.calibration_data
        if data is not None:
            p = Path(data)
            if not p.is_file():
                raise DataError(f"calibration data file {data} does not exist")
            src = {"file": "sha256:" + sha256_file(p)}
        else:
            src = {"synthesised": PROMPTS_PER_GROUP}
        return {"version": VERSION, "data": src, "fractions": self.fractions, "gen": self.gens[0],
                "criterion": CRITERION_EXACT, "tolerance": self.tolerance,
                "max_bound": AUTO_MAX_BOUND, "decode_rounds": DECODE_ROUNDS,
                "decode": {k: v for k, v in sorted(vars(self.cfg.decode).items())},
                "dtype": str(self.loaded.dtype), "device": self.loaded.device.type, "max_len": self.max_len}

    def cache_key(self, settings: dict[str, Any]) -> tuple[str, dict[str, str]]:
        fp = checkpoint_fingerprint(self.loaded.model_path)
        blob = json.dumps({"checkpoint": fp, "settings": settings}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest(), fp

    def cache_path(self, key: str) -> Path:
        name = re.sub(r"[^A-Za-z0-9._-]+", "_", self.model_name)[:64] or "model"
        return cache_dir() / "profiles" / f"{name}-{key[:24]}.json"

    def _cached(self, path: Path) -> BicacheProfile | None:
        if not path.is_file():
            return None
        try:
            prof = BicacheProfile.load(path)
        except ValueError as e:
            log.warning("ignoring the cached profile %s (%s); calibrating again", path, e)
            return None
        meta = prof.extra.get("auto") or {}
        if prof.n_layers != self.n_layers:
            log.warning("ignoring the cached profile %s: it is for %d layers", path, prof.n_layers)
            return None
        if not meta.get("complete", False) and float(meta.get("budget_s", 0.0)) < self.budget - 1e-9:
            log.info("the cached profile %s was cut short by a budget of %g s; calibrating again with %g s",
                     path, float(meta.get("budget_s", 0.0)), self.budget)
            return None
        return prof

    def _save(self, path: Path, prof: BicacheProfile) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            prof.save(tmp)
            os.replace(tmp, path)  # atomic: a concurrent start reads the old file or the new one
            log.info("bicache profile cached at %s", path)
        except OSError as e:
            log.warning("could not write the profile cache %s (%s); the next start calibrates again", path, e)

    # ------------------------------------------------------------------------------ front end
    def profile(self) -> BicacheProfile | None:
        """The cached profile for this model and these settings, else one calibrated now (and
        cached); None (depth 0) when calibrating fails or cannot run."""
        t0 = _now()
        settings = self.settings()
        key, fp = self.cache_key(settings)
        path = self.cache_path(key)
        cached = self._cached(path)
        if cached is not None:
            stats["cache_hits"] += 1
            meta = cached.extra.get("auto", {})
            log.info("using cached profile %s (key %s, calibrated in %.1f s%s): %s", path, key[:12],
                     float(meta.get("seconds", 0.0)), "" if meta.get("complete", True) else ", partial",
                     _table_str(cached))
            return cached
        if self.measure_stack is None:
            log.warning("--bicache-profile auto: no measurement stack to calibrate with; depth 0")
            return None
        stats["calibrations"] += 1
        log.info("calibrating a bicache profile for %s (%d layers) within %g s (--calibration-budget-s); "
                 "cache key %s", self.model_name, self.n_layers, self.budget, key[:12])
        try:
            prof = self._calibrate(t0, key, fp, settings)
        except DataError:
            raise
        except Exception:
            log.exception("auto-calibration failed; serving with bicache depth 0 (no reuse)")
            return None
        if prof is not None:
            self._save(path, prof)
        return prof

    def _items(self) -> tuple[list[Item], dict[str, int]]:
        """The measurements in the order they run (``driver.by_rounds``), and the group sizes."""
        tok = self.loaded.tokenizer
        if self.cfg.calibration_data is not None:
            records = read_data(self.cfg.calibration_data)
            groups = {r.line: "data" for r in records}
            samples = tokenize(records, tok.encode, MAX_DATA_SAMPLES)
            if not samples:
                raise DataError(f"{self.cfg.calibration_data}: no usable samples")
        else:
            hi = max(16, min(320, self.max_len - self.gens[0] - 8))
            made = synthesize(tok, len(SHAPES) * PROMPTS_PER_GROUP, min_tokens=min(128, hi), max_tokens=hi)
            records = [Record(i + 1, "prompt", text=text) for i, (_, text) in enumerate(made)]
            groups = {i + 1: g for i, (g, _) in enumerate(made)}
            samples = tokenize(records, tok.encode, None)
        by_group: dict[str, list[Sample]] = {}
        for s in samples:
            by_group.setdefault(groups[s.line], []).append(s)
        items: list[Item] = []
        for g, ss in by_group.items():  # the first request's question comes from the same shape
            items += items_for(ss, plan_tasks(ss, self.fractions, self.gens, self.max_len), g, "first_request")
        return by_rounds(items, len(self.fractions)), {g: len(ss) for g, ss in sorted(by_group.items())}

    def _stack(self, items: Sequence[Item]) -> MeasureStack | None:
        """The measurement stack, sized for ``items``; None (and a warning) when it does not fit."""
        L = self.n_layers
        # the first request's whole question may be longer than the measured request's rest
        longest_prompt = max(max(it.task.prompt_len, it.task.s_len + len(it.context)) for it in items)
        longest_seq = max(max(it.task.seq_len, it.task.s_len + len(it.context) + it.task.gen_len) for it in items)
        try:
            return self.measure_stack(max_running=L + 1, max_prefix_cache_tokens=longest_prompt + 1,
                                      max_total_tokens=(L + 2) * longest_seq)
        except MemoryError as e:
            log.warning("auto-calibration: not enough device memory for its K/V (%s); not calibrating: bicache "
                        "depth 0. Calibrate offline with python -m bicache_sgl.calibrate and pass "
                        "--bicache-profile FILE", e)
            return None

    def _calibrate(self, t0: float, key: str, fp: dict[str, str], settings: dict[str, Any]) -> BicacheProfile | None:
        deadline = t0 + self.budget
        items, group_sizes = self._items()
        if not items:
            log.warning("auto-calibration: no prompt reaches any prefix fraction (context %d tokens); depth 0",
                        self.max_len)
            return None
        log.info("auto-calibration data: %s, %d measurements per meter at most",
                 ", ".join(f"{n} {g} prompts" for g, n in group_sizes.items()), len(items))
        stack = self._stack(items)
        if stack is None:
            return None
        nb = len(self.fractions)
        first, dec = Tally(), Tally()
        uninformative = [0]
        driver = None
        try:
            driver = Driver(self.loaded.model, self.loaded.model_config.mask_token_id, self.loaded.device, stack,
                            gen_length=max(self.gens), log=log, clock=_now)

            def first_step(it: Item) -> None:
                sp = {"block_length": it.task.gen_len, "steps_per_block": 1, "threshold": 0.0, "ignore_eos": True}
                first.add(it, [first_flip(driver.agreement(it, sp)[1]), self.n_layers])

            soft = _now() + FIRST_STEP_SHARE * max(0.0, deadline - _now())
            n1, _ = driver.run("auto-calibration first-step agreement", items, first_step, deadline=deadline,
                               soft_deadline=soft)
            b1 = self._depths(first, items)
            todo = [it for it in items if it.round < DECODE_ROUNDS and (b1[it.task.bucket] or 0) > 0]

            def decode(it: Item) -> None:
                top = b1[it.task.bucket]
                _, outs = driver.agreement(it, {}, max_depth=top)
                if any(outs):  # every depth answered EOS at once: agrees, but says nothing
                    dec.add(it, [first_flip(outs), top])
                else:
                    uninformative[0] += 1

            def no_evidence(done: int) -> str | None:
                if done >= UNINFORMATIVE_GIVE_UP and uninformative[0] == done:
                    return "every output so far was EOS at once at every depth (no evidence either way)"
                return None

            n2, why2 = driver.run("auto-calibration decoding agreement", todo, decode, deadline=deadline,
                                  give_up=no_evidence)
            if n1 < len(items) and _now() < deadline:  # time left: more first-step samples
                more, _ = driver.run("auto-calibration first-step agreement (continued)", items[n1:], first_step,
                                     deadline=deadline)
                n1 += more
                # with more samples; where the decoding check has evidence it checked depths <= the
                # earlier b1 only, and min(b1, b2) below keeps the bucket within what it checked
                b1 = self._depths(first, items)
        finally:
            stack = driver = None  # the closures hold the driver: drop both before freeing memory
            _release_memory(self.loaded.device)
        if uninformative[0]:
            log.info("auto-calibration decoding agreement: %d of %d samples answered EOS at once at every depth "
                     "(no evidence either way; the first-step result stands there)", uninformative[0], n2)
        b2 = self._depths(dec, todo, partial_ok=True)
        raw: list[int | None] = []
        for b in range(nb):
            d = b1[b]
            if d is not None and b2[b] is not None:
                d = min(d, b2[b])
            raw.append(d)
        complete = n1 == len(items) and (n2 == len(todo) or why2 is not None)
        unmeasured = [f"{self.fractions[b]:g}" for b in range(nb)
                      if any(not first.get(it.group, b) for it in items if it.task.bucket == b)]
        if unmeasured:
            log.warning("auto-calibration: the budget of %g s ran out before r = %s%% was measured: depth 0 there "
                        "(safe; raise --calibration-budget-s for more reuse at low r)", self.budget,
                        ", ".join(reversed(unmeasured)))
        elif not complete:
            log.warning("auto-calibration: the budget of %g s ran out before every planned measurement; the "
                        "table uses what was measured (--calibration-budget-s for more)", self.budget)
        table = safe_table(self.fractions, raw)
        seconds = _now() - t0
        groups = sorted(group_sizes)

        def per_group(acc: Tally):
            return {g: [exact_bucket(_flips(acc, g, b), self.tolerance, 1.0) for b in range(nb)] for g in groups}

        prof = BicacheProfile(
            table=tuple(table), n_layers=self.n_layers, model=self.model_name, criterion=CRITERION_EXACT,
            threshold=self.tolerance,
            extra={"cached_context": "first_request", "fractions": self.fractions, "depth_raw": raw,
                   "tolerance": self.tolerance, "confidence": 0.95, "max_bound": AUTO_MAX_BOUND,
                   "depth_first_step": b1, "depth_decoding": b2,
                   "buckets": [self._bucket(first, dec, groups, b) for b in range(nb)],
                   "exact_first_step": per_group(first), "exact_decoding": per_group(dec),
                   "samples_first_step": {g: [len(first.get(g, b)) for b in range(nb)] for g in groups},
                   "samples_decoding": {g: [len(dec.get(g, b)) for b in range(nb)] for g in groups},
                   "decoding_uninformative": uninformative[0],
                   "gen_length": self.gens[0], "block_length": self.block,
                   "auto": {"key": key, "complete": complete, "budget_s": self.budget, "seconds": round(seconds, 2),
                            "checkpoint": fp, "settings": settings}})
        log.info("auto-calibration done in %.1f s%s: %s", seconds, "" if complete else " (budget ran out)",
                 _table_str(prof))
        return prof

    def _bucket(self, first: Tally, dec: Tally, groups: Sequence[str], b: int) -> dict | None:
        """The bucket's JSON over every shape, from the first-step samples (n); where the decoding
        meter has evidence, the counts reach only as deep as it measured (b1), and at each depth the
        larger of the two meters' disagreement counts is kept."""
        bk = exact_bucket([f for g in groups for f in _flips(first, g, b)], self.tolerance, AUTO_MAX_BOUND)
        dk = exact_bucket([f for g in groups for f in _flips(dec, g, b)], self.tolerance, AUTO_MAX_BOUND)
        if bk is None:
            return None
        if dk is not None:
            by = [max(x, y) for x, y in zip(bk["disagreements_by_depth"], dk["disagreements_by_depth"])]
            bk = exact_bucket([(next((d for d, k in enumerate(by) if k > i), len(by)), len(by) - 1)
                               for i in range(bk["n"])], self.tolerance, AUTO_MAX_BOUND)
        return {"r": self.fractions[b], **bk}

    def _depths(self, acc: Tally, items: Sequence[Item], partial_ok: bool = False) -> list[int | None]:
        """Per bucket: the exact depth (``measure.exact_bucket``) of the samples of every shape
        together (a disagreement in any shape counts; the bound is over them all, at most
        ``AUTO_MAX_BOUND``), 0 where a shape that has a sample there was not measured (budget;
        ``partial_ok``: the shapes measured), None where no sample reaches the bucket or
        (``partial_ok``) none was measured."""
        out: list[int | None] = []
        for b in range(len(self.fractions)):
            want = {it.group for it in items if it.task.bucket == b}
            if not want:
                out.append(None)
                continue
            rows = [f for g in sorted(want) for f in _flips(acc, g, b)]
            if not partial_ok and any(not _flips(acc, g, b) for g in want):
                out.append(0)
            elif not rows:
                out.append(None)
            else:  # None: too few samples for a verdict (no table entry)
                out.append(exact_bucket(rows, self.tolerance, AUTO_MAX_BOUND)["depth"])
        return out


def _release_memory(device) -> None:
    """Free the measurement stack's pool before the serving engine sizes its own."""
    gc.collect()
    if getattr(device, "type", "cpu") == "cuda":
        import torch
        torch.cuda.empty_cache()


def _flips(acc: Tally, group: str, bucket: int) -> list[tuple[int, int]]:
    """The (first flip, deepest depth measured) of each sample of a (group, bucket)."""
    return [(int(f), int(t)) for f, t in acc.get(group, bucket)]


def _table_str(prof: BicacheProfile) -> str:
    return "r% -> depth " + ", ".join(f"{r:g}:{b}" for r, b in prof.table)
