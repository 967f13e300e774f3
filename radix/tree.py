"""Radix tree over token ids whose nodes hold prefix state only up to a depth.

The tree is pure bookkeeping: a node's *value* is an int64 array of slot indices (one slot per
token) into a prefix tensor pool owned elsewhere, and its *depth* says how many leading layers
of state those slots hold. See docs/radix.md for the contracts in prose.

Invariants (all checked by :meth:`RadixTree.check_integrity`):

* every non-root node has ``len(key) == len(value) >= 1``; children of a node are keyed by the
  first token of their key, so siblings never share a first token;
* the tokens on the path root -> node spell the prefix the node's slots belong to; no slot is
  held twice anywhere in the tree;
* ``lock_ref`` counts the locks taken on the node or on any node below it, so a parent's
  ``lock_ref`` is at least the sum of its children's; a node is *protected* iff ``lock_ref > 0``;
* a parent's ``last_access`` is never older than any child's (every access touches the whole
  path), which makes "evict the least recently used leaf first" a valid LRU order;
* every evictable leaf (unlocked, childless) has a live entry in the eviction heap;
* the size counters equal what a full walk of the tree computes.

The tree is not thread-safe: the engine drives it from its one scheduler thread.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "InsertResult",
    "MatchResult",
    "NodeHandle",
    "NullRadixTree",
    "PrefixIndex",
    "RadixTree",
    "TreeNode",
    "common_prefix_len",
]

_EMPTY_SLOTS = np.empty(0, dtype=np.int64)
_EMPTY_SLOTS.setflags(write=False)


class TreeNode:
    """One radix node. Callers treat it as an opaque handle (``NodeHandle``).

    A handle stays valid (and keeps ending at the same prefix length) across splits, depth
    upgrades and trims; it dies only when its node is evicted or the tree is reset. Using a dead
    handle raises ``ValueError``.
    """

    __slots__ = (
        "alive",
        "children",
        "depth",
        "key",
        "last_access",
        "lock_ref",
        "owner",
        "parent",
        "serial",
        "value",
    )

    def __init__(self, key: np.ndarray, value: np.ndarray, depth: int,
                 parent: TreeNode | None, last_access: int, serial: int, owner: object) -> None:
        self.key = key                  # int64 token ids of this edge
        self.value = value              # int64 slot ids, one per token of `key`
        self.depth = depth              # layers of prefix state the slots hold
        self.parent = parent
        self.children: dict[int, TreeNode] = {}  # first token of child's key -> child
        self.lock_ref = 0               # locks on this node or any descendant
        self.last_access = last_access  # logical clock value of the last match/insert through it
        self.serial = serial            # creation order: deterministic LRU tie-break
        self.alive = True               # False once evicted / reset: handle is dead
        self.owner = owner              # the tree that made it (rejects foreign handles)

    def __repr__(self) -> str:
        state = "" if self.alive else " dead"
        return (f"<TreeNode #{self.serial} len={len(self.key)} depth={self.depth} "
                f"lock={self.lock_ref} t={self.last_access}{state}>")


NodeHandle = TreeNode


@dataclass(frozen=True, eq=False)
class MatchResult:
    """Result of :meth:`RadixTree.match_prefix`.

    ``segments`` has one ``(end_len, depth)`` pair per node on the matched path, with strictly
    increasing ``end_len``; the last ``end_len`` equals ``length``. ``values`` is a fresh copy.
    """

    length: int
    handle: NodeHandle
    values: np.ndarray
    segments: tuple[tuple[int, int], ...]

    def depth_at(self, prefix_len: int) -> int:
        """Minimum node depth over tokens ``[0, prefix_len)``; 0 for ``prefix_len == 0``.

        Raises ``ValueError`` if ``prefix_len`` is negative or longer than the match.
        """
        if prefix_len < 0 or prefix_len > self.length:
            raise ValueError(f"prefix_len {prefix_len} outside [0, {self.length}]")
        if prefix_len == 0:
            return 0
        best: int | None = None
        for end_len, depth in self.segments:
            best = depth if best is None else min(best, depth)
            if end_len >= prefix_len:
                break
        assert best is not None  # length > 0 implies at least one segment
        return best


@dataclass(frozen=True, eq=False)
class InsertResult:
    """Result of :meth:`RadixTree.insert`.

    ``taken[i]`` is True where the tree now owns ``values[i]`` (new tokens, depth upgrades, and
    positions where the caller passed the very slot the tree already held there). ``to_free``
    lists the slots the caller must return to the pool: its own slots the tree did not take,
    plus old slots replaced by a depth upgrade. Every array in ``to_free`` is non-empty.
    """

    prefix_len: int
    handle: NodeHandle
    taken: np.ndarray
    to_free: list[np.ndarray]


class PrefixIndex(ABC):
    """The prefix index interface (token ids -> slot arrays with a depth), implemented by
    :class:`RadixTree` and by :class:`NullRadixTree` (caching off). Tensor-free: slot arrays point
    into a pool owned elsewhere, so the index is tested on CPU in milliseconds."""

    @abstractmethod
    def match_prefix(self, ids: Sequence[int]) -> MatchResult:
        """Longest cached prefix; may split a node and refreshes LRU times on the path."""

    @abstractmethod
    def peek_prefix_len(self, ids: Sequence[int]) -> int:
        """Length of the longest cached prefix, changing nothing (no split, no LRU touch)."""

    @abstractmethod
    def insert(self, ids: Sequence[int], values: np.ndarray, depth: int) -> InsertResult:
        """Cache ``ids`` with slots ``values`` holding ``depth`` layers of state."""

    @abstractmethod
    def lock(self, handle: NodeHandle) -> None:
        """Protect the path root -> handle from eviction, trims and upgrades' frees."""

    @abstractmethod
    def unlock(self, handle: NodeHandle) -> None:
        """Undo one :meth:`lock`."""

    @abstractmethod
    def evict(self, num_tokens: int) -> list[np.ndarray]:
        """Evict unlocked LRU leaves until ``num_tokens`` are freed (or nothing is evictable)."""

    @abstractmethod
    def trim_depth(self, handle: NodeHandle, depth: int) -> None:
        """Lower a node's recorded depth."""

    @abstractmethod
    def set_depth(self, handle: NodeHandle, depth: int) -> None:
        """Record the depth a node's slots now hold (raise: an upgrade; lower: a trim)."""

    @abstractmethod
    def path(self, handle: NodeHandle) -> list[NodeHandle]:
        """Nodes from the root (excluded) down to ``handle``."""

    @abstractmethod
    def lru_nodes(self) -> list[NodeHandle]:
        """Unlocked nodes, least recently used first (trim candidates)."""

    @abstractmethod
    def depth_histogram(self) -> dict[int, int]:
        """Cached tokens per node depth."""

    @abstractmethod
    def evictable_size(self) -> int: ...

    @abstractmethod
    def protected_size(self) -> int: ...

    @abstractmethod
    def total_size(self) -> int: ...

    @abstractmethod
    def total_layer_tokens(self) -> int: ...

    @abstractmethod
    def all_values(self) -> np.ndarray: ...

    @abstractmethod
    def reset(self) -> list[np.ndarray]: ...

    @abstractmethod
    def check_integrity(self) -> None: ...

    @abstractmethod
    def pretty(self) -> str: ...


