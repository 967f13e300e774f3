"""The depth decision, in one place: from a request's facts and its radix match, which positions it
reuses, at what depth, and what its first forward stores or upgrades (whether it is audited is the
online audit's: bicache/audit.py ``OnlineAudit.admit``).

The capture-context rule (docs/prefix_cache.md). A cached row of token t at layer l was computed in
ONE forward, the capturing request C's, over C's whole sequence (prompt + generation region). The
profile's b(r) was measured for state captured in a sequence that shares a fraction r with the one
reusing it, so the row may serve request B only if

    l < b(shared(C, B)),   shared(C, B) = LCP(prompt_C, prompt_B) / max(N_C, N_B)

where LCP is the common token prefix of the two prompts and N the positions each forward saw. Two
consequences: a short head shared by every request ("Question: ", a chat template) captured by
another family's request is usable only at b(head / N), however long the rest of the match; and the
same prompt captured beside 256 generation positions is not reused at full depth beside 16.

So the planner works per token: ``usable[t]`` is the number of leading layers whose rows exist AND
pass the rule for their own capture context (upgrades put deeper layers of a token in another
context, so each layer is checked on its own) AND lie before that context's *span cut*
(:func:`span_cuts`): the last segment boundary of the prompt (bicache/segments.py: after an
end-of-turn token or a blank line) at or before LCP(prompt_C, prompt_B), so the opening tokens of
the segment where the two prompts diverge ("Question: " before two different questions), whose
state was captured beside the other continuation, are never reused; a capture whose whole sequence
is shared (prefix-only, an output capture) is reused up to its end. It then reuses the one contiguous span
[start, end) of matched positions and depth d <= min(usable) over it that maximise the skipped work
(end - start) x d: the reused positions need not start at 0, since recomputing a short head costs
little. Everything here is numpy bookkeeping, tested without a model.

The request's generation mode (``RequestFacts.mode``, bicache/policy.py ``request_mode``) picks the
table b(.) is read from: a request that stops at EOS reads the "stop" table, one whose answer is
forced past EOS the "ignore_eos" table. The capture's mode does not matter (a row is computed over
the capturer's MASK region, whatever it later decodes); what is stored is sized for the deepest
mode (``DepthPolicy.store_depth``), since the reader's mode is checked when it reuses.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import pairwise

import numpy as np

from .policy import DepthPolicy, FixedPolicy, OffPolicy
from .profile import MODE_IGNORE_EOS


def shared_fraction(lcp: int, capture_len: int, seq_len: int) -> float:
    """The r that bounds a row captured in a sequence of ``capture_len`` positions when it serves a
    request of ``seq_len`` positions whose prompt shares ``lcp`` leading tokens with the capturer's."""
    n = max(capture_len, seq_len)
    return lcp / n if n > 0 else 0.0


@dataclass(frozen=True)
class RequestFacts:
    """What the planner needs to know about the request (no policies: the engine passes facts)."""

    prompt_len: int
    seq_len: int  # N: positions of the request's forward (prompt + generation region)
    forced_depth: int | None = None  # the request's own ``bicache_depth``
    exact: bool = False  # likelihood scoring / prefill-only: reuse nothing
    mode: str = MODE_IGNORE_EOS  # generation mode (policy.request_mode): the profile table it reads
    probe: bool = False  # drawn by the online audit to probe deeper depths (then always audited)
    # segment boundaries of the prompt (bicache/segments.py ``SegmentBoundaries.positions``: sorted
    # positions p where [0, p) holds whole segments); None: the span is not cut (--bicache-span-cut none)
    boundaries: tuple[int, ...] | None = None


