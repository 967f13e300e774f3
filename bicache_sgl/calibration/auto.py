"""The first-run profile: ``bicache_profile="auto"`` (server: ``--bicache-profile auto``).

In bicache mode, a model with no ``bicache_profile.json`` beside it and none given is calibrated at
start-up, before the engine sizes its cache and before the server's ready line, within
``calibration_budget_s`` seconds, and the result is cached on disk so that a restart does not
calibrate again. See docs/calibration.md ("A profile on first run") for the measurements behind
the choices below.

What is measured: the ``agreement`` criterion through the real runtime, on a second, ``naive``
engine that the caller builds (``engine_factory``; this module never imports the engine), with the
``first_request`` cached context (the state the runtime really stores). Two meters:

1. first step: the whole generation region unmasked in ONE step with ``ignore_eos``, i.e. the
   top-1 of the request's first forward at every generated position, at every depth 0..L (what
   the online audit checks; a model that answers EOS at once is still compared position by
   position);
2. decoding: greedy decoding with the engine's decode defaults at depths 0..b1 (b1: what step 1
   allows), the end-to-end check; it can only lower a bucket. A sample whose every output is
   empty (EOS at once) says nothing and is not counted.

Err safe: in each bucket, per prompt shape (group), b = the largest d such that every depth 0..d
has mean agreement >= ``MIN_AGREEMENT``; the bucket takes the minimum over shapes and over the two
meters; the table is the running minimum from high r down (``safe_table``). Buckets are measured
from high r to low r, round by round, so a budget that runs out leaves the LOW buckets unmeasured;
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..bicache.profile import PROFILE_AUTO, PROFILE_FILENAME, PROFILE_NONE, BicacheProfile, find_profile
from .data import (
    DEFAULT_FRACTIONS,
    DataError,
    Record,
    Sample,
    Task,
    first_request_rest,
    gen_candidates,
    plan_tasks,
    read_data,
    tokenize,
)
from .measure import AgreementMeter, depth_from_agreement, mean_rows, safe_table
from .synth import SHAPES, synthesize

log = logging.getLogger(__name__)

CACHE_ENV = "BICACHE_SGL_CACHE"  # cache root; default ~/.cache/bicache_sgl
# part of the cache key: bump when what is measured changes (2: pairs keep their question whole;
# 3: four prompt shapes, chat and a shared head included)
VERSION = 3
MIN_AGREEMENT = 0.9
GEN_LENGTH = 32
PROMPTS_PER_GROUP = 4  # synthesised prompts of each shape (synth.SHAPES)
MAX_DATA_SAMPLES = 24  # samples used from --calibration-data
DECODE_ROUNDS = 2  # decoding check: samples per (shape, bucket)
FIRST_STEP_SHARE = 0.5  # of the budget, for the first-step meter beyond its first round
UNINFORMATIVE_GIVE_UP = 8  # decoding check: stop after this many samples that all answered EOS at once
CONTENT_HASH_MAX_BYTES = 32 << 20  # checkpoint files up to this size are hashed by content
_HEX_BLOB = re.compile(r"^[0-9a-f]{40}$|^[0-9a-f]{64}$")

# counts for tests and logs: calibrations run, cached profiles used
stats = {"calibrations": 0, "cache_hits": 0}


def cache_dir() -> Path:
    """``$BICACHE_SGL_CACHE`` or ``~/.cache/bicache_sgl``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "bicache_sgl"


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def checkpoint_fingerprint(model_path: str | Path) -> dict[str, str]:
    """File name -> identity, for every regular file of the checkpoint folder but the profile:
    the content digest of files up to ``CONTENT_HASH_MAX_BYTES`` (config, tokenizer, small
    weights), the Hugging Face blob digest of a hub snapshot's files (their link target is named
    by it), and size + mtime (ns) of other large files. Hashing gigabytes of weights would make
    every start pay what the cache saves; size + mtime changes whenever the weights are written
    again (a new fine-tune, a new download), a copy that drops the mtime only costs one more
    calibration, and a false hit would need other weights of the same sizes with the same
    nanosecond mtimes."""
    out: dict[str, str] = {}
    for f in sorted(Path(model_path).iterdir()):
        if f.name.startswith(".") or f.name == PROFILE_FILENAME or not f.is_file():
            continue
        real = f.resolve()
        st = real.stat()
        if f.is_symlink() and _HEX_BLOB.match(real.name):
            out[f.name] = "blob:" + real.name
        elif st.st_size <= CONTENT_HASH_MAX_BYTES:
            out[f.name] = "sha256:" + _sha256_file(real)
        else:
            out[f.name] = f"size:{st.st_size},mtime_ns:{st.st_mtime_ns}"
    return out


