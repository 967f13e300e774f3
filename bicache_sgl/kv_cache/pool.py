"""The prefix pool: shared prefix state stored per (cached token, layer), so a token costs memory
in proportion to the depth its node holds.

Layout (DESIGN.md section 5). A *row* holds one token's state at one layer l:
  K[row], V[row]  K/V of layer l                      -> [rows, Hkv, Dh]
  H[row]          residual leaving layer l (= entering layer l + 1)   -> [rows, hidden]
A cached token has a *token slot* (what the radix index stores); ``table[slot, l]`` is its row at
layer l, or -1. A node of depth k holds rows for layers 0..k-1 of each of its tokens, so a request
can skip those tokens in layers < d and resume them at layer d (reading H of layer d - 1) for
any d <= k. Bytes per layer-token = (2 * kv_dim + hidden) * itemsize:
LLaDA-8B bf16 (kv_dim 4096, hidden 4096): 24 KiB; Dream-7B bf16 (kv_dim 512, hidden 3584): 9 KiB.
(Storing only the residual and re-projecting K/V would cost 8 / 7 KiB per layer-token, for extra
projection work on every hit; for GQA models K/V alone is the cheaper half.) The residual of
the last layer is never read (a request never resumes after the last layer).

Allocators are free lists of indices (numpy; no tensors in the bookkeeping).
"""

from __future__ import annotations

import numpy as np
import torch

from ..models.config import ModelConfig
from .memory import layer_token_bytes


class SlotAllocator:
    """Free list over ``capacity`` indices. Pure bookkeeping: tested without tensors."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._free = np.arange(capacity - 1, -1, -1, dtype=np.int64)  # pop from the end: low indices first
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
        slots = np.asarray(slots, dtype=np.int64).ravel()
        if slots.size == 0:
            return
        if self._n_free + slots.size > self.capacity:
            raise RuntimeError("prefix pool: freeing more slots than allocated (double free)")
        self._free[self._n_free:self._n_free + slots.size] = slots[::-1]
        self._n_free += slots.size

    def free_set(self) -> np.ndarray:
        return self._free[:self._n_free].copy()


class PrefixPool:
    """Token slots (``tokens``), per-layer rows (``rows``) and the tensors behind the rows."""

    def __init__(self, cfg: ModelConfig, token_capacity: int, row_capacity: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.cfg, self.dtype, self.device = cfg, dtype, device
        self.n_layers = cfg.n_layers
        self.tokens = SlotAllocator(token_capacity)
        self.rows = SlotAllocator(row_capacity)
        self.table = np.full((token_capacity, cfg.n_layers), -1, dtype=np.int64)
        self.k = torch.zeros((row_capacity, cfg.n_kv_heads, cfg.head_dim), dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.h = torch.zeros((row_capacity, cfg.hidden_size), dtype=dtype, device=device)

    @property
    def token_capacity(self) -> int:
        return self.tokens.capacity

    @property
    def row_capacity(self) -> int:
        return self.rows.capacity

    @property
    def bytes_per_layer_token(self) -> int:
        return layer_token_bytes(self.cfg, self.dtype)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.h))

    def to_device(self, idx: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(idx, dtype=np.int64)).to(self.device)

    def held_depth(self, slots: np.ndarray) -> int:
        """Leading layers for which every one of ``slots`` has a row."""
        if len(slots) == 0:
            return self.n_layers
        have = self.table[slots] >= 0  # [n, L]
        full = have.all(axis=0)
        return int(np.argmin(full)) if not full.all() else self.n_layers

    def rows_of(self, slots: np.ndarray, depth: int) -> np.ndarray:
        """[depth, n] rows of layers < depth (all must exist)."""
        rows = self.table[slots, :depth].T
        assert (rows >= 0).all(), "reading a layer the node does not hold"
        return rows

    # Reads at admission (copied into the request's private buffers, so later eviction, trims or
    # upgrades never change a running request).
    def read_kv(self, slots: np.ndarray, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [depth, n, Hkv, Dh] of layers < depth."""
        rows = self.to_device(self.rows_of(slots, depth))
        return self.k[rows], self.v[rows]

    def read_h(self, slots: np.ndarray, layer: int) -> torch.Tensor:
        """Residual entering ``layer`` (1 <= layer < L) [n, hidden]."""
        rows = self.to_device(self.table[slots, layer - 1])
        return self.h[rows]

    # Writes by the model while it runs (captures).
    def write_kv(self, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k.index_copy_(0, rows, k.to(self.dtype))
        self.v.index_copy_(0, rows, v.to(self.dtype))

    def write_h(self, rows: torch.Tensor, h: torch.Tensor) -> None:
        self.h.index_copy_(0, rows, h.to(self.dtype))

    # Bookkeeping (host only).
    def bind(self, slots: np.ndarray, layer: int, rows: np.ndarray) -> np.ndarray:
        """Record ``rows`` as ``slots``' layer ``layer``; returns the rows NOT bound because the
        slot already had that layer (a concurrent upgrade won): the caller frees them."""
        cur = self.table[slots, layer]
        new = cur < 0
        self.table[slots[new], layer] = rows[new]
        return rows[~new]

    def drop_layers(self, slots: np.ndarray, from_layer: int) -> int:
        """Free the rows of layers >= ``from_layer`` of ``slots``; returns rows freed."""
        part = self.table[slots, from_layer:]
        rows = part[part >= 0]
        self.rows.free(rows)
        self.table[slots, from_layer:] = -1
        return int(rows.size)

    def free_tokens(self, slots: np.ndarray) -> int:
        """Free token slots and every row they hold; returns rows freed."""
        n = self.drop_layers(slots, 0)
        self.tokens.free(slots)
        return n
