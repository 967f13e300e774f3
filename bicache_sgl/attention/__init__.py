"""Attention backends behind one small interface (``base.AttentionBackend``) and a name registry.

The registry maps a name to ``"module:factory"``; the module is imported only when that backend is
chosen, so optional libraries (FlashInfer) are never imported unless asked for.
"""

from __future__ import annotations

import importlib

import torch

from .base import AttentionBackend

# name -> "module:factory(device) -> AttentionBackend" (imported on demand)
BACKENDS: dict[str, str] = {
    "torch": "bicache_sgl.attention.torch_backend:TorchAttention",
    "flashinfer": "bicache_sgl.attention.flashinfer_backend:FlashInferAttention",
}
ALIASES = {"torch_native": "torch", "sdpa": "torch"}


def available_backends() -> list[str]:
    return sorted(BACKENDS)


def create_backend(name: str, device: torch.device) -> AttentionBackend:
    """The backend registered as ``name`` (or an alias), built for ``device``."""
    name = ALIASES.get(name, name)
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {available_backends()}")
    module, factory = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), factory)(device)


__all__ = ["BACKENDS", "AttentionBackend", "available_backends", "create_backend"]