def _as_ids(ids: Sequence[int]) -> np.ndarray:
    arr = np.asarray(ids)
    if arr.ndim != 1:
        raise ValueError(f"ids must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return _EMPTY_SLOTS
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"ids must be integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common leading run of two token sequences (vectorised)."""
    x, y = np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64)
    n = min(len(x), len(y))
    diff = np.flatnonzero(x[:n] != y[:n])
    return int(diff[0]) if diff.size else n


def _common_len(key: np.ndarray, ids: np.ndarray, start: int) -> int:
    """Length of the common prefix of ``key`` and ``ids[start:]``."""
    n = min(len(key), len(ids) - start)
    diff = np.flatnonzero(key[:n] != ids[start:start + n])
    return int(diff[0]) if diff.size else n



def _as_slots(values: np.ndarray, n: int) -> np.ndarray:
    """Validated private int64 copy of ``values``: 1-D integer slot ids, one per token id."""
    vals = np.asarray(values)
    if vals.ndim != 1 or len(vals) != n:
        raise ValueError(f"values must be 1-D with one slot per id: got shape {vals.shape} "
                         f"for {n} ids")
    if vals.size and not np.issubdtype(vals.dtype, np.integer):
        raise ValueError(f"values must be integer slot ids, got dtype {vals.dtype}")
    return np.array(vals, dtype=np.int64, copy=True)

def _check_depth(depth: int) -> int:
    if isinstance(depth, (bool, np.bool_)) or not isinstance(depth, (int, np.integer)):
        raise TypeError(f"depth must be an int, got {type(depth).__name__}")
    if depth < 0:
        raise ValueError(f"depth must be >= 0, got {depth}")
    return int(depth)


