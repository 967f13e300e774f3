"""The orders of a ``RadixTree``: the lazy eviction heap of evictable leaves and the lazy trim
heap of unlocked nodes, so neither eviction nor a trim scans the tree (a mixin of ``RadixTree``).
Which node goes first is the tree's :class:`EvictionOrder` (least recently used by default).

Heap entries are ``(key, serial, push order, node)``, ``key`` the order's key of the node when
pushed: the push order keeps nodes from being compared. An eviction entry is live iff its node is
still an evictable leaf with that key; a trim entry is live iff ``node.cold_t`` equals its key
(one live entry per node). Stale entries are skipped on pop and purged when they outnumber the
nodes.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections.abc import Iterator

from radix.node import TreeNode, check_depth


class EvictionOrder(ABC):
    """Which unlocked node a ``RadixTree`` gives up first, for eviction and trims alike: the
    smaller :meth:`key` first, ties by creation order. A node's key may change only when the tree
    touches the node (a match or insert through it, a split, a lock or unlock), because those are
    the moments its heap entries are refreshed."""

    name: str

    @abstractmethod
    def key(self, node: TreeNode) -> int:
        """The node's place in the order, an int >= 0 (smaller: given up sooner)."""


class LeastRecentlyUsed(EvictionOrder):
    """The least recently matched or inserted first (the tree's logical clock)."""

    name = "lru"

    def key(self, node: TreeNode) -> int:
        return node.last_access


class LruHeaps:
    """Eviction and trim heaps over the tree's nodes (state set up by ``RadixTree.__init__``)."""

    _root: TreeNode
    _num_nodes: int
    _push_seq: itertools.count
    _heap: list[tuple[int, int, int, TreeNode]]
    _cold: list[tuple[int, int, int, TreeNode]]
    _cold_floor: int  # the trim heap is complete for unlocked nodes deeper than this
    _layer_tokens: int
    _order: EvictionOrder

    def _hist_add(self, depth: int, tokens: int) -> None:
        raise NotImplementedError

    def iter_nodes(self) -> Iterator[TreeNode]:
        raise NotImplementedError

    def _begin_trim(self, min_depth: int) -> int:
        """``min_depth`` checked; the trim heap made complete for nodes deeper than it."""
        min_depth = check_depth(min_depth)
        if min_depth < self._cold_floor:
            self._rebuild_cold()
        self._cold_floor = max(self._cold_floor, min_depth)
        return min_depth

    def _pop_cold(self, min_depth: int) -> TreeNode | None:
        """The coldest live, unlocked node deeper than ``min_depth``, taken off the trim heap (None
        when none is left). Stale entries, locked nodes and nodes at or below the floor leave the
        heap as they are met: unlock and set_depth push a node again."""
        heap = self._cold
        while heap:
            t, _, _, node = heapq.heappop(heap)
            if not node.alive or node.cold_t != t:
                continue  # stale
            node.cold_t = -1
            if node.lock_ref > 0 or node.depth <= min_depth:
                continue
            return node
        return None

    def halve_cold(self, min_depth: int, need: int) -> tuple[list[TreeNode], list[int], int]:
        """Halve the depth of unlocked nodes deeper than ``min_depth`` (each to
        ``max(min_depth, depth // 2)``), least recently used first, in the passes of
        :meth:`PrefixIndex.halve_cold` (a node halved and still deeper than the floor comes again
        in the next pass), until ``need`` layer-tokens are dropped or nothing is deeper than the
        floor. Returns (the nodes in the order they were halved, a node halved twice appearing
        twice; the depth each halving left; layer-tokens dropped).

        The same choices as walking that order and calling ``set_depth`` per node (the tests'
        ``trim_candidates``), in one loop: no generator step, handle validation or histogram entry
        per node (the counters are updated once at the end), which is what a full pool pays per
        trimmed node."""
        min_depth = self._begin_trim(min_depth)
        nodes: list[TreeNode] = []
        kept: list[int] = []
        dropped = 0
        hist_delta: dict[int, int] = {}
        deferred: list[TreeNode] = []
        while dropped < need:
            while dropped < need and (node := self._pop_cold(min_depth)) is not None:
                deferred.append(node)
                old, size = node.depth, len(node.key)
                new = max(min_depth, old // 2)
                node.depth = new
                dropped += size * (old - new)
                hist_delta[old] = hist_delta.get(old, 0) - size
                hist_delta[new] = hist_delta.get(new, 0) + size
                nodes.append(node)
                kept.append(new)
            if dropped >= need or not deferred:
                break
            again, deferred = deferred, []  # the next pass: each node once more, coldest first
            for node in again:
                self._cold_push(node)
        for node in deferred:
            self._cold_push(node)
        self._layer_tokens -= dropped
        for depth, delta in hist_delta.items():
            self._hist_add(depth, delta)
        return nodes, kept, dropped

    def _is_evictable_leaf(self, node: TreeNode) -> bool:
        return (node.alive and node is not self._root and not node.children
                and node.lock_ref == 0)

    def _maybe_push(self, node: TreeNode) -> None:
        """Give ``node`` an eviction-heap entry at its current time if it is an evictable leaf."""
        if not self._is_evictable_leaf(node):
            return
        key = self._order.key
        heapq.heappush(self._heap, (key(node), node.serial, next(self._push_seq), node))
        # Stale entries pile up with every touch; rebuild once they dominate so the heap stays
        # O(nodes) and each pop stays O(log nodes).
        if len(self._heap) > 2 * self._num_nodes + 64:
            self._heap = [(key(n), n.serial, next(self._push_seq), n)
                          for n in self.iter_nodes() if self._is_evictable_leaf(n)]
            heapq.heapify(self._heap)

    def _cold_push(self, node: TreeNode) -> None:
        """Give an unlocked ``node`` its one live trim-heap entry at its current time."""
        k = self._order.key(node)
        if node.lock_ref > 0 or node is self._root or node.cold_t == k:
            return
        node.cold_t = k
        heapq.heappush(self._cold, (k, node.serial, next(self._push_seq), node))
        if len(self._cold) > 2 * self._num_nodes + 64:
            self._rebuild_cold()

    def _rebuild_cold(self) -> None:
        self._cold = []
        key = self._order.key
        for n in self.iter_nodes():
            n.cold_t = -1 if n.lock_ref else key(n)
            if not n.lock_ref:
                self._cold.append((n.cold_t, n.serial, next(self._push_seq), n))
        heapq.heapify(self._cold)
        self._cold_floor = 0

