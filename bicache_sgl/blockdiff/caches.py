"""The block engine's exact prefix caches, keyed by block length.

A block's K/V depends on the block length it was computed with (block-causal attention: a
position sees its own block and the earlier ones, so with another block length the same tokens
attend to other positions at every layer past the first). A request with a per-request
``block_length`` (SDAR's and LLaDA2's published generate take one) therefore reuses only blocks
computed with its own block length: one ``BlockPrefixCache`` per block length, never a lookup
across them. They share one cap in token positions (``cap_tokens``: the engine's cache size) and,
with a K/V budget, the room the running windows leave: making room evicts the other block
lengths' blocks first (only requests of that length could reuse them), then the least recently
used leaves of the request's own length.
"""

from __future__ import annotations

from ..kv_cache.block_prefix import BlockPrefixCache


class BlockCaches:
    """One exact ``BlockPrefixCache`` per block length under one cap (module docstring)."""

    def __init__(self, cap_tokens: int) -> None:
        if cap_tokens < 0:
            raise ValueError("cap_tokens must be >= 0")
        self.cap_tokens = cap_tokens
        self._by_length: dict[int, BlockPrefixCache] = {}

    def of(self, block_length: int) -> BlockPrefixCache:
        """The cache of ``block_length`` (created empty on first use)."""
        c = self._by_length.get(block_length)
        if c is None:
            c = self._by_length[block_length] = BlockPrefixCache(block_length, self.cap_tokens // block_length)
        return c

    @property
    def lengths(self) -> list[int]:
        """The block lengths that have a cache (with or without blocks)."""
        return sorted(self._by_length)

    @property
    def n_tokens(self) -> int:
        """Token positions held by every cache together."""
        return sum(c.n_tokens for c in self._by_length.values())

    @property
    def n_blocks(self) -> int:
        return sum(c.n_blocks for c in self._by_length.values())

    def _others(self, block_length: int) -> int:
        return sum(c.n_tokens for b, c in self._by_length.items() if b != block_length)

    def room(self, block_length: int, free_tokens: int | None) -> int:
        """Blocks of ``block_length`` its cache may hold beside the other lengths' blocks, under the
        cap and ``free_tokens`` (what the running windows leave of the K/V budget; None: no budget)."""
        others = self._others(block_length)
        t = self.cap_tokens - others
        if free_tokens is not None:
            t = min(t, free_tokens - others)
        return max(0, t) // block_length

    def make_room(self, block_length: int, free_tokens: int) -> int:
        """Evict until every cache together holds at most ``free_tokens`` positions: the other
        block lengths' blocks first, then ``block_length``'s own least recently used leaves.
        Returns how many blocks of ``block_length`` may stay (its matched path survives as the
        first that many: the match touched it last)."""
        for b, c in self._by_length.items():
            excess = self.n_tokens - free_tokens
            if excess <= 0:
                break
            if b != block_length:
                c.shrink(max(0, c.n_blocks - -(-excess // b)))
        keep = max(0, free_tokens - self._others(block_length)) // block_length
        if block_length in self._by_length:
            self._by_length[block_length].shrink(keep)
        return keep

    def flush(self) -> None:
        for c in self._by_length.values():
            c.flush()
