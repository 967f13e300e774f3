"""Full recomputation of a ``RadixTree``'s invariants, and its debugging dump (a mixin of
``RadixTree``). Slow on purpose (a walk of every node): tests and the cache manager's
``check_integrity`` call it, the serving path never does."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from radix.node import TreeNode


class TreeChecks:
    """``check_integrity`` and ``pretty`` over the tree's state (set up by ``RadixTree``)."""

    def check_integrity(self, held_depth: Callable[[np.ndarray], int] | None = None) -> None:
        """Recompute everything from scratch; raise ``AssertionError`` naming a broken invariant.
        ``held_depth(slots)``, when given, must equal every unlocked node's depth."""
        _check_tree(self, held_depth)

    def pretty(self) -> str:
        """Indented dump: one line per node with tokens, slots, depth, lock count, LRU time."""
        return _pretty_tree(self)


def _check_tree(tree: Any, held_depth: Callable[[np.ndarray], int] | None) -> None:
    root = tree._root
    assert root.alive and root.parent is None, "root: must be alive and parentless"
    assert len(root.key) == 0 and len(root.value) == 0, "root: must hold no tokens"
    assert root.lock_ref == 0, "root: lock_ref must stay 0"
    evictable = protected = layer_tokens = num_nodes = 0
    hist: dict[int, int] = {}
    slots: list[np.ndarray] = []
    leaves: list[TreeNode] = []
    unlocked: list[TreeNode] = []
    stack = [root]
    while stack:
        node = stack.pop()
        child_locks = 0
        for first, child in node.children.items():
            stack.append(child)
            assert child.alive, f"alive: {child!r} is reachable but marked dead"
            assert child.owner is tree, f"owner: {child!r} belongs to another tree"
            assert child.parent is node, f"parent link: {child!r} does not point to its parent"
            assert len(child.key) >= 1, f"non-empty key: {child!r}"
            assert int(child.key[0]) == first, f"child key: {child!r} filed under {first}"
            assert child.key.dtype == np.int64 and child.value.dtype == np.int64, \
                f"dtype: {child!r} key/value must be int64"
            assert child.key.ndim == 1 and len(child.value) == len(child.key), \
                f"len(value) == len(key): {child!r}"
            assert isinstance(child.depth, int) and child.depth >= 0, f"depth >= 0: {child!r}"
            assert child.lock_ref >= 0, f"lock_ref >= 0: {child!r}"
            if node is not root:
                assert child.last_access <= node.last_access, \
                    f"LRU order: child {child!r} newer than parent {node!r}"
            if held_depth is not None and child.lock_ref == 0:  # a locked node may be mid-commit
                held = held_depth(child.value)
                assert held == child.depth, f"{child!r}: the pool holds {held} layers"
            child_locks += child.lock_ref
            size = len(child.key)
            num_nodes += 1
            layer_tokens += size * child.depth
            hist[child.depth] = hist.get(child.depth, 0) + size
            if child.lock_ref > 0:
                protected += size
            else:
                evictable += size
                unlocked.append(child)
            slots.append(child.value)
            if not child.children and child.lock_ref == 0:
                leaves.append(child)
        if node is not root:
            assert node.lock_ref >= child_locks, \
                f"lock_ref covers children: {node!r} has {node.lock_ref} < {child_locks}"
    assert evictable == tree._evictable, \
        f"evictable counter: {tree._evictable} != recomputed {evictable}"
    assert protected == tree._protected, \
        f"protected counter: {tree._protected} != recomputed {protected}"
    assert layer_tokens == tree._layer_tokens, \
        f"layer-token counter: {tree._layer_tokens} != recomputed {layer_tokens}"
    assert num_nodes == tree._num_nodes, \
        f"node counter: {tree._num_nodes} != recomputed {num_nodes}"
    assert hist == tree._hist, f"depth histogram: {tree._hist} != recomputed {hist}"
    if slots:
        all_slots = np.concatenate(slots)
        uniq, counts = np.unique(all_slots, return_counts=True)
        assert uniq.size == all_slots.size, \
            f"unique slots: slots held twice: {uniq[counts > 1][:10].tolist()}"
    key = tree._order.key
    live = {id(node) for t, _, _, node in tree._heap if node.alive and key(node) == t}
    for node in leaves:
        assert id(node) in live, f"eviction heap: evictable leaf {node!r} has no live entry"
    cold = {id(node) for t, _, _, node in tree._cold if node.alive and node.cold_t == t}
    for node in unlocked:
        if node.depth > tree._cold_floor:
            assert node.cold_t == key(node) and id(node) in cold, \
                f"trim heap: unlocked node {node!r} has no live entry"


def _pretty_tree(tree: Any) -> str:
    lines = [f"RadixTree(tokens={tree.total_size()}, evictable={tree.evictable_size()}, "
             f"protected={tree.protected_size()}, layer_tokens={tree.total_layer_tokens()})"]

    def short(a: np.ndarray) -> str:
        items = a.tolist()
        return str(items) if len(items) <= 8 else f"{items[:8]}...(+{len(items) - 8})"

    def walk(node: TreeNode, indent: int) -> None:
        for first in sorted(node.children):
            c = node.children[first]
            lines.append(f"{'  ' * indent}- ids={short(c.key)} slots={short(c.value)} "
                         f"depth={c.depth} lock={c.lock_ref} t={c.last_access}")
            walk(c, indent + 1)

    walk(tree._root, 1)
    return "\n".join(lines)
