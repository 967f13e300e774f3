"""Radix prefix cache over token ids whose nodes hold prefix state only up to a depth.

Pure bookkeeping (no torch): node values are int64 slot arrays into a prefix pool owned by the
engine. ``PrefixIndex`` (radix/index.py) is what the cache manager calls; ``RadixTree``
(radix/tree.py) is the cache, ``NullRadixTree`` the same interface caching nothing. Value types
and argument checks: radix/node.py; the eviction and trim heaps: radix/lru.py; the full invariant
check and dump: radix/integrity.py.
See docs/radix.md.
"""

from radix.index import NullRadixTree, PrefixIndex
from radix.node import InsertResult, MatchResult, NodeHandle, TreeNode, common_prefix_len
from radix.tree import RadixTree

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
