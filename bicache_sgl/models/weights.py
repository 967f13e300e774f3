"""Checkpoint-name -> runtime-name maps and the expected tensor shapes: each family declares its
own (``models/families/``); this is the lookup by a ModelConfig's family."""

from __future__ import annotations

from .families import checkpoint_names

__all__ = ["checkpoint_names"]
