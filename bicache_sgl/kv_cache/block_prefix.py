"""The exact prefix cache of the block-causal families (LLaDA2.x, SDAR).

A block-causal model's K/V of a block depend only on that block and the blocks before it, at the
same absolute positions. So a cached block is exact in every later request whose tokens agree on
that block and everything before it: the cache is a trie whose edges are whole blocks of token
ids (from position 0), and a request reuses the longest chain of its *whole* prompt blocks at
every layer (full depth). The last partial prompt block, and everything after it, is computed.
No profile, calibration or audit applies: there is no approximation to bound.

Each node holds its block's K and V at every layer ([L, block_length, Hkv, Dh] each). Reuse
copies them into the request's K/V buffer. Eviction drops least-recently-used leaves when the
cache holds more than ``max_blocks`` blocks, or to the room given (``insert``'s
``room``, ``shrink``: the block engine's K/V budget, shared with the running requests). Imports
nothing of the package.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass(eq=False)
class _Node:
    key: tuple[int, ...]
    parent: "_Node | None"
    k: torch.Tensor | None = None  # [L, B, Hkv, Dh]
    v: torch.Tensor | None = None
    children: dict = field(default_factory=dict)
    last_used: int = 0


class BlockPrefixCache:
    """A trie of whole blocks with their exact K/V. ``match`` / ``insert`` work on token ids from
    position 0; both touch the path they walk (LRU)."""

    def __init__(self, block_length: int, max_blocks: int) -> None:
        if block_length < 1 or max_blocks < 0:
            raise ValueError("block_length must be >= 1 and max_blocks >= 0")
        self.block_length, self.max_blocks = block_length, max_blocks
        self.root = _Node((), None)
        self.n_blocks = 0
        self._clock = itertools.count(1)

    def _blocks(self, ids: Sequence[int], n_tokens: int):
        B = self.block_length
        for b in range(n_tokens // B):
            yield tuple(int(t) for t in ids[b * B:(b + 1) * B])

    def match(self, ids: Sequence[int], n_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The (K, V) of the longest chain of cached whole blocks of ``ids[:n_tokens]`` (only whole
        blocks count: ``n_tokens // block_length`` at most)."""
        out, node, now = [], self.root, next(self._clock)
        for key in self._blocks(ids, n_tokens):
            node = node.children.get(key)
            if node is None:
                break
            node.last_used = now
            out.append((node.k, node.v))
        return out

    def insert(self, ids: Sequence[int], n_tokens: int, k: torch.Tensor, v: torch.Tensor,
               room: int | None = None) -> int:
        """Cache the whole blocks of ``ids[:n_tokens]`` whose K/V are ``k[:, :n_tokens]`` /
        ``v[:, :n_tokens]`` ([L, >= n_tokens, Hkv, Dh], final values), then evict down to
        ``min(max_blocks, room)`` blocks (older leaves first, the path just inserted last).
        Returns blocks added."""
        B, node, now, added = self.block_length, self.root, next(self._clock), 0
        limit = self.max_blocks if room is None else max(0, min(self.max_blocks, room))
        if limit == 0:
            self.shrink(0)
            return 0
        for b, key in enumerate(self._blocks(ids, n_tokens)):
            child = node.children.get(key)
            if child is None:
                child = _Node(key, node, k[:, b * B:(b + 1) * B].clone(), v[:, b * B:(b + 1) * B].clone())
                node.children[key] = child
                self.n_blocks += 1
                added += 1
            child.last_used = now
            node = child
        self.shrink(limit)
        return added

    def shrink(self, max_blocks: int) -> int:
        """Evict least-recently-used leaves until at most ``max_blocks`` blocks remain; returns
        blocks evicted. One pass over the trie, then a heap: a parent is never older than its
        children (every touch of a node touches its path), so a parent left childless joins the
        heap in its LRU place."""
        if self.n_blocks <= max_blocks:
            return 0
        heap = [(n.last_used, id(n), n) for n in self._nodes() if not n.children]
        heapq.heapify(heap)
        evicted = 0
        while self.n_blocks > max_blocks and heap:
            _, _, victim = heapq.heappop(heap)
            parent = victim.parent
            del parent.children[victim.key]
            self.n_blocks -= 1
            evicted += 1
            if parent is not self.root and not parent.children:
                heapq.heappush(heap, (parent.last_used, id(parent), parent))
        return evicted

    @property
    def n_tokens(self) -> int:
        """Token positions held (whole blocks)."""
        return self.n_blocks * self.block_length

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def flush(self) -> None:
        """Drop every cached block."""
        self.root = _Node((), None)
        self.n_blocks = 0

    def bytes_per_block(self) -> int:
        for n in self._nodes():
            return 2 * n.k.numel() * n.k.element_size()
        return 0
