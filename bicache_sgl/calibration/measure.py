"""Measurement: the K/V-cosine meter, the end-to-end agreement meter and the depth rules.

Both meters compare a *cached* state of the shared prefix S with the state S has inside the
target request's own forward. Where the cached state comes from is ``context``:

- ``None`` (``prefix_only``): S alone through the model, as an explicit ``cache_prefix`` request
  fills the prefix cache;
- a token list (``first_request``): the prompt tokens after S of the request that first computed
  S (``data.first_request_rest``). The cached state is S sliced from the forward of S + those
  tokens + that request's MASK generation region: what the runtime stores when a request inserts
  its prompt into the prefix cache after its first forward.

The depth rules err safe: a depth passes only when every smaller depth passes too, and the
r -> b table never exceeds a measured bucket at or above r (``BicacheProfile.monotone``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from ..bicache.planner import last_boundary
from ..bicache.profile import MAX_BOUND, BicacheProfile, bucket_depth, flip_bound
from .data import (
    DEFAULT_CACHED_CONTEXT,
    DEFAULT_FRACTIONS,
    DEFAULT_PAIR_TOLERANCE,
    Sample,
    Task,
    common_prefix_len,
    first_request_rest,
    gen_candidates,
    plan_tasks,
)

log = logging.getLogger("bicache_sgl.calibrate")

DEPTH_RULES = ("leading", "resume")


def token_cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean over tokens of the cosine similarity of rows (trailing dims flattened), in float64.
    Identical rows give exactly 1.0."""
    a = a.reshape(a.shape[0], -1).double()
    b = b.reshape(b.shape[0], -1).double()
    dot = (a * b).sum(-1)
    den = torch.sqrt((a * a).sum(-1) * (b * b).sum(-1))
    cos = torch.where(den > 0, dot / den.clamp_min(1e-300), torch.ones_like(dot))
    return float(cos.mean())


class SimilarityMeter:
    """K / V / h similarity per layer between the cached state of S and its in-context state."""

    def __init__(self, model, mask_id: int, device) -> None:
        self.model, self.mask_id, self.device = model, mask_id, device
        self._full_key = None
        self._full_states = None

    def _states(self, ids: list[int]):
        x = torch.tensor(ids, dtype=torch.long, device=self.device)
        return self.model.forward_dense(x, return_states=True)[1]

    @torch.no_grad()
    def measure(self, sample: Sample, task: Task,
                context: Sequence[int] | None = None) -> tuple[list[float], list[float], list[float]]:
        """Per-layer (K, V, h) similarity of S. ``context``: see the module docstring."""
        key = (task.sample, task.prompt_len, task.gen_len)
        if key != self._full_key:  # prompts: one full forward serves every bucket of the sample
            self._full_states = self._states(sample.ids[:task.prompt_len] + [self.mask_id] * task.gen_len)
            self._full_key = key
        S = task.s_len
        s_ids = list(sample.ids[:S])
        if context is None:
            cached = self._states(s_ids)
        else:
            cached = self._states(s_ids + list(context) + [self.mask_id] * task.gen_len)
        sk, sv, sh = [], [], []
        for (h_c, k_c, v_c), (h_f, k_f, v_f) in zip(cached, self._full_states):
            sk.append(token_cosine(k_c[:S], k_f[:S]))
            sv.append(token_cosine(v_c[:S], v_f[:S]))
            sh.append(token_cosine(h_c[:S], h_f[:S]))
        return sk, sv, sh


def token_agreement(a: Sequence[int], b: Sequence[int]) -> float:
    """Fraction of positions holding the same token, over the longer output (outputs stop at
    EOS, so a shorter output counts its missing positions as disagreements); 1.0 if both empty."""
    n = max(len(a), len(b))
    if n == 0:
        return 1.0
    return sum(1 for x, y in zip(a, b) if x == y) / n


class NothingReused(RuntimeError):
    """The runtime reuses nothing of this measurement's shared prefix (its span cut is at 0): the
    item says nothing about any depth and is skipped (``Driver.run``)."""


def span_end(stack, prompt: Sequence[int], lcp: int) -> int:
    """Where the runtime's reused span ends for a prompt sharing ``lcp`` leading tokens with a
    capture that saw more than them: the last segment boundary at or before ``lcp``
    (``bicache.planner.span_cuts``), from the stack's own boundary tokens (its request factory's
    ``segments``); ``lcp`` when the stack does not cut the span."""
    seg = getattr(getattr(stack, "requests", None), "segments", None)
    if seg is None:
        return lcp
    return last_boundary(seg.positions(prompt), lcp)