class RadixTree(PrefixIndex):
    """SGLang-style radix tree over token ids with per-node prefix-state depth."""

    def __init__(self) -> None:
        self._serials = itertools.count()
        self._push_seq = itertools.count()  # unique heap tie-break so nodes are never compared
        self._clock = 0                     # logical LRU clock: one tick per match/insert
        self._root = self._new_node(_EMPTY_SLOTS, _EMPTY_SLOTS, 0, None)
        # Root is never evicted, locked or trimmed; it holds no tokens.
        self._evictable = 0
        self._protected = 0
        self._layer_tokens = 0
        self._num_nodes = 0                 # excluding root
        # Lazy min-heap of (last_access, serial, push_seq, node). An entry is live iff the node
        # is still an evictable leaf and its last_access equals the entry's; stale entries are
        # skipped on pop and purged by _compact_heap when they outnumber the nodes.
        self._heap: list[tuple[int, int, int, TreeNode]] = []

    # ------------------------------------------------------------------ queries

    def match_prefix(self, ids: Sequence[int]) -> MatchResult:
        """Longest cached prefix of ``ids``.

        On a partial match inside a node, the node is split so the returned handle ends exactly
        at ``length``. Every node on the matched path gets a fresh LRU time. A match of length 0
        returns the root handle.
        """
        arr = _as_ids(ids)
        now = self._tick()
        node = self._root
        pos = 0
        parts: list[np.ndarray] = []
        segments: list[tuple[int, int]] = []
        while pos < len(arr):
            child = node.children.get(int(arr[pos]))
            if child is None:
                break
            m = _common_len(child.key, arr, pos)
            # m >= 1 because the child's first token equals arr[pos].
            if m < len(child.key):
                child = self._split(child, m)
            self._touch(child, now)
            parts.append(child.value)
            pos += m
            segments.append((pos, child.depth))
            node = child
        values = np.concatenate(parts) if parts else _EMPTY_SLOTS.copy()
        return MatchResult(length=pos, handle=node, values=values, segments=tuple(segments))

    def peek_prefix_len(self, ids: Sequence[int]) -> int:
        """Length of the longest cached prefix of ``ids``; the tree is not changed (no split,
        no LRU touch), so a scheduler may ask for every waiting request on every step."""
        arr = _as_ids(ids)
        node, pos = self._root, 0
        while pos < len(arr):
            child = node.children.get(int(arr[pos]))
            if child is None:
                break
            m = _common_len(child.key, arr, pos)
            pos += m
            if m < len(child.key):
                break
            node = child
        return pos

    # ------------------------------------------------------------------ insert

    def insert(self, ids: Sequence[int], values: np.ndarray, depth: int) -> InsertResult:
        """Cache ``ids`` with slots ``values`` holding ``depth`` layers of state.

        Tokens already cached keep their slots unless the node holding them has a lower depth:
        then the node takes the caller's slots for its range, its depth becomes ``depth``, and
        its old slots go to ``to_free``. This is allowed on locked nodes too; the caller must
        have copied anything a running request still reads out of the old slots before freeing
        them. Passing the very slot the tree already holds at a position is fine: it is counted
        as taken and never appears in ``to_free`` (an in-place upgrade when depth grows).
        New tokens become a new leaf holding ``values[prefix_len:]``.
        """
        arr = _as_ids(ids)
        depth = _check_depth(depth)
        # Private copy: the tree keeps slices of it, so later writes to the caller's buffer
        # cannot change what the tree owns.
        vals = _as_slots(values, len(arr))
        n = len(arr)
        taken = np.zeros(n, dtype=bool)
        replaced: list[np.ndarray] = []
        now = self._tick()
        node = self._root
        pos = 0
        while pos < n:
            child = node.children.get(int(arr[pos]))
            if child is None:
                break
            m = _common_len(child.key, arr, pos)
            if m < len(child.key):
                child = self._split(child, m)
            new = vals[pos:pos + m]
            same = child.value == new
            taken[pos:pos + m] = same
            if child.depth < depth:
                old = child.value[~same]
                if old.size:
                    replaced.append(old.copy())
                child.value = new
                taken[pos:pos + m] = True
                self._layer_tokens += m * (depth - child.depth)
                child.depth = depth
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
            taken[pos:] = True
            self._maybe_push(leaf)
            node = leaf
        to_free: list[np.ndarray] = []
        rejected = vals[~taken]
        if rejected.size:
            to_free.append(rejected)
        to_free.extend(replaced)
        return InsertResult(prefix_len=prefix_len, handle=node, taken=taken, to_free=to_free)

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
        # Validate first so a bad unlock leaves the tree untouched. Ancestors carry at least
        # the handle's count (lock_ref invariant), but check every node anyway.
        for node in path:
            if node.lock_ref <= 0:
                raise RuntimeError(f"unlock below zero at {node!r}")
        for node in path:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += len(node.key)
                self._protected -= len(node.key)
                self._maybe_push(node)

    # ------------------------------------------------------------------ eviction

    def evict(self, num_tokens: int) -> list[np.ndarray]:
        """Free at least ``num_tokens`` tokens, least recently used unlocked leaves first.

        A parent whose last child goes becomes a leaf and competes in the same pass. Stops as
        soon as the target is reached or nothing evictable remains. Returns the freed slot
        arrays (the caller returns them to the pool); their handles die.
        """
        freed: list[np.ndarray] = []
        got = 0
        while got < num_tokens and self._heap:
            t, _, _, node = heapq.heappop(self._heap)
            if not self._is_evictable_leaf(node) or node.last_access != t:
                continue  # stale entry
            parent = node.parent
            assert parent is not None
            freed.append(node.value)
            got += len(node.key)
            del parent.children[int(node.key[0])]
            self._evictable -= len(node.key)
            self._layer_tokens -= len(node.key) * node.depth
            self._num_nodes -= 1
            node.alive = False
            node.parent = None
            self._maybe_push(parent)
        return freed

    def trim_depth(self, handle: NodeHandle, depth: int) -> None:
        """Record that ``handle``'s node now holds only ``depth`` layers (memory accounting).

        ``depth`` must be in ``[0, current depth]`` (``ValueError`` otherwise: growing depth
        goes through :meth:`insert`). A locked node cannot be trimmed (``RuntimeError``): a
        running request may be reading its layers. Trimming the root is a no-op.
        """
        depth = _check_depth(depth)
        self._path_to_root(handle)  # validates the handle
        if handle is self._root:
            return
        if depth > handle.depth:
            raise ValueError(f"trim_depth cannot grow depth ({handle.depth} -> {depth})")
        if handle.lock_ref > 0:
            raise RuntimeError(f"cannot trim locked node {handle!r}")
        self._layer_tokens -= len(handle.key) * (handle.depth - depth)
        handle.depth = depth

    def set_depth(self, handle: NodeHandle, depth: int) -> None:
        """Record that ``handle``'s node now holds ``depth`` layers (its slots are unchanged).

        Raising is allowed on locked nodes (an upgrade only adds layers); lowering follows
        :meth:`trim_depth` (a locked node cannot lose layers). The root is a no-op.
        """
        depth = _check_depth(depth)
        self._path_to_root(handle)
        if handle is self._root or depth == handle.depth:
            return
        if depth < handle.depth:
            self.trim_depth(handle, depth)
            return
        self._layer_tokens += len(handle.key) * (depth - handle.depth)
        handle.depth = depth

    def path(self, handle: NodeHandle) -> list[TreeNode]:
        """Nodes from the root (excluded) down to ``handle``; validates the handle."""
        return self._path_to_root(handle)[::-1]

    def depth_histogram(self) -> dict[int, int]:
        """Cached tokens per node depth, e.g. ``{2: 640, 6: 128}``."""
        hist: dict[int, int] = {}
        for n in self._iter_nodes():
            hist[n.depth] = hist.get(n.depth, 0) + len(n.key)
        return dict(sorted(hist.items()))

    def lru_nodes(self) -> list[TreeNode]:
        """Unlocked nodes holding tokens, least recently used first (ties: creation order)."""
        nodes = [n for n in self._iter_nodes() if n.lock_ref == 0]
        nodes.sort(key=lambda n: (n.last_access, n.serial))
        return nodes

    def reset(self) -> list[np.ndarray]:
        """Drop every node and return all held slots. Raises ``RuntimeError`` if any is locked."""
        if self._protected > 0:
            raise RuntimeError(f"cannot reset: {self._protected} tokens are locked")
        nodes = list(self._iter_nodes())
        freed = [node.value for node in nodes]
        for node in nodes:  # every outstanding handle dies
            node.alive = False
            node.parent = None
        self._root.children = {}
        self._heap = []
        self._evictable = self._protected = self._layer_tokens = self._num_nodes = 0
        return freed

    # ------------------------------------------------------------------ sizes

    def evictable_size(self) -> int:
        """Tokens in unlocked nodes."""
        return self._evictable

    def protected_size(self) -> int:
        """Tokens in locked nodes."""
        return self._protected

    def total_size(self) -> int:
        """Tokens held by the tree."""
        return self._evictable + self._protected

    def total_layer_tokens(self) -> int:
        """Sum over nodes of ``len * depth``: the prefix pool's memory in token-layers."""
        return self._layer_tokens

    def num_nodes(self) -> int:
        """Nodes excluding the root (debugging / tests)."""
        return self._num_nodes

    def all_values(self) -> np.ndarray:
        """Every slot the tree holds, in no particular order (for the pool's integrity check)."""
        parts = [node.value for node in self._iter_nodes()]
        return np.concatenate(parts) if parts else _EMPTY_SLOTS.copy()

    # ------------------------------------------------------------------ debugging

    def check_integrity(self) -> None:
        """Recompute everything from scratch; raise ``AssertionError`` naming a broken invariant."""
        root = self._root
        assert root.alive and root.parent is None, "root: must be alive and parentless"
        assert len(root.key) == 0 and len(root.value) == 0, "root: must hold no tokens"
        assert root.lock_ref == 0, "root: lock_ref must stay 0"
        evictable = protected = layer_tokens = num_nodes = 0
        slots: list[np.ndarray] = []
        candidates: list[TreeNode] = []
        stack = [root]
        while stack:
            node = stack.pop()
            child_locks = 0
            for first, child in node.children.items():
                stack.append(child)
                assert child.alive, f"alive: {child!r} is reachable but marked dead"
                assert child.owner is self, f"owner: {child!r} belongs to another tree"
                assert child.parent is node, f"parent link: {child!r} does not point to its parent"
                assert len(child.key) >= 1, f"non-empty key: {child!r}"
                assert int(child.key[0]) == first, f"child key: {child!r} filed under {first}"
                assert child.key.dtype == np.int64 and child.value.dtype == np.int64, \
                    f"dtype: {child!r} key/value must be int64"
                assert child.key.ndim == 1 and len(child.value) == len(child.key), \
                    f"len(value) == len(key): {child!r}"
                assert isinstance(child.depth, int) and child.depth >= 0, \
                    f"depth >= 0: {child!r}"
                assert child.lock_ref >= 0, f"lock_ref >= 0: {child!r}"
                if node is not root:
                    assert child.last_access <= node.last_access, \
                        f"LRU order: child {child!r} newer than parent {node!r}"
                child_locks += child.lock_ref
                size = len(child.key)
                num_nodes += 1
                layer_tokens += size * child.depth
                if child.lock_ref > 0:
                    protected += size
                else:
                    evictable += size
                slots.append(child.value)
                if not child.children and child.lock_ref == 0:
                    candidates.append(child)
            if node is not root:
                assert node.lock_ref >= child_locks, \
                    f"lock_ref covers children: {node!r} has {node.lock_ref} < {child_locks}"
        assert evictable == self._evictable, \
            f"evictable counter: {self._evictable} != recomputed {evictable}"
        assert protected == self._protected, \
            f"protected counter: {self._protected} != recomputed {protected}"
        assert layer_tokens == self._layer_tokens, \
            f"layer-token counter: {self._layer_tokens} != recomputed {layer_tokens}"
        assert num_nodes == self._num_nodes, \
            f"node counter: {self._num_nodes} != recomputed {num_nodes}"
        if slots:
            all_slots = np.concatenate(slots)
            uniq, counts = np.unique(all_slots, return_counts=True)
            assert uniq.size == all_slots.size, \
                f"unique slots: slots held twice: {uniq[counts > 1][:10].tolist()}"
        live = {id(node) for t, _, _, node in self._heap
                if node.alive and node.last_access == t}
        for node in candidates:
            assert id(node) in live, f"eviction heap: evictable leaf {node!r} has no live entry"

    def pretty(self) -> str:
        """Indented dump: one line per node with tokens, slots, depth, lock count, LRU time."""
        lines = [f"RadixTree(tokens={self.total_size()}, evictable={self._evictable}, "
                 f"protected={self._protected}, layer_tokens={self._layer_tokens})"]

        def short(a: np.ndarray) -> str:
            items = a.tolist()
            return str(items) if len(items) <= 8 else f"{items[:8]}...(+{len(items) - 8})"

        def walk(node: TreeNode, indent: int) -> None:
            for first in sorted(node.children):
                c = node.children[first]
                lines.append(f"{'  ' * indent}- ids={short(c.key)} slots={short(c.value)} "
                             f"depth={c.depth} lock={c.lock_ref} t={c.last_access}")
                walk(c, indent + 1)

        walk(self._root, 1)
        return "\n".join(lines)

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

    def _touch(self, node: TreeNode, now: int) -> None:
        node.last_access = now
        self._maybe_push(node)

    def _is_evictable_leaf(self, node: TreeNode) -> bool:
        return (node.alive and node is not self._root and not node.children
                and node.lock_ref == 0)

    def _maybe_push(self, node: TreeNode) -> None:
        """Give ``node`` a heap entry at its current time if it is an evictable leaf."""
        if not self._is_evictable_leaf(node):
            return
        heapq.heappush(self._heap, (node.last_access, node.serial, next(self._push_seq), node))
        # Stale entries pile up with every touch; rebuild once they dominate so the heap stays
        # O(nodes) and each pop stays O(log nodes).
        if len(self._heap) > 2 * self._num_nodes + 64:
            self._compact_heap()

    def _compact_heap(self) -> None:
        self._heap = [(n.last_access, n.serial, next(self._push_seq), n)
                      for n in self._iter_nodes() if self._is_evictable_leaf(n)]
        heapq.heapify(self._heap)

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

    def _iter_nodes(self):
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())


