"""Configuration of the block-diffusion families (LLaDA2.x, SDAR): parsed from a checkpoint's
config.json, with the checkpoint's tensor names and the family's published decoding defaults.

Block-diffusion models attend block-causally: the sequence is cut into blocks of ``block_length``
tokens from absolute position 0 (the prompt included); a position sees its own block and every
earlier block, never a later one. Facts and sources: docs/block_diffusion.md.

- LLaDA2.x (inclusionAI LLaDA2.0-mini / -flash, LLaDA2.1-mini): ``architectures``
  ["LLaDA2MoeModelLM"], ``model_type`` "llada2_moe". Fused query_key_value projection, QK-norm,
  partial rotary (``partial_rotary_factor``), MoE FFN (sigmoid scores + expert bias or softmax,
  grouped top-k, shared experts, routed scaling) after ``first_k_dense_replace`` dense layers.
- SDAR (JetAstra): ``architectures`` ["SDARForCausalLM"], ``model_type`` "sdar". Qwen3-style dense
  stack: separate q/k/v/o projections, QK-norm, full rotary, SwiGLU MLP.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .spec import CheckpointError

LLADA2_ARCHS = ("LLaDA2MoeModelLM",)
SDAR_ARCHS = ("SDARForCausalLM", "SDARModel")
BLOCK_FAMILIES = ("llada2", "sdar")

_MAX_DIM = 1 << 24


@dataclass(frozen=True)
class BlockDecodeDefaults:
    """A family's published decoding defaults (docs/block_diffusion.md has the sources).
    ``steps``: denoising steps per block (capped at gen_length // minimal_topk as the published
    LLaDA2 generate does); ``threshold``: confidence above which every masked position of the
    block is unmasked in one step."""

    block_length: int
    steps: int
    threshold: float
    minimal_topk: int = 1
    cap_steps_by_gen_length: bool = True  # LLaDA2: steps = min(steps, gen_length // minimal_topk); SDAR: no cap
    # LLaDA2.1's token editing (None: off); set by --dllm-algorithm JointThreshold (and its
    # --dllm-algorithm-config) or generation_config.json (edit_threshold / editing_threshold,
    # max_post_edit_steps / max_post_steps). SGLang's convention: 0.0 allows every edit
    edit_threshold: float | None = None
    max_post_edit_steps: int = 16

    def __post_init__(self) -> None:
        if self.block_length < 1 or self.steps < 1 or self.minimal_topk < 1:
            raise ValueError(f"block_length, steps and minimal_topk must be >= 1, got {self}")
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {self.threshold}")
        if self.edit_threshold is not None and not 0.0 <= self.edit_threshold <= 1.0:
            raise ValueError(f"edit_threshold must be in [0, 1], got {self.edit_threshold}")
        if self.max_post_edit_steps < 0:
            raise ValueError(f"max_post_edit_steps must be >= 0, got {self.max_post_edit_steps}")

    @property
    def algorithm(self) -> str:
        """The rule these defaults run (config.BLOCK_ALGORITHMS): ``joint_threshold`` (LLaDA2.1's
        token editing) when an edit threshold is set, else ``low_confidence``."""
        return "low_confidence" if self.edit_threshold is None else "joint_threshold"


# LLaDA2 (published modeling file's generate(): block_length 32, steps 32, threshold 0.95,
# minimal_topk 1); SDAR (its generate.py: block_length 4, denoising_steps 4, confidence
# threshold 0.85, low_confidence_dynamic)
FAMILY_DEFAULTS = {
    "llada2": BlockDecodeDefaults(block_length=32, steps=32, threshold=0.95),
    "sdar": BlockDecodeDefaults(block_length=4, steps=4, threshold=0.85, cap_steps_by_gen_length=False),
}
# The special ids hard-coded by the published code (LLaDA2.0's generate(): mask 156895, eos 156892;
# SDAR's tokenizer's <|MASK|>, Qwen3 vocabulary + 1 added): the last fallback when config.json,
# generation_config.json and the tokenizer name none (models/special_ids.py reads them in that order).
MASK_ID_DEFAULTS = {"llada2": 156895, "sdar": 151669}
EOS_ID_DEFAULTS = {"llada2": 156892, "sdar": 151645}


@dataclass(frozen=True)
class BlockModelConfig:
    """Everything the block-diffusion forward needs; MoE fields are 0 / unused for dense models."""

    family: str  # "llada2" | "sdar"
    n_layers: int
    hidden_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense MLP width (SDAR's every layer; LLaDA2's first_k_dense_replace layers)
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float
    rotary_dim: int  # leading dims of each head that are rotated (partial rotary); == head_dim: full
    qk_norm: bool
    qkv_bias: bool
    o_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    mask_token_id: int
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    # MoE (LLaDA2); num_experts == 0: every layer dense
    num_experts: int = 0
    num_experts_per_tok: int = 0
    n_group: int = 1
    topk_group: int = 1
    num_shared_experts: int = 0
    moe_intermediate_size: int = 0
    shared_intermediate_size: int = 0  # per shared expert
    first_k_dense_replace: int = 0
    routed_scaling_factor: float = 1.0
    score_function: str = "sigmoid"  # "sigmoid" (with expert bias) | "softmax"
    expert_bias: bool = False
    norm_topk_prob: bool = True
    decode: BlockDecodeDefaults = FAMILY_DEFAULTS["llada2"]
    torch_dtype: str | None = None
    name: str = ""

    def __post_init__(self) -> None:
        if self.family not in BLOCK_FAMILIES:
            raise CheckpointError(f"unknown block-diffusion family {self.family!r}")
        for k in ("n_layers", "hidden_size", "n_heads", "n_kv_heads", "head_dim", "vocab_size",
                  "max_position_embeddings"):
            v = getattr(self, k)
            if not isinstance(v, int) or v <= 0:
                raise CheckpointError(f"config.json: {k} must be a positive integer, got {v!r}")
        if self.n_heads % self.n_kv_heads:
            raise CheckpointError(f"config.json: num_attention_heads ({self.n_heads}) must be a multiple of "
                                  f"num_key_value_heads ({self.n_kv_heads})")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise CheckpointError(f"config.json: the rotary dim (head_dim x partial_rotary_factor) is "
                                  f"{self.rotary_dim}; it must be even and in (0, head_dim={self.head_dim}]")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise CheckpointError(f"config.json: mask_token_id {self.mask_token_id} is outside the vocabulary "
                                  f"({self.vocab_size})")
        if self.num_experts:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise CheckpointError(f"config.json: num_experts_per_tok ({self.num_experts_per_tok}) must be in "
                                      f"[1, num_experts={self.num_experts}]")
            if self.num_experts % self.n_group or not 0 < self.topk_group <= self.n_group:
                raise CheckpointError(f"config.json: n_group ({self.n_group}) must divide num_experts "
                                      f"({self.num_experts}) and topk_group ({self.topk_group}) be in [1, n_group]")
            if self.num_experts_per_tok > self.topk_group * (self.num_experts // self.n_group):
                raise CheckpointError("config.json: num_experts_per_tok exceeds the experts of the topk_group groups")
            if self.score_function == "sigmoid" and self.num_experts // self.n_group < 2:
                raise CheckpointError("config.json: sigmoid grouped routing scores a group by its top-2 experts; "
                                      "each group needs at least 2 experts")
            if self.score_function not in ("sigmoid", "softmax"):
                raise CheckpointError(f"config.json: score_function must be 'sigmoid' or 'softmax', got "
                                      f"{self.score_function!r}")
        elif self.intermediate_size <= 0:
            raise CheckpointError("config.json: intermediate_size must be a positive integer")

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer >= self.first_k_dense_replace

    @property
    def arch(self) -> str:
        return self.family


def detect_block_family(cfg: Mapping[str, Any]) -> str | None:
    """'llada2' / 'sdar' when config.json names a block-diffusion architecture, else None."""
    archs = cfg.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    model_type = str(cfg.get("model_type", "")).lower()
    if any(a in LLADA2_ARCHS for a in archs) or model_type == "llada2_moe":
        return "llada2"
    if any(a in SDAR_ARCHS for a in archs) or model_type == "sdar":
        return "sdar"
    return None


def _get(cfg: Mapping[str, Any], key: str, default: Any) -> Any:
    v = cfg.get(key)
    if v is None:
        if default is _REQUIRED:
            raise CheckpointError(f"config.json is missing {key}")
        return default
    return v


_REQUIRED = object()


def _int(cfg: Mapping[str, Any], key: str, default: Any = _REQUIRED, lo: int = 1, hi: int = 1 << 31) -> int:
    v = _get(cfg, key, default)
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise CheckpointError(f"config.json: {key} must be an integer in [{lo}, {hi}], got {v!r}")
    return v


def _num(cfg: Mapping[str, Any], key: str, default: float, positive: bool = True) -> float:
    v = _get(cfg, key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or (positive and v <= 0):
        raise CheckpointError(f"config.json: {key} must be a finite number{' > 0' if positive else ''}, got {v!r}")
    return float(v)


def _flag(cfg: Mapping[str, Any], key: str, default: bool) -> bool:
    v = _get(cfg, key, default)
    if isinstance(v, bool) or v in (0, 1):
        return bool(v)
    raise CheckpointError(f"config.json: {key} must be true or false, got {v!r}")


def _ids(cfg: Mapping[str, Any], key: str, default: int) -> tuple[int, ...]:
    v = _get(cfg, key, default)
    items = v if isinstance(v, (list, tuple)) else [v]
    if not items or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in items):
        raise CheckpointError(f"config.json: {key} must be a token id or a list of token ids, got {v!r}")
    return tuple(items)


def parse_block_config(cfg: Mapping[str, Any], name: str = "") -> BlockModelConfig:
    """config.json dict of a LLaDA2 or SDAR checkpoint -> BlockModelConfig; CheckpointError naming
    the bad key otherwise."""
    family = detect_block_family(cfg)
    if family is None:
        raise CheckpointError(f"config.json names no block-diffusion architecture ({cfg.get('architectures')!r})")
    d = _int(cfg, "hidden_size", hi=_MAX_DIM)
    n_heads = _int(cfg, "num_attention_heads", hi=_MAX_DIM)
    if cfg.get("head_dim") is not None:
        head_dim = _int(cfg, "head_dim", hi=_MAX_DIM)
    elif d % n_heads:
        raise CheckpointError(f"config.json: hidden_size ({d}) must be divisible by num_attention_heads ({n_heads})")
    else:
        head_dim = d // n_heads
    n_kv = _int(cfg, "num_key_value_heads", default=n_heads, hi=_MAX_DIM) if cfg.get("num_key_value_heads") else n_heads
    if str(cfg.get("hidden_act", "silu")) != "silu":
        raise CheckpointError(f"config.json: hidden_act {cfg.get('hidden_act')!r} is not supported (silu only)")
    if cfg.get("rope_scaling"):
        raise CheckpointError("config.json: rope_scaling is not supported (plain RoPE only)")
    common = dict(
        n_layers=_int(cfg, "num_hidden_layers", hi=1 << 12), hidden_size=d, n_heads=n_heads, n_kv_heads=n_kv,
        head_dim=head_dim, vocab_size=_int(cfg, "vocab_size", hi=_MAX_DIM),
        rms_norm_eps=_num(cfg, "rms_norm_eps", 1e-6), tie_word_embeddings=_flag(cfg, "tie_word_embeddings", False),
        max_position_embeddings=_int(cfg, "max_position_embeddings", default=32768),
        mask_token_id=_int(cfg, "mask_token_id", default=MASK_ID_DEFAULTS[family], lo=0),
        eos_token_ids=_ids(cfg, "eos_token_id", EOS_ID_DEFAULTS[family]), pad_token_id=cfg.get("pad_token_id"),
        decode=FAMILY_DEFAULTS[family], torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"), name=name)
    if family == "sdar":
        bias = _flag(cfg, "attention_bias", False)
        return BlockModelConfig(
            family=family, intermediate_size=_int(cfg, "intermediate_size", hi=_MAX_DIM),
            rope_theta=_num(cfg, "rope_theta", 1000000.0), rotary_dim=head_dim, qk_norm=True, qkv_bias=bias,
            o_bias=bias, **common)
    if _flag(cfg, "norm_head", False):
        raise CheckpointError("config.json: norm_head true is not supported (the published LLaDA2 checkpoints set it "
                              "false)")
    if _flag(cfg, "use_bias", False):
        raise CheckpointError("config.json: use_bias true is not supported (the published LLaDA2 checkpoints set it "
                              "false; dense / MLP biases are not implemented)")
    factor = _num(cfg, "partial_rotary_factor", 1.0)
    if factor > 1:
        raise CheckpointError(f"config.json: partial_rotary_factor must be in (0, 1], got {factor}")
    n_exp = _int(cfg, "num_experts", default=0, lo=0, hi=1 << 16)
    moe: dict[str, Any] = {}
    if n_exp:
        score = str(_get(cfg, "score_function", "sigmoid"))
        expert_bias = _flag(cfg, "moe_router_enable_expert_bias", score == "sigmoid")
        if (score == "sigmoid") != expert_bias:
            # the combinations SGLang's llada2.py accepts: (sigmoid, bias) or (softmax, no bias)
            raise CheckpointError(f"config.json: score_function {score!r} with moe_router_enable_expert_bias "
                                  f"{expert_bias} is not a published combination (sigmoid + bias, softmax without)")
        n_shared = _int(cfg, "num_shared_experts", default=0, lo=0, hi=1 << 10)
        moe_ff = _int(cfg, "moe_intermediate_size", hi=_MAX_DIM)
        moe = dict(
            num_experts=n_exp, num_experts_per_tok=_int(cfg, "num_experts_per_tok", hi=n_exp),
            n_group=_int(cfg, "n_group", default=1), topk_group=_int(cfg, "topk_group", default=1),
            num_shared_experts=n_shared, moe_intermediate_size=moe_ff,
            shared_intermediate_size=_int(cfg, "moe_shared_expert_intermediate_size", default=moe_ff, hi=_MAX_DIM),
            first_k_dense_replace=_int(cfg, "first_k_dense_replace", default=0, lo=0),
            routed_scaling_factor=_num(cfg, "routed_scaling_factor", 1.0), score_function=score,
            expert_bias=expert_bias, norm_topk_prob=_flag(cfg, "norm_topk_prob", True))
    dense_needed = not n_exp or moe["first_k_dense_replace"] > 0
    return BlockModelConfig(
        family=family,
        intermediate_size=_int(cfg, "intermediate_size", hi=_MAX_DIM) if dense_needed else
        _int(cfg, "intermediate_size", default=1, hi=_MAX_DIM),
        rope_theta=_num(cfg, "rope_theta", 10000.0), rotary_dim=int(head_dim * factor),
        qk_norm=_flag(cfg, "use_qk_norm", True), qkv_bias=_flag(cfg, "use_qkv_bias", False), o_bias=False,
        **common, **moe)


def block_checkpoint_names(cfg: BlockModelConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """runtime parameter name -> (checkpoint tensor name, expected shape), in the published formats.
    Experts are listed one by one (the checkpoints store them so); the model stacks them."""
    d, hd, H, Hkv, V = cfg.hidden_size, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads, cfg.vocab_size
    out: dict[str, tuple[str, tuple[int, ...]]] = {}

    def mlp(ours: str, theirs: str, ff: int) -> None:
        out[f"{ours}.gate_proj.weight"] = (f"{theirs}.gate_proj.weight", (ff, d))
        out[f"{ours}.up_proj.weight"] = (f"{theirs}.up_proj.weight", (ff, d))
        out[f"{ours}.down_proj.weight"] = (f"{theirs}.down_proj.weight", (d, ff))

    if cfg.family == "llada2":
        out["embed.weight"] = ("model.word_embeddings.weight", (V, d))
    else:
        out["embed.weight"] = ("model.embed_tokens.weight", (V, d))
    out["norm.weight"] = ("model.norm.weight", (d,))
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = ("lm_head.weight", (V, d))
    for i in range(cfg.n_layers):
        p, o = f"model.layers.{i}.", f"layers.{i}."
        out[o + "attn_norm.weight"] = (p + "input_layernorm.weight", (d,))
        out[o + "ffn_norm.weight"] = (p + "post_attention_layernorm.weight", (d,))
        if cfg.family == "llada2":
            out[o + "qkv.weight"] = (p + "attention.query_key_value.weight", ((H + 2 * Hkv) * hd, d))
            if cfg.qkv_bias:
                out[o + "qkv.bias"] = (p + "attention.query_key_value.bias", ((H + 2 * Hkv) * hd,))
            out[o + "o_proj.weight"] = (p + "attention.dense.weight", (d, H * hd))
            if cfg.qk_norm:
                out[o + "q_norm.weight"] = (p + "attention.query_layernorm.weight", (hd,))
                out[o + "k_norm.weight"] = (p + "attention.key_layernorm.weight", (hd,))
        else:
            # SDAR: separate projections, fused into ``qkv`` by the loader (q, k, v rows in order)
            for part, rows in (("q", H * hd), ("k", Hkv * hd), ("v", Hkv * hd)):
                out[f"{o}{part}_proj.weight"] = (f"{p}self_attn.{part}_proj.weight", (rows, d))
                if cfg.qkv_bias:
                    out[f"{o}{part}_proj.bias"] = (f"{p}self_attn.{part}_proj.bias", (rows,))
            out[o + "o_proj.weight"] = (p + "self_attn.o_proj.weight", (d, H * hd))
            if cfg.o_bias:
                out[o + "o_proj.bias"] = (p + "self_attn.o_proj.bias", (d,))
            out[o + "q_norm.weight"] = (p + "self_attn.q_norm.weight", (hd,))
            out[o + "k_norm.weight"] = (p + "self_attn.k_norm.weight", (hd,))
        if cfg.is_moe_layer(i):
            E = cfg.num_experts
            out[o + "gate.weight"] = (p + "mlp.gate.weight", (E, d))
            if cfg.expert_bias:
                out[o + "gate.expert_bias"] = (p + "mlp.gate.expert_bias", (E,))
            for e in range(E):
                mlp(f"{o}experts.{e}", f"{p}mlp.experts.{e}", cfg.moe_intermediate_size)
            if cfg.num_shared_experts:
                mlp(o + "shared", p + "mlp.shared_experts", cfg.shared_intermediate_size * cfg.num_shared_experts)
        else:
            mlp(o + "mlp", p + "mlp", cfg.intermediate_size)
    return out
