"""Tiny random checkpoints in the real LLaDA2 (LLaDA2MoeModelLM) and SDAR (SDARForCausalLM)
formats: config.json with the published keys, safetensors with the published tensor names
(experts one by one, LLaDA2's fused query_key_value, SDAR's separate q/k/v and q_norm/k_norm),
and the byte-level Hugging Face tokenizer of ``bicache_sgl.testing``.

The router weights are drawn wider than the rest and the expert bias is non-zero, so tokens
really route to different experts (the tests assert it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..models.block_config import block_checkpoint_names, parse_block_config
from . import SPECIAL_TOKENS, _published_ids, _random_tensors, _save_tensors, _start_folder


def _finish(folder: Path, cfg: dict[str, Any], block_length: int, seed: int, std: float, shards: int,
            published_ids: bool = False) -> str:
    """Write config.json (``published_ids``: without ``mask_token_id``, as published),
    generation_config.json (``block_length``) and the random weights."""
    (folder / "config.json").write_text(json.dumps(_published_ids(cfg) if published_ids else cfg, indent=1))
    (folder / "generation_config.json").write_text(json.dumps({"block_length": block_length}))
    # the router is drawn wider (spread scores, varied routing) and the expert bias non-zero
    tensors = _random_tensors(block_checkpoint_names(parse_block_config(cfg)), seed, std,
                              stds={"expert_bias": 0.1, "gate.weight": 0.5})
    weight_map = _save_tensors(folder, tensors, shards)
    if weight_map is not None:
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return str(folder)


def make_tiny_llada2(folder: str | Path, *, n_layers: int = 3, hidden_size: int = 64, n_heads: int = 4,
                     n_kv_heads: int = 2, head_dim: int = 16, num_experts: int = 8, experts_per_tok: int = 2,
                     n_group: int = 4, topk_group: int = 2, num_shared_experts: int = 1,
                     moe_intermediate_size: int = 32, intermediate_size: int = 128, first_k_dense_replace: int = 1,
                     partial_rotary_factor: float = 0.5, score_function: str = "sigmoid", block_length: int = 4,
                     eos_token_id: int | None = None, seed: int = 0, std: float = 0.08, shards: int = 1,
                     published_ids: bool = False, special: tuple[str, ...] = tuple(SPECIAL_TOKENS),
                     mask_token: str = "<|mask|>") -> str:
    """A random LLaDA2 checkpoint (LLaDA2.0-mini's config keys and tensor names at tiny sizes).
    ``block_length`` is not a config.json key of the real checkpoints: it is written to
    ``generation_config.json`` here (the loader takes the block length from the caller).
    ``published_ids``: config.json names no mask id (as published; the tokenizer's <|mask|> /
    ``mask_token`` does); ``special``: the tokenizer's added tokens in id order (the first is
    EOS and pad), ``mask_token`` the one it declares as its mask."""
    folder, special, vocab = _start_folder(folder, special, mask_token=mask_token)
    cfg = {
        "architectures": ["LLaDA2MoeModelLM"], "model_type": "llada2_moe", "hidden_act": "silu",
        "hidden_size": hidden_size, "intermediate_size": intermediate_size, "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads, "num_key_value_heads": n_kv_heads, "head_dim": head_dim,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 600000,
        "partial_rotary_factor": partial_rotary_factor, "use_qk_norm": True, "use_qkv_bias": False,
        "use_bias": False, "norm_head": False, "tie_word_embeddings": False, "vocab_size": vocab,
        "num_experts": num_experts, "num_experts_per_tok": experts_per_tok, "n_group": n_group,
        "topk_group": topk_group, "num_shared_experts": num_shared_experts,
        "moe_intermediate_size": moe_intermediate_size, "first_k_dense_replace": first_k_dense_replace,
        "routed_scaling_factor": 2.5, "score_function": score_function,
        "moe_router_enable_expert_bias": score_function == "sigmoid", "norm_topk_prob": True,
        "mask_token_id": special[mask_token],
        "eos_token_id": next(iter(special.values())) if eos_token_id is None else eos_token_id,
        "pad_token_id": next(iter(special.values())), "torch_dtype": "float32",
    }
    return _finish(folder, cfg, block_length, seed, std, shards, published_ids)


def make_tiny_sdar(folder: str | Path, *, n_layers: int = 3, hidden_size: int = 64, n_heads: int = 4,
                   n_kv_heads: int = 2, head_dim: int = 16, intermediate_size: int = 128, block_length: int = 4,
                   eos_token_id: int | None = None, seed: int = 0, std: float = 0.08, shards: int = 1,
                   published_ids: bool = False, special: tuple[str, ...] = tuple(SPECIAL_TOKENS),
                   mask_token: str = "<|mask|>") -> str:
    """A random SDAR checkpoint (SDARForCausalLM: Qwen3-style names, q_norm / k_norm, GQA);
    ``published_ids``, ``special``, ``mask_token``: as :func:`make_tiny_llada2` (SDAR's own
    tokenizer declares ``<|MASK|>``)."""
    folder, special, vocab = _start_folder(folder, special, mask_token=mask_token)
    cfg = {
        "architectures": ["SDARForCausalLM"], "model_type": "sdar", "hidden_act": "silu",
        "hidden_size": hidden_size, "intermediate_size": intermediate_size, "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads, "num_key_value_heads": n_kv_heads, "head_dim": head_dim,
        "attention_bias": False, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "tie_word_embeddings": False, "vocab_size": vocab, "mask_token_id": special[mask_token],
        "eos_token_id": next(iter(special.values())) if eos_token_id is None else eos_token_id,
        "pad_token_id": next(iter(special.values())), "torch_dtype": "float32",
    }
    return _finish(folder, cfg, block_length, seed, std, shards, published_ids)
