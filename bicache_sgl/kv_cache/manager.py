"""The cache manager: the whole lifecycle of one request's use of the prefix cache.

    admit   match ONCE (the last prompt token excluded), lock the matched path, choose the depth
            with the request's policy, copy the reused state into the request's private K/V, and
            reserve pool rows for what the request's first forward will write (a *capture*);
    commit  after that forward filled the rows: bind them, insert the prompt, record node depths;
    release when the request leaves: free an uncommitted capture, unlock the path.

Node depth follows use (DESIGN.md section 5). With engine policy b(.), sequence length N, reused
prefix p (depth d) and reusable prompt length P (the prompt minus its last token):

- store:   tokens the request computes in full (the unmatched rest of the prompt, and matched
           tokens it did not reuse) are written for layers < b(P / N): the depth a repeat of this
           prompt would be allowed;
- upgrade: reused nodes holding fewer than b(p / N) layers get layers [node depth, b(p / N))
           from this request's forward (its prefix positions are computed there anyway, from
           layer d on). Those layers come from THIS request's context on top of the reused shallow
           layers; the shallow layers stay as first written;
- trim:    under memory pressure, the deepest layers of cold (least recently used, unlocked) nodes
           go first, halving their depth, before whole nodes are evicted (LRU leaves).

A running request never sees a node change under it: it reads the reused rows where they live
(its ``SeqKV`` points at them), its path stays locked (locked nodes are never trimmed or
evicted), and upgrades only add rows.

The index (``radix.PrefixIndex``) and the tensor pool (``PrefixPool``) stay separate; this class
is the only code that touches both. :class:`NullCacheManager` has the same interface and caches
nothing, so "cache off" is a constructor choice, not a branch elsewhere.

Invariants (``check_integrity``): token slots held + free + in flight == token capacity; rows
bound in the table + free + in flight == row capacity; every node's tokens have rows exactly for
layers < its depth.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from radix import NodeHandle, NullRadixTree, PrefixIndex, RadixTree

from ..bicache.policy import NO_REUSE, DepthChoice, DepthPolicy
from ..models.forward_batch import Capture, SeqKV
from .pool import KVPool

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

    choice: DepthChoice = NO_REUSE
    handle: NodeHandle | None = None  # locked end of the match, None once released
    matched_slots: np.ndarray = field(default_factory=lambda: _NO_SLOTS)
    resume_rows: np.ndarray | None = None  # [prefix] rows whose h is S entering layer `depth`
    capture: Capture | None = None  # rows the first forward writes; None once committed
    new_slots: np.ndarray = field(default_factory=lambda: _NO_SLOTS)  # token slots of prompt[matched:]
    pending: list[tuple[np.ndarray, int, np.ndarray]] = field(default_factory=list)  # (slots, layer, rows)
    touched: list[tuple[int, int]] = field(default_factory=list)  # prompt position ranges that get rows


class CacheManager:
    """Prefix index + pool under one depth policy (see module docstring)."""

    enabled = True

    def __init__(self, index: PrefixIndex, pool: KVPool, policy: DepthPolicy) -> None:
        self.index, self.pool, self.policy = index, pool, policy
        self.in_flight_tokens = 0  # token slots of captures not yet committed or released
        self.in_flight_rows = 0
        self.num_lookups = self.num_hits = 0
        self.matched_tokens = self.looked_up_tokens = 0
        self.evicted_tokens = 0
        self.upgrades = 0
        self.trimmed_layer_tokens = 0

    def peek(self, prompt: Sequence[int]) -> int:
        """Cached length of a waiting request's prompt; changes nothing (scheduler ordering)."""
        return self.index.peek_prefix_len(reusable_prefix(prompt))

    # ------------------------------------------------------------------------------- lifecycle
    def admit(self, prompt: Sequence[int], seq_len: int, policy: DepthPolicy, kv: SeqKV | None) -> CacheGrant:
        """Match, lock, choose the depth under ``policy`` (the request's), point ``kv`` at the
        reused rows and reserve the capture (none if the pool cannot make room)."""
        key = reusable_prefix(prompt)
        m = self.index.match_prefix(key)
        self.num_lookups += 1
        self.looked_up_tokens += len(key)
        self.matched_tokens += m.length
        self.num_hits += m.length > 0
        self.index.lock(m.handle)
        grant = CacheGrant(policy.choose(m.segments, m.length, seq_len), m.handle, np.asarray(m.values, np.int64))
        d, p = grant.choice.depth, grant.choice.prefix
        if d > 0 and p > 0 and kv is not None:
            # Read in place: the path stays locked until release, so these rows cannot change.
            self.pool.share_prefix(kv, grant.matched_slots[:p], d)
            if d < self.pool.n_layers:
                grant.resume_rows = self.pool.table[grant.matched_slots[:p], d - 1].copy()
        self._reserve(grant, m, len(prompt), seq_len)
        return grant

    def _reserve(self, grant: CacheGrant, m, prompt_len: int, seq_len: int) -> None:
        """Plan and allocate what the first forward writes: (positions, layers) ranges."""
        p, b = grant.choice.prefix, self.policy.target_depth
        k_reused = b(p / seq_len) if p else 0
        k_full = b((prompt_len - 1) / seq_len)
        ranges: list[tuple[int, int, int, int]] = []  # (start, end, first layer, end layer)
        start = 0
        for end, node_depth in m.segments:
            want = k_reused if end <= p else k_full
            if node_depth < want:
                ranges.append((start, end, node_depth, want))
            start = end
        n_new = prompt_len - m.length
        if n_new > 0 and k_full > 0:
            ranges.append((m.length, prompt_len, 0, k_full))
        n_rows = sum((e - s) * (hi - lo) for s, e, lo, hi in ranges)
        tokens_needed = n_new if n_new > 0 else 0
        if (n_rows == 0 and tokens_needed == 0) or not self._make_room(n_rows, tokens_needed):
            return
        new_slots = self.pool.tokens.alloc(tokens_needed) if tokens_needed else _NO_SLOTS
        slots = np.concatenate([grant.matched_slots, new_slots])
        self.in_flight_tokens += tokens_needed
        self.in_flight_rows += n_rows
        layers: dict[int, tuple[np.ndarray, torch.Tensor]] = {}
        by_set: dict[tuple[int, ...], np.ndarray] = {}  # layers with the same ranges share one array
        for layer in range(self.pool.n_layers):
            active = tuple(j for j, (_, _, lo, hi) in enumerate(ranges) if lo <= layer < hi)
            if not active:
                continue
            if active not in by_set:
                by_set[active] = np.concatenate([np.arange(ranges[j][0], ranges[j][1], dtype=np.int64)
                                                 for j in active])
            pos_l = by_set[active]
            rows = self.pool.rows.alloc(len(pos_l))
            grant.pending.append((slots[pos_l], layer, rows))
            layers[layer] = (pos_l, self.pool.to_device(rows))
        grant.new_slots = new_slots
        grant.touched = [(s, e) for s, e, _, _ in ranges]
        grant.capture = Capture(layers)

    def commit(self, prompt: Sequence[int], grant: CacheGrant) -> None:
        """The first forward has written the capture: bind its rows, insert the prompt (new
        tokens), and record every node's depth along the path from what the table now holds."""
        if grant.capture is None:
            return
        grant.capture = None
        pending, grant.pending = grant.pending, []
        new_slots, grant.new_slots = grant.new_slots, _NO_SLOTS
        self.in_flight_tokens -= len(new_slots)
        if pending:
            slots = np.concatenate([sl for sl, _, _ in pending])
            layers = np.concatenate([np.full(len(sl), layer, dtype=np.int64) for sl, layer, _ in pending])
            rows = np.concatenate([r for _, _, r in pending])
            self.in_flight_rows -= len(rows)
            self.pool.rows.free(self.pool.bind(slots, layers, rows))  # rows a concurrent upgrade beat
        handle, new_leaf = grant.handle, None
        if len(new_slots):
            try:
                # depth 0: existing nodes are never changed by an insert; depths are set below
                res = self.index.insert(prompt, np.concatenate([grant.matched_slots, new_slots]), 0)
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
            held = self.pool.held_depth(node.value)
            if held > node.depth:
                self.upgrades += node is not new_leaf
                self.index.set_depth(node, held)

    def release(self, grant: CacheGrant) -> None:
        """The request is leaving (finished, aborted or failed). Idempotent."""
        if grant.capture is not None:
            grant.capture = None
            for _, _, rows in grant.pending:
                self.pool.rows.free(rows)
                self.in_flight_rows -= len(rows)
            grant.pending = []
            self.pool.tokens.free(grant.new_slots)
            self.in_flight_tokens -= len(grant.new_slots)
            grant.new_slots = _NO_SLOTS
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
        while (pool.rows.num_free < rows or pool.tokens.num_free < tokens) and self.index.evictable_size() > 0:
            for arr in self.index.evict(1):
                pool.free_tokens(arr)
                self.evicted_tokens += len(arr)
        return pool.rows.num_free >= rows and pool.tokens.num_free >= tokens

    def _trim(self, need: int) -> None:
        """Halve the depth of cold unlocked nodes, least recently used first, until ``need`` rows
        are free (shallow layers serve every prefix fraction; deep ones only high ones)."""
        freed = 0
        while freed < need:
            progress = False
            for node in self.index.lru_nodes():
                if node.depth <= MIN_TRIM_DEPTH:
                    continue
                new = max(MIN_TRIM_DEPTH, node.depth // 2)
                n = self.pool.drop_layers(node.value, new)
                self.index.set_depth(node, new)
                freed += n
                self.trimmed_layer_tokens += n
                progress = True
                if freed >= need:
                    return
            if not progress:
                return

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
            "prefix_cache_trimmed_layer_tokens_total": self.trimmed_layer_tokens,
            "cache_lookups": lookups,
            "cache_hit_rate": self.num_hits / lookups if lookups else 0.0,
            "cache_token_hit_rate": self.matched_tokens / self.looked_up_tokens if self.looked_up_tokens else 0.0,
            "evicted_tokens": self.evicted_tokens,
        }

    def check_integrity(self) -> None:
        self.index.check_integrity()
        pool = self.pool
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
        rows_total = bound + pool.rows.num_free + self.in_flight_rows
        assert rows_total == pool.row_capacity, f"row leak: bound {bound} + free {pool.rows.num_free} + in-flight " \
                                                f"{self.in_flight_rows} != {pool.row_capacity}"
        for node in self.index.lru_nodes():
            assert pool.held_depth(node.value) == node.depth, f"{node!r}: table holds {pool.held_depth(node.value)}"