def resolve_profile(cfg, loaded, engine_factory: Callable[..., Any] | None = None) -> BicacheProfile | None:
    """The profile the engine runs with. ``cfg``: the EngineConfig (``bicache_profile``,
    ``prefix_cache_kind``, ``calibration_budget_s``, ``calibration_data``, ``decode``,
    ``context_length``); ``loaded``: the loaded model (``model``, ``model_config``, ``model_path``,
    ``tokenizer``, ``device``, ``dtype``); ``engine_factory(**overrides)``: builds a second engine
    on the same checkpoint and config with those overrides (the calibration engine).

    ``None`` (default): the profile beside the model, else ``auto`` in bicache mode. ``"none"``:
    no profile. ``"auto"``: the cached first-run profile, else calibrate now. Anything else: that
    file."""
    choice = cfg.bicache_profile
    n_layers = loaded.model_config.n_layers
    bicache = cfg.prefix_cache_kind[0] == "bicache"
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
    return AutoCalibration(cfg, loaded, engine_factory).profile()


@dataclass
class _Item:
    """One measurement: a sample of a group at a bucket, with the first request's question."""

    group: str
    round: int
    sample: Sample
    task: Task
    context: list[int]


class AutoCalibration:
    """One start-up calibration (or cache hit) of one model."""

    def __init__(self, cfg, loaded, engine_factory: Callable[..., Any] | None) -> None:
        self.cfg, self.loaded, self.factory = cfg, loaded, engine_factory
        self.budget = float(cfg.calibration_budget_s)
        self.n_layers = loaded.model_config.n_layers
        mc = loaded.model_config
        self.max_len = min(mc.max_position_embeddings, cfg.context_length or mc.max_position_embeddings)
        self.block = cfg.decode.block_length
        self.gens = gen_candidates(GEN_LENGTH, self.block)
        self.fractions = [float(f) for f in DEFAULT_FRACTIONS]
        self.model_name = Path(loaded.model_path).resolve().name

    # ------------------------------------------------------------------------------------ cache
    def settings(self) -> dict[str, Any]:
        data = self.cfg.calibration_data
        if data is not None:
            p = Path(data)
            if not p.is_file():
                raise DataError(f"calibration data file {data} does not exist")
            src = {"file": "sha256:" + _sha256_file(p)}
        else:
            src = {"synthesised": PROMPTS_PER_GROUP}
        return {"version": VERSION, "data": src, "fractions": self.fractions, "gen": self.gens[0],
                "min_agreement": MIN_AGREEMENT, "decode_rounds": DECODE_ROUNDS,
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

    # ---------------------------------------------------------------------------------- driver
    def profile(self) -> BicacheProfile | None:
        t0 = time.monotonic()
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
        if self.factory is None:
            log.warning("--bicache-profile auto: no engine to calibrate with; depth 0")
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

    def _items(self) -> tuple[list[_Item], dict[str, int]]:
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
        cells: dict[tuple[str, int], list[_Item]] = {}
        for g, ss in by_group.items():
            for t in plan_tasks(ss, self.fractions, self.gens, self.max_len):
                ctx = first_request_rest(ss, t)  # the other question comes from the same shape
                if ctx is not None:
                    lst = cells.setdefault((g, t.bucket), [])
                    lst.append(_Item(g, len(lst), ss[t.sample], t, list(ctx)))
        # rounds, and within a round the buckets from high r down
        order = []
        for rnd in range(max((len(v) for v in cells.values()), default=0)):
            for b in reversed(range(len(self.fractions))):
                for g in sorted(by_group):
                    lst = cells.get((g, b), [])
                    if rnd < len(lst):
                        order.append(lst[rnd])
        return order, {g: len(ss) for g, ss in sorted(by_group.items())}

    def _calibration_engine(self, items: Sequence[_Item]):
        L = self.n_layers
        # the first request's whole question may be longer than the measured request's rest
        longest_prompt = max(max(it.task.prompt_len, it.task.s_len + len(it.context)) for it in items)
        longest_seq = max(max(it.task.seq_len, it.task.s_len + len(it.context) + it.task.gen_len) for it in items)
        if self.loaded.device.type == "cuda":
            import torch
            free, _ = torch.cuda.mem_get_info(self.loaded.device)
            mc = self.loaded.model_config
            weights = sum(p.numel() * p.element_size() for p in self.loaded.model.parameters())
            kv_per_token = 2 * L * mc.n_kv_heads * mc.head_dim * self.loaded.dtype.itemsize
            need = int(1.1 * weights) + (L + 3) * longest_seq * kv_per_token + (1 << 30)
            if free < need:
                log.warning("auto-calibration needs a second copy of the weights (%.1f GiB free, about %.1f GiB "
                            "needed); not calibrating: bicache depth 0. Calibrate offline with python -m "
                            "bicache_sgl.calibrate and pass --bicache-profile FILE", free / 2**30, need / 2**30)
                return None
        return self.factory(prefix_cache="naive", bicache_profile=PROFILE_NONE, bicache_audit_rate=0.0,
                            max_running_requests=L + 1, max_queued_requests=None,
                            max_prefix_cache_tokens=longest_prompt + 1, max_total_tokens=(L + 2) * longest_seq)

    def _calibrate(self, t0: float, key: str, fp: dict[str, str], settings: dict[str, Any]) -> BicacheProfile | None:
        deadline = t0 + self.budget
        items, group_sizes = self._items()
        if not items:
            log.warning("auto-calibration: no prompt reaches any prefix fraction (context %d tokens); depth 0",
                        self.max_len)
            return None
        log.info("auto-calibration data: %s, %d measurements per meter at most",
                 ", ".join(f"{n} {g} prompts" for g, n in group_sizes.items()), len(items))
        engine = self._calibration_engine(items)
        if engine is None:
            return None
        nb = len(self.fractions)
        first: dict[tuple[str, int], list[list[float]]] = {}
        dec: dict[tuple[str, int], list[list[float]]] = {}
        uninformative = [0]
        meter = None
        try:
            meter = AgreementMeter(engine, max(self.gens))

            def first_step(it: _Item) -> None:
                sp = {"block_length": it.task.gen_len, "steps_per_block": 1, "threshold": 0.0, "ignore_eos": True}
                agr, _ = meter.measure(it.sample, it.task, sp, it.context)
                first.setdefault((it.group, it.task.bucket), []).append(agr)

            soft = time.monotonic() + FIRST_STEP_SHARE * max(0.0, deadline - time.monotonic())
            n1, _ = _stage("first-step agreement", items, first_step, deadline, soft)
            b1 = self._depths(first, items)
            todo = [it for it in items if it.round < DECODE_ROUNDS and (b1[it.task.bucket] or 0) > 0]

            def decode(it: _Item) -> None:
                agr, outs = meter.measure(it.sample, it.task, {}, it.context, max_depth=b1[it.task.bucket])
                if any(outs):  # every depth answered EOS at once: agrees, but says nothing
                    dec.setdefault((it.group, it.task.bucket), []).append(agr)
                else:
                    uninformative[0] += 1

            def no_evidence(done: int) -> str | None:
                if done >= UNINFORMATIVE_GIVE_UP and uninformative[0] == done:
                    return "every output so far was EOS at once at every depth (no evidence either way)"
                return None

            n2, why2 = _stage("decoding agreement", todo, decode, deadline, None, no_evidence)
            if n1 < len(items) and time.monotonic() < deadline:  # time left: more first-step samples
                more, _ = _stage("first-step agreement (continued)", items[n1:], first_step, deadline, None)
                n1 += more
                # with more samples; where the decoding check has evidence it checked depths <= the
                # earlier b1 only, and min(b1, b2) below keeps the bucket within what it checked
                b1 = self._depths(first, items)
        finally:
            engine.shutdown()
            engine = meter = None  # the closures hold the meter: drop both before freeing memory
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
                      if any(not first.get((it.group, b)) for it in items if it.task.bucket == b)]
        if unmeasured:
            log.warning("auto-calibration: the budget of %g s ran out before r = %s%% was measured: depth 0 there "
                        "(safe; raise --calibration-budget-s for more reuse at low r)", self.budget,
                        ", ".join(reversed(unmeasured)))
        elif not complete:
            log.warning("auto-calibration: the budget of %g s ran out before every planned measurement; the "
                        "table uses what was measured (--calibration-budget-s for more)", self.budget)
        table = safe_table(self.fractions, raw)
        seconds = time.monotonic() - t0
        groups = sorted(group_sizes)

        def per_group(acc):
            return {g: [_rnd(mean_rows(acc.get((g, b), []))) for b in range(nb)] for g in groups}

        prof = BicacheProfile(
            table=tuple(table), n_layers=self.n_layers, model=self.model_name, criterion="agreement",
            threshold=MIN_AGREEMENT,
            extra={"cached_context": "first_request", "fractions": self.fractions, "depth_raw": raw,
                   "depth_first_step": b1, "depth_decoding": b2,
                   "agreement_first_step": per_group(first), "agreement_decoding": per_group(dec),
                   "samples_first_step": {g: [len(first.get((g, b), [])) for b in range(nb)] for g in groups},
                   "samples_decoding": {g: [len(dec.get((g, b), [])) for b in range(nb)] for g in groups},
                   "decoding_uninformative": uninformative[0],
                   "gen_length": self.gens[0], "block_length": self.block,
                   "auto": {"key": key, "complete": complete, "budget_s": self.budget, "seconds": round(seconds, 2),
                            "checkpoint": fp, "settings": settings}})
        log.info("auto-calibration done in %.1f s%s: %s", seconds, "" if complete else " (budget ran out)",
                 _table_str(prof))
        return prof

    def _depths(self, acc: dict, items: Sequence[_Item], partial_ok: bool = False) -> list[int | None]:
        """Per bucket: the min over groups of the agreement depth, 0 where a group that has a
        sample there was not measured (budget; ``partial_ok``: None, no verdict), None where no
        sample reaches the bucket."""
        out: list[int | None] = []
        for b in range(len(self.fractions)):
            want = {it.group for it in items if it.task.bucket == b}
            if not want:
                out.append(None)
                continue
            depths = []
            for g in sorted(want):
                rows = acc.get((g, b))
                if rows:
                    depths.append(depth_from_agreement(mean_rows(rows), MIN_AGREEMENT))
                elif not partial_ok:
                    depths = [0]
                    break
            out.append(min(depths) if depths else None)
        return out


