"""The prefix pool: shared, depth-limited prefix state, one slot per cached token.

Layout (chosen per DESIGN.md section 5): for a pool of depth D, each slot holds
  k[l], v[l]  for layers l < D          -> [D, capacity, Hkv, Dh]
  h[l - 1]    residual entering layer l, for l = 1..D -> [D, capacity, hidden]
so a request can skip the slot's token in layers < d and resume it at layer d for any d <= D
without re-projecting anything. Bytes per token = D * (2 * kv_dim + hidden) * itemsize:
LLaDA-8B bf16 (kv_dim 4096, hidden 4096): 24 KiB per layer, 768 KiB per token at D = 32;
Dream-7B bf16 (kv_dim 512, hidden 3584): 9 KiB per layer, 252 KiB per token at D = 28.
(Storing only h and re-projecting K/V would cost 8 / 7 KiB per layer instead, for extra
projection work on every hit; for GQA models K/V alone is the cheaper half.)

The allocator is a free list of slot indices (numpy, no tensors in the bookkeeping).
"""

from __future__ import annotations

import numpy as np
import torch

from ..models.config import ModelConfig
from .memory import prefix_bytes_per_token


class SlotAllocator:
    """Free list over ``capacity`` slots. Pure bookkeeping: tested without tensors."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._free = np.arange(capacity - 1, -1, -1, dtype=np.int64)  # pop from the end: low slots first
        self._n_free = capacity

    @property
    def num_free(self) -> int:
        return self._n_free

    def alloc(self, n: int) -> np.ndarray | None:
        if n > self._n_free:
            return None
        out = self._free[self._n_free - n:self._n_free][::-1].copy()
        self._n_free -= n
        return out

    def free(self, slots: np.ndarray) -> None:
        slots = np.asarray(slots, dtype=np.int64)
        if slots.size == 0:
            return
        if self._n_free + slots.size > self.capacity:
            raise RuntimeError("prefix pool: freeing more slots than allocated (double free)")
        self._free[self._n_free:self._n_free + slots.size] = slots[::-1]
        self._n_free += slots.size

    def free_set(self) -> np.ndarray:
        return self._free[:self._n_free].copy()


class PrefixPool:
    """Tensor storage for the prefix cache (see module docstring for the layout)."""

    def __init__(self, cfg: ModelConfig, depth: int, capacity: int, dtype: torch.dtype, device: torch.device) -> None:
        self.cfg, self.depth, self.capacity = cfg, depth, capacity
        self.dtype, self.device = dtype, device
        self.allocator = SlotAllocator(capacity)
        shape_kv = (depth, capacity, cfg.n_kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape_kv, dtype=dtype, device=device)
        self.v = torch.zeros(shape_kv, dtype=dtype, device=device)
        self.h = torch.zeros((depth, capacity, cfg.hidden_size), dtype=dtype, device=device)

    @property
    def bytes_per_token(self) -> int:
        return prefix_bytes_per_token(self.cfg, self.depth, self.dtype)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.h))

    def slots_tensor(self, slots: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64)).to(self.device)

    # Captures from a forward (called by the model while it runs).
    def write_kv(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer].index_copy_(0, slots, k.to(self.dtype))
        self.v[layer].index_copy_(0, slots, v.to(self.dtype))

    def write_h(self, layer: int, slots: torch.Tensor, h: torch.Tensor) -> None:
        """h: residual stream entering ``layer`` (1 <= layer <= depth)."""
        self.h[layer - 1].index_copy_(0, slots, h.to(self.dtype))

    # Reads at admission (copied into the request's private buffers, so later eviction or
    # depth upgrades never change a running request).
    def read_kv(self, depth: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[:depth, slots], self.v[:depth, slots]

    def read_h(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        return self.h[layer - 1, slots]
