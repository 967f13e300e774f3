"""The cache manager: the whole lifecycle of one request's use of the prefix cache.

    admit   match ONCE (the last prompt token excluded), lock the matched path, let the planner
            (bicache/planner.py) choose the reused span, its depth and what to store from the
            request's facts and each matched row's capture context, point the request's K/V at
            the reused rows (read in place), and reserve pool rows for what the request's first
            forward will write (a *capture*);
    commit  after that forward filled the rows: bind them with their capture context (the
            request's prompt and its sequence length), insert the prompt, record node depths;
    release when the request leaves: free an uncommitted capture, unlock the path.

Node depth follows use (docs/prefix_cache.md; the rule is the planner's): positions a request
computes in full are stored for layers < b(P / N) (a repeat of the prompt), reused positions get
their node's missing deeper layers from this request's forward (an upgrade, in this request's
context), and under memory pressure the deepest layers of cold nodes go first (trim), before whole
LRU leaves are evicted. Each row keeps the context it was captured in (``KVPool.ctx``), so the
capture-context rule is checked per row, upgraded layers included.

A running request never sees a node change under it: it reads the reused rows where they live
(its ``SeqKV`` points at them), its path stays locked (locked nodes are never trimmed or
evicted), and upgrades only add rows.

The index (``radix.PrefixIndex``) and the tensor pool (``KVPool``) stay separate; this class
is the only code that touches both. Cache off is the same class over ``radix.NullRadixTree`` (the
one null object): nothing matches, nothing is reserved or stored (``enabled`` is False).

Invariants (``check_integrity``): token slots held + free + in flight == token capacity; rows
bound in the table + free + in flight == row capacity; every node's tokens have rows exactly for
layers < its depth; every bound row has a capture context, kept exactly while a row refers to it;
two token slots with one capture class (``KVPool.cls``) have equal capture-context rows.

Cost per request (examples/bench_host.py): the match is read in runs of equally captured tokens
(one class label per token, one ctx row per run), each stored range is bound as one rectangle of
the tables, and the reused rows are copied per contiguous run of slots; what remains O(rows) is
writing the rows a request stores or reuses.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise

import numpy as np
import torch

from radix import NodeHandle, PrefixIndex, common_prefix_len, make_index

from ..bicache.planner import NO_REUSE, MatchFacts, RequestFacts, ReusePlan, contexts_in, plan_reuse
from ..bicache.policy import DepthPolicy
from .pool import KVPool
from .store import Capture, SeqKV

log = logging.getLogger(__name__)

_NO_SLOTS = np.zeros(0, dtype=np.int64)
MIN_TRIM_DEPTH = 1  # trimming keeps at least this many layers; below it a node is evicted instead


def reusable_prefix(prompt: Sequence[int]) -> Sequence[int]:
    """The part of a prompt that may be served from the cache: all but the last token, which is
    always recomputed (as in SGLang) so every request computes at least one prompt position."""
    return prompt[:max(len(prompt) - 1, 0)]


@dataclass
class CacheGrant:
    """What admission gave one request; owned by the request until ``release``."""

    plan: ReusePlan = NO_REUSE
    handle: NodeHandle | None = None  # locked end of the match, None once released
    matched_slots: np.ndarray = field(default_factory=lambda: _NO_SLOTS)
    resume_rows: np.ndarray | None = None  # [prefix] rows whose h is S entering layer `depth`
    capture: Capture | None = None  # rows the first forward writes; None once committed
    new_slots: np.ndarray = field(default_factory=lambda: _NO_SLOTS)  # token slots of prompt[matched:]
    slots: np.ndarray = field(default_factory=lambda: _NO_SLOTS)  # matched + new slots: what commit inserts
    # (slots, first layer, rows [layers, len(slots)], slots are new, capture classes at admission
    # for a re-capture else None) per stored range: one table rectangle each
    pending: list[tuple[np.ndarray, int, np.ndarray, bool, np.ndarray | None]] = field(default_factory=list)
    touched: list[tuple[int, int]] = field(default_factory=list)  # prompt position ranges that get rows

    def give_up_reuse(self) -> None:
        """Serve the match with no reuse (an audit with no room for its shadow before
        ``CacheManager.share``; an audited request after its exact first forward). What the
        first forward stores is unchanged."""
        self.plan = self.plan.without_reuse()


class CacheManager:
    """Prefix index + pool under one depth policy (see module docstring)."""

    def __init__(self, index: PrefixIndex, pool: KVPool, policy: DepthPolicy) -> None:
        self.index, self.pool, self.policy = index, pool, policy
        self.enabled = index.caches  # False: cache off (the null index)
        self.in_flight_tokens = 0  # token slots of captures not yet committed or released
        self.in_flight_rows = 0
        self.num_lookups = self.num_hits = 0
        self.matched_tokens = self.looked_up_tokens = 0
        self.evicted_tokens = 0
        self.upgrades = 0
        self.recaptures = self.recaptured_tokens = 0  # re-captured ranges / token slots (rebind_block)
        self.trimmed_layer_tokens = 0

    def peek(self, prompt: Sequence[int]) -> int:
        """Cached length of a waiting request's prompt; changes nothing (scheduler ordering)."""
        return self.index.peek_prefix_len(reusable_prefix(prompt))

    # ------------------------------------------------------------------------------- lifecycle
    def admit(self, prompt: Sequence[int], facts: RequestFacts) -> CacheGrant:
        """Match once, lock, let the planner decide (bicache/planner.py) from the request's facts
        and every matched row's capture context, and reserve the capture (none if the pool cannot
        make room). The request reads nothing yet: :meth:`share` points its K/V at the rows."""
        ids = np.asarray(prompt, dtype=np.int64)  # one conversion of a list prompt, not one per use
        key = reusable_prefix(ids)
        m = self.index.match_prefix(key)
        self.num_lookups += 1
        self.looked_up_tokens += len(key)
        self.matched_tokens += m.length
        self.num_hits += m.length > 0
        self.index.lock(m.handle)
        slots = np.asarray(m.values, np.int64)
        plan = plan_reuse(self.policy, facts, self._match_facts(ids, m, slots))
        grant = CacheGrant(plan, m.handle, slots)
        self._reserve(grant, plan, m.length, facts.prompt_len)
        return grant

    def share(self, grant: CacheGrant, kv: SeqKV | None) -> None:
        """Point ``kv`` at the rows ``grant.plan`` reuses (read in place: the path stays locked
        until release, so these rows cannot change). A plan may be given up before this call
        (e.g. no room for its audit shadow); after it, it may not."""
        plan, slots = grant.plan, grant.matched_slots
        d, a, p = plan.depth, plan.start, plan.prefix
        if d > 0 and p > a and kv is not None:
            self.pool.share_prefix(kv, slots[a:p], d, start=a)
            if d < self.pool.n_layers:
                grant.resume_rows = self.pool.layer_table[d - 1, slots[a:p]].astype(np.int64)  # a copy

    def _match_facts(self, prompt: np.ndarray, m, slots: np.ndarray) -> MatchFacts:
        """The match in runs of equally captured tokens (one ``KVPool.cls`` label per token, then
        one ctx row per run): which rows exist, their capture contexts, and how much each context
        shares with ``prompt``."""
        pool = self.pool
        if len(slots) == 0:
            empty = np.zeros((0, pool.n_layers), dtype=np.int64)
            return MatchFacts(m.length, tuple(m.segments), empty >= 0, empty, {})
        cls = pool.cls[slots]
        runs = np.concatenate([[0], np.flatnonzero(cls[1:] != cls[:-1]) + 1]).astype(np.int64)
        ctx = pool.layer_ctx[:, slots[runs]].T  # [runs, L]: equal class => equal row (KVPool docstring)
        held = ctx >= 0  # a row is bound exactly where it has a capture context (check_integrity)
        contexts = pool.contexts
        shared = {c: (common_prefix_len(contexts.tokens(c), prompt), contexts.seq_len(c)) for c in contexts_in(ctx)}
        return MatchFacts(m.length, tuple(m.segments), held, ctx, shared, runs)

    def _reserve(self, grant: CacheGrant, plan: ReusePlan, matched: int, prompt_len: int) -> None:
        """Allocate what the first forward writes: the planner's (positions, layers) ranges.

        Each range (s, e, lo, hi) gets one block of rows, ``[hi - lo, e - s]`` layer-major, so
        commit binds it as one rectangle of the table and a layer's rows of a range are one
        contiguous slice of the allocation (an ascending run when the free list gives one)."""
        ranges = plan.store
        n_rows = sum((e - s) * (hi - lo) for s, e, lo, hi in ranges)
        n_new = prompt_len - matched
        # the null index holds no token, so cache off reserves nothing
        tokens_needed = n_new if n_new > 0 and self.enabled else 0
        if (n_rows == 0 and tokens_needed == 0) or not self._make_room(n_rows, tokens_needed):
            return
        new_slots = self.pool.tokens.alloc(tokens_needed) if tokens_needed else _NO_SLOTS
        slots = np.concatenate([grant.matched_slots, new_slots])
        self.in_flight_tokens += tokens_needed
        self.in_flight_rows += n_rows
        all_rows = self.pool.rows.alloc(n_rows)
        blocks: list[np.ndarray] = []  # [hi - lo, e - s] per range, views of all_rows
        off = 0
        for s, e, lo, hi in ranges:
            n = (e - s) * (hi - lo)
            block = all_rows[off:off + n].reshape(hi - lo, e - s)
            blocks.append(block)
            # a range over new tokens binds into empty slots (fresh off the free list, whose rows
            # free_tokens dropped); one over matched tokens may race a concurrent upgrade; a
            # re-capture replaces the rows only where no other capture changed them since now
            recap = s < matched and any(a <= s and e <= z for a, z in plan.recapture)
            expect = self.pool.cls[slots[s:e]].copy() if recap else None
            grant.pending.append((slots[s:e], lo, block, s >= matched, expect))
            off += n
        grant.new_slots = new_slots
        grant.slots = slots
        grant.touched = [(s, e) for s, e, _, _ in ranges]
        grant.capture = Capture(self._capture_layers(ranges, blocks, all_rows))

    def _capture_layers(self, ranges: tuple[tuple[int, int, int, int], ...], blocks: list[np.ndarray],
                        all_rows: np.ndarray) -> dict[int, tuple[np.ndarray, torch.Tensor]]:
        """The forward's per-layer (positions, device rows) for the stored ranges: one host ->
        device copy of the rows, split into views.

        A layer inside one range reads a slice of the one device copy; a layer inside several reads
        their rows concatenated, appended to the same host buffer so there is still one copy."""
        if len(ranges) == 1:  # the common case: one [hi - lo, e - s] block, one view per layer
            s, e, lo, hi = ranges[0]
            pos = np.arange(s, e, dtype=np.int64)  # shared by every layer (the forward keys on it)
            views = self.pool.to_device(all_rows).view(hi - lo, e - s).unbind(0)
            return dict(zip(range(lo, hi), ((pos, v) for v in views)))
        # the active ranges change only at a range's first or end layer: one set per interval
        cuts = sorted({0, self.pool.n_layers, *(x for _, _, lo, hi in ranges for x in (lo, hi))})
        per_layer: list[tuple[int, tuple[int, ...]]] = []
        for l0, l1 in pairwise(cuts):
            active = tuple(j for j, (_, _, lo, hi) in enumerate(ranges) if lo <= l0 < hi)
            if active:
                per_layer.extend((layer, active) for layer in range(l0, l1))
        # the host buffer: all_rows (range j's layers in order, e - s rows each), then the
        # concatenated rows of the layers inside several ranges; one device copy, split into views
        sizes: list[int] = []
        chunk0: list[int] = []  # index of range j's first layer chunk
        for s, e, lo, hi in ranges:
            chunk0.append(len(sizes))
            sizes.extend([e - s] * (hi - lo))
        extra: list[np.ndarray] = []
        which: list[int] = []  # each layer's chunk
        for layer, active in per_layer:
            if len(active) == 1:
                j = active[0]
                which.append(chunk0[j] + layer - ranges[j][2])
            else:
                part = np.concatenate([blocks[j][layer - ranges[j][2]] for j in active])
                extra.append(part)
                which.append(len(sizes))
                sizes.append(len(part))
        dev = self.pool.to_device(np.concatenate([all_rows, *extra]) if extra else all_rows)
        chunks = torch.split(dev, sizes)  # views, one call (slicing per layer costs more)
        by_set: dict[tuple[int, ...], np.ndarray] = {}  # layers with the same ranges share one array
        layers: dict[int, tuple[np.ndarray, torch.Tensor]] = {}
        for (layer, active), c in zip(per_layer, which):
            pos = by_set.get(active)
            if pos is None:
                pos = by_set[active] = np.concatenate([np.arange(ranges[j][0], ranges[j][1], dtype=np.int64)
                                                       for j in active])
            layers[layer] = (pos, chunks[c])
        return layers

    def commit(self, prompt: Sequence[int], grant: CacheGrant, capture_len: int) -> None:
        """The first forward has written the capture: bind its rows (recording the context they
        were computed in: ``prompt`` beside ``capture_len`` positions in all), insert the prompt
        (new tokens), and record every node's depth along the path from what the table now holds."""
        if grant.capture is None:
            return
        ids = np.asarray(prompt, dtype=np.int64)  # the context's record and the insert share it
        grant.capture = None
        pending, grant.pending = grant.pending, []
        new_slots, grant.new_slots = grant.new_slots, _NO_SLOTS
        all_slots, grant.slots = grant.slots, _NO_SLOTS
        self.in_flight_tokens -= len(new_slots)
        if pending:
            ctx = self.pool.contexts.new(ids, capture_len)
            lost = []
            for slots, lo, block, fresh, expect in pending:  # one rectangle of the table per stored range
                self.in_flight_rows -= block.size
                if expect is None:
                    beaten = self.pool.bind_block(slots, lo, block, ctx, fresh=fresh)
                else:
                    beaten, replaced = self.pool.rebind_block(slots, lo, block, ctx, expect)
                    self.recaptured_tokens += replaced
                    self.recaptures += replaced > 0
                if beaten.size:
                    lost.append(beaten)
            if lost:  # rows a concurrent upgrade beat
                self.pool.rows.free_parts(lost)
            self.pool.contexts.forget(ctx)  # nothing bound (every row lost): drop the registration
        handle, new_leaf = grant.handle, None
        if len(new_slots):
            try:
                # depth 0: existing nodes are never changed by an insert; depths are set below
                res = self.index.insert(ids, all_slots, 0)
            except Exception:
                log.exception("prefix cache insert failed; continuing without caching this prompt")
                self.pool.free_tokens(new_slots)
                return
            for arr in res.to_free:  # tokens another request inserted first
                self.pool.free_tokens(arr)
            handle = res.handle
            new_leaf = res.handle if res.prefix_len < len(prompt) else None
        if handle is None:
            return
        # Only nodes whose tokens received rows in this commit can hold more layers than before
        # (every bind is followed by its own commit's check), so the others are skipped.
        touched, end = grant.touched, 0
        for node in self.index.path(handle):
            start, end = end, end + len(node.value)
            if not any(s < end and start < e for s, e in touched):
                continue
            held = self.pool.held_depth_by_class(node.value)
            if held > node.depth:
                self.upgrades += node is not new_leaf
                self.index.set_depth(node, held)

    def release(self, grant: CacheGrant) -> None:
        """The request is leaving (finished, aborted or failed). Idempotent."""
        if grant.capture is not None:
            grant.capture = None
            for _, _, block, _, _ in grant.pending:
                self.pool.rows.free(block)
                self.in_flight_rows -= block.size
            grant.pending = []
            self.pool.tokens.free(grant.new_slots)
            self.in_flight_tokens -= len(grant.new_slots)
            grant.new_slots = grant.slots = _NO_SLOTS
        if grant.handle is not None:
            self.index.unlock(grant.handle)
            grant.handle = None
        grant.resume_rows = None

    # ------------------------------------------------------------------------------- capacity
    def _make_room(self, rows: int, tokens: int) -> bool:
        """Free rows (trimming cold nodes' deep layers first) and token slots (evicting LRU
        leaves) until both fit; False if they cannot."""
        pool = self.pool
        if rows > pool.rows.capacity or tokens > pool.tokens.capacity:
            return False
        if pool.rows.num_free < rows:
            self._trim(rows - pool.rows.num_free)
        # LRU leaves until both fit, in one call: an unlocked node's tokens hold rows exactly for
        # layers < its depth (check_integrity), so the layer-tokens the index counts are the rows
        # each eviction frees; all of it goes back to the pool at once
        gone = self.index.evict(max(0, tokens - pool.tokens.num_free), max(0, rows - pool.rows.num_free))
        if gone:
            slots = np.concatenate(gone)
            pool.free_tokens(slots)
            self.evicted_tokens += len(slots)
        return pool.rows.num_free >= rows and pool.tokens.num_free >= tokens

    def _trim(self, need: int) -> None:
        """Halve the depth of cold unlocked nodes, least recently used first, until ``need`` rows
        are free (shallow layers serve every prefix fraction; deep ones only high ones)."""
        # one pass halves each cold node once, the next pass again (the index's trim order). An
        # unlocked node's tokens hold rows exactly for layers < its depth (check_integrity), so
        # the layer-tokens the index drops are the rows to free, all at once, after the walk.
        nodes, keep, _ = self.index.halve_cold(MIN_TRIM_DEPTH, need)
        if nodes:
            values = [node.value for node in nodes]
            # a node halved twice appears twice; its later (lower) depth is what it keeps
            keep_per_slot = np.repeat(np.asarray(keep, dtype=np.int64), [len(v) for v in values])
            self.trimmed_layer_tokens += self._drop_min(np.concatenate(values), keep_per_slot)

    def _drop_min(self, slots: np.ndarray, keep: np.ndarray) -> int:
        """``drop_layers`` for slots listed more than once: each keeps its lowest depth."""
        order = np.lexsort((keep, slots))
        s, k = slots[order], keep[order]
        first = np.concatenate([[True], s[1:] != s[:-1]])
        return self.pool.drop_layers(s[first], k[first])

    def flush(self) -> int:
        """Evict everything not locked by a running request. Returns tokens freed."""
        before = self.index.total_size()
        for arr in self.index.evict(before):
            self.pool.free_tokens(arr)
            self.evicted_tokens += len(arr)
        return before - self.index.total_size()

    # ------------------------------------------------------------------------------- reporting
    def stats(self) -> dict:
        lookups, pool = self.num_lookups, self.pool
        stored = self.index.total_layer_tokens()
        return {
            "prefix_cache_policy": self.policy.describe(),
            "prefix_cache_capacity_tokens": pool.token_capacity,
            "prefix_cache_capacity_layer_tokens": pool.row_capacity,
            "prefix_cache_used_tokens": self.index.total_size(),
            "prefix_cache_stored_layer_tokens": stored,
            "prefix_cache_stored_bytes": stored * pool.bytes_per_layer_token,
            "prefix_cache_depth_histogram": {str(k): v for k, v in self.index.depth_histogram().items()},
            "prefix_cache_evictable_tokens": self.index.evictable_size(),
            "prefix_cache_protected_tokens": self.index.protected_size(),
            "prefix_cache_free_tokens": pool.tokens.num_free,
            "prefix_cache_free_layer_tokens": pool.rows.num_free,
            "prefix_cache_in_flight_tokens": self.in_flight_tokens,
            "prefix_cache_in_flight_layer_tokens": self.in_flight_rows,
            "prefix_cache_max_depth": self.policy.max_node_depth,
            "prefix_cache_bytes_per_layer_token": pool.bytes_per_layer_token,
            "prefix_cache_bytes": pool.nbytes,
            "prefix_cache_upgrades_total": self.upgrades,
            "prefix_cache_recaptures_total": self.recaptures,
            "prefix_cache_recaptured_tokens_total": self.recaptured_tokens,
            "prefix_cache_retired_layer_tokens": pool.retired_rows,
            "prefix_cache_trimmed_layer_tokens_total": self.trimmed_layer_tokens,
            "cache_lookups": lookups,
            "cache_hit_rate": self.num_hits / lookups if lookups else 0.0,
            "cache_token_hit_rate": self.matched_tokens / self.looked_up_tokens if self.looked_up_tokens else 0.0,
            "evicted_tokens": self.evicted_tokens,
        }

    def check_integrity(self) -> None:
        """Recompute the index's and the pool's invariants (module docstring); slow, for tests."""
        pool = self.pool
        self.index.check_integrity(pool.held_depth)
        held = np.asarray(self.index.all_values(), dtype=np.int64)
        free = pool.tokens.free_set()
        assert len(np.unique(held)) == len(held), "a token slot is held twice by the index"
        assert len(np.intersect1d(held, free)) == 0, "a token slot is both free and held by the index"
        total = len(held) + len(free) + self.in_flight_tokens
        assert total == pool.token_capacity, f"token slot leak: free {len(free)} + cached {len(held)} + " \
                                             f"in-flight {self.in_flight_tokens} != {pool.token_capacity}"
        bound = int((pool.table >= 0).sum())
        assert bound == self.index.total_layer_tokens(), \
            f"rows bound {bound} != layer-tokens the index records {self.index.total_layer_tokens()}"
        rows_total = bound + pool.rows.num_free + self.in_flight_rows + pool.retired_rows
        assert rows_total == pool.row_capacity, f"row leak: bound {bound} + free {pool.rows.num_free} + in-flight " \
                                                f"{self.in_flight_rows} + retired {pool.retired_rows} != " \
                                                f"{pool.row_capacity}"
        assert int(pool.retired.sum()) == pool.retired_rows, "retired row count out of step"
        assert not (pool.retired & (pool.readers == 0)).any(), "a retired row nobody reads was not freed"
        assert (pool.readers >= 0).all(), "a prefix row read by fewer than no sequence"
        assert np.array_equal(pool.table >= 0, pool.ctx >= 0), "a bound row without a capture context (or back)"
        ids, counts = np.unique(pool.ctx[pool.ctx >= 0], return_counts=True)
        refs = pool.contexts.refs()
        assert dict(zip(ids.tolist(), counts.tolist())) == {c: n for c, n in refs.items() if n}, \
            "capture-context reference counts do not match the rows that refer to them"
        assert len(pool.contexts) == len(ids), "a capture context is kept that no row refers to"
        pool.check_exact_classes(np.arange(pool.token_capacity))


def make_cache_manager(policy: DepthPolicy, pool: KVPool, index: str | None = None) -> CacheManager:
    """The cache for ``policy`` over ``pool``'s prefix rows, on the prefix index named ``index``
    (``radix.INDEXES``); by default "radix", or "none" (caching nothing) when the policy uses no
    cache."""
    name = index if index is not None else ("radix" if policy.uses_cache else "none")
    return CacheManager(make_index(name), pool, policy)
