"""Tiny random checkpoints in the real format of every registered model family
(:data:`TINY_MAKERS`, keyed by family name), with a real byte-level tokenizer.

Used by the tests and benchmarks (no model hub on CI machines). The files are exactly what the
real checkpoints ship: config.json with the real keys, safetensors (single or sharded with
``model.safetensors.index.json``) with the real tensor names, and a Hugging Face tokenizer that
``AutoTokenizer.from_pretrained(folder)`` loads.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ..models.families import checkpoint_names, parse_model_config

SPECIAL_TOKENS = ["<|endoftext|>", "<|eot_id|>", "<|mask|>", "<|start_header_id|>", "<|end_header_id|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] }}"
                 "<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>"
                 "\n\n{% endif %}")


def save_byte_tokenizer(folder: str | Path, special: tuple[str, ...] | list[str] = tuple(SPECIAL_TOKENS),
                        chat_template: str | None = CHAT_TEMPLATE, mask_token: str = "<|mask|>") -> dict[str, int]:
    """A byte-level tokenizer (one token per UTF-8 byte, 256 ids) plus ``special`` tokens (the
    first is EOS and pad), with ``chat_template`` (None: none in the tokenizer). Returns the
    special-token ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(list(special))
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token=special[0], pad_token=special[0],
                                   mask_token=mask_token)
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(str(folder))
    return {t: tk.token_to_id(t) for t in special}


def _start_folder(folder: str | Path, special: tuple[str, ...] | list[str] = tuple(SPECIAL_TOKENS),
                  chat_template: str | None = CHAT_TEMPLATE, mask_token: str = "<|mask|>"
                  ) -> tuple[Path, dict[str, int], int]:
    """Create ``folder`` and write the byte tokenizer into it (``mask_token``: its declared mask
    token); returns the folder, the special-token ids and the vocabulary size (256 bytes + the
    special tokens)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    ids = save_byte_tokenizer(folder, special, chat_template=chat_template, mask_token=mask_token)
    return folder, ids, 256 + len(special)


def _published_ids(cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json as LLaDA-MoE, LLaDA2.x and SDAR publish it: no ``mask_token_id`` (their
    code reads the mask from the tokenizer)."""
    return {k: v for k, v in cfg.items() if k != "mask_token_id"}


def _random_tensors(names: dict[str, tuple[str, tuple[int, ...]]], seed: int, std: float,
                    stds: dict[str, float] | None = None) -> dict[str, torch.Tensor]:
    """Random weights keyed by checkpoint name, drawn in ``names``' order from one generator
    seeded with ``seed``; ``stds``: the std of the tensors whose runtime name ends with a key
    (else ``std``; norms near 1, biases small). ``names``: runtime name -> (checkpoint name, shape)."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for ours, (ck, shape) in names.items():
        special = [v for k, v in (stds or {}).items() if ours.endswith(k)]
        if special:
            t = special[0] * torch.randn(shape, generator=g)
        elif ours.endswith("norm.weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=g)
        elif ours.endswith(".bias"):
            t = 0.02 * torch.randn(shape, generator=g)
        else:
            t = std * torch.randn(shape, generator=g)
        tensors[ck] = t.contiguous()
    return tensors


def _save_tensors(folder: Path, tensors: dict[str, torch.Tensor], shards: int) -> dict[str, str] | None:
    """Save ``tensors`` as ``model.safetensors`` (``shards <= 1``: returns None) or as ``shards``
    numbered files in insertion order (returns the weight map; the caller writes the index)."""
    from safetensors.torch import save_file
    if shards <= 1:
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return None
    names = list(tensors)
    per = (len(names) + shards - 1) // shards
    weight_map = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: tensors[k] for k in names[s * per:(s + 1) * per]}
        save_file(part, str(folder / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in part})
    return weight_map


def _write_weights(folder: Path, cfg_dict: dict[str, Any], seed: int, shards: int, std: float,
                   stds: dict[str, float] | None = None) -> None:
    """Random weights for every tensor of the config's family (see :func:`_random_tensors`)."""
    tensors = _random_tensors(checkpoint_names(parse_model_config(cfg_dict)), seed, std, stds)
    weight_map = _save_tensors(folder, tensors, shards)
    if weight_map is None:
        return
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))


def make_tiny_llada(folder: str | Path, *, n_layers: int = 4, d_model: int = 64, n_heads: int = 4,
                    n_kv_heads: int | None = None, mlp_hidden_size: int = 128, seed: int = 0, shards: int = 1,
                    std: float = 0.08, weight_tying: bool = False) -> str:
    """A random LLaDA checkpoint (LLaDAModelLM config keys and tensor names)."""
    folder, special, vocab = _start_folder(folder)
    cfg = {
        "architectures": ["LLaDAModelLM"], "model_type": "llada", "activation_type": "silu", "alibi": False,
        "block_type": "llama", "d_model": d_model, "n_layers": n_layers, "n_heads": n_heads,
        "n_kv_heads": n_kv_heads or n_heads, "mlp_hidden_size": mlp_hidden_size, "mlp_ratio": 4,
        "max_sequence_length": 4096, "rope": True, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
        "layer_norm_type": "rms", "include_bias": False, "include_qkv_bias": False, "weight_tying": weight_tying,
        "vocab_size": vocab, "embedding_size": vocab, "mask_token_id": special["<|mask|>"],
        "eos_token_id": special["<|endoftext|>"], "pad_token_id": special["<|endoftext|>"],
        "scale_logits": False, "torch_dtype": "float32",
    }
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    _write_weights(folder, cfg, seed, shards, std)
    return str(folder)


