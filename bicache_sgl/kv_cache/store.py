"""Where K/V live: the row store (``KVStore``), one sequence's rows (``SeqKV``) and a sequence's
capture into prefix-pool rows (``Capture``).

These are cache storage types: the pool (kv_cache/pool.py) owns one ``KVStore`` and hands out
``SeqKV``s, the cache manager builds ``Capture``s, and the model's forward reads and writes through
them. This module imports nothing of the package, so the model side may import it without a circle;
the model shape it needs is the structural ``KVShape`` (``models.config.ModelConfig`` is one).
"""

from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

_MADV_POPULATE_WRITE = 23  # Linux >= 5.14: fault pages in writable, contents unchanged
_PAGE = 4096


def _populate_write(t: torch.Tensor) -> bool:
    """Ask the kernel to back ``t``'s pages now (``madvise(MADV_POPULATE_WRITE)``); False where it
    cannot (not Linux, an older kernel): the caller then writes the pages itself."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return False
    start = t.data_ptr() & ~(_PAGE - 1)  # the page holding the first byte: populating keeps contents
    length = t.data_ptr() + t.numel() * t.element_size() - start
    return madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), _MADV_POPULATE_WRITE) == 0


def prefault(t: torch.Tensor) -> None:
    """Back a CPU tensor's memory with pages now, not at its first write.

    ``torch.empty`` on the CPU maps pages lazily: the first write to each 4 KiB page traps into the
    kernel, which zeroes it. For the prefix rows that write is a capture inside a request's forward,
    so a fresh server's first fill of the pool paid about 0.4-0.8 ms per MiB stored on the serving
    path (issue 38: 20-40% of a forward that stores every prompt; docs/performance.md). Paid once at
    startup instead, as a CUDA allocation is. Contents stay undefined (populate) or become zero."""
    if t.device.type != "cpu" or t.numel() == 0:
        return
    if not _populate_write(t):
        t.zero_()


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

    def prefault_prefix(self) -> None:
        """Back the prefix rows (``[0, len(h))`` of k, v and h) with memory now (``prefault``): they
        are written by captures, on the serving path. The private rows are left lazy: cache off
        and bicache use them alike, and freed rows are handed out again first."""
        n = int(self.h.shape[0])
        for t in (self.k[:n], self.v[:n], self.h):
            prefault(t)

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
