"""LLaDA-MoE (inclusionAI/LLaDA-MoE-7B-A1B-Base, -Instruct): masked diffusion with a
mixture-of-experts FFN, in the ``LLaDAMoEModelLM`` format.

Recognised by ``architectures`` (its config.json shares ``model_type`` "llada" with dense
LLaDA, whose keys it does not have). config.json uses OLMoE-style keys: ``hidden_size``,
``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``, ``num_experts``,
``num_experts_per_tok``, ``expert_intermediate_size``, ``dense_intermediate_size`` (layers whose
``moe_layer_freq`` entry is 0), ``shared_expert_intermediate_size`` (null: none),
``qk_layernorm``, ``moe_router_enable_expert_bias``, ``attention_bias``, ``rope_theta``.

The forward, as the published modeling file computes it: pre-norm layers; attention with an
RMSNorm over each head's q and k (``q_norm``/``k_norm``, weights [head_dim]) before RoPE
(rotate-half, full head dim), bidirectional; the FFN scores experts with a bias-free linear
router, softmax in float32 (plus the expert bias when enabled), keeps the top-k probabilities
as they are (the published block fixes ``norm_topk_prob`` to False, whatever config.json says,
and applies no routed scaling factor), and sums those experts' SwiGLU outputs weighted by them;
a shared expert, when configured, is added for every token. No logit shift. The mask token
(<|mask|>) is not in config.json: it is read from the tokenizer, as the dllm pipeline reads it
(models/special_ids.py; 156895, the model card's generate's, only when nothing names it). Decoding: LLaDA's
low-confidence remasking on its per-block schedule (the model card's generate).

Tensors: ``model.embed_tokens``, ``model.layers.{i}.self_attn.{q,k,v,o}_proj`` (+ ``q_norm``,
``k_norm``), ``input_layernorm``, ``post_attention_layernorm``, ``mlp.gate`` (router),
``mlp.experts.{e}.{gate,up,down}_proj`` (``mlp.expert_bias`` when enabled), dense layers'
``mlp.{gate,up,down}_proj``, ``shared_expert.{gate,up,down}_proj``, ``model.norm``, ``lm_head``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from ...decoding.plan import FamilyDecoding
from ..spec import (
    MAX_LAYERS,
    MAX_POSITIONS,
    CheckpointError,
    ModelConfig,
    MoESpec,
    cfg_bool,
    cfg_float,
    cfg_ids,
    cfg_int,
    heads_split,
)
from .base import Family, TensorMap, llama_tensor_names

log = logging.getLogger(__name__)

NAME = "llada_moe"
# the model card's generate(mask_id=156895) and <|endoftext|>: the last fallback when config.json,
# generation_config.json and the tokenizer (its <|mask|>) name none (models/special_ids.py)
MASK_ID = 156895  # <|mask|>
EOS_ID = 156892  # <|endoftext|>
END_OF_TURN = ("<|role_end|>", "<|endoftext|>")
# the Instruct model's chat format (<role>HUMAN</role>...<|role_end|><role>ASSISTANT</role>), for a
# tokenizer that ships no template
CHAT_TEMPLATE = (
    "{% for m in messages %}<role>{% if m['role'] == 'user' %}HUMAN{% else %}{{ m['role'] | upper }}{% endif %}"
    "</role>{{ m['content'] }}<|role_end|>{% endfor %}{% if add_generation_prompt %}<role>ASSISTANT</role>{% endif %}")


def _moe_layers(cfg: Mapping[str, Any], n_layers: int) -> tuple[bool, ...]:
    """``moe_layer_freq``: per layer 1 (MoE) or 0 (dense); absent: every layer MoE."""
    v = cfg.get("moe_layer_freq")
    if v is None or v == []:
        return (True,) * n_layers
    if not isinstance(v, list) or len(v) != n_layers or any(x not in (0, 1) or isinstance(x, float) for x in v):
        raise CheckpointError(f"config.json: moe_layer_freq must be a list of {n_layers} entries, each 0 (dense) or "
                              f"1 (MoE), got {v!r}")
    return tuple(bool(x) for x in v)


def _refuse_unsupported(cfg: Mapping[str, Any]) -> None:
    """Settings the published forward would apply and this runtime does not: refused, never ignored."""
    if cfg.get("clip_qkv") is not None:
        raise CheckpointError(f"config.json: clip_qkv {cfg['clip_qkv']!r} is not supported (null only)")
    if cfg.get("rope_scaling") is not None:
        raise CheckpointError(f"config.json: rope_scaling {cfg['rope_scaling']!r} is not supported (plain RoPE only)")
    prf = cfg.get("partial_rotary_factor")
    if prf is not None and prf != -1 and prf != 1:
        raise CheckpointError(f"config.json: partial_rotary_factor {prf!r} is not supported (1: the whole head)")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"config.json: hidden_act {act!r} is not supported (silu only)")
    if cfg_bool(cfg, "tie_word_embeddings"):
        raise CheckpointError("config.json: tie_word_embeddings is not supported for LLaDA-MoE (it has an lm_head)")


def parse(cfg: Mapping[str, Any], name: str = "") -> ModelConfig:
    _refuse_unsupported(cfg)
    d = cfg_int(cfg, "hidden_size")
    n_heads = cfg_int(cfg, "num_attention_heads")
    head_dim = heads_split(d, n_heads, "hidden_size", "num_attention_heads")
    n_kv = cfg_int(cfg, "num_key_value_heads") if cfg.get("num_key_value_heads") else n_heads
    L = cfg_int(cfg, "num_hidden_layers", hi=MAX_LAYERS)
    layers = _moe_layers(cfg, L)
    n_experts = cfg_int(cfg, "num_experts")
    shared = cfg.get("shared_expert_intermediate_size")
    if shared is not None and shared != -1:
        shared = cfg_int(cfg, "shared_expert_intermediate_size")
    else:
        shared = None
    if cfg.get("norm_topk_prob"):
        # the published sparse block sets norm_topk_prob = False in its constructor
        log.warning("config.json: norm_topk_prob is true, but the published LLaDA-MoE forward never renormalises "
                    "the top-k router weights; neither does this server")
    score = cfg.get("moe_router_score_function")
    if score not in (None, "softmax"):
        # the published sparse block always applies softmax, whatever this names
        log.warning("config.json: moe_router_score_function %r; the published LLaDA-MoE forward scores experts "
                    "with softmax regardless, and so does this server", score)
    moe = MoESpec(n_experts=n_experts, top_k=cfg_int(cfg, "num_experts_per_tok"),
                  expert_size=cfg_int(cfg, "expert_intermediate_size"), layers=layers, norm_topk_prob=False,
                  expert_bias=cfg_bool(cfg, "moe_router_enable_expert_bias"), shared_expert_size=shared)
    # the dense FFN width, used only by dense layers (moe_layer_freq 0)
    dense = cfg_int(cfg, "dense_intermediate_size") if not all(layers) else \
        cfg_int(cfg, "dense_intermediate_size", default=moe.expert_size)
    bias = cfg_bool(cfg, "attention_bias")
    return ModelConfig(
        arch=NAME, n_layers=L, hidden_size=d, n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim,
        intermediate_size=dense, vocab_size=cfg_int(cfg, "vocab_size"),
        rope_theta=cfg_float(cfg, "rope_theta", 10000.0), rms_norm_eps=cfg_float(cfg, "rms_norm_eps", 1e-5),
        mask_token_id=cfg_int(cfg, "mask_token_id", default=MASK_ID, lo=0, hi=1 << 31),
        eos_token_ids=cfg_ids(cfg, "eos_token_id", EOS_ID), pad_token_id=cfg.get("pad_token_id"),
        tie_word_embeddings=False, qkv_bias=bias, o_bias=bias, mlp_bias=False,
        max_position_embeddings=cfg_int(cfg, "max_position_embeddings", default=4096, hi=MAX_POSITIONS),
        logit_shift=0, torch_dtype=cfg.get("torch_dtype"), name=name,
        qk_norm=cfg_bool(cfg, "qk_layernorm"), moe=moe)


_DENSE_PARTS = {"attn_norm": "input_layernorm", "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj",
                "v_proj": "self_attn.v_proj", "o_proj": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
                "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj", "down_proj": "mlp.down_proj"}
_SWIGLU = ("gate_proj", "up_proj", "down_proj")


def tensor_names(cfg: ModelConfig) -> TensorMap:
    """The dense parts (attention, norms, dense layers' FFN) by the Llama-style map; then each MoE
    layer's router, experts (runtime ``layers.{i}.experts.{e}.*``), expert bias and shared
    expert in place of the dense FFN; QK-norm weights."""
    moe = cfg.moe
    assert moe is not None
    dense = llama_tensor_names(cfg, embed="model.embed_tokens.weight", norm="model.norm.weight",
                               lm_head="lm_head.weight", block="model.layers.{i}.", parts=_DENSE_PARTS)
    d, hd, E, F = cfg.hidden_size, cfg.head_dim, moe.n_experts, moe.expert_size
    swiglu = {"gate_proj": lambda w: (w, d), "up_proj": lambda w: (w, d), "down_proj": lambda w: (d, w)}
    out: TensorMap = {}
    for ours, v in dense.items():
        if not ours.startswith("layers."):
            out[ours] = v
    for i in range(cfg.n_layers):
        pre, ck = f"layers.{i}.", f"model.layers.{i}."
        for ours, v in dense.items():
            if not ours.startswith(pre):
                continue
            if cfg.is_moe_layer(i) and ours.split(".")[2] in _SWIGLU:
                continue  # a MoE layer has no dense FFN
            out[ours] = v
        if cfg.qk_norm:
            out[pre + "q_norm.weight"] = (ck + "self_attn.q_norm.weight", (hd,))
            out[pre + "k_norm.weight"] = (ck + "self_attn.k_norm.weight", (hd,))
        if not cfg.is_moe_layer(i):
            continue
        out[pre + "router.weight"] = (ck + "mlp.gate.weight", (E, d))
        if moe.expert_bias:
            out[pre + "expert_bias"] = (ck + "mlp.expert_bias", (E,))
        for e in range(E):
            for part in _SWIGLU:
                out[f"{pre}experts.{e}.{part}.weight"] = (f"{ck}mlp.experts.{e}.{part}.weight", swiglu[part](F))
        if moe.shared_expert_size is not None:
            for part in _SWIGLU:
                out[f"{pre}shared_expert.{part}.weight"] = (f"{ck}shared_expert.{part}.weight",
                                                            swiglu[part](moe.shared_expert_size))
    return out


FAMILY = Family(name=NAME, architectures=("LLaDAMoEModelLM", "LLaDAMoEModel"), model_types=("llada",), parse=parse,
                tensor_names=tensor_names, decoding=FamilyDecoding(NAME), marker_keys=("num_experts",),
                chat_template=CHAT_TEMPLATE, end_of_turn=END_OF_TURN, mask_token_id=MASK_ID,
                eos_token_ids=(EOS_ID,))
