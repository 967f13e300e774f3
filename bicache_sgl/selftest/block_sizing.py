"""Sizing rows of the block-diffusion families (LLaDA2.0-mini, SDAR-8B shapes, no weights read):
weight bytes from the published tensor shapes (every expert counted), the K/V bytes per token
(every layer), the server's default K/V budget on this device (running windows + exact block
cache: blockdiff/budget.py, the same call the engine makes once its weights are loaded) and the
4k-token requests it holds."""

from __future__ import annotations

import math

import torch

from ..blockdiff.budget import block_kv_budget
from ..config import EngineConfig
from ..models.block_config import block_checkpoint_names, parse_block_config
from .report import INFO, Row

SECTION = "memory"
GiB, MiB = 1 << 30, 1 << 20

# inclusionAI/LLaDA2.0-mini config.json (docs/block_diffusion.md): 20 layers, hidden 2048, 16 heads
# / 4 KV heads x 128, 256 experts (8 routed + 1 shared, 512 wide), first layer dense (5120)
LLADA2_MINI_CONFIG = {
    "architectures": ["LLaDA2MoeModelLM"], "model_type": "llada2_moe", "hidden_size": 2048, "num_hidden_layers": 20,
    "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 5120,
    "moe_intermediate_size": 512, "num_experts": 256, "num_experts_per_tok": 8, "num_shared_experts": 1,
    "n_group": 8, "topk_group": 4, "first_k_dense_replace": 1, "routed_scaling_factor": 2.5,
    "score_function": "sigmoid", "moe_router_enable_expert_bias": True, "norm_topk_prob": True,
    "partial_rotary_factor": 0.5, "rope_theta": 600000, "rms_norm_eps": 1e-6, "use_qk_norm": True,
    "use_qkv_bias": False, "use_bias": False, "vocab_size": 157184, "max_position_embeddings": 32768,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}
# SDAR-8B (Qwen3-8B dimensions): 36 layers, hidden 4096, 32 heads / 8 KV heads x 128, SwiGLU 12288
SDAR_8B_CONFIG = {
    "architectures": ["SDARForCausalLM"], "model_type": "sdar", "hidden_size": 4096, "num_hidden_layers": 36,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 12288,
    "vocab_size": 151936, "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "attention_bias": False, "torch_dtype": "bfloat16",
}
REQUEST_TOKENS = 4096


def block_memory_row(label: str, config: dict, device: torch.device) -> Row:
    cfg = parse_block_config(config, label)
    elem = 4 if device.type == "cpu" else 2  # the block engine's auto dtype: fp32 on CPU, bf16 elsewhere
    weights = sum(math.prod(s) for _, s in block_checkpoint_names(cfg).values()) * elem
    active = weights
    if cfg.num_experts:
        per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size * elem
        n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.n_layers))
        active = weights - n_moe * (cfg.num_experts - cfg.num_experts_per_tok) * per_expert
    kv_token = 2 * cfg.n_layers * cfg.kv_dim * elem
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
        after = max(0, free - weights)  # what the engine would see once the weights are loaded
    else:
        import os
        free = after = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    budget = block_kv_budget(EngineConfig(), cfg, torch.float32 if elem == 4 else torch.bfloat16, device,
                             cfg.max_position_embeddings, free_bytes=after)
    fits = budget.tokens // REQUEST_TOKENS
    detail = (f"{'fp32' if elem == 4 else 'bf16'} weights {weights / GiB:,.2f} GiB ({active / GiB:,.2f} GiB active per "
              f"token); K/V {kv_token:,} B/token ({cfg.n_layers} layers); default K/V budget (running windows + "
              f"exact block cache) {budget.tokens:,} tokens ({budget.tokens * kv_token / GiB:,.1f} GiB of the "
              f"{free / GiB:.1f} GiB {'free' if device.type == 'cuda' else 'of host RAM'}): {fits:,} requests of "
              f"{REQUEST_TOKENS} tokens at once")
    return Row(SECTION, f"sizing: {label} (no weights)", INFO, detail)


def block_memory_rows(device: torch.device) -> list[Row]:
    return [block_memory_row("LLaDA2.0-mini shape", LLADA2_MINI_CONFIG, device),
            block_memory_row("SDAR-8B shape", SDAR_8B_CONFIG, device)]
