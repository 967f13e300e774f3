"""A checkpoint's config.json -> :class:`ModelConfig`, through the model-family registry
(``models/families/``: each family recognises and parses its own format). The configuration
type and the checked key readers are ``models/spec.py``."""

from __future__ import annotations

from .families import family_of, parse_model_config
from .spec import ATTENTION_PATTERNS, CheckpointError, ModelConfig, MoESpec

__all__ = ["ATTENTION_PATTERNS", "CheckpointError", "MoESpec", "ModelConfig", "detect_arch", "parse_model_config"]


def detect_arch(cfg: dict) -> str:
    """The name of the family a config.json dict belongs to (CheckpointError when none)."""
    return family_of(cfg).name
