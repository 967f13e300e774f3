"""Radix tree over token ids whose nodes hold prefix state only up to a depth.

The tree is pure bookkeeping: a node's *value* is an int64 array of slot indices (one slot per
token) into a prefix tensor pool owned elsewhere, and its *depth* says how many leading layers
of state those slots hold. See docs/radix.md for the contracts in prose.

Invariants (all checked by :meth:`RadixTree.check_integrity`, radix/integrity.py):

* every non-root node has ``len(key) == len(value) >= 1``; children of a node are keyed by the
  first token of their key, so siblings never share a first token;
* the tokens on the path root -> node spell the prefix the node's slots belong to; no slot is
  held twice anywhere in the tree;
* ``lock_ref`` counts the locks taken on the node or on any node below it, so a parent's
  ``lock_ref`` is at least the sum of its children's; a node is *protected* iff ``lock_ref > 0``;
* a parent's ``last_access`` is never older than any child's (every access touches the whole
  path), which makes "evict the least recently used leaf first" a valid LRU order;
* every evictable leaf (unlocked, childless) has a live entry in the eviction heap, and every
  unlocked node deeper than the trim floor one in the trim heap, so neither eviction nor a trim
  scans the tree;
* the size counters and the depth histogram equal what a full walk of the tree computes.

The tree is not thread-safe: the engine drives it from its one scheduler thread.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence

import numpy as np

from radix.index import PrefixIndex
from radix.integrity import TreeChecks
from radix.lru import EvictionOrder, LeastRecentlyUsed, LruHeaps
from radix.node import (
    EMPTY_SLOTS,
    InsertResult,
    MatchResult,
    NodeHandle,
    TreeNode,
    as_ids,
    as_slots,
    check_depth,
    common_len_at,
)


class RadixTree(LruHeaps, TreeChecks, PrefixIndex):
    """SGLang-style radix tree over token ids with per-node prefix-state depth."""

    def __init__(self, order: EvictionOrder | None = None) -> None:
        """``order``: which unlocked node eviction and trims give up first (default: least
        recently used)."""
        self._order = order if order is not None else LeastRecentlyUsed()
        self._serials = itertools.count()
        self._push_seq = itertools.count()
        self._clock = 0                     # logical LRU clock: one tick per match/insert
        self._root = self._new_node(EMPTY_SLOTS, EMPTY_SLOTS, 0, None)
        # Root is never evicted, locked or trimmed; it holds no tokens.
        self._evictable = 0
        self._protected = 0
        self._layer_tokens = 0
        self._num_nodes = 0                 # excluding root
        self._hist: dict[int, int] = {}     # depth -> tokens held at that depth
        # Lazy min-heap of evictable leaves. An entry is live iff the node is still an evictable
        # leaf and its order key equals the entry's; stale entries are skipped on pop and purged
        # when they outnumber the nodes.
        self._heap: list[tuple[int, int, int, TreeNode]] = []
        # Lazy min-heap of unlocked nodes for trims: an entry is live iff node.cold_t equals its
        # key (one live entry per node). Complete for nodes deeper than _cold_floor.
        self._cold: list[tuple[int, int, int, TreeNode]] = []
        self._cold_floor = 0

    # ------------------------------------------------------------------ queries

    def match_prefix(self, ids: Sequence[int]) -> MatchResult:
        """Longest cached prefix of ``ids``.

        On a partial match inside a node, the node is split so the returned handle ends exactly
        at ``length``. Every node on the matched path gets a fresh LRU time. A match of length 0
        returns the root handle.
        """
        arr = as_ids(ids)
        now = self._tick()
        node, pos = self._root, 0
        parts: list[np.ndarray] = []
        segments: list[tuple[int, int]] = []
        while pos < len(arr):
            child = node.children.get(int(arr[pos]))
            if child is None:
                break
            m = common_len_at(child.key, arr, pos)
            # m >= 1 because the child's first token equals arr[pos].
            if m < len(child.key):
                child = self._split(child, m)
            self._touch(child, now)
            parts.append(child.value)
            pos += m
            segments.append((pos, child.depth))
            node = child
        values = np.concatenate(parts) if parts else EMPTY_SLOTS.copy()
        return MatchResult(length=pos, handle=node, values=values, segments=tuple(segments))

    def peek_prefix_len(self, ids: Sequence[int]) -> int:
        """Length of the longest cached prefix of ``ids``; the tree is not changed (no split,
        no LRU touch), so a scheduler may ask for every waiting request on every step."""
        arr = as_ids(ids)
        node, pos = self._root, 0
        while pos < len(arr):
            child = node.children.get(int(arr[pos]))
            if child is None:
                break
            m = common_len_at(child.key, arr, pos)
            pos += m
            if m < len(child.key):
                break
            node = child
        return pos

    # ------------------------------------------------------------------ insert

    def insert(self, ids: Sequence[int], values: np.ndarray, depth: int) -> InsertResult:
        """Cache ``ids`` with slots ``values``; new tokens become one leaf holding ``depth``.

        Tokens already cached keep their node, slots and depth: where the caller's slot differs it
        comes back in ``to_free``; passing the very slot the tree holds counts as taken. A node's
        depth changes only through :meth:`set_depth`.
        """
        arr = as_ids(ids)
        depth = check_depth(depth)
        # Private copy: the tree keeps slices of it, so later writes to the caller's buffer
        # cannot change what the tree owns.
        vals = as_slots(values, len(arr))
        n = len(arr)
        taken = np.zeros(n, dtype=bool)
        now = self._tick()
        node, pos = self._root, 0
        while pos < n:
            child = node.children.get(int(arr[pos]))
            if child is None:
                break
            m = common_len_at(child.key, arr, pos)
            if m < len(child.key):
                child = self._split(child, m)
            taken[pos:pos + m] = child.value == vals[pos:pos + m]
            self._touch(child, now)
            pos += m
            node = child
        prefix_len = pos
        if pos < n:
            leaf = self._new_node(arr[pos:].copy(), vals[pos:], depth, node)
            leaf.last_access = now
            node.children[int(arr[pos])] = leaf
            size = n - pos
            self._num_nodes += 1
            self._evictable += size  # a new leaf has no locks
            self._layer_tokens += size * depth
            self._hist_add(depth, size)
            taken[pos:] = True
            self._maybe_push(leaf)
            self._cold_push(leaf)
            node = leaf
        rejected = vals[~taken]
        return InsertResult(prefix_len=prefix_len, handle=node, taken=taken,
                            to_free=[rejected] if rejected.size else [])

    # ------------------------------------------------------------------ locks

    def lock(self, handle: NodeHandle) -> None:
        """Protect the path root -> ``handle`` from eviction (``lock_ref += 1`` on each node).

        Locking the root is a no-op (it holds nothing).
        """
        for node in self._path_to_root(handle):
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.lock_ref += 1

    def unlock(self, handle: NodeHandle) -> None:
        """Undo one :meth:`lock` of ``handle``. Raises ``RuntimeError`` if it is not locked.

        Unlocking the root is a no-op, mirroring :meth:`lock`.
        """
        path = self._path_to_root(handle)
        # Validate first so a bad unlock leaves the tree untouched.
        for node in path:
            if node.lock_ref <= 0:
                raise RuntimeError(f"unlock below zero at {node!r}")
        for node in path:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += len(node.key)
                self._protected -= len(node.key)
                self._maybe_push(node)
                self._cold_push(node)

    # ------------------------------------------------------------------ eviction and depth

    def evict(self, num_tokens: int, num_layer_tokens: int = 0) -> list[np.ndarray]:
        """Free at least ``num_tokens`` tokens and ``num_layer_tokens`` layer-tokens (a node
        holds ``len * depth``), least recently used unlocked leaves first.

        A parent whose last child goes becomes a leaf and competes in the same pass. Stops as
        soon as both targets are reached or nothing evictable remains. Returns the freed slot
        arrays (the caller returns them to the pool); their handles die.
        """
        freed: list[np.ndarray] = []
        got = got_layers = 0
        while (got < num_tokens or got_layers < num_layer_tokens) and self._heap:
            t, _, _, node = heapq.heappop(self._heap)
            if not self._is_evictable_leaf(node) or self._order.key(node) != t:
                continue  # stale entry
            parent = node.parent
            assert parent is not None
            size = len(node.key)
            freed.append(node.value)
            got += size
            got_layers += size * node.depth
            del parent.children[int(node.key[0])]
            self._evictable -= size
            self._layer_tokens -= size * node.depth
            self._hist_add(node.depth, -size)
            self._num_nodes -= 1
            node.alive = False
            node.parent = None
            self._maybe_push(parent)
        return freed

    def set_depth(self, handle: NodeHandle, depth: int) -> None:
        """Record that ``handle``'s node now holds ``depth`` layers (its slots are unchanged).

        Raising is allowed on locked nodes (an upgrade only adds layers). Lowering is a trim:
        a locked node cannot lose layers (``RuntimeError``: a running request may be reading
        them). The root is a no-op.
        """
        depth = check_depth(depth)
        self._path_to_root(handle)  # validates the handle
        if handle is self._root or depth == handle.depth:
            return
        if depth < handle.depth and handle.lock_ref > 0:
            raise RuntimeError(f"cannot trim locked node {handle!r}")
        size = len(handle.key)
        self._layer_tokens += size * (depth - handle.depth)
        self._hist_add(handle.depth, -size)
        self._hist_add(depth, size)
        raised, handle.depth = depth > handle.depth, depth
        if raised:
            self._cold_push(handle)  # may now be deeper than the trim floor (no-op when locked)

    # ------------------------------------------------------------------ sizes

    def path(self, handle: NodeHandle) -> list[TreeNode]:
        """Nodes from the root (excluded) down to ``handle``; validates the handle."""
        return self._path_to_root(handle)[::-1]

    def depth_histogram(self) -> dict[int, int]:
        """Cached tokens per node depth, e.g. ``{2: 640, 6: 128}`` (kept as nodes change)."""
        return dict(sorted(self._hist.items()))

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def total_size(self) -> int:
        return self._evictable + self._protected

    def total_layer_tokens(self) -> int:
        return self._layer_tokens

    def num_nodes(self) -> int:
        """Nodes excluding the root (debugging / tests)."""
        return self._num_nodes

    def all_values(self) -> np.ndarray:
        parts = [node.value for node in self.iter_nodes()]
        return np.concatenate(parts) if parts else EMPTY_SLOTS.copy()

    def reset(self) -> list[np.ndarray]:
        """Drop every node and return all held slots. Raises ``RuntimeError`` if any is locked."""
        if self._protected > 0:
            raise RuntimeError(f"cannot reset: {self._protected} tokens are locked")
        nodes = list(self.iter_nodes())
        for node in nodes:  # every outstanding handle dies
            node.alive = False
            node.parent = None
        self._root.children = {}
        self._heap, self._cold, self._hist = [], [], {}
        self._evictable = self._protected = self._layer_tokens = self._num_nodes = 0
        return [node.value for node in nodes]

    def iter_nodes(self) -> Iterator[TreeNode]:
        """Every node but the root, depth first (debugging, integrity, compaction)."""
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    # ------------------------------------------------------------------ debugging

    def __repr__(self) -> str:
        return (f"RadixTree(nodes={self._num_nodes}, tokens={self.total_size()}, "
                f"protected={self._protected})")

    # ------------------------------------------------------------------ internals

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _new_node(self, key: np.ndarray, value: np.ndarray, depth: int,
                  parent: TreeNode | None) -> TreeNode:
        return TreeNode(key, value, depth, parent, self._clock, next(self._serials), self)

    def _hist_add(self, depth: int, tokens: int) -> None:
        left = self._hist.get(depth, 0) + tokens
        if left:
            self._hist[depth] = left
        else:
            self._hist.pop(depth, None)

    def _touch(self, node: TreeNode, now: int) -> None:
        node.last_access = now
        self._maybe_push(node)
        self._cold_push(node)

    def _split(self, child: TreeNode, m: int) -> TreeNode:
        """Split ``child`` after its first ``m`` tokens; return the new upper node.

        ``child`` keeps its identity (so handles to it still end at the same prefix length);
        the new node inherits depth, lock count and LRU time, so no counter changes.
        """
        assert 0 < m < len(child.key)
        parent = child.parent
        assert parent is not None
        upper = self._new_node(child.key[:m], child.value[:m], child.depth, parent)
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        child.key = child.key[m:]
        child.value = child.value[m:]
        child.parent = upper
        upper.children[int(child.key[0])] = child
        parent.children[int(upper.key[0])] = upper
        self._num_nodes += 1
        self._cold_push(upper)
        return upper

    def _path_to_root(self, handle: NodeHandle) -> list[TreeNode]:
        """Nodes from ``handle`` up to (excluding) the root; validates the handle."""
        if not isinstance(handle, TreeNode) or handle.owner is not self:
            raise ValueError(f"not a handle of this tree: {handle!r}")
        if not handle.alive:
            raise ValueError(f"dead handle (evicted or reset): {handle!r}")
        path: list[TreeNode] = []
        node = handle
        while node is not self._root:
            path.append(node)
            assert node.parent is not None, "live node detached from root"
            node = node.parent
        return path
