"""Attention backends: one small interface, a name registry, optional libraries imported lazily.

A backend computes bidirectional (non-causal) attention for a packed batch of sequences. Queries
of all sequences are packed row-wise; each sequence attends to all of its own keys (its private
K/V for the whole sequence at this layer), never to another sequence's.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Sequence

import torch


class AttentionBackend(ABC):
    """Varlen non-causal attention over packed queries."""

    name: str = "base"

    def begin_forward(self) -> None:
        """Called once per model forward (backends may drop per-forward plans here)."""

    @abstractmethod
    def attend(self, q: torch.Tensor, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
               q_indptr: Sequence[int], layout_key: object) -> torch.Tensor:
        """q: [T, H, Dh] packed; keys[i]/values[i]: [N_i, Hkv, Dh]; sequence i owns q rows
        q_indptr[i]:q_indptr[i+1]. ``layout_key`` is equal for calls with the same q/kv lengths in
        one forward, so a backend may reuse its plan. Returns [T, H, Dh] in q's dtype."""