class NullRadixTree(PrefixIndex):
    """A prefix cache that caches nothing: ``prefix_cache="off"`` is this object, not a branch.

    match is always empty, insert takes nothing and hands every slot back in ``to_free``,
    eviction frees nothing, every size is 0.
    """

    def __init__(self) -> None:
        self._root = TreeNode(_EMPTY_SLOTS, _EMPTY_SLOTS, 0, None, 0, 0, self)

    def match_prefix(self, ids: Sequence[int]) -> MatchResult:
        """Always a match of length 0 at the root."""
        _as_ids(ids)
        return MatchResult(length=0, handle=self._root, values=_EMPTY_SLOTS.copy(), segments=())

    def peek_prefix_len(self, ids: Sequence[int]) -> int:
        """Always 0."""
        _as_ids(ids)
        return 0

    def insert(self, ids: Sequence[int], values: np.ndarray, depth: int) -> InsertResult:
        """Takes nothing; every caller slot comes back in ``to_free``."""
        arr = _as_ids(ids)
        _check_depth(depth)
        vals = _as_slots(values, len(arr))
        to_free = [vals] if vals.size else []
        return InsertResult(prefix_len=0, handle=self._root,
                            taken=np.zeros(len(arr), dtype=bool), to_free=to_free)

    def _check(self, handle: NodeHandle) -> None:
        if handle is not self._root:
            raise ValueError(f"not a handle of this tree: {handle!r}")

    def lock(self, handle: NodeHandle) -> None:
        """No-op (the only handle is the root)."""
        self._check(handle)

    def unlock(self, handle: NodeHandle) -> None:
        """No-op (the only handle is the root)."""
        self._check(handle)

    def evict(self, num_tokens: int) -> list[np.ndarray]:
        """Nothing to evict."""
        return []

    def trim_depth(self, handle: NodeHandle, depth: int) -> None:
        """No-op (validates arguments)."""
        _check_depth(depth)
        self._check(handle)

    def set_depth(self, handle: NodeHandle, depth: int) -> None:
        """No-op (validates arguments)."""
        _check_depth(depth)
        self._check(handle)

    def path(self, handle: NodeHandle) -> list[NodeHandle]:
        self._check(handle)
        return []

    def lru_nodes(self) -> list[NodeHandle]:
        return []

    def depth_histogram(self) -> dict[int, int]:
        return {}

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def total_size(self) -> int:
        return 0

    def total_layer_tokens(self) -> int:
        return 0

    def num_nodes(self) -> int:
        return 0

    def all_values(self) -> np.ndarray:
        return _EMPTY_SLOTS.copy()

    def reset(self) -> list[np.ndarray]:
        return []

    def check_integrity(self) -> None:
        assert not self._root.children, "null tree: must hold nothing"

    def pretty(self) -> str:
        return "NullRadixTree(caching off)"

    def __repr__(self) -> str:
        return "NullRadixTree()"