class AgreementMeter:
    """End-to-end: the same request at every depth 0..L through a ``naive`` prefix cache (its nodes
    hold all L layers) that holds S from a prefix-only request or from the first request of
    ``context``.

    The stack is passed in by the caller and only duck-typed (this package sits below
    ``bicache_sgl.engine`` and never imports it): it needs ``n_layers``, ``flush()`` and
    ``run(greqs)``, which runs the requests to completion, queued together so that one admission
    round sees them all (in arrival order, no prefix-aware deferral: every one of them must match
    exactly S and nothing a sibling inserted), and returns each one's final event (``error``,
    ``output_ids``, ``meta_info``). ``bicache_sgl.engine.engine.measurement_stack`` builds one on
    the already loaded model."""

    def __init__(self, stack, gen_length: int) -> None:
        self.stack = stack
        self.L = stack.n_layers
        self.gen_length = gen_length

    def _run(self, greqs) -> list:
        results = self.stack.run_sync(greqs)
        for ev in results:
            if ev.error:
                raise RuntimeError(f"calibration request failed: {ev.error}")
        return results

    def measure(self, sample: Sample, task: Task, sampling: dict, context: Sequence[int] | None = None,
                max_depth: int | None = None) -> tuple[list[float], list[list[int]]]:
        """Agreement with depth 0 of the request at each depth 0..``max_depth`` (default L), and
        the outputs."""
        from ..config import SamplingParams
        from ..io_struct import GenerateRequest, span_depth
        self.stack.flush()
        params = SamplingParams.from_dict({**sampling, "max_new_tokens": min(self.gen_length, task.gen_len),
                                           "temperature": 0.0})
        s_ids = list(sample.ids[:task.s_len])
        prompt = list(sample.ids[:task.prompt_len])
        if context is None:
            self._run([GenerateRequest(s_ids, SamplingParams(max_new_tokens=0))])
            expect = task.s_len
        else:
            # The first request inserts its whole prompt, computed in its own context; the target
            # (whose last prompt token is always recomputed) matches S plus any leading tokens
            # the two questions share.
            self._run([GenerateRequest(s_ids + list(context), params)])
            # the runtime's span cut (docs/prefix_cache.md "Where the reused span ends"): the rows
            # of that first request serve only up to the last segment boundary at or before the
            # point where the two prompts part; measured exactly as it is served
            lcp = task.s_len + common_prefix_len(context, prompt[task.s_len:])
            expect = min(span_end(self.stack, prompt, lcp), len(prompt) - 1)
            if expect == 0:
                raise NothingReused("no segment boundary before the shared prefix ends: nothing is reused")
        top = self.L if max_depth is None else max(0, min(int(max_depth), self.L))
        evs = self._run([GenerateRequest(prompt, params, bicache_depth=d) for d in range(top + 1)])
        for d, ev in enumerate(evs):
            m = ev.meta_info
            if span_depth(m) != d or (d > 0 and m.get("reused_prefix_tokens") != expect):
                raise RuntimeError(
                    f"calibration request at depth {d} reused {m.get('reused_prefix_tokens')} prefix tokens at depth "
                    f"{span_depth(m)}; expected {expect} at depth {d} (is the prefix cache large enough?)")
        outs = [list(ev.output_ids) for ev in evs]
        return [token_agreement(outs[0], o) for o in outs], outs


# ---------------------------------------------------------------------------------- decisions
def depth_from_similarity(sim: Sequence[float], threshold: float, rule: str = "resume") -> int:
    """``leading``: number of leading layers with sim >= threshold. ``resume``: the largest d with
    layers 0..d all >= threshold (layer d's K/V of S come from the cached residual stream), L if
    every layer passes."""
    L = len(sim)
    c = 0
    while c < L and sim[c] >= threshold:
        c += 1
    if rule == "leading" or c == L:
        return c
    return max(0, c - 1)


def depth_from_agreement(agr: Sequence[float], min_agreement: float) -> int:
    """The largest depth d such that every depth 0..d agrees with cache-off on >= min_agreement of
    the tokens (depth 0 is cache-off itself, so it always passes). A deeper depth that passes
    after a failing one is noise, not evidence: it is not taken."""
    best = 0
    for d, a in enumerate(agr):
        if d > 0 and a < min_agreement - 1e-12:
            break
        best = d
    return best