def _release_memory(device) -> None:
    """Free the calibration engine's weights and pool before the serving engine sizes its own."""
    gc.collect()
    if getattr(device, "type", "cpu") == "cuda":
        import torch
        torch.cuda.empty_cache()


def _rnd(row):
    return None if row is None else [round(float(x), 4) for x in row]


def _table_str(prof: BicacheProfile) -> str:
    return "r% -> depth " + ", ".join(f"{r:g}:{b}" for r, b in prof.table)


def _stage(name: str, items: Sequence[_Item], run: Callable[[_Item], None], deadline: float,
           soft_deadline: float | None, give_up: Callable[[int], str | None] | None = None) -> tuple[int, str | None]:
    """Run ``items`` in order until done or out of time; log progress at 0/25/50/75/100 % (the
    quarters only for 8 items or more). A
    measurement is not started if the mean time of those before it would overrun ``deadline``;
    past ``soft_deadline`` only the first round is finished; ``give_up(done)`` may end the stage
    early with a reason. Returns (how many ran, the give-up reason or None)."""
    total = len(items)
    if total == 0:
        log.info("auto-calibration %s: nothing to measure", name)
        return 0, None
    t0 = time.monotonic()
    log.info("auto-calibration %s: 0%% (0/%d)", name, total)
    done, next_mark, stopped, reason = 0, 25, "", None
    for it in items:
        now = time.monotonic()
        est = (now - t0) / done if done else 0.0
        if now + est > deadline:
            stopped = "budget spent"
            break
        if soft_deadline is not None and it.round > 0 and now + est > soft_deadline:
            stopped = "its share of the budget spent"
            break
        reason = give_up(done) if give_up is not None else None
        if reason:
            stopped = reason
            break
        run(it)
        done += 1
        pct = 100 * done // total
        if pct >= next_mark and done < total and total >= 8:
            log.info("auto-calibration %s: %d%% (%d/%d, %.1f s)", name, pct, done, total, time.monotonic() - t0)
            while next_mark <= pct:
                next_mark += 25
    log.info("auto-calibration %s: %d%% (%d/%d) in %.1f s%s", name, 100 * done // total, done, total,
             time.monotonic() - t0, f", stopped: {stopped}" if stopped else "")
    return done, reason
