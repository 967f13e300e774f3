"""Where K/V live: the row store (``KVStore``), one sequence's rows (``SeqKV``) and a sequence's
capture into prefix-pool rows (``Capture``).

These are cache storage types: the pool (kv_cache/pool.py) owns one ``KVStore`` and hands out
``SeqKV``s, the cache manager builds ``Capture``s, and the model's forward reads and writes through
them. This module imports nothing of the package, so the model side may import it without a circle;
the model shape it needs is the structural ``KVShape`` (``models.config.ModelConfig`` is one).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch


class KVShape(Protocol):
    """The model dimensions the cache is sized by (``ModelConfig`` satisfies it)."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    hidden_size: int

    @property
    def kv_dim(self) -> int: ...


@dataclass
class KVStore:
    """Rows of K/V shared by every sequence and the prefix pool; ``h`` holds the residual leaving
    the layer for prefix-pool rows (rows ``[0, len(h))``). k, v: [R, Hkv, Dh]; h: [R_prefix, D]."""

    k: torch.Tensor
    v: torch.Tensor
    h: torch.Tensor

    @classmethod
    def allocate(cls, n_rows: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 prefix_rows: int = 0, hidden: int = 0) -> KVStore:
        # Uninitialised on purpose: a row is always written by a forward before any attention reads it.
        k = torch.empty((n_rows, n_kv_heads, head_dim), dtype=dtype, device=device)
        return cls(k, torch.empty_like(k), torch.empty((prefix_rows, hidden), dtype=dtype, device=device))

    @classmethod
    def for_sequences(cls, cfg: KVShape, lengths: list[int], dtype: torch.dtype,
                      device: torch.device) -> tuple[KVStore, list[SeqKV]]:
        """A store holding exactly the private K/V of sequences of ``lengths`` (tests, tools)."""
        store = cls.allocate(cfg.n_layers * sum(lengths), cfg.n_kv_heads, cfg.head_dim, dtype, device)
        kvs, base = [], 0
        for n in lengths:
            rows = np.arange(base, base + cfg.n_layers * n, dtype=np.int64)
            kvs.append(SeqKV(rows.reshape(cfg.n_layers, n).copy(), rows))
            base += cfg.n_layers * n
        return store, kvs

    @property
    def bytes_per_row(self) -> int:
        return 2 * self.k[0].numel() * self.k.element_size()


@dataclass
class SeqKV:
    """Where one sequence's K/V live: ``rows[l, j]`` is the store row of layer l, position j.

    From the pool (``KVPool.alloc_seq``) ``owned`` is None: the sequence's private rows are
    ``rows`` outside the reused rectangles ``given`` (those read prefix rows the sequence does not
    own), so the row ids are held once. Elsewhere (``KVStore.for_sequences``, tools) ``owned`` lists
    the rows allocated for it and the pool never frees them."""

    rows: np.ndarray  # int64 [L, N]
    owned: np.ndarray | None = None  # int64, any shape; None: the pool's (private = rows outside given)
    # (depth, start, end) per reused rectangle rows[:depth, start:end] (pool only): prefix rows,
    # so the pool frees the private rows by slices around them, not by a pass over the whole grid
    given: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def n_positions(self) -> int:
        return int(self.rows.shape[1])


@dataclass
class Capture:
    """Write this sequence's prefix state into prefix-pool rows while it runs.

    ``layers[l] = (positions, rows)``: the K/V of layer l at ``positions`` go to pool rows
    ``rows`` (long, on the pool's device), and so does the residual leaving layer l (entering
    l + 1; never for the last layer). Every position must be computed by the sequence at layer l
    (a reused S position only from the sequence's depth on)."""

    layers: dict[int, tuple[np.ndarray, torch.Tensor]]
