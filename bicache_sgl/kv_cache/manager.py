"""The cache manager: the whole lifecycle of one request's use of the prefix cache.

    admit   match ONCE (the last prompt token excluded), lock the matched path, choose the depth
            with the request's policy, copy the reused state into the request's private K/V, and
            allocate pool slots for the request's new prompt tokens (a *capture*);
    commit  after the request's first forward filled those slots: insert the prompt into the index;
    release when the request leaves: free an uncommitted capture, unlock the path.

The index (``radix.PrefixIndex``) and the tensor pool (``PrefixPool``) stay separate; this class
is the only code that touches both. :class:`NullCacheManager` has the same interface and caches
nothing, so "cache off" is a constructor choice, not a branch elsewhere.

Invariant (``check_integrity``): free slots + slots held by the index + slots of in-flight
captures == pool capacity, with no slot in two places.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from radix import NodeHandle, NullRadixTree, PrefixIndex, RadixTree

from ..bicache.policy import NO_REUSE, DepthChoice, DepthPolicy
from ..models.forward_batch import Capture, SeqKV
from .pool import PrefixPool

log = logging.getLogger(__name__)

_NO_SLOTS = np.zeros(0, dtype=np.int64)


def reusable_prefix(prompt: Sequence[int]) -> Sequence[int]:
    """The part of a prompt that may be served from the cache: all but the last token, which is
    always recomputed (as in SGLang) so every request computes at least one prompt position."""
    return prompt[:max(len(prompt) - 1, 0)]


@dataclass
class CacheGrant:
    """What admission gave one request; owned by the request until ``release``."""

    choice: DepthChoice = NO_REUSE
    handle: NodeHandle | None = None  # locked path end, None once released
    matched_slots: np.ndarray = field(default_factory=lambda: _NO_SLOTS)
    capture: Capture | None = None  # slots being filled by the first forward, None once committed
    capture_slots: np.ndarray = field(default_factory=lambda: _NO_SLOTS)  # the capture's slots (host)
    resume_h: torch.Tensor | None = None  # [prefix, D] residual of S entering layer `depth`


class CacheManager:
    """Prefix index + pool under one depth policy (see module docstring)."""

    enabled = True

    def __init__(self, index: PrefixIndex, pool: PrefixPool, policy: DepthPolicy) -> None:
        self.index, self.pool, self.policy = index, pool, policy
        self.in_flight = 0  # slots of captures not yet committed or released
        self.num_lookups = self.num_hits = 0
        self.matched_tokens = self.looked_up_tokens = 0
        self.evicted_tokens = 0

    @property
    def node_depth(self) -> int:
        return self.pool.depth

    def peek(self, prompt: Sequence[int]) -> int:
        """Cached length of a waiting request's prompt; changes nothing (scheduler ordering)."""
        return self.index.peek_prefix_len(reusable_prefix(prompt))

    # ------------------------------------------------------------------------------- lifecycle
    def admit(self, prompt: Sequence[int], seq_len: int, policy: DepthPolicy, kv: SeqKV | None) -> CacheGrant:
        """Match, lock, choose the depth under ``policy``, copy the reused state into ``kv`` and
        allocate a capture for the new prompt tokens (none if the pool cannot make room)."""
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
            # Copy, so the request never reads the pool again: eviction or a node upgrade cannot
            # change a running request's output.
            slots = self.pool.slots_tensor(grant.matched_slots[:p])
            k, v = self.pool.read_kv(d, slots)
            kv.k[:d, :p] = k
            kv.v[:d, :p] = v
            if d < self.pool.cfg.n_layers:
                grant.resume_h = self.pool.read_h(d, slots).clone()
        new = len(prompt) - m.length
        if new > 0:
            slots = self._alloc(new)
            if slots is not None:
                grant.capture = Capture(np.arange(m.length, len(prompt), dtype=np.int64),
                                        self.pool.slots_tensor(slots), self.pool.depth)
                grant.capture_slots = slots
        return grant

    def commit(self, prompt: Sequence[int], grant: CacheGrant) -> None:
        """The first forward has written the capture: insert the prompt into the index."""
        if grant.capture is None:
            return
        slots, grant.capture, grant.capture_slots = grant.capture_slots, None, _NO_SLOTS
        self.in_flight -= len(slots)
        try:
            values = np.concatenate([grant.matched_slots, slots])
            # The index treats the slots it already holds (the matched range) as taken, so
            # to_free holds only duplicates of ours and slots replaced by a depth upgrade.
            res = self.index.insert(prompt, values, self.pool.depth)
        except Exception:
            log.exception("prefix cache insert failed; continuing without caching this prompt")
            self.pool.allocator.free(slots)
            return
        for arr in res.to_free:
            self.pool.allocator.free(arr)

    def release(self, grant: CacheGrant) -> None:
        """The request is leaving (finished, aborted or failed). Idempotent."""
        if grant.capture is not None:
            slots, grant.capture, grant.capture_slots = grant.capture_slots, None, _NO_SLOTS
            self.pool.allocator.free(slots)
            self.in_flight -= len(slots)
        if grant.handle is not None:
            self.index.unlock(grant.handle)
            grant.handle = None
        grant.resume_h = None

    # ------------------------------------------------------------------------------- capacity
    def _alloc(self, n: int) -> np.ndarray | None:
        a = self.pool.allocator
        if a.num_free < n:
            self._evict(n - a.num_free)
        slots = a.alloc(n)
        if slots is not None:
            self.in_flight += n
        return slots

    def _evict(self, n: int) -> None:
        for arr in self.index.evict(n):
            self.pool.allocator.free(arr)
            self.evicted_tokens += len(arr)

    def flush(self) -> int:
        """Evict everything not locked by a running request. Returns tokens freed."""
        before = self.index.total_size()
        self._evict(before)
        return before - self.index.total_size()

    # ------------------------------------------------------------------------------- reporting
    def stats(self) -> dict:
        lookups = self.num_lookups
        return {
            "prefix_cache_policy": self.policy.describe(),
            "prefix_cache_capacity_tokens": self.pool.capacity,
            "prefix_cache_used_tokens": self.index.total_size(),
            "prefix_cache_evictable_tokens": self.index.evictable_size(),
            "prefix_cache_protected_tokens": self.index.protected_size(),
            "prefix_cache_free_tokens": self.pool.allocator.num_free,
            "prefix_cache_in_flight_tokens": self.in_flight,  # free + used + in flight == capacity
            "prefix_cache_depth": self.pool.depth,
            "prefix_cache_bytes_per_token": self.pool.bytes_per_token,
            "prefix_cache_bytes": self.pool.nbytes,
            "cache_lookups": lookups,
            "cache_hit_rate": self.num_hits / lookups if lookups else 0.0,
            "cache_token_hit_rate": self.matched_tokens / self.looked_up_tokens if self.looked_up_tokens else 0.0,
            "evicted_tokens": self.evicted_tokens,
        }

    def check_integrity(self) -> None:
        self.index.check_integrity()
        held = np.asarray(self.index.all_values(), dtype=np.int64)
        free = self.pool.allocator.free_set()
        assert len(np.unique(held)) == len(held), "a slot is held twice by the index"
        assert len(np.intersect1d(held, free)) == 0, "a slot is both free and held by the index"
        total = len(held) + len(free) + self.in_flight
        assert total == self.pool.capacity, f"slot leak: free {len(free)} + cached {len(held)} + in-flight " \
                                            f"{self.in_flight} != capacity {self.pool.capacity}"


