"""Radix prefix cache over token ids whose nodes hold prefix state only up to a depth.

Pure bookkeeping (no torch): node values are int64 slot arrays into a prefix pool owned by the
engine. ``RadixTree`` is the cache; ``NullRadixTree`` is the same interface caching nothing.
See docs/radix.md.
"""

from radix.tree import (
    InsertResult,
    MatchResult,
    NodeHandle,
    NullRadixTree,
    PrefixIndex,
    RadixTree,
    TreeNode,
    common_prefix_len,
)

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
