"""Attention backends: one small interface, a name registry, optional libraries imported lazily.

A backend computes bidirectional (non-causal) attention for a packed batch of sequences. Queries
of all sequences are packed row-wise; each sequence attends to all of its own keys (its private
K/V for the whole sequence at this layer), never to another sequence's.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import numpy as np
import torch


class AttentionBackend(ABC):
    """Varlen non-causal attention over packed queries; keys are read from a row store through
    per-sequence, per-layer row indices (nothing is concatenated or copied per request)."""

    name: str = "base"

    def begin_forward(self, kv_rows: Sequence[np.ndarray],
                      flat: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        """Once per model forward. ``kv_rows[i]``: int64 [L, N_i], the store row of sequence i's
        K/V at every layer and position (its keys at layer l are ``k_store[kv_rows[i][l]]``).
        ``flat``: the same rows side by side, (int64 [L, sum N_i], indptr [B + 1]) with sequence
        i in columns indptr[i]:indptr[i + 1], when the caller has built it (ForwardBatch does);
        otherwise ``flat_rows`` builds it on first use."""
        self.kv_rows = list(kv_rows)
        self._flat = flat

    def flat_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """(int64 [L, sum N_i], indptr [B + 1]): every sequence's rows side by side."""
        if self._flat is None:
            indptr = np.zeros(len(self.kv_rows) + 1, dtype=np.int64)
            np.cumsum([r.shape[1] for r in self.kv_rows], out=indptr[1:])
            rows = np.concatenate(self.kv_rows, axis=1) if self.kv_rows else np.zeros((0, 0), dtype=np.int64)
            self._flat = (rows, indptr)
        return self._flat

    @abstractmethod
    def attend(self, q: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor, layer: int,
               q_indptr: Sequence[int], layout_key: object) -> torch.Tensor:
        """q: [T, H, Dh] packed; k_store/v_store: [R, Hkv, Dh]; sequence i owns q rows
        q_indptr[i]:q_indptr[i+1] and attends to all of its keys at ``layer``. ``layout_key`` is
        equal for calls with the same q_indptr in one forward, so a backend may reuse its plan.
        Returns [T, H, Dh] in q's dtype."""