def make_tiny_dream(folder: str | Path, *, n_layers: int = 4, hidden_size: int = 64, n_heads: int = 4,
                    n_kv_heads: int = 2, intermediate_size: int = 128, seed: int = 0, shards: int = 1,
                    std: float = 0.08) -> str:
    """A random Dream checkpoint (Qwen2-style names, GQA, q/k/v biases, shifted logits)."""
    folder, special, vocab = _start_folder(folder)
    cfg = {
        "architectures": ["DreamModel"], "model_type": "Dream", "hidden_act": "silu", "hidden_size": hidden_size,
        "intermediate_size": intermediate_size, "num_attention_heads": n_heads, "num_key_value_heads": n_kv_heads,
        "num_hidden_layers": n_layers, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "tie_word_embeddings": False, "vocab_size": vocab,
        "mask_token_id": special["<|mask|>"], "eos_token_id": special["<|endoftext|>"],
        "pad_token_id": special["<|endoftext|>"], "bos_token_id": special["<|endoftext|>"], "torch_dtype": "float32",
    }
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    _write_weights(folder, cfg, seed, shards, std)
    return str(folder)


# LLaDA-MoE's special tokens (Ling's chat format); the first is EOS and pad
LLADA_MOE_SPECIAL_TOKENS = ("<|endoftext|>", "<|role_end|>", "<|mask|>", "<role>", "</role>")


def make_tiny_llada_moe(folder: str | Path, *, n_layers: int = 4, hidden_size: int = 64, n_heads: int = 4,
                        n_kv_heads: int | None = None, n_experts: int = 8, top_k: int = 2, expert_size: int = 32,
                        moe_layer_freq: list[int] | None = None, shared_expert_size: int | None = None,
                        expert_bias: bool = False, dense_size: int = 96, seed: int = 0, shards: int = 1,
                        std: float = 0.08, router_std: float = 0.2, embed_std: float = 1.0,
                        published_ids: bool = False, special: tuple[str, ...] = LLADA_MOE_SPECIAL_TOKENS) -> str:
    """A random LLaDA-MoE checkpoint (LLaDAMoEModelLM config keys and tensor names: QK-norm,
    per-expert SwiGLU tensors; a router whose ``router_std``, with embeddings of ``embed_std``
    that keep the residual token-specific, makes routing differ between tokens).
    config.json names ``mask_token_id``, unless ``published_ids``: then, as the published
    config.json, it names none and the loader reads the tokenizer's <|mask|> (``special``: the
    added tokens in id order, the first EOS and pad). The tokenizer ships no chat template: the
    family's is used."""
    folder, special, vocab = _start_folder(folder, special, chat_template=None)
    cfg = {
        "architectures": ["LLaDAMoEModelLM"], "model_type": "llada", "hidden_act": "silu",
        "hidden_size": hidden_size, "num_hidden_layers": n_layers, "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads or n_heads, "dense_intermediate_size": dense_size,
        "expert_intermediate_size": expert_size, "shared_expert_intermediate_size": shared_expert_size,
        "num_experts": n_experts, "num_experts_per_tok": top_k, "norm_topk_prob": False,
        "moe_layer_freq": moe_layer_freq or [1] * n_layers, "moe_router_enable_expert_bias": expert_bias,
        "moe_router_score_function": "softmax", "routed_scaling_factor": 1, "qk_layernorm": True,
        "attention_bias": False, "attention_dropout": 0.0, "clip_qkv": None, "rope_theta": 50000.0,
        "rope_scaling": None, "partial_rotary_factor": 1, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False, "vocab_size": vocab, "router_aux_loss_coef": 0.01, "use_cache": False,
        "mask_token_id": special["<|mask|>"], "eos_token_id": special["<|endoftext|>"],
        "pad_token_id": special["<|endoftext|>"], "torch_dtype": "float32",
    }
    (folder / "config.json").write_text(json.dumps(_published_ids(cfg) if published_ids else cfg, indent=1))
    _write_weights(folder, cfg, seed, shards, std, stds={"router.weight": router_std, "expert_bias": 0.05,
                                                               "embed.weight": embed_std})
    return str(folder)


# family name (models.families.FAMILIES) -> its tiny maker: maker(folder, **kw) -> folder
from .block import make_tiny_llada2, make_tiny_sdar  # noqa: E402 (it imports this module's tokenizer helpers)

TINY_MAKERS = {"llada": make_tiny_llada, "dream": make_tiny_dream, "llada_moe": make_tiny_llada_moe,
               "llada2": make_tiny_llada2, "sdar": make_tiny_sdar}
