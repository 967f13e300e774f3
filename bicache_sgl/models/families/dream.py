"""Dream (Dream-org/Dream-v0-Base-7B, -Instruct-7B; apple/DiffuCoder): the Qwen2-derived
``DreamModel`` format.

config.json uses Qwen2's keys (``hidden_size``, ``num_hidden_layers``, ``num_key_value_heads``,
``head_dim``); tensors are Qwen2's (``model.layers.{i}.self_attn.q_proj`` with q/k/v biases,
``mlp.gate_proj``, ``lm_head``). Bidirectional attention, dense SwiGLU, GQA, and shifted logits:
the output at position i - 1 predicts token i. Decoding: any algorithm, Dream's own
(``diffusion_generate``'s ``alg``) from the checkpoint's generation_config.json.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...decoding.plan import FamilyDecoding
from ..spec import MAX_LAYERS, MAX_POSITIONS, ModelConfig, cfg_bool, cfg_float, cfg_ids, cfg_int, heads_split
from .base import Family, TensorMap, llama_tensor_names

NAME = "dream"
MASK_ID = 151666  # Dream's <|mask|>
EOS_ID = 151643


def parse(cfg: Mapping[str, Any], name: str = "") -> ModelConfig:
    d = cfg_int(cfg, "hidden_size")
    n_heads = cfg_int(cfg, "num_attention_heads")
    if cfg.get("head_dim") is not None:
        head_dim = cfg_int(cfg, "head_dim")
    else:
        head_dim = heads_split(d, n_heads, "hidden_size", "num_attention_heads")
    n_kv = cfg_int(cfg, "num_key_value_heads") if cfg.get("num_key_value_heads") else n_heads
    return ModelConfig(
        arch=NAME, n_layers=cfg_int(cfg, "num_hidden_layers", hi=MAX_LAYERS), hidden_size=d, n_heads=n_heads,
        n_kv_heads=n_kv, head_dim=head_dim, intermediate_size=cfg_int(cfg, "intermediate_size"),
        vocab_size=cfg_int(cfg, "vocab_size"), rope_theta=cfg_float(cfg, "rope_theta", 10000.0),
        rms_norm_eps=cfg_float(cfg, "rms_norm_eps", 1e-6),
        mask_token_id=cfg_int(cfg, "mask_token_id", default=MASK_ID, lo=0, hi=1 << 31),
        eos_token_ids=cfg_ids(cfg, "eos_token_id", EOS_ID), pad_token_id=cfg.get("pad_token_id"),
        tie_word_embeddings=cfg_bool(cfg, "tie_word_embeddings"), qkv_bias=True, o_bias=False,
        mlp_bias=False, max_position_embeddings=cfg_int(cfg, "max_position_embeddings", default=32768,
                                                        hi=MAX_POSITIONS),
        logit_shift=1, torch_dtype=cfg.get("torch_dtype"), name=name)


def tensor_names(cfg: ModelConfig) -> TensorMap:
    return llama_tensor_names(
        cfg, embed="model.embed_tokens.weight", norm="model.norm.weight", lm_head="lm_head.weight",
        block="model.layers.{i}.",
        parts={"attn_norm": "input_layernorm", "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj",
               "v_proj": "self_attn.v_proj", "o_proj": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
               "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj", "down_proj": "mlp.down_proj"})


# Without a generation_config.json "alg" a Dream request runs low_confidence, as before the
# registry (kept so that no request changes; the checkpoint's own alg wins when it ships one).
FAMILY = Family(name=NAME, architectures=("DreamModel", "DreamForMaskedLM"), model_types=("dream",), parse=parse,
                tensor_names=tensor_names, decoding=FamilyDecoding(NAME), marker_keys=("hidden_size",),
                mask_token_id=MASK_ID, eos_token_ids=(EOS_ID,))
