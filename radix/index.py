"""The prefix index interface, exactly what the cache manager calls, and its null object.

``PrefixIndex`` maps token ids to slot arrays (one slot per token, into a pool owned elsewhere)
whose node holds a depth (leading layers of prefix state). Tensor-free, so the index is tested on
CPU in milliseconds. ``RadixTree`` (radix/tree.py) is the cache; ``NullRadixTree`` caches nothing,
so "cache off" is the choice of index, not a second cache manager.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import numpy as np

from radix.node import EMPTY_SLOTS, InsertResult, MatchResult, NodeHandle, TreeNode, as_ids, as_slots, check_depth


class PrefixIndex(ABC):
    """Token ids -> slot arrays with a depth. Every method here is one the cache manager uses."""

    #: whether the index can hold anything (False only for the null index)
    caches: bool = True

    @abstractmethod
    def match_prefix(self, ids: Sequence[int]) -> MatchResult:
        """Longest cached prefix; may split a node and refreshes LRU times on the path."""

    @abstractmethod
    def peek_prefix_len(self, ids: Sequence[int]) -> int:
        """Length of the longest cached prefix, changing nothing (no split, no LRU touch)."""

    @abstractmethod
    def insert(self, ids: Sequence[int], values: np.ndarray, depth: int) -> InsertResult:
        """Cache the new tokens of ``ids`` with their slots of ``values`` at ``depth``; tokens
        already cached keep their node, slots and depth (a depth changes only by ``set_depth``)."""

    @abstractmethod
    def lock(self, handle: NodeHandle) -> None:
        """Protect the path root -> handle from eviction and depth loss."""

    @abstractmethod
    def unlock(self, handle: NodeHandle) -> None:
        """Undo one :meth:`lock`."""

    @abstractmethod
    def evict(self, num_tokens: int, num_layer_tokens: int = 0) -> list[np.ndarray]:
        """Evict unlocked LRU leaves until ``num_tokens`` tokens and ``num_layer_tokens``
        layer-tokens (``len * depth`` per node) are freed, or nothing is evictable."""

    @abstractmethod
    def set_depth(self, handle: NodeHandle, depth: int) -> None:
        """Record the depth a node's slots now hold: the one way a node's depth changes (raise:
        an upgrade, allowed on locked nodes; lower: a trim, refused on locked nodes)."""

    @abstractmethod
    def path(self, handle: NodeHandle) -> list[NodeHandle]:
        """Nodes from the root (excluded) down to ``handle``."""

    @abstractmethod
    def halve_cold(self, min_depth: int, need: int) -> tuple[list[NodeHandle], list[int], int]:
        """Halve unlocked nodes deeper than ``min_depth`` (to ``max(min_depth, depth // 2)``),
        least recently used first, in passes (a node still deeper than ``min_depth`` after its
        halving comes again in the next pass), until ``need`` layer-tokens are dropped: (nodes
        halved, in order, the depth each halving left, layer-tokens dropped). The caller frees the
        rows."""

    @abstractmethod
    def depth_histogram(self) -> dict[int, int]:
        """Cached tokens per node depth."""

    @abstractmethod
    def evictable_size(self) -> int:
        """Tokens in unlocked nodes."""

    @abstractmethod
    def protected_size(self) -> int:
        """Tokens in locked nodes."""

    @abstractmethod
    def total_size(self) -> int:
        """Tokens held."""

    @abstractmethod
    def total_layer_tokens(self) -> int:
        """Sum over nodes of ``len * depth``: the prefix pool's rows in use."""

    @abstractmethod
    def all_values(self) -> np.ndarray:
        """Every slot held, in no particular order (the pool's integrity check)."""

    @abstractmethod
    def check_integrity(self, held_depth: Callable[[np.ndarray], int] | None = None) -> None:
        """Recompute every invariant; ``held_depth(slots)``, when given, must equal each node's
        depth (the pool's table agrees with the index). Raises ``AssertionError`` naming it."""


class NullRadixTree(PrefixIndex):
    """A prefix index that caches nothing (``prefix_cache="off"``).

    match is always empty, insert takes nothing and hands every slot back in ``to_free``,
    eviction frees nothing, every size is 0.
    """

    caches = False

    def __init__(self) -> None:
        self._root = TreeNode(EMPTY_SLOTS, EMPTY_SLOTS, 0, None, 0, 0, self)

    def match_prefix(self, ids: Sequence[int]) -> MatchResult:
        """Always a match of length 0 at the root."""
        as_ids(ids)
        return MatchResult(length=0, handle=self._root, values=EMPTY_SLOTS.copy(), segments=())

    def peek_prefix_len(self, ids: Sequence[int]) -> int:
        """Always 0."""
        as_ids(ids)
        return 0

    def insert(self, ids: Sequence[int], values: np.ndarray, depth: int) -> InsertResult:
        """Takes nothing; every caller slot comes back in ``to_free``."""
        arr = as_ids(ids)
        check_depth(depth)
        vals = as_slots(values, len(arr))
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

    def evict(self, num_tokens: int, num_layer_tokens: int = 0) -> list[np.ndarray]:
        """Nothing to evict."""
        return []

    def set_depth(self, handle: NodeHandle, depth: int) -> None:
        """No-op (validates arguments)."""
        check_depth(depth)
        self._check(handle)

    def path(self, handle: NodeHandle) -> list[NodeHandle]:
        self._check(handle)
        return []

    def halve_cold(self, min_depth: int, need: int) -> tuple[list[NodeHandle], list[int], int]:
        check_depth(min_depth)
        return [], [], 0

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

    def all_values(self) -> np.ndarray:
        return EMPTY_SLOTS.copy()

    def check_integrity(self, held_depth: Callable[[np.ndarray], int] | None = None) -> None:
        assert not self._root.children, "null tree: must hold nothing"

    def __repr__(self) -> str:
        return "NullRadixTree()"