def first_flip(outs: Sequence[Sequence[int]]) -> int:
    """``outs[d]``: one sample's greedy output at depth d (``outs[0]``: cache off). The first depth
    whose output is not token for token cache off's (the whole generated region: past EOS too when
    the request ignored EOS); ``len(outs)`` if every measured depth equals it."""
    ref = list(outs[0])
    for d in range(1, len(outs)):
        if list(outs[d]) != ref:
            return d
    return len(outs)


def exact_bucket(flips: Sequence[tuple[int, int]], tolerance: float = 0.0,
                 max_bound: float = MAX_BOUND) -> dict | None:
    """The ``exact`` criterion's verdict on one bucket. ``flips``: per sample (its ``first_flip``,
    the deepest depth measured for it). A sample that first differs at depth f disagrees at every
    depth >= f ("equal at every depth 0..d"). Returns the bucket's JSON (n, the depth, the
    disagreements there, their 95% flip-rate bound (a depth above 0 needs it <= ``max_bound``, or
    <= ``tolerance``), and the disagreements at each depth 0..top,
    from which ``BicacheProfile.at_tolerance`` re-derives the depth), or None without samples.
    The depth is None (no verdict, no table entry) where every sample agreed at depth 1 but there
    are too few of them for the bound (``bicache.profile.bucket_depth``)."""
    if not flips:
        return None
    n = len(flips)
    top = min(t for _, t in flips)
    by_depth = [sum(1 for f, _ in flips if f <= d) for d in range(top + 1)]
    depth = bucket_depth(by_depth, n, tolerance, max_bound)
    k = by_depth[depth or 0]
    return {"n": n, "depth": depth, "disagreements": k, "flip_bound95": round(flip_bound(k, n), 5),
            "measured_depth": top, "disagreements_by_depth": by_depth}


def safe_table(fractions: Sequence[float], raw: Sequence[int | None]) -> list[tuple[float, int]]:
    """The profile table from per-bucket depths (None: no sample reached the bucket, no entry):
    starts with (0, 0), and at each r is the smallest depth measured at or above r."""
    entries = [(float(r), int(b)) for r, b in zip(fractions, raw) if b is not None]
    if not any(r == 0 for r, _ in entries):
        entries.insert(0, (0.0, 0))
    return BicacheProfile.monotone(entries)


def mean_rows(rows: list[list[float]]) -> list[float] | None:
    if not rows:
        return None
    return [sum(col) / len(col) for col in zip(*rows)]


def kv_cosine_profile(model, model_config, samples: Sequence[Sample], *, fractions: Sequence[float] = DEFAULT_FRACTIONS,
                      gen_length: int = 32, block_length: int = 32, threshold: float = 0.97,
                      depth_rule: str = "resume", model_name: str = "",
                      cached_context: str = DEFAULT_CACHED_CONTEXT, pair_tolerance: float = DEFAULT_PAIR_TOLERANCE):
    """The kv-cosine profile of already tokenized samples (for scripts that build their own
    workload, e.g. examples/bench_prefix.py). Pairs are placed as ``data.plan_task`` says (whole
    question, r at or below the bucket within ``pair_tolerance`` points). Returns (BicacheProfile,
    per-bucket similarity)."""
    device = next(model.parameters()).device
    meter = SimilarityMeter(model, model_config.mask_token_id, device)
    tasks = plan_tasks(samples, fractions, gen_candidates(gen_length, block_length),
                       model_config.max_position_embeddings, pair_tolerance)
    rows: list[list[list[float]]] = [[] for _ in fractions]
    skipped = 0
    for t in tasks:
        ctx = None
        if cached_context == "first_request":
            ctx = first_request_rest(samples, t)
            if ctx is None:
                skipped += 1
                continue
        sk, sv, _ = meter.measure(samples[t.sample], t, ctx)
        rows[t.bucket].append([(a + b) / 2 for a, b in zip(sk, sv)])
    if skipped:
        log.warning("first_request: %d of %d measurements skipped (no other sample with a different question, "
                    "long enough for a prompt); their buckets fall back to the next lower fraction", skipped,
                    len(tasks))
    sims = [mean_rows(x) for x in rows]
    raw = [None if sim is None else depth_from_similarity(sim, threshold, depth_rule) for sim in sims]
    prof = BicacheProfile(table=tuple(safe_table(fractions, raw)), n_layers=model_config.n_layers,
                          model=model_name, criterion="kv-cosine", threshold=threshold,
                          extra={"fractions": list(fractions), "similarity": sims, "depth_rule": depth_rule,
                                 "cached_context": cached_context})
    return prof, sims