class NullCacheManager:
    """Caching off: the same interface, nothing matched, nothing stored."""

    enabled = False

    def __init__(self, pool: KVPool, policy: DepthPolicy) -> None:
        self.pool, self.policy = pool, policy
        self.index = NullRadixTree()

    def peek(self, prompt: Sequence[int]) -> int:
        return 0

    def admit(self, prompt: Sequence[int], seq_len: int, policy: DepthPolicy, kv: SeqKV | None) -> CacheGrant:
        return CacheGrant()

    def commit(self, prompt: Sequence[int], grant: CacheGrant) -> None:
        grant.capture = None

    def release(self, grant: CacheGrant) -> None:
        grant.capture = grant.handle = grant.resume_rows = None

    def flush(self) -> int:
        return 0

    def stats(self) -> dict:
        zero = ("capacity_tokens", "capacity_layer_tokens", "used_tokens", "stored_layer_tokens", "stored_bytes",
                "evictable_tokens", "protected_tokens", "free_tokens", "free_layer_tokens", "in_flight_tokens",
                "in_flight_layer_tokens", "max_depth", "bytes_per_layer_token", "bytes", "upgrades_total",
                "trimmed_layer_tokens_total")
        return {"prefix_cache_policy": self.policy.describe(), **{f"prefix_cache_{k}": 0 for k in zero},
                "prefix_cache_depth_histogram": {}, "cache_lookups": 0, "cache_hit_rate": 0.0,
                "cache_token_hit_rate": 0.0, "evicted_tokens": 0}

    def check_integrity(self) -> None:
        self.index.check_integrity()


def make_cache_manager(policy: DepthPolicy, pool: KVPool) -> CacheManager | NullCacheManager:
    """The cache for ``policy``: none at all for ``off``, else a radix index over ``pool``'s prefix
    rows."""
    if not policy.uses_cache:
        return NullCacheManager(pool, policy)
    return CacheManager(RadixTree(), pool, policy)
