"""The memory sizing an engine would use on this device (``engine.builder.plan_for``, the sizing
call every engine stack makes, under the default ``EngineConfig``), for the bundled
model and for LLaDA-8B- and LLaDA-MoE-7B-A1B-shaped configs built in memory (no weights are read
or allocated; a MoE's weights count every expert, all of which are resident).

On CUDA the engine sizes its pools from the memory free after loading the weights; here the
weights are not loaded, so their bytes (from the checkpoint's tensor shapes) are taken off what
is free now. On the CPU the pools have fixed budgets (``CPU_POOL_BYTES``, ``CPU_REQUEST_BYTES``).
"""

from __future__ import annotations

import math
import os

import torch

from ..bicache.policy import make_policy
from ..bicache.profile import find_profile
from ..config import EngineConfig
from ..engine.builder import plan_for
from ..kv_cache.memory import MemoryPlan, itemsize
from ..models.config import ModelConfig, parse_model_config
from ..models.loader import load_model_config, pick_dtype
from ..models.weights import checkpoint_names
from .report import FAIL, INFO, Row

SECTION = "memory"
MiB, GiB = 1 << 20, 1 << 30

# LLaDA-8B-Instruct's shape (GSAI-ML/LLaDA-8B-Instruct config.json): 32 layers, hidden 4096, 32
# heads without GQA, SwiGLU 12288, vocabulary 126464, bf16 weights
LLADA_8B_CONFIG = {
    "architectures": ["LLaDAModelLM"], "model_type": "llada", "d_model": 4096, "n_layers": 32, "n_heads": 32,
    "n_kv_heads": 32, "mlp_hidden_size": 12288, "vocab_size": 126464, "embedding_size": 126464,
    "max_sequence_length": 4096, "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "mask_token_id": 126336,
    "eos_token_id": 126081, "pad_token_id": 126081, "weight_tying": False, "include_bias": False,
    "include_qkv_bias": False, "torch_dtype": "bfloat16",
}

# LLaDA-MoE-7B-A1B's shape (inclusionAI/LLaDA-MoE-7B-A1B-Instruct config.json): 16 layers, hidden
# 2048, 16 heads without GQA, 64 SwiGLU experts of 1024 per layer (top-8), vocabulary 157184, bf16:
# 7.36B parameters, of which the experts are 6.4B
LLADA_MOE_7B_CONFIG = {
    "architectures": ["LLaDAMoEModelLM"], "model_type": "llada", "hidden_size": 2048, "num_hidden_layers": 16,
    "num_attention_heads": 16, "num_key_value_heads": 16, "dense_intermediate_size": 8192,
    "expert_intermediate_size": 1024, "shared_expert_intermediate_size": None, "num_experts": 64,
    "num_experts_per_tok": 8, "moe_layer_freq": [1] * 16, "qk_layernorm": True, "attention_bias": False,
    "rope_theta": 50000, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "vocab_size": 157184,
    "tie_word_embeddings": False, "eos_token_id": 156892, "pad_token_id": 156892, "torch_dtype": "bfloat16",
}


def weight_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of the model's parameters in ``dtype`` (from the checkpoint's tensor shapes)."""
    return sum(math.prod(shape) for _, shape in checkpoint_names(cfg).values()) * itemsize(dtype)


def engine_plan(cfg: ModelConfig, device: torch.device, max_depth: int, *, free_bytes: int | None = None,
                engine: EngineConfig | None = None) -> tuple[torch.dtype, MemoryPlan]:
    """(dtype, plan) as ``Engine`` computes them for this model with ``engine``'s flags (default
    flags when None); ``free_bytes`` is CUDA's free memory once the weights are loaded."""
    ec = engine or EngineConfig()
    dtype = pick_dtype(ec.dtype, cfg, device)
    return dtype, plan_for(ec, cfg, dtype, device, max_depth, free_bytes=free_bytes)


def _device_memory(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes: CUDA's, or the host's physical memory for the CPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    return avail, total


def memory_row(label: str, cfg: ModelConfig, device: torch.device, max_depth: int, depth_note: str) -> Row:
    """One model's sizing on ``device``; FAIL only when the weights fit but the pools, as sized,
    would not (a sizing bug), INFO otherwise (a model too large for the device is a fact)."""
    free, total = _device_memory(device)
    dtype = pick_dtype(EngineConfig().dtype, cfg, device)
    weights = weight_bytes(cfg, dtype)
    name = f"sizing: {label}"
    if device.type == "cuda" and weights >= free:
        return Row(SECTION, name, INFO, f"{str(dtype).removeprefix('torch.')} weights {weights / GiB:.1f} GiB do not "
                                        f"fit the {free / GiB:.1f} GiB free of {total / GiB:.1f} GiB")
    after = free - weights if device.type == "cuda" else None
    dtype, plan = engine_plan(cfg, device, max_depth, free_bytes=after)
    used = weights + plan.pool_bytes + plan.request_bytes
    full = plan.pool_rows // max(1, max_depth)
    detail = (f"{str(dtype).removeprefix('torch.')} weights {weights / MiB:,.1f} MiB; {depth_note}: prefix pool "
              f"{plan.pool_rows:,} layer-tokens = {full:,} tokens at depth {max_depth} ({plan.pool_bytes / MiB:,.1f} "
              f"MiB, {plan.pool_bytes_per_row:,} B each; {plan.pool_tokens:,} token slots); request K/V "
              f"{plan.request_tokens:,} tokens ({plan.request_bytes / MiB:,.1f} MiB, {plan.request_bytes_per_token:,} "
              f"B/token); {used / GiB:.2f} of {total / GiB:.1f} GiB {'free' if device.type == 'cuda' else 'host RAM'}")
    if device.type == "cuda" and used > free:
        return Row(SECTION, name, FAIL, detail + f" exceeds the {free / GiB:.1f} GiB free")
    if used > total:  # the CPU's budgets are fixed; the weights alone may not fit this host
        detail += " (more than this host has)"
    return Row(SECTION, name, INFO, detail)


def memory_rows(bundled_path: str, device: torch.device) -> list[Row]:
    """The bundled model at its default policy's node depth, LLaDA-8B and LLaDA-MoE-7B-A1B at full
    depth (the most any profile can allow: every layer of every cached token)."""
    cfg = load_model_config(bundled_path)
    ec = EngineConfig()
    policy = make_policy(ec.prefix_cache, cfg.n_layers, find_profile(bundled_path, None, cfg.n_layers))
    depth = policy.max_node_depth
    big = parse_model_config(LLADA_8B_CONFIG, "LLaDA-8B shape")
    from .block_sizing import block_memory_rows
    moe = parse_model_config(LLADA_MOE_7B_CONFIG, "LLaDA-MoE-7B-A1B shape")
    return [memory_row("bundled model", cfg, device, depth, f"{ec.prefix_cache} nodes hold <= {depth} layers"),
            memory_row("LLaDA-8B shape (no weights)", big, device, big.n_layers, f"full depth {big.n_layers}"),
            memory_row("LLaDA-MoE-7B-A1B shape (no weights)", moe, device, moe.n_layers,
                       f"full depth {moe.n_layers}"),
            *block_memory_rows(device)]
