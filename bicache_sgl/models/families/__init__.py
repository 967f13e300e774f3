"""The model-family registry: every checkpoint format the server runs, one module each.

A checkpoint's config.json is matched to its family by ``architectures`` first, then by
``model_type`` (:func:`family_of`); the family parses it into a :class:`ModelConfig` and names
its tensors. Adding a family: docs/architecture.md, "Adding a model family".
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from ...decoding.plan import FamilyDecoding
from ..spec import CheckpointError, ModelConfig
from . import dream, llada, llada2, llada_moe, sdar
from .base import Family, TensorMap

# registration order breaks model_type ties (marker keys first)
FAMILIES: Mapping[str, Family] = MappingProxyType(
    {f.name: f for f in (llada.FAMILY, dream.FAMILY, llada_moe.FAMILY, llada2.FAMILY, sdar.FAMILY)})

__all__ = ["FAMILIES", "Family", "TensorMap", "checkpoint_names", "family_decoding", "family_named", "family_of",
           "parse_model_config"]


def _supported() -> str:
    return "; ".join(f"{f.name} (architectures {list(f.architectures)}, model_type {list(f.model_types)})"
                     for f in FAMILIES.values())


def family_of(cfg: Mapping[str, Any]) -> Family:
    """The family of a config.json dict: the one claiming one of its ``architectures``, else its
    ``model_type``; CheckpointError naming what is supported when none does."""
    archs = cfg.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise CheckpointError(f"config.json: architectures must be a list of class names, got {archs!r}")
    for a in archs:
        for fam in FAMILIES.values():
            if a in fam.architectures:
                return fam
    model_type = str(cfg.get("model_type", "")).lower()
    candidates = [f for f in FAMILIES.values() if model_type in f.model_types]
    if candidates:
        marked = [f for f in candidates if f.marker_keys and all(k in cfg for k in f.marker_keys)]
        return (marked or candidates)[0]
    raise CheckpointError(f"unsupported architecture {archs or model_type!r}: bicache-sgl runs {_supported()}")


def family_named(name: str) -> Family:
    """The registered family ``name`` (a ModelConfig's ``arch``)."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise CheckpointError(f"unknown model family {name!r}; registered: {', '.join(FAMILIES)}") from None


def parse_model_config(cfg: Mapping[str, Any], name: str = "") -> ModelConfig:
    """config.json dict -> ModelConfig, by its family. Raises CheckpointError naming the bad key."""
    if not isinstance(cfg, Mapping):
        raise CheckpointError(f"config.json must hold a JSON object, got {type(cfg).__name__}")
    return family_of(cfg).parse(cfg, name)


def checkpoint_names(cfg: ModelConfig) -> TensorMap:
    """runtime parameter name -> (checkpoint tensor name, expected shape), by the config's family."""
    return family_named(cfg.arch).tensor_names(cfg)


def family_decoding(cfg: ModelConfig) -> FamilyDecoding:
    """The decoding the config's family declares (default and accepted algorithms)."""
    return family_named(cfg.arch).decoding
