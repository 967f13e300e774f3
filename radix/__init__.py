"""Radix prefix cache over token ids whose nodes hold prefix state only up to a depth.

Pure bookkeeping (no torch): node values are int64 slot arrays into a prefix pool owned by the
engine. ``PrefixIndex`` (radix/index.py) is what the cache manager calls; ``RadixTree``
(radix/tree.py) is the cache, ``NullRadixTree`` the same interface caching nothing. Value types
and argument checks: radix/node.py; the eviction and trim heaps and the order they follow
(``EvictionOrder``, LRU by default): radix/lru.py; the full invariant check and dump:
radix/integrity.py. ``INDEXES`` / ``make_index``: the indexes by name.
See docs/radix.md.
"""

from radix.index import NullRadixTree, PrefixIndex
from radix.lru import EvictionOrder, LeastRecentlyUsed
from radix.node import InsertResult, MatchResult, NodeHandle, TreeNode, common_prefix_len
from radix.tree import RadixTree

# name -> factory of the prefix indexes a cache manager can be built on: a new index is a
# PrefixIndex subclass added here, and the cache manager picks it by name (make_index)
INDEXES = {"radix": RadixTree, "none": NullRadixTree}


def make_index(name: str) -> PrefixIndex:
    """A new, empty prefix index by its name in :data:`INDEXES` (ValueError listing the names)."""
    try:
        factory = INDEXES[name]
    except KeyError:
        raise ValueError(f"no prefix index {name!r}; known: {', '.join(sorted(INDEXES))}") from None
    return factory()


__all__ = [
    "INDEXES",
    "EvictionOrder",
    "InsertResult",
    "LeastRecentlyUsed",
    "MatchResult",
    "NodeHandle",
    "NullRadixTree",
    "PrefixIndex",
    "RadixTree",
    "TreeNode",
    "common_prefix_len",
    "make_index",
]
