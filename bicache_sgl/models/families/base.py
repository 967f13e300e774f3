"""What a checkpoint family is (:class:`Family`), and the tensor-name helper the Llama-style
families share.

A family is everything specific to one checkpoint format, declared in one module of this
package and registered in ``models/families/__init__.py``: how its config.json is recognised and
parsed (token-id defaults, logit shift and the layer's parts land in the :class:`ModelConfig`
it returns), its tensor-name map, its decoding defaults and accepted algorithms, and what prefix
reuse means for it. Nothing outside the family decides these (docs/architecture.md, "Adding a
model family").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ...decoding.plan import FamilyDecoding
from ..spec import ModelConfig

# runtime parameter name -> (checkpoint tensor name, expected shape)
TensorMap = dict[str, tuple[str, tuple[int, ...]]]

# What reusing a cached prefix means for a family's attention pattern (docs/prefix_cache.md):
# "bicache": bidirectional attention, so a cached row was computed without the request's suffix
# and reusing it is an approximation, allowed up to the depth the r -> depth profile says.
# "exact": block-causal attention (LLaDA2.x, SDAR), so a cached whole block is exact in every
# later context with the same blocks before it: reused at full depth, no profile.
PREFIX_REUSE = ("bicache", "exact")
# special tokens that end a turn in the chat formats of LLaDA, Dream and the bundled model: the
# engine stops a generation at any of them present in the vocabulary (with config.json's EOS ids)
END_OF_TURN = ("<|eot_id|>", "<|endoftext|>", "<|im_end|>")


@dataclass(frozen=True)
class Family:
    """One checkpoint family (module docstring).

    ``architectures`` are matched first against config.json's ``architectures``; only when no
    family claims one of those is ``model_type`` (lower-cased) matched against ``model_types``,
    and where several families share a model_type the one whose ``marker_keys`` are all in the
    config wins (else the first registered). ``parse(cfg, name)`` returns the ModelConfig (with
    ``arch == name``) or raises CheckpointError naming the key at fault; ``tensor_names(cfg)``
    is the checkpoint's tensor-name map. ``chat_template``: the template used when the folder's
    tokenizer has none (None: no fallback). ``end_of_turn``: special tokens that end a
    generation besides config.json's EOS ids (those in the vocabulary). ``mask_token_id`` /
    ``eos_token_ids``: the ids the family's published generate hard-codes, used only when
    config.json, generation_config.json and the tokenizer name none (models/special_ids.py)."""

    name: str
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    parse: Callable[[Mapping[str, Any], str], ModelConfig]
    tensor_names: Callable[[ModelConfig], TensorMap]
    decoding: FamilyDecoding
    prefix_reuse: str = "bicache"
    marker_keys: tuple[str, ...] = ()
    chat_template: str | None = None
    end_of_turn: tuple[str, ...] = END_OF_TURN
    mask_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.prefix_reuse not in PREFIX_REUSE:
            raise ValueError(f"family {self.name!r}: prefix_reuse must be one of {PREFIX_REUSE}")
        if self.decoding.family != self.name:
            raise ValueError(f"family {self.name!r}: its FamilyDecoding names {self.decoding.family!r}")


# the runtime's names of one layer's dense parts (models/model.py DecoderLayer)
DENSE_LAYER_PARTS = ("attn_norm", "q_proj", "k_proj", "v_proj", "o_proj", "ffn_norm", "gate_proj", "up_proj",
                     "down_proj")


def llama_tensor_names(cfg: ModelConfig, *, embed: str, norm: str, lm_head: str, block: str,
                       parts: Mapping[str, str]) -> TensorMap:
    """The map of a pre-norm Llama-style stack (attention + SwiGLU per layer): ``embed``,
    ``norm``, ``lm_head`` (unless the embeddings are tied) are the checkpoint's names of the
    embedding, final norm and LM head; ``block`` formats layer i's prefix (``{i}``);
    ``parts`` maps each of DENSE_LAYER_PARTS to its checkpoint name under it (biases as the
    config says: q/k/v with qkv_bias, o with o_bias, gate/up/down with mlp_bias)."""
    d, kv, ff, V = cfg.hidden_size, cfg.kv_dim, cfg.intermediate_size, cfg.vocab_size
    qd = cfg.n_heads * cfg.head_dim
    out: TensorMap = {"embed.weight": (embed, (V, d)), "norm.weight": (norm, (d,))}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (lm_head, (V, d))
    shapes = {"attn_norm": (d,), "q_proj": (qd, d), "k_proj": (kv, d), "v_proj": (kv, d), "o_proj": (d, qd),
              "ffn_norm": (d,), "gate_proj": (ff, d), "up_proj": (ff, d), "down_proj": (d, ff)}
    bias = {"q_proj": (qd,), "k_proj": (kv,), "v_proj": (kv,)} if cfg.qkv_bias else {}
    if cfg.o_bias:
        bias["o_proj"] = (d,)
    if cfg.mlp_bias:
        bias.update({"gate_proj": (ff,), "up_proj": (ff,), "down_proj": (d,)})
    for i in range(cfg.n_layers):
        pre = block.format(i=i)
        for ours, theirs in parts.items():
            out[f"layers.{i}.{ours}.weight"] = (pre + theirs + ".weight", shapes[ours])
        for ours, shape in bias.items():
            out[f"layers.{i}.{ours}.bias"] = (pre + parts[ours] + ".bias", shape)
    return out
