"""Checkpoint-name -> runtime-name maps for each architecture, and the expected tensor shapes."""

from __future__ import annotations

from .config import ModelConfig


def checkpoint_names(cfg: ModelConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """runtime parameter name -> (checkpoint tensor name, expected shape)."""
    d, kv, ff, V = cfg.hidden_size, cfg.kv_dim, cfg.intermediate_size, cfg.vocab_size
    qd = cfg.n_heads * cfg.head_dim
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    if cfg.arch == "llada":
        p = "model.transformer."
        out["embed.weight"] = (p + "wte.weight", (V, d))
        out["norm.weight"] = (p + "ln_f.weight", (d,))
        if not cfg.tie_word_embeddings:
            out["lm_head.weight"] = (p + "ff_out.weight", (V, d))
        names = {"attn_norm": "attn_norm", "q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj",
                 "o_proj": "attn_out", "ffn_norm": "ff_norm", "gate_proj": "ff_proj", "up_proj": "up_proj",
                 "down_proj": "ff_out"}
        blk = p + "blocks.{i}."
    else:
        out["embed.weight"] = ("model.embed_tokens.weight", (V, d))
        out["norm.weight"] = ("model.norm.weight", (d,))
        if not cfg.tie_word_embeddings:
            out["lm_head.weight"] = ("lm_head.weight", (V, d))
        names = {"attn_norm": "input_layernorm", "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj",
                 "v_proj": "self_attn.v_proj", "o_proj": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
                 "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj", "down_proj": "mlp.down_proj"}
        blk = "model.layers.{i}."
    shapes = {"attn_norm": (d,), "q_proj": (qd, d), "k_proj": (kv, d), "v_proj": (kv, d), "o_proj": (d, qd),
              "ffn_norm": (d,), "gate_proj": (ff, d), "up_proj": (ff, d), "down_proj": (d, ff)}
    bias = {"q_proj": (qd,), "k_proj": (kv,), "v_proj": (kv,)} if cfg.qkv_bias else {}
    if cfg.o_bias:
        bias["o_proj"] = (d,)
    if cfg.mlp_bias:
        bias.update({"gate_proj": (ff,), "up_proj": (ff,), "down_proj": (d,)})
    for i in range(cfg.n_layers):
        pre = blk.format(i=i)
        for ours, theirs in names.items():
            out[f"layers.{i}.{ours}.weight"] = (pre + theirs + ".weight", shapes[ours])
        for ours, shape in bias.items():
            out[f"layers.{i}.{ours}.bias"] = (pre + names[ours] + ".bias", shape)
    return out
