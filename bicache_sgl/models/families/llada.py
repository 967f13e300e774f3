"""LLaDA (GSAI-ML/LLaDA-8B-Base, -Instruct, LLaDA-1.5): the OLMo-derived ``LLaDAModelLM`` format.

config.json uses OLMo's keys (``d_model``, ``n_layers``, ``mlp_hidden_size`` or ``mlp_ratio``,
``include_bias``, ``weight_tying``); tensors live under ``model.transformer.`` (``wte``,
``blocks.{i}.q_proj`` ... ``ff_out``, ``ln_f``). Bidirectional attention, dense SwiGLU, no
logit shift. Decoding: LLaDA's low-confidence remasking on its per-block linear schedule.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...decoding.plan import FamilyDecoding
from ..spec import (
    MAX_DIM,
    MAX_LAYERS,
    MAX_POSITIONS,
    CheckpointError,
    ModelConfig,
    cfg_bool,
    cfg_float,
    cfg_ids,
    cfg_int,
    heads_split,
)
from .base import Family, TensorMap, llama_tensor_names

NAME = "llada"
MASK_ID = 126336  # LLaDA's <|mdm_mask|>
EOS_ID = 126081


def parse(cfg: Mapping[str, Any], name: str = "") -> ModelConfig:
    d = cfg_int(cfg, "d_model")
    n_heads = cfg_int(cfg, "n_heads")
    head_dim = heads_split(d, n_heads, "d_model", "n_heads")
    n_kv = cfg_int(cfg, "n_kv_heads", default=n_heads) if cfg.get("n_kv_heads") else n_heads
    if cfg_bool(cfg, "multi_query_attention"):
        n_kv = 1
    vocab = cfg_int(cfg, "embedding_size", "vocab_size")
    if cfg.get("mlp_hidden_size"):
        mlp = cfg_int(cfg, "mlp_hidden_size")
    else:
        ratio = cfg_float(cfg, "mlp_ratio", 4)
        mlp = int(ratio * d)
        if not 1 <= mlp <= MAX_DIM:
            raise CheckpointError(f"config.json: mlp_ratio {ratio} gives an MLP width of {mlp}")
    if cfg.get("block_type", "llama") not in ("llama", "sequential"):
        raise CheckpointError(f"config.json: block_type {cfg.get('block_type')!r} is not supported (llama only)")
    if cfg_bool(cfg, "alibi"):
        raise CheckpointError("config.json: alibi position encoding is not supported (rope only)")
    include_bias = cfg_bool(cfg, "include_bias")
    return ModelConfig(
        arch=NAME, n_layers=cfg_int(cfg, "n_layers", hi=MAX_LAYERS), hidden_size=d, n_heads=n_heads,
        n_kv_heads=n_kv, head_dim=head_dim, intermediate_size=mlp, vocab_size=vocab,
        rope_theta=cfg_float(cfg, "rope_theta", 10000.0), rms_norm_eps=cfg_float(cfg, "rms_norm_eps", 1e-5),
        mask_token_id=cfg_int(cfg, "mask_token_id", default=MASK_ID, lo=0, hi=1 << 31),
        eos_token_ids=cfg_ids(cfg, "eos_token_id", EOS_ID), pad_token_id=cfg.get("pad_token_id"),
        tie_word_embeddings=cfg_bool(cfg, "weight_tying"),
        qkv_bias=include_bias or cfg_bool(cfg, "include_qkv_bias"), o_bias=include_bias, mlp_bias=include_bias,
        max_position_embeddings=cfg_int(cfg, "max_sequence_length", default=4096, hi=MAX_POSITIONS),
        logit_shift=0, torch_dtype=cfg.get("torch_dtype"), name=name)


def tensor_names(cfg: ModelConfig) -> TensorMap:
    p = "model.transformer."
    return llama_tensor_names(
        cfg, embed=p + "wte.weight", norm=p + "ln_f.weight", lm_head=p + "ff_out.weight", block=p + "blocks.{i}.",
        parts={"attn_norm": "attn_norm", "q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj",
               "o_proj": "attn_out", "ffn_norm": "ff_norm", "gate_proj": "ff_proj", "up_proj": "up_proj",
               "down_proj": "ff_out"})


FAMILY = Family(name=NAME, architectures=("LLaDAModelLM", "LLaDAModel"), model_types=("llada",), parse=parse,
                tensor_names=tensor_names, decoding=FamilyDecoding(NAME), marker_keys=("d_model",),
                mask_token_id=MASK_ID, eos_token_ids=(EOS_ID,))
