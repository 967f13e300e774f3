"""Architecture-neutral model configuration parsed from a checkpoint's config.json."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class CheckpointError(ValueError):
    """A checkpoint folder cannot be used; the message names the problem."""


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # "llada" | "dream"
    n_layers: int
    hidden_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # rows of the embedding / LM head
    rope_theta: float
    rms_norm_eps: float
    mask_token_id: int
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    max_position_embeddings: int
    logit_shift: int  # 1 for Dream: position i-1's output predicts token i
    torch_dtype: str | None = None
    name: str = ""

    def __post_init__(self) -> None:
        for k in ("n_layers", "hidden_size", "n_heads", "n_kv_heads", "head_dim", "intermediate_size", "vocab_size",
                  "max_position_embeddings"):
            v = getattr(self, k)
            if not isinstance(v, int) or v <= 0:
                raise CheckpointError(f"config.json: {k} must be a positive integer, got {v!r}")
        if self.n_heads % self.n_kv_heads:
            raise CheckpointError(f"config.json: n_heads ({self.n_heads}) must be a multiple of n_kv_heads "
                                  f"({self.n_kv_heads})")
        if self.head_dim % 2:
            raise CheckpointError(f"config.json: the head dim (head_dim, or the hidden size / heads) is "
                                  f"{self.head_dim}; it must be even for RoPE")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise CheckpointError(f"config.json: mask_token_id {self.mask_token_id} is outside the vocabulary "
                                  f"({self.vocab_size})")
        if not (isinstance(self.rms_norm_eps, (int, float)) and self.rms_norm_eps > 0):
            raise CheckpointError(f"config.json: rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")
        if not (isinstance(self.rope_theta, (int, float)) and self.rope_theta > 0):
            raise CheckpointError(f"config.json: rope_theta must be > 0, got {self.rope_theta!r}")

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim


LLADA_ARCHS = ("LLaDAModelLM", "LLaDAModel")
DREAM_ARCHS = ("DreamModel", "DreamForMaskedLM")
MASK_ID_DEFAULTS = {"llada": 126336, "dream": 151666}


_MISSING = object()
# Sizes beyond these are not a real checkpoint but a corrupt or hostile config.json (they would
# make the loader loop or allocate for ever instead of failing).
_MAX_DIM = 1 << 24
_MAX_LAYERS = 1 << 12
_MAX_POSITIONS = 1 << 31


def _get(cfg: Mapping[str, Any], keys: tuple[str, ...], default: Any) -> tuple[str, Any]:
    """(the key that is set, its value); the first key and ``default`` when none is set."""
    for k in keys:
        if k in cfg and cfg[k] is not None:
            return k, cfg[k]
    if default is _MISSING:
        raise CheckpointError(f"config.json is missing {' / '.join(keys)}")
    return keys[0], default


def _int(cfg: Mapping[str, Any], *keys: str, default: Any = _MISSING, lo: int = 1, hi: int = _MAX_DIM) -> int:
    """An integer setting, named in the error when it is not one or out of [lo, hi]. Integral
    floats (4.0) are accepted; strings, booleans, 2.5 and lists are not."""
    key, v = _get(cfg, keys, default)
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise CheckpointError(f"config.json: {key} must be an integer, got {v!r}")
    if v < lo:
        what = "a positive integer" if lo == 1 else f"an integer >= {lo}"
        raise CheckpointError(f"config.json: {key} must be {what}, got {v}")
    if v > hi:
        raise CheckpointError(f"config.json: {key} = {v} is implausibly large (at most {hi})")
    return v


def _float(cfg: Mapping[str, Any], key: str, default: float) -> float:
    """A finite, positive number."""
    _, v = _get(cfg, (key,), default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise CheckpointError(f"config.json: {key} must be a finite number > 0, got {v!r}")
    return float(v)


def _bool(cfg: Mapping[str, Any], key: str, default: bool = False) -> bool:
    _, v = _get(cfg, (key,), default)
    if isinstance(v, bool) or v in (0, 1):
        return bool(v)
    raise CheckpointError(f"config.json: {key} must be true or false, got {v!r}")


def _ids(cfg: Mapping[str, Any], key: str, default: Any) -> tuple[int, ...]:
    """A token id or a list of them (eos_token_id)."""
    _, v = _get(cfg, (key,), default)
    items = v if isinstance(v, (list, tuple)) else [v]
    out = []
    for x in items:
        if isinstance(x, float) and x.is_integer():
            x = int(x)
        if isinstance(x, bool) or not isinstance(x, int) or x < 0:
            raise CheckpointError(f"config.json: {key} must be a token id or a list of token ids, got {v!r}")
        out.append(x)
    return tuple(out)


def _heads_split(d: int, n_heads: int, d_key: str, h_key: str) -> int:
    if d % n_heads:
        raise CheckpointError(f"config.json: {d_key} ({d}) must be divisible by {h_key} ({n_heads})")
    return d // n_heads


def detect_arch(cfg: Mapping[str, Any]) -> str:
    archs = cfg.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise CheckpointError(f"config.json: architectures must be a list of class names, got {archs!r}")
    model_type = str(cfg.get("model_type", "")).lower()
    if any(a in LLADA_ARCHS for a in archs) or model_type == "llada":
        return "llada"
    if any(a in DREAM_ARCHS for a in archs) or model_type == "dream":
        return "dream"
    raise CheckpointError(
        f"unsupported architecture {archs or model_type!r}: bicache-sgl runs LLaDA "
        f"(architectures {list(LLADA_ARCHS)}, model_type 'llada') and Dream ({list(DREAM_ARCHS)}, model_type 'Dream')")


def parse_model_config(cfg: Mapping[str, Any], name: str = "") -> ModelConfig:
    """config.json dict -> ModelConfig. Raises CheckpointError naming the bad key."""
    if not isinstance(cfg, Mapping):
        raise CheckpointError(f"config.json must hold a JSON object, got {type(cfg).__name__}")
    arch = detect_arch(cfg)
    if arch == "llada":
        d = _int(cfg, "d_model")
        n_heads = _int(cfg, "n_heads")
        head_dim = _heads_split(d, n_heads, "d_model", "n_heads")
        n_kv = _int(cfg, "n_kv_heads", default=n_heads) if cfg.get("n_kv_heads") else n_heads
        if _bool(cfg, "multi_query_attention"):
            n_kv = 1
        vocab = _int(cfg, "embedding_size", "vocab_size")
        if cfg.get("mlp_hidden_size"):
            mlp = _int(cfg, "mlp_hidden_size")
        else:
            ratio = _float(cfg, "mlp_ratio", 4)
            mlp = int(ratio * d)
            if not 1 <= mlp <= _MAX_DIM:
                raise CheckpointError(f"config.json: mlp_ratio {ratio} gives an MLP width of {mlp}")
        if cfg.get("block_type", "llama") not in ("llama", "sequential"):
            raise CheckpointError(f"config.json: block_type {cfg.get('block_type')!r} is not supported (llama only)")
        if _bool(cfg, "alibi"):
            raise CheckpointError("config.json: alibi position encoding is not supported (rope only)")
        include_bias = _bool(cfg, "include_bias")
        return ModelConfig(
            arch=arch, n_layers=_int(cfg, "n_layers", hi=_MAX_LAYERS), hidden_size=d, n_heads=n_heads,
            n_kv_heads=n_kv, head_dim=head_dim, intermediate_size=mlp, vocab_size=vocab,
            rope_theta=_float(cfg, "rope_theta", 10000.0), rms_norm_eps=_float(cfg, "rms_norm_eps", 1e-5),
            mask_token_id=_int(cfg, "mask_token_id", default=MASK_ID_DEFAULTS["llada"], lo=0, hi=1 << 31),
            eos_token_ids=_ids(cfg, "eos_token_id", 126081), pad_token_id=cfg.get("pad_token_id"),
            tie_word_embeddings=_bool(cfg, "weight_tying"),
            qkv_bias=include_bias or _bool(cfg, "include_qkv_bias"), o_bias=include_bias, mlp_bias=include_bias,
            max_position_embeddings=_int(cfg, "max_sequence_length", default=4096, hi=_MAX_POSITIONS),
            logit_shift=0, torch_dtype=cfg.get("torch_dtype"), name=name)
    d = _int(cfg, "hidden_size")
    n_heads = _int(cfg, "num_attention_heads")
    if cfg.get("head_dim") is not None:
        head_dim = _int(cfg, "head_dim")
    else:
        head_dim = _heads_split(d, n_heads, "hidden_size", "num_attention_heads")
    n_kv = _int(cfg, "num_key_value_heads") if cfg.get("num_key_value_heads") else n_heads
    return ModelConfig(
        arch=arch, n_layers=_int(cfg, "num_hidden_layers", hi=_MAX_LAYERS), hidden_size=d, n_heads=n_heads,
        n_kv_heads=n_kv, head_dim=head_dim, intermediate_size=_int(cfg, "intermediate_size"),
        vocab_size=_int(cfg, "vocab_size"), rope_theta=_float(cfg, "rope_theta", 10000.0),
        rms_norm_eps=_float(cfg, "rms_norm_eps", 1e-6),
        mask_token_id=_int(cfg, "mask_token_id", default=MASK_ID_DEFAULTS["dream"], lo=0, hi=1 << 31),
        eos_token_ids=_ids(cfg, "eos_token_id", 151643), pad_token_id=cfg.get("pad_token_id"),
        tie_word_embeddings=_bool(cfg, "tie_word_embeddings"), qkv_bias=True, o_bias=False,
        mlp_bias=False, max_position_embeddings=_int(cfg, "max_position_embeddings", default=32768, hi=_MAX_POSITIONS),
        logit_shift=1, torch_dtype=cfg.get("torch_dtype"), name=name)
