"""A planted LLaDA-MoE checkpoint: the planted model of ``testing/planted.py`` (safe prefix-reuse
depth k by construction) rebuilt in the LLaDA-MoE format, with its circuit routed through experts.

``make_planted_llada_moe(folder, k=2, n_layers=6)`` writes a real ``LLaDAMoEModelLM`` checkpoint
(every layer a MoE layer, QK-norm, 12 experts, top-2) that the normal loader reads. Same task as
the planted LLaDA (the answer is the prompt's digit at every generated position, "-" without
one) and the same attention circuit, with QK-norm doing the scaling (a head's normalised q and k
have norm sqrt(head_dim) times their norm weights, so the scores are set by those weights):

- layers 0 .. k-1 (relay): the FFN moves the token's features from residual block l to block
  l + 1; the router sends digit tokens to expert 0 and the others to expert 1 (both carry the
  relay; the runner-up expert's weight is e^-40, nothing), so routing differs between tokens
  while the residual entering layers 0..k and their K/V stay functions of the token alone;
- layer k (gather): attention writes the class of the digit found into block C (FFN: nothing);
- layer k + 1 (read): attention copies position 0's block C into block B, and the FFN's router
  picks expert c from B's class c: expert c writes the answer one-hot into block A. The answer
  is this routing decision, made on state that depends on the whole sequence;
- layers k + 2 .. L - 1: inert (random q/k/v, zero output, zero experts).

Reusing a prefix at depth d <= k is exact; at d > k the generated positions read position 0's
block C as computed in the context that filled the cache, so the router picks that context's
expert: naive reuse answers the other question's digit.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from ..models.families import checkpoint_names, parse_model_config
from . import LLADA_MOE_SPECIAL_TOKENS, _start_folder
from .planted import (
    _CODE,
    _FEAT,
    DIGITS,
    GATHER_SCORE,
    N_CLASSES,
    NONE_CHAR,
    READ_MARGIN,
    _answer_head,
    _char_ids,
    _embedding,
    _inert_attention,
    _rope_pairs,
)

N_EXPERTS = 12  # one per answer class (11), and the relay pair (experts 0 and 1) reuses two of them
TOP_K = 2
ROUTE_MARGIN = 40.0  # router-logit margin of the chosen expert: the runner-up's weight is e^-40
EXPERT_SIZE = 16


def make_planted_llada_moe(folder: str | Path, *, k: int = 2, n_layers: int = 6, head_dim: int = 32,
                           max_position_embeddings: int = 2048, rope_theta: float = 500000.0, seed: int = 0) -> str:
    """Write the planted LLaDA-MoE checkpoint (safe depth ``k``, ``n_layers >= k + 2``) into ``folder``."""
    if k < 0 or n_layers < k + 2:
        raise ValueError(f"need 0 <= k and n_layers >= k + 2, got k={k}, n_layers={n_layers}")
    folder, special, vocab = _start_folder(folder, LLADA_MOE_SPECIAL_TOKENS, chat_template=None)
    char_id = _char_ids(folder)
    # residual layout: const, relay blocks 0..k, C (gathered class), B (read class), A (answer), code
    const, relay = 0, 1
    C = relay + _FEAT * (k + 1)
    B = C + N_CLASSES
    A = B + N_CLASSES
    code = A + N_CLASSES
    D = head_dim * math.ceil((code + _CODE) / head_dim)
    n_heads = D // head_dim
    eps = 1e-5
    cfg = {
        "architectures": ["LLaDAMoEModelLM"], "model_type": "llada", "hidden_act": "silu", "hidden_size": D,
        "num_hidden_layers": n_layers, "num_attention_heads": n_heads, "num_key_value_heads": n_heads,
        "dense_intermediate_size": EXPERT_SIZE, "expert_intermediate_size": EXPERT_SIZE,
        "shared_expert_intermediate_size": None, "num_experts": N_EXPERTS, "num_experts_per_tok": TOP_K,
        "norm_topk_prob": False, "moe_layer_freq": [1] * n_layers, "moe_router_enable_expert_bias": False,
        "moe_router_score_function": "softmax", "qk_layernorm": True, "attention_bias": False, "clip_qkv": None,
        "rope_theta": rope_theta, "partial_rotary_factor": 1, "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": eps, "tie_word_embeddings": False, "vocab_size": vocab,
        "mask_token_id": special["<|mask|>"], "eos_token_id": special["<|endoftext|>"],
        "pad_token_id": special["<|endoftext|>"], "torch_dtype": "float32",
    }
    mc = parse_model_config(cfg)
    g = torch.Generator().manual_seed(seed)
    f64 = torch.float64

    def block(b: int) -> int:
        return relay + _FEAT * b

    emb = _embedding(vocab, D, const, block(0), code, char_id, g)
    rho = math.sqrt(4.0 / D + eps)  # rms of the residual in the relay layers: four unit entries
    rho_b = math.sqrt(6.0 / D + eps)  # ... entering the read layer's FFN (+ C and B, one-hots)

    js, jf, theta_f = _rope_pairs(head_dim, rope_theta, max_position_embeddings)
    # read score = sqrt(hd) * wq * wk * sin((i - j) theta_f) for the normalised q = (1, 0), k = (0, 1)
    read_w = math.sqrt(READ_MARGIN / (theta_f * math.cos(theta_f * max_position_embeddings)) / math.sqrt(head_dim))
    gather_w = math.sqrt(GATHER_SCORE / math.sqrt(head_dim))

    sd: dict[str, torch.Tensor] = {"embed.weight": emb, "norm.weight": torch.ones(D, dtype=f64)}
    rho_f = math.sqrt(7.0 / D + eps)  # const, class, flag, code, C, B, A
    sd["lm_head.weight"] = _answer_head(vocab, D, A, char_id, rho_f)

    qd, F = n_heads * head_dim, EXPERT_SIZE
    for li in range(n_layers):
        p = f"layers.{li}."
        q, kk, v, o = _inert_attention(qd, D, g)
        qn, kn = torch.ones(head_dim, dtype=f64), torch.ones(head_dim, dtype=f64)
        router = torch.zeros(N_EXPERTS, D, dtype=f64)
        experts = [[torch.zeros(F, D, dtype=f64), torch.zeros(F, D, dtype=f64), torch.zeros(D, F, dtype=f64)]
                   for _ in range(N_EXPERTS)]
        if li < k:  # relay through expert 0 (digits) or 1 (the rest); x = h / rho after the norm
            router[0, block(li) + N_CLASSES] = ROUTE_MARGIN * rho  # is-digit flag
            router[1, block(li) + N_CLASSES + 1] = ROUTE_MARGIN * rho  # not-digit flag
            gamma = 30.0 * rho  # gate pre-activation 30: silu(30) = 30 to fp64 precision
            silu = 30.0 / (1.0 + math.exp(-30.0))
            for e in (0, 1):
                gate, up, down = experts[e]
                for c in range(_FEAT):
                    gate[c, const] = gamma
                    up[c, block(li) + c] = 1.0
                    down[block(li + 1) + c, c] = rho / silu
                    down[block(li) + c, c] = -rho / silu
        elif li == k:  # gather: the normalised q (flags in block k) meets the normalised digit keys
            q[:head_dim].zero_()
            kk[:head_dim].zero_()
            v[:head_dim].zero_()
            q[js, block(k) + N_CLASSES] = 1.0
            q[js, block(k) + N_CLASSES + 1] = 1.0
            kk[js, block(k) + N_CLASSES] = 1.0  # is-digit flag
            qn[js] = kn[js] = gather_w
            for c in range(N_CLASSES):
                v[c, block(k) + c] = rho
                o[C + c, c] = 1.0
        elif li == k + 1:  # read position 0's C into B; route on B: expert c writes the answer A_c
            q[:head_dim].zero_()
            kk[:head_dim].zero_()
            v[:head_dim].zero_()
            q[jf, const] = 1.0
            kk[jf + head_dim // 2, const] = 1.0
            qn[jf] = kn[jf + head_dim // 2] = read_w
            rho_c = math.sqrt(5.0 / D + eps)
            for c in range(N_CLASSES):
                v[c, C + c] = rho_c
                o[B + c, c] = 1.0
                router[c, B + c] = ROUTE_MARGIN * rho_b
                gate, up, down = experts[c]
                gate[0, const] = 30.0 * rho_b
                up[0, const] = rho_b  # x_const = 1 / rho_b: the product is silu(30) = 30
                down[A + c, 0] = 1.0 / 30.0
        sd.update({p + "attn_norm.weight": torch.ones(D, dtype=f64), p + "ffn_norm.weight": torch.ones(D, dtype=f64),
                   p + "q_proj.weight": q, p + "k_proj.weight": kk, p + "v_proj.weight": v, p + "o_proj.weight": o,
                   p + "q_norm.weight": qn, p + "k_norm.weight": kn, p + "router.weight": router})
        for e, (gate, up, down) in enumerate(experts):
            sd.update({f"{p}experts.{e}.gate_proj.weight": gate, f"{p}experts.{e}.up_proj.weight": up,
                       f"{p}experts.{e}.down_proj.weight": down})

    from safetensors.torch import save_file
    names = checkpoint_names(mc)
    if set(names) != set(sd):
        raise AssertionError(f"planted weights do not match the LLaDA-MoE names: {sorted(set(names) ^ set(sd))}")
    tensors = {ck: sd[ours].to(torch.float32).contiguous() for ours, (ck, _) in names.items()}
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "planted.json").write_text(json.dumps({
        "safe_depth": k, "n_layers": n_layers, "gather_layer": k, "read_layer": k + 1, "format": "LLaDAMoEModelLM",
        "task": "answer = the prompt's digit at every generated position ('-' if none); the read layer's router "
                "picks the answer's expert from position 0's state, which gathered the digit at layer k",
        "answer_ids": {ch: char_id[ch] for ch in DIGITS + NONE_CHAR},
    }, indent=1))
    return str(folder)
