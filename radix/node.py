"""The radix index's value types: nodes (opaque handles), match and insert results, and the
argument checks every index shares. No torch: slot arrays are int64 numpy arrays."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

EMPTY_SLOTS = np.empty(0, dtype=np.int64)
EMPTY_SLOTS.setflags(write=False)


class TreeNode:
    """One radix node. Callers treat it as an opaque handle (``NodeHandle``).

    A handle stays valid (and keeps ending at the same prefix length) across splits, depth
    changes and trims; it dies only when its node is evicted or the tree is reset. Using a dead
    handle raises ``ValueError``.
    """

    __slots__ = (
        "alive",
        "children",
        "cold_t",
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
        self.owner = owner              # the index that made it (rejects foreign handles)
        self.cold_t = -1                # order key of its live trim-heap entry, -1: none

    def __repr__(self) -> str:
        state = "" if self.alive else " dead"
        return (f"<TreeNode #{self.serial} len={len(self.key)} depth={self.depth} "
                f"lock={self.lock_ref} t={self.last_access}{state}>")


NodeHandle = TreeNode


@dataclass(frozen=True, eq=False)
class MatchResult:
    """Result of ``match_prefix``.

    ``segments`` has one ``(end_len, depth)`` pair per node on the matched path, with strictly
    increasing ``end_len``; the last ``end_len`` equals ``length``. ``values`` is a fresh copy.
    """

    length: int
    handle: NodeHandle
    values: np.ndarray
    segments: tuple[tuple[int, int], ...]


@dataclass(frozen=True, eq=False)
class InsertResult:
    """Result of ``insert``.

    ``taken[i]`` is True where the index now owns ``values[i]`` (new tokens, and positions where
    the caller passed the very slot the index already held there). ``to_free`` lists the caller's
    slots the index did not take (tokens already cached under other slots): the caller returns
    them to the pool. Every array in ``to_free`` is non-empty.
    """

    prefix_len: int
    handle: NodeHandle
    taken: np.ndarray
    to_free: list[np.ndarray]


def as_ids(ids: Sequence[int]) -> np.ndarray:
    """``ids`` as a 1-D int64 array (no copy when it already is one)."""
    if type(ids) is np.ndarray and ids.dtype == np.int64 and ids.ndim == 1 and ids.size:
        return ids  # the engine's prompts: no checks to repeat
    arr = np.asarray(ids)
    if arr.ndim != 1:
        raise ValueError(f"ids must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return EMPTY_SLOTS
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"ids must be integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def as_slots(values: np.ndarray, n: int) -> np.ndarray:
    """Validated private int64 copy of ``values``: 1-D integer slot ids, one per token id."""
    vals = np.asarray(values)
    if vals.ndim != 1 or len(vals) != n:
        raise ValueError(f"values must be 1-D with one slot per id: got shape {vals.shape} "
                         f"for {n} ids")
    if vals.size and not np.issubdtype(vals.dtype, np.integer):
        raise ValueError(f"values must be integer slot ids, got dtype {vals.dtype}")
    return np.array(vals, dtype=np.int64, copy=True)


def check_depth(depth: int) -> int:
    """``depth`` as a plain int >= 0 (``TypeError`` / ``ValueError`` naming it otherwise)."""
    if isinstance(depth, (bool, np.bool_)) or not isinstance(depth, (int, np.integer)):
        raise TypeError(f"depth must be an int, got {type(depth).__name__}")
    if depth < 0:
        raise ValueError(f"depth must be >= 0, got {depth}")
    return int(depth)


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common leading run of two token sequences (vectorised)."""
    x, y = np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64)
    n = min(len(x), len(y))
    if n == 0:
        return 0
    neq = x[:n] != y[:n]
    i = int(neq.argmax())  # the first mismatch, or 0 when there is none
    return i if neq[i] else n


def common_len_at(key: np.ndarray, ids: np.ndarray, start: int) -> int:
    """Length of the common prefix of ``key`` and ``ids[start:]`` (both int64)."""
    n = min(len(key), len(ids) - start)
    if n <= 0:
        return 0
    # one comparison of the whole edge: a node's key is compared at C speed, not per token; a
    # bool argmax is the first mismatch (or 0 when there is none, told apart by reading it)
    neq = key[:n] != ids[start:start + n]
    i = int(neq.argmax())
    return i if neq[i] else n