class NullCacheManager:
    """Caching off: the same interface, nothing matched, nothing stored."""

    enabled = False
    node_depth = 0
    pool = None

    def __init__(self, policy: DepthPolicy) -> None:
        self.policy = policy
        self.index = NullRadixTree()

    def peek(self, prompt: Sequence[int]) -> int:
        return 0

    def admit(self, prompt: Sequence[int], seq_len: int, policy: DepthPolicy, kv: SeqKV | None) -> CacheGrant:
        return CacheGrant()

    def commit(self, prompt: Sequence[int], grant: CacheGrant) -> None:
        grant.capture = None

    def release(self, grant: CacheGrant) -> None:
        grant.capture = grant.handle = grant.resume_h = None

    def flush(self) -> int:
        return 0

    def stats(self) -> dict:
        return {"prefix_cache_policy": self.policy.describe(), "prefix_cache_capacity_tokens": 0,
                "prefix_cache_used_tokens": 0, "prefix_cache_evictable_tokens": 0,
                "prefix_cache_protected_tokens": 0, "prefix_cache_free_tokens": 0,
                "prefix_cache_in_flight_tokens": 0, "prefix_cache_depth": 0, "prefix_cache_bytes_per_token": 0,
                "prefix_cache_bytes": 0, "cache_lookups": 0, "cache_hit_rate": 0.0, "cache_token_hit_rate": 0.0,
                "evicted_tokens": 0}

    def check_integrity(self) -> None:
        self.index.check_integrity()


def make_cache_manager(policy: DepthPolicy, pool_tokens: int, model_config, dtype: torch.dtype,
                       device: torch.device) -> CacheManager | NullCacheManager:
    """The cache for ``policy``: none at all for ``off``, else a radix index over a pool whose
    nodes hold ``policy.node_depth`` layers."""
    if not policy.uses_cache:
        return NullCacheManager(policy)
    pool = PrefixPool(model_config, policy.node_depth, pool_tokens, dtype, device)
    return CacheManager(RadixTree(), pool, policy)
