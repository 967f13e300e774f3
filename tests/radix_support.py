"""What only the radix tests ask of a prefix index, kept out of ``radix`` (whose interface is what
the cache manager calls): the trim order as a generator, and a match's depth over a prefix.

``trim_candidates`` walks ``RadixTree``'s own trim heap (radix/lru.py), so it sees exactly the
order ``halve_cold`` uses; the tests compare the two.
"""

from __future__ import annotations

from collections.abc import Iterator

from radix import MatchResult, NullRadixTree, PrefixIndex, RadixTree, TreeNode


def trim_candidates(tree: PrefixIndex, min_depth: int) -> Iterator[TreeNode]:
    """Unlocked nodes deeper than ``min_depth``, least recently used first (ties: creation
    order), in passes: a node the caller leaves deeper than ``min_depth`` comes again in the next
    pass; the iteration ends after a pass that yields nothing. Close it (``contextlib.closing``)
    when stopping early; between two items the caller may only lower the yielded node's depth."""
    if isinstance(tree, NullRadixTree):
        return
    assert isinstance(tree, RadixTree), type(tree)
    min_depth = tree._begin_trim(min_depth)
    deferred: list[TreeNode] = []
    try:
        while True:
            while (node := tree._pop_cold(min_depth)) is not None:
                deferred.append(node)
                yield node
            if not deferred:
                return
            again, deferred = deferred, []
            for node in again:
                tree._cold_push(node)
            if not tree._cold:
                return
    finally:
        for node in deferred:
            tree._cold_push(node)


def depth_at(match: MatchResult, prefix_len: int) -> int:
    """Minimum node depth over tokens ``[0, prefix_len)`` of ``match``; 0 for ``prefix_len == 0``.
    Raises ``ValueError`` if ``prefix_len`` is negative or longer than the match."""
    if prefix_len < 0 or prefix_len > match.length:
        raise ValueError(f"prefix_len {prefix_len} outside [0, {match.length}]")
    if prefix_len == 0:
        return 0
    best: int | None = None
    for end_len, depth in match.segments:
        best = depth if best is None else min(best, depth)
        if end_len >= prefix_len:
            break
    assert best is not None  # length > 0 implies at least one segment
    return best
