"""The architecture-neutral model configuration (:class:`ModelConfig`) and the checked readers of
config.json keys that every family's parser uses (``models/families/``): each raises a
:class:`CheckpointError` naming the key at fault."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class CheckpointError(ValueError):
    """A checkpoint folder cannot be used; the message names the problem."""


# Which keys a position's queries attend to. "bidirectional": every key of its sequence (LLaDA,
# Dream, LLaDA-MoE: masked diffusion over the whole sequence).
# "block_causal": blocks of a fixed length from position 0; a position sees its own block and the
# blocks before it (LLaDA2.x, SDAR: served by bicache_sgl/blockdiff, not the bidirectional runtime).
ATTENTION_PATTERNS = ("bidirectional", "block_causal")


@dataclass(frozen=True)
class MoESpec:
    """A mixture-of-experts FFN: per token a linear router scores ``n_experts`` experts (softmax
    in float32), the ``top_k`` highest are kept, and the token's FFN output is the sum of those
    experts' SwiGLU outputs weighted by their router probabilities (renormalised over the top-k
    only with ``norm_topk_prob``). ``expert_bias``: a per-expert bias (a checkpoint tensor) added
    to the probabilities before the top-k and kept in the weights; ``shared_expert_size``: a
    SwiGLU expert every token also passes through (None: none). ``layers[i]``: whether layer i
    is a MoE layer (else the dense SwiGLU of ``ModelConfig.intermediate_size``)."""

    n_experts: int
    top_k: int
    expert_size: int  # each expert's SwiGLU width
    layers: tuple[bool, ...]
    norm_topk_prob: bool = False
    expert_bias: bool = False
    shared_expert_size: int | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.n_experts:
            raise CheckpointError(f"config.json: num_experts_per_tok ({self.top_k}) must be in [1, num_experts "
                                  f"({self.n_experts})]")


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # the checkpoint family (models/families/: "llada", "dream", ...), which parsed it
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
    attention: str = "bidirectional"  # ATTENTION_PATTERNS
    qk_norm: bool = False  # RMSNorm over each head's q and k (weights [head_dim]) before RoPE
    moe: MoESpec | None = None  # the FFN: None is a dense SwiGLU in every layer

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
        if self.attention not in ATTENTION_PATTERNS:
            raise CheckpointError(f"attention pattern {self.attention!r} is not one of {ATTENTION_PATTERNS}")
        if self.moe is not None and len(self.moe.layers) != self.n_layers:
            raise CheckpointError(f"config.json: the MoE layer pattern has {len(self.moe.layers)} entries for "
                                  f"{self.n_layers} layers")

    @property
    def ffn(self) -> str:
        """The FFN kind: "swiglu" (dense) or "moe"."""
        return "swiglu" if self.moe is None else "moe"

    def is_moe_layer(self, i: int) -> bool:
        return self.moe is not None and self.moe.layers[i]

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim


MISSING = object()
# Sizes beyond these are not a real checkpoint but a corrupt or hostile config.json (they would
# make the loader loop or allocate for ever instead of failing).
MAX_DIM = 1 << 24
MAX_LAYERS = 1 << 12
MAX_POSITIONS = 1 << 31


def cfg_get(cfg: Mapping[str, Any], keys: tuple[str, ...], default: Any) -> tuple[str, Any]:
    """(the key that is set, its value); the first key and ``default`` when none is set."""
    for k in keys:
        if k in cfg and cfg[k] is not None:
            return k, cfg[k]
    if default is MISSING:
        raise CheckpointError(f"config.json is missing {' / '.join(keys)}")
    return keys[0], default


def cfg_int(cfg: Mapping[str, Any], *keys: str, default: Any = MISSING, lo: int = 1, hi: int = MAX_DIM) -> int:
    """An integer setting, named in the error when it is not one or out of [lo, hi]. Integral
    floats (4.0) are accepted; strings, booleans, 2.5 and lists are not."""
    key, v = cfg_get(cfg, keys, default)
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


def cfg_float(cfg: Mapping[str, Any], key: str, default: float) -> float:
    """A finite, positive number."""
    _, v = cfg_get(cfg, (key,), default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise CheckpointError(f"config.json: {key} must be a finite number > 0, got {v!r}")
    return float(v)


def cfg_bool(cfg: Mapping[str, Any], key: str, default: bool = False) -> bool:
    _, v = cfg_get(cfg, (key,), default)
    if isinstance(v, bool) or v in (0, 1):
        return bool(v)
    raise CheckpointError(f"config.json: {key} must be true or false, got {v!r}")


def id_list(v: Any, where: str, key: str) -> tuple[int, ...]:
    """A token id or a list of them (integral floats accepted), read from ``where``'s ``key``;
    anything else is a CheckpointError naming both."""
    items = v if isinstance(v, (list, tuple)) else [v]
    out = []
    for x in items:
        if isinstance(x, float) and x.is_integer():
            x = int(x)
        if isinstance(x, bool) or not isinstance(x, int) or x < 0:
            raise CheckpointError(f"{where}: {key} must be a token id or a list of token ids, got {v!r}")
        out.append(x)
    return tuple(out)


def cfg_ids(cfg: Mapping[str, Any], key: str, default: Any) -> tuple[int, ...]:
    """A token id or a list of them (eos_token_id)."""
    _, v = cfg_get(cfg, (key,), default)
    return id_list(v, "config.json", key)


def heads_split(d: int, n_heads: int, d_key: str, h_key: str) -> int:
    if d % n_heads:
        raise CheckpointError(f"config.json: {d_key} ({d}) must be divisible by {h_key} ({n_heads})")
    return d // n_heads


