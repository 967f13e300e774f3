"""Attention backends behind one small interface (``base.AttentionBackend``) and a name registry.

The registry maps a name to ``"module:factory"``; the module is imported only when that backend is
chosen, so optional libraries (FlashInfer) are never imported unless asked for.
"""

from __future__ import annotations

import importlib
import logging

import torch

from .base import AttentionBackend

log = logging.getLogger(__name__)

# name -> "module:factory(device) -> AttentionBackend" (imported on demand)
BACKENDS: dict[str, str] = {
    "torch": "bicache_sgl.attention.torch_backend:TorchAttention",
    "flashinfer": "bicache_sgl.attention.flashinfer_backend:FlashInferAttention",
}
# name -> "module:function(dtype, head_dim) -> reason or None" for kernels with limits
SUPPORT_CHECKS: dict[str, str] = {
    "flashinfer": "bicache_sgl.attention.flashinfer_backend:unsupported_reason",
}
ALIASES = {"torch_native": "torch", "sdpa": "torch"}


def available_backends() -> list[str]:
    return sorted(BACKENDS)


def create_backend(name: str, device: torch.device, dtype: torch.dtype | None = None,
                   head_dim: int | None = None) -> AttentionBackend:
    """The backend registered as ``name`` (or an alias), built for ``device``. When the model's
    ``dtype`` / ``head_dim`` are given and the chosen kernels do not support them, the torch
    backend is used instead, with one warning."""
    name = ALIASES.get(name, name)
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {available_backends()}")
    if name in SUPPORT_CHECKS and dtype is not None and head_dim is not None:
        reason = _load(SUPPORT_CHECKS[name])(dtype, head_dim)
        if reason is not None:
            log.warning("attention backend %r does not support %s; using the torch backend", name, reason)
            return create_backend("torch", device)
    return _load(BACKENDS[name])(device)


def _load(ref: str):
    module, attr = ref.split(":")
    return getattr(importlib.import_module(module), attr)


__all__ = ["BACKENDS", "AttentionBackend", "available_backends", "create_backend"]