@dataclass(frozen=True)
class MatchFacts:
    """The radix match, per token and layer. ``held[t, l]``: the row exists; ``ctx[t, l]`` its
    capture context id; ``shared[c] = (lcp, capture_len)`` for every context id in ``ctx``.

    Run-compressed form: with ``runs`` given (the first token of each run of tokens whose
    ``(ctx, held)`` rows are equal: 0 first, ascending), ``held`` and ``ctx`` hold one row per run,
    ``[len(runs), L]``; the pool builds this form from its capture classes without reading every
    row of the match."""

    length: int
    segments: tuple[tuple[int, int], ...]  # (end_len, node_depth) per node on the path
    held: np.ndarray  # bool [length, L], or [runs, L]
    ctx: np.ndarray  # int64 [length, L], or [runs, L]; -1 where no row
    shared: Mapping[int, tuple[int, int]] = field(default_factory=dict)
    runs: np.ndarray | None = None  # int64 [runs]

    def __post_init__(self) -> None:
        n = self.length if self.runs is None else len(self.runs)
        if self.ctx.shape[:1] != (n,) or self.held.shape != self.ctx.shape:
            raise ValueError(f"MatchFacts: ctx {self.ctx.shape} and held {self.held.shape} must be "
                             f"[{n}, L] ({'one row per run' if self.runs is not None else 'one row per token'})")

    def run_rows(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(run starts, ctx [runs, L], held [runs, L]): one row per run of equal rows."""
        if self.runs is not None:
            return self.runs, self.ctx, self.held
        starts = run_starts(self.ctx, self.held)
        return starts, self.ctx[starts], self.held[starts]


@dataclass(frozen=True)
class ReusePlan:
    """What one request reuses and stores. Positions [start, prefix) are reused at ``depth``;
    ``matched`` is reported as cached_tokens."""

    matched: int = 0
    prefix: int = 0  # end of the reused span
    depth: int = 0
    r: float = 0.0  # the shared fraction that bounded the depth (the audit's bucket)
    start: int = 0  # first reused position
    seq_len: int = 0
    # rows the first forward writes: (first position, end position, first layer, end layer)
    store: tuple[tuple[int, int, int, int], ...] = ()
    mode: str = MODE_IGNORE_EOS  # the request's generation mode (the audit's table)
    # position ranges [s, e) of ``store`` whose rows REPLACE the held ones (a re-capture: the held
    # rows did not serve this request as deep as its own capture would serve a repeat of it)
    recapture: tuple[tuple[int, int], ...] = ()
    # a probe's plan that reads rows the depths in force forbid (audited, never served): the least
    # shared fraction among those rows' contexts (the bucket whose probe depth it tests); None otherwise
    probe_r: float | None = None

    @property
    def reused(self) -> int:
        return self.prefix - self.start

    def without_reuse(self) -> "ReusePlan":
        """The same match served with no reuse (still reported as cached_tokens); what it stores is
        unchanged (the positions it would have reused are then computed in full)."""
        return replace(self, prefix=0, depth=0, r=0.0, start=0, probe_r=None)

    @property
    def prefix_fraction(self) -> float:
        return self.reused / self.seq_len if self.seq_len else 0.0

    @property
    def skipped_layer_tokens(self) -> int:
        return self.reused * self.depth


NO_REUSE = ReusePlan()


def request_policy(engine_policy: DepthPolicy, facts: RequestFacts) -> DepthPolicy:
    """The policy one request's depth is chosen under: ``exact`` requests reuse nothing; a request's
    own ``bicache_depth`` fixes its depth (still capped by the rows the match holds); a probe (the
    online audit's) is planned at the probe depths (``DepthPolicy.probing``); otherwise the engine's
    policy."""
    if facts.exact:
        return OffPolicy(engine_policy.n_layers)
    if facts.forced_depth is not None:
        return FixedPolicy(engine_policy.n_layers, facts.forced_depth)
    return engine_policy.probing() if facts.probe else engine_policy


def last_boundary(boundaries: Sequence[int], pos: int) -> int:
    """The last of the sorted segment ``boundaries`` at or before ``pos`` (0 when there is none):
    where a span that may run up to ``pos`` ends."""
    i = bisect_right(boundaries, pos)
    return boundaries[i - 1] if i else 0


def span_cuts(match: MatchFacts, boundaries: Sequence[int] | None) -> dict[int, int] | None:
    """Per capture context c of the match, the first position its rows may NOT serve (the span cut,
    docs/prefix_cache.md "Where the reused span ends"): the last segment boundary at or before
    LCP(prompt_c, prompt) (0 when there is none), or the whole LCP when the capture's sequence is
    all shared (``lcp >= N_c``: a prefix-only or output capture the request extends, whose rows were
    computed beside nothing else). ``boundaries``: the request's sorted boundary positions; None:
    no cut (every context's rows serve up to the match's end)."""
    if boundaries is None:
        return None
    return {c: lcp if lcp >= n_c else last_boundary(boundaries, lcp) for c, (lcp, n_c) in match.shared.items()}


def usable_depths(policy: DepthPolicy, match: MatchFacts, seq_len: int, mode: str = MODE_IGNORE_EOS,
                  cuts: Mapping[int, int] | None = None) -> tuple[np.ndarray, dict[int, float]]:
    """Per matched token, the leading layers that exist and pass the capture-context rule under
    ``policy`` for a request of generation ``mode`` (and lie before their context's cut, ``cuts``:
    :func:`span_cuts`, None: no cut); and the shared fraction of each capture context."""
    bounds, per_run, r_of = usable_runs(policy, match, seq_len, mode, cuts)
    return np.repeat(per_run, np.diff(bounds)), r_of


def usable_runs(policy: DepthPolicy, match: MatchFacts, seq_len: int, mode: str = MODE_IGNORE_EOS,
                cuts: Mapping[int, int] | None = None) -> tuple[np.ndarray, np.ndarray, dict[int, float]]:
    """:func:`usable_depths` per run: (bounds [runs + 1], usable depth per run [runs], the shared
    fraction of each capture context); run i is tokens [bounds[i], bounds[i + 1]). A run that a
    context's cut falls inside is split there."""
    bounds, per_run, r_of = _usable_runs(policy, match, seq_len, mode, cuts)
    return np.asarray(bounds, dtype=np.int64), np.asarray(per_run, dtype=np.int64), r_of


# Up to this many run rows x layers a match is judged in plain Python: an admission's few runs
# cost less as a list walk than as the dozen numpy calls of the array path (which is the same rule)
_SMALL_RUN_CELLS = 2048


def _split_at_cuts(starts: np.ndarray, m: int, cuts: Mapping[int, int] | None) -> tuple[np.ndarray, np.ndarray]:
    """(run starts with every cut inside (0, m) added, index of the original run of each): a run is
    split where a context's cut falls inside it, so every token of a run is on one side of every cut."""
    if not cuts:
        return starts, np.arange(len(starts), dtype=np.int64)
    inner = [x for x in set(cuts.values()) if 0 < x < m]
    if not inner:
        return starts, np.arange(len(starts), dtype=np.int64)
    split = np.union1d(starts, np.asarray(inner, dtype=np.int64))
    return split, np.searchsorted(starts, split, side="right") - 1


def _usable_runs(policy: DepthPolicy, match: MatchFacts, seq_len: int, mode: str = MODE_IGNORE_EOS,
                 cuts: Mapping[int, int] | None = None
                 ) -> tuple[list[int] | np.ndarray, list[int] | np.ndarray, dict[int, float]]:
    """:func:`usable_runs` as lists for a few runs, arrays otherwise (the planner's own path)."""
    m, L = match.length, match.ctx.shape[1]
    if m == 0:
        return [0], [], {}
    r_of = {c: shared_fraction(lcp, n_c, seq_len) for c, (lcp, n_c) in match.shared.items()}
    # Tokens captured together carry the same (ctx, held) row, so the match is a few runs of equal
    # rows: judge one row per run ([runs, L], not [m, L]) and repeat the answer over the run.
    starts, ctx_r, held_r = match.run_rows()
    starts, of_run = _split_at_cuts(starts, m, cuts)
    if len(of_run) != len(ctx_r):  # split runs read their original run's row
        ctx_r, held_r = ctx_r[of_run], held_r[of_run]
    no_cut = m  # a context without a cut serves every matched position
    if ctx_r.size <= _SMALL_RUN_CELLS:
        lim_of = {c: policy.target_depth(r, mode) for c, r in r_of.items()}  # no entry: no row (-1)
        cut_of = cuts if cuts is not None else {}
        per_run = []
        for s, crow, hrow in zip(starts.tolist(), ctx_r.tolist(), held_r.tolist()):
            d = 0  # leading layers whose row exists, whose context allows layer d and serves position s
            for c, h in zip(crow, hrow):
                if not h or lim_of.get(c, 0) <= d or s >= cut_of.get(c, no_cut):
                    break
                d += 1
            per_run.append(d)
        return [*starts.tolist(), m], per_run, r_of
    # the depth each row's context allows (0 where there is no row, or the run is past its cut)
    lim = np.zeros(ctx_r.shape, dtype=np.int16)
    for c, r in r_of.items():
        here = ctx_r == c
        if cuts is not None:
            here &= (starts < cuts.get(c, no_cut))[:, None]
        lim[here] = policy.target_depth(r, mode)
    ok = (lim > np.arange(L, dtype=np.int16)[None, :]) & held_r
    per_run = np.where(ok.all(axis=1), L, ok.argmin(axis=1)).astype(np.int64)
    return np.concatenate([starts, [m]]).astype(np.int64), per_run, r_of


def run_starts(ctx: np.ndarray, held: np.ndarray | None = None) -> np.ndarray:
    """First token of each run of equal rows of ``ctx`` [m, L] (and of ``held``: pass None when
    ``held`` is exactly ``ctx >= 0``, as in the pool, where a row is bound exactly where it has a
    capture context)."""
    if len(ctx) == 0:
        return np.zeros(0, dtype=np.int64)
    change = (ctx[1:] != ctx[:-1]).any(axis=1)
    if held is not None:
        change |= (held[1:] != held[:-1]).any(axis=1)
    return np.concatenate([[0], np.flatnonzero(change) + 1]).astype(np.int64)


def contexts_in(ctx: np.ndarray) -> list[int]:
    """The distinct context ids (>= 0) of a [n, k] block: each appears in its first row or where a
    column changes, so only those few candidates are sorted."""
    if ctx.size == 0:
        return []
    if ctx.size <= 4096:  # a few runs' rows (the common case): a set of ints costs less than numpy calls
        return sorted(c for c in set(ctx.ravel().tolist()) if c >= 0)
    cand = np.concatenate([ctx[0], ctx[1:][ctx[1:] != ctx[:-1]]])
    return [int(c) for c in np.unique(cand) if c >= 0]


def best_span_runs(bounds: np.ndarray | list[int], usable: np.ndarray | list[int]) -> tuple[int, int, int]:
    """(start, end, depth) maximising (end - start) x depth with depth <= the usable depth of every
    token in [start, end); ties go to the longer span; (0, 0, 0) when nothing is usable. Over runs
    of tokens with one usable depth each (run i: tokens [bounds[i], bounds[i + 1]), depth
    usable[i]), in O(runs) per candidate depth."""
    if len(usable) <= _SMALL_RUNS:
        return _best_span_small(list(map(int, bounds)), list(map(int, usable)))
    usable = np.asarray(usable)
    bounds = np.asarray(bounds)
    best = (0, 0, 0)
    best_gain = 0
    for d in np.unique(usable[usable > 0]).tolist():
        mask = np.concatenate([[False], usable >= d, [False]])
        edges = np.flatnonzero(mask[1:] != mask[:-1])
        starts, ends = bounds[edges[0::2]], bounds[edges[1::2]]
        i = int(np.argmax(ends - starts))
        s, e = int(starts[i]), int(ends[i])
        gain = (e - s) * d
        if gain > best_gain or (gain == best_gain and e - s > best[1] - best[0]):
            best, best_gain = (s, e, int(d)), gain
    return best


_SMALL_RUNS = 64  # up to this many runs the span is chosen in plain Python (fewer calls, same rule)


def _best_span_small(bounds: list[int], usable: list[int]) -> tuple[int, int, int]:
    """:func:`best_span_runs` over lists: the same candidates in the same order (per depth, the
    first longest maximal segment), so the same answer, ties included."""
    best = (0, 0, 0)
    best_gain = 0
    n = len(usable)
    for d in sorted({u for u in usable if u > 0}):
        s = e = 0
        open_at = -1  # first run of the segment being scanned, -1: none
        for i, u in enumerate(usable):
            if u >= d:
                if open_at < 0:
                    open_at = i
            elif open_at >= 0:
                if bounds[i] - bounds[open_at] > e - s:
                    s, e = bounds[open_at], bounds[i]
                open_at = -1
        if open_at >= 0 and bounds[n] - bounds[open_at] > e - s:
            s, e = bounds[open_at], bounds[n]
        gain = (e - s) * d
        if gain > best_gain or (gain == best_gain and e - s > best[1] - best[0]):
            best, best_gain = (s, e, d), gain
    return best


def store_ranges(engine_policy: DepthPolicy, facts: RequestFacts, match: MatchFacts, start: int, end: int,
                 depth: int, served: tuple[list[int] | np.ndarray, list[int] | np.ndarray] | None = None
                 ) -> tuple[tuple[tuple[int, int, int, int], ...], tuple[tuple[int, int], ...]]:
    """The rows the request's first forward writes (docs/prefix_cache.md, "Node depth follows use"),
    and which of them re-capture held rows.

    Positions it computes in full (new tokens, matched tokens outside the reused span) get layers
    up to b(P / N), the depth a repeat of the prompt is allowed (P: the reusable prompt); reused
    positions, computed from ``depth`` on, get deeper layers up to b(end / N) on top of what their
    node holds. Everything written is captured in this request's own context.

    Re-capture ("A capture serves the requests after it"): matched positions computed in full whose
    held rows serve this request fewer layers than b(P / N) under the engine's policy (``served``:
    (run bounds, usable depth per run), from the capture-context rule) were captured in a context
    that shares too little with requests like this one: a prefill-only hint (its context is the
    prefix alone), another family's request. Their rows are replaced by this request's (layers
    [0, max(node depth, b(P / N)))), so the next request like it reuses them as deep as the rule
    allows it. The replacement happens at commit only where no other capture changed the rows
    since admission (``KVPool.rebind_block``)."""
    P, N = facts.prompt_len - 1, facts.seq_len
    b = engine_policy.store_depth  # rows for any later reader's mode (each is checked when it reuses)
    if not engine_policy.uses_cache or N <= 0:
        return (), ()
    k_full = b(P / N) if P > 0 else 0
    k_span = b(end / N) if end > start else 0
    # runs of matched tokens to re-capture: held rows that served less than a repeat would get
    recap: list[tuple[int, int]] = []
    want = engine_policy.target_depth(P / N, facts.mode) if P > 0 else 0
    # a repeat of this request could be served this request's rows only before its own span cut
    # (the last boundary of its prompt): past it, re-capturing serves nobody like it
    limit = match.length
    if facts.boundaries is not None:
        limit = min(limit, last_boundary(facts.boundaries, facts.prompt_len))
    if served is not None and want > 0 and k_full > 0:
        bounds, per_run = served
        run0, _, held_r = match.run_rows()  # served runs may split these: find each one's own
        for i, u in enumerate(per_run):
            s, e = int(bounds[i]), min(int(bounds[i + 1]), limit)
            if s < e and u < want and held_r[bisect_right(run0, s) - 1, 0]:
                for a, z in ((s, min(e, start)), (max(s, end), e)) if end > start else ((s, e),):
                    if a < z:
                        if recap and recap[-1][1] == a:
                            recap[-1] = (recap[-1][0], z)
                        else:
                            recap.append((a, z))
    out: list[tuple[int, int, int, int]] = []
    s0 = 0
    for e0, node_depth in match.segments:
        cuts = sorted({s0, e0, *(x for x in (start, end, *(y for r in recap for y in r)) if s0 < x < e0)})
        for s, e in pairwise(cuts):
            in_span = start <= s and e <= end and end > start
            if in_span:
                lo, hi = max(node_depth, depth), k_span
            elif any(a <= s and e <= z for a, z in recap):
                lo, hi = 0, max(node_depth, k_full)
            else:
                lo, hi = node_depth, k_full
            if lo < hi:
                out.append((s, e, lo, hi))
        s0 = e0
    if facts.prompt_len > match.length and k_full > 0:
        out.append((match.length, facts.prompt_len, 0, k_full))
    return tuple(out), tuple(recap)


def plan_reuse(engine_policy: DepthPolicy, facts: RequestFacts, match: MatchFacts) -> ReusePlan:
    """The whole depth decision for one request (see the module docstring)."""
    policy = request_policy(engine_policy, facts)
    start = end = depth = 0
    r_bind = 0.0
    served = None  # (run bounds, usable depth per run) under the engine's policy: re-capture's test
    probe_r = None
    cuts = span_cuts(match, facts.boundaries)
    if match.length > 0 and facts.seq_len > 0 and policy.uses_cache and policy.max_node_depth > 0:
        bounds, usable, r_of = _usable_runs(policy, match, facts.seq_len, facts.mode, cuts)
        if policy is engine_policy:
            served = (bounds, usable)
        start, end, depth = best_span_runs(bounds, usable)
        if depth > 0:
            # the binding fraction: the least-shared context among the rows reused and the layer
            # right below them (the one that stopped the depth, when a context did)
            # rows are equal within a run, so the runs' first rows hold every context of the span
            # (the match's own runs: ``bounds`` may hold extra splits at the span cuts)
            runs, ctx_r, _ = match.run_rows()
            runs = runs.tolist()
            first = bisect_right(runs, start) - 1
            last = bisect_left(runs, end)
            r_bind = min(r_of[c] for c in contexts_in(ctx_r[first:last, :depth + 1]))
            if policy is not engine_policy and facts.probe:  # rows read beyond their depth in force?
                block = ctx_r[first:last, :depth]
                beyond = [r_of[c] for c in contexts_in(block)
                          if (block[:, engine_policy.target_depth(r_of[c], facts.mode):] == c).any()]
                probe_r = min(beyond) if beyond else None
    if served is None and match.length > 0 and facts.seq_len > 0 and engine_policy.max_node_depth > 0:
        served = _usable_runs(engine_policy, match, facts.seq_len, facts.mode, cuts)[:2]
    store, recapture = store_ranges(engine_policy, facts, match, start, _node_end(match, end), depth, served)
    return ReusePlan(match.length, end, depth, r_bind, start, facts.seq_len, store, facts.mode, recapture, probe_r)


def _node_end(match: MatchFacts, end: int) -> int:
    """The end of the node holding position ``end - 1`` (``end`` itself when 0 or at a node's end).

    A span cut can end the reused span inside a node; what the request stores must still give the
    node's tokens one depth (a node holds rows exactly for layers < its depth), so the store plan
    treats the rest of that node like the span: the same layers [node depth, b(.)) for every token
    of it. The positions after the cut are computed in full by this request (they are not reused),
    so every layer of them is available to store."""
    if end <= 0:
        return end
    for e0, _ in match.segments:
        if e0 >= end:
            return e0
    return end
