"""Prefix cache = radix index (``radix.RadixTree``) + tensor storage (PrefixPool).

The index and the pool stay separate: the tree hands out opaque slot arrays, the pool owns the
tensors. With ``NullRadixTree`` and no pool the same interface caches nothing, so "cache off" is a
constructor choice, not a branch elsewhere.

Invariant (checked by ``check_integrity``, and by the tests when idle):
    free slots + slots held by the tree == capacity, with no slot in both.
Slots being filled by a running forward are held by that request until it inserts or frees them.
"""

from __future__ import annotations

import numpy as np

from radix import MatchResult, NullRadixTree, RadixTree

from .pool import PrefixPool


class PrefixCache:
    def __init__(self, tree: RadixTree | NullRadixTree, pool: PrefixPool | None) -> None:
        self.tree, self.pool = tree, pool
        self.in_flight = 0  # slots allocated to running forwards, not yet inserted or freed
        # statistics
        self.num_lookups = 0
        self.num_hits = 0
        self.matched_tokens = 0
        self.looked_up_tokens = 0
        self.evicted_tokens = 0

    @classmethod
    def null(cls) -> "PrefixCache":
        return cls(NullRadixTree(), None)

    @property
    def enabled(self) -> bool:
        return self.pool is not None

    @property
    def depth(self) -> int:
        return self.pool.depth if self.pool is not None else 0

    @property
    def capacity(self) -> int:
        return self.pool.capacity if self.pool is not None else 0

    def match(self, ids: list[int]) -> MatchResult:
        m = self.tree.match_prefix(ids)
        self.num_lookups += 1
        self.looked_up_tokens += len(ids)
        self.matched_tokens += m.length
        self.num_hits += m.length > 0
        return m

    def lock(self, handle) -> None:
        self.tree.lock(handle)

    def unlock(self, handle) -> None:
        self.tree.unlock(handle)

    def alloc(self, n: int) -> np.ndarray | None:
        """n slots for a capture, evicting LRU unlocked prefixes if needed; None if the cache cannot
        make room (the request then simply runs without inserting)."""
        if self.pool is None or n <= 0:
            return None
        a = self.pool.allocator
        if a.num_free < n:
            self._evict(n - a.num_free)
        slots = a.alloc(n)
        if slots is not None:
            self.in_flight += n
        return slots

    def _evict(self, n: int) -> None:
        for arr in self.tree.evict(n):
            self.pool.allocator.free(arr)
            self.evicted_tokens += len(arr)

    def release(self, slots: np.ndarray) -> None:
        """Give back slots from ``alloc`` that will not be inserted."""
        if self.pool is not None and len(slots):
            self.pool.allocator.free(slots)
            self.in_flight -= len(slots)

    def insert(self, ids: list[int], matched_values: np.ndarray, new_slots: np.ndarray) -> None:
        """Insert ``ids`` whose first len(matched_values) tokens were matched (and are held by the
        tree) and whose remaining tokens were captured into ``new_slots`` at the pool's depth."""
        values = np.concatenate([np.asarray(matched_values, dtype=np.int64), new_slots])
        # The tree treats slots it already holds (the matched range) as taken, so to_free holds
        # only duplicates of ours and slots replaced by a depth upgrade.
        res = self.tree.insert(ids, values, self.depth)
        self.in_flight -= len(new_slots)
        for arr in res.to_free:
            self.pool.allocator.free(arr)

    def flush(self) -> int:
        """Evict everything not locked by a running request. Returns tokens freed."""
        if self.pool is None:
            return 0
        before = self.tree.total_size()
        self._evict(before)
        return before - self.tree.total_size()

    def stats(self) -> dict:
        return {
            "prefix_cache_capacity_tokens": self.capacity,
            "prefix_cache_used_tokens": self.tree.total_size(),
            "prefix_cache_evictable_tokens": self.tree.evictable_size(),
            "prefix_cache_protected_tokens": self.tree.protected_size(),
            "prefix_cache_free_tokens": self.pool.allocator.num_free if self.pool is not None else 0,
            "prefix_cache_in_flight_tokens": self.in_flight,  # free + used + in flight == capacity
            "prefix_cache_depth": self.depth,
            "prefix_cache_bytes_per_token": self.pool.bytes_per_token if self.pool is not None else 0,
            "prefix_cache_bytes": self.pool.nbytes if self.pool is not None else 0,
            "cache_lookups": self.num_lookups,
            "cache_hit_rate": self.num_hits / self.num_lookups if self.num_lookups else 0.0,
            "cache_token_hit_rate": self.matched_tokens / self.looked_up_tokens if self.looked_up_tokens else 0.0,
            "evicted_tokens": self.evicted_tokens,
        }

    def check_integrity(self) -> None:
        self.tree.check_integrity()
        if self.pool is None:
            return
        held = np.asarray(self.tree.all_values(), dtype=np.int64)
        free = self.pool.allocator.free_set()
        assert len(np.unique(held)) == len(held), "a slot is held twice by the tree"
        assert len(np.intersect1d(held, free)) == 0, "a slot is both free and held by the tree"
        total = len(held) + len(free) + self.in_flight
        assert total == self.capacity, f"slot leak: free {len(free)} + cached {len(held)} + in-flight " \
                                       f"{self.in_flight} != capacity {self.capacity}"
