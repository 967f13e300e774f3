"""Attention backends: one small interface, a name registry, optional libraries imported lazily.

A backend computes bidirectional (non-causal) attention for a packed batch of sequences. Queries
of all sequences are packed row-wise; each sequence attends to all of its own keys (its private
K/V for the whole sequence at this layer), never to another sequence's.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, Sequence

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


_REGISTRY: dict[str, Callable[[torch.device], AttentionBackend]] = {}


def register_backend(name: str) -> Callable:
    def deco(factory: Callable[[torch.device], AttentionBackend]) -> Callable:
        _REGISTRY[name] = factory
        return factory
    return deco


def available_backends() -> list[str]:
    _load_builtin()
    return sorted(_REGISTRY)


def _load_builtin() -> None:
    # Importing the modules registers them; flashinfer's module imports flashinfer itself lazily.
    from . import flashinfer_backend, torch_backend  # noqa: F401


def create_backend(name: str, device: torch.device) -> AttentionBackend:
    _load_builtin()
    aliases = {"torch_native": "torch", "sdpa": "torch"}
    name = aliases.get(name, name)
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {sorted(_REGISTRY)}")
    return _REGISTRY[name](device)
