"""Shared by the block-diffusion families (llada2.py, sdar.py): their registry view.

Their checkpoints are parsed by ``models/block_config.py`` (the full configuration the
block-diffusion runtime needs: partial rotary, grouped sigmoid routing, routed scaling, the
published block decoding defaults); the registry keeps the architecture-neutral
:class:`ModelConfig` of it, with ``attention="block_causal"`` (the bidirectional runtime refuses
such a config: ``models/loader.load_model``) and the expert counts for memory sizing. Their prefix
reuse is ``"exact"``: whole shared blocks at full depth, no profile (docs/prefix_cache.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..block_config import BlockModelConfig, block_checkpoint_names, parse_block_config
from ..spec import ModelConfig, MoESpec
from .base import TensorMap


def as_model_config(b: BlockModelConfig) -> ModelConfig:
    moe = None
    if b.num_experts:
        moe = MoESpec(n_experts=b.num_experts, top_k=b.num_experts_per_tok, expert_size=b.moe_intermediate_size,
                      layers=tuple(b.is_moe_layer(i) for i in range(b.n_layers)), norm_topk_prob=b.norm_topk_prob,
                      expert_bias=b.expert_bias,
                      shared_expert_size=b.shared_intermediate_size * b.num_shared_experts
                      if b.num_shared_experts else None)
    return ModelConfig(
        arch=b.family, n_layers=b.n_layers, hidden_size=b.hidden_size, n_heads=b.n_heads, n_kv_heads=b.n_kv_heads,
        head_dim=b.head_dim, intermediate_size=b.intermediate_size, vocab_size=b.vocab_size, rope_theta=b.rope_theta,
        rms_norm_eps=b.rms_norm_eps, mask_token_id=b.mask_token_id, eos_token_ids=b.eos_token_ids,
        pad_token_id=b.pad_token_id, tie_word_embeddings=b.tie_word_embeddings, qkv_bias=b.qkv_bias, o_bias=b.o_bias,
        mlp_bias=False, max_position_embeddings=b.max_position_embeddings, logit_shift=0, torch_dtype=b.torch_dtype,
        name=b.name, attention="block_causal", qk_norm=b.qk_norm, moe=moe)


def parse(cfg: Mapping[str, Any], name: str = "") -> ModelConfig:
    return as_model_config(parse_block_config(cfg, name))


def tensor_names(cfg: ModelConfig) -> TensorMap:
    """The checkpoint's tensor names (experts one by one, as published), from the registry view:
    the names depend only on the family, the sizes, QK-norm, biases and the expert layout."""
    moe = cfg.moe
    first_moe = moe.layers.index(True) if moe is not None and True in moe.layers else 0
    b = BlockModelConfig(
        family=cfg.arch, n_layers=cfg.n_layers, hidden_size=cfg.hidden_size, n_heads=cfg.n_heads,
        n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, intermediate_size=cfg.intermediate_size,
        vocab_size=cfg.vocab_size, rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_norm_eps,
        rotary_dim=cfg.head_dim, qk_norm=cfg.qk_norm, qkv_bias=cfg.qkv_bias, o_bias=cfg.o_bias,
        tie_word_embeddings=cfg.tie_word_embeddings, max_position_embeddings=cfg.max_position_embeddings,
        mask_token_id=cfg.mask_token_id, eos_token_ids=cfg.eos_token_ids, pad_token_id=cfg.pad_token_id,
        num_experts=moe.n_experts if moe else 0, num_experts_per_tok=moe.top_k if moe else 0,
        num_shared_experts=1 if moe and moe.shared_expert_size else 0,
        moe_intermediate_size=moe.expert_size if moe else 0,
        shared_intermediate_size=(moe.shared_expert_size or 0) if moe else 0, first_k_dense_replace=first_moe,
        expert_bias=bool(moe and moe.expert_bias))
    return block_checkpoint_names(b)
