"""A planted LLaDA checkpoint: weights set by hand so that its safe prefix-reuse depth is known.

``make_planted_llada(folder, k=2, n_layers=6)`` writes a real LLaDA-format checkpoint (config.json
with the LLaDA keys, ``model.safetensors`` with the LLaDA tensor names, the byte-level tokenizer of
``bicache_sgl.testing``) that the normal loader reads. Its task: the answer to a prompt is the digit
the prompt holds, repeated at every generated position ("-" when the prompt holds no digit). The
circuit that computes it makes the answer pass *through the state of the first position*, so any
shared prefix carries it:

- layers 0 .. k-1 (relay): attention writes nothing (its output projection is zero; q/k/v are random,
  so these layers' K/V are real, token-dependent tensors that a prefix cache stores and reuses);
  the MLP of layer l moves the token's features (class one-hot, digit flags) from residual block l
  to block l+1. So the residual entering layers 0..k, and the K/V of layers 0..k, are functions of
  the token alone: the same in every context, and they differ from layer to layer.
- layer k (gather): every position whose features reached block k attends (sharply,
  position-independently) to the digit tokens and writes the class of what it found into block C.
  From here on every position's residual, the prefix's included, depends on the rest of the
  sequence. (A position resumed from the wrong layer's residual has no features in block k: it
  attends uniformly and gathers "none", so such a runtime bug turns the answer into "-".)
- layer k+1 (read): every position attends to position 0 (a RoPE pair whose score falls with the
  key position) and copies position 0's block C into block A.
- layers k+2 .. L-1: inert (random q/k/v that read C and A, zero output).
- LM head: logit of the digit (or "-") of class c = A_c times a large gain.

So reusing a prefix at depth d <= k is exact (what it reuses is context-free), and at any d > k the
generated positions read position 0's block C as computed in the context that filled the cache:
the digit of *that* context's question (or "-" for a prefix-only forward). The safe depth is k by
construction; docs/fidelity.md has the details.

Keep digits out of the shared prefix and put exactly one digit in the question.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from ..models.config import parse_model_config
from ..models.weights import checkpoint_names
from . import _start_folder

DIGITS = "0123456789"
NONE_CHAR = "-"  # the answer when the sequence holds no digit
N_CLASSES = 11  # ten digits + none
_FEAT = N_CLASSES + 2  # class one-hot, is-digit, not-digit
_CODE = 8  # random per-token code (makes the inert layers' K/V token-specific)

GATHER_SCORE = 30.0  # attention logit of a digit key in the gather layer (others: 0)
READ_MARGIN = 40.0  # attention-logit margin of position 0 over position 1 in the read layer
HEAD_GAIN = 40.0  # logit margin of the answer token at the LM head


def planted_layout(k: int, head_dim: int = 32) -> dict[str, int]:
    """Residual channel offsets: const, relay blocks 0..k, C (gathered class), A (answer), code."""
    const = 0
    relay = 1
    c = relay + _FEAT * (k + 1)
    a = c + N_CLASSES
    code = a + N_CLASSES
    need = code + _CODE
    d_model = head_dim * math.ceil(need / head_dim)
    return {"const": const, "relay": relay, "c": c, "a": a, "code": code, "d_model": d_model}


def expected_answer(prompt: str) -> str:
    """The character the planted model generates at every position for ``prompt`` (one digit in it)."""
    ds = [ch for ch in prompt if ch in DIGITS]
    if not ds:
        return NONE_CHAR
    if len(set(ds)) > 1:
        raise ValueError("the planted model's answer is only defined for prompts holding one distinct digit")
    return ds[0]


def _char_ids(folder: Path) -> dict[str, int]:
    from tokenizers import Tokenizer
    tk = Tokenizer.from_file(str(folder / "tokenizer.json"))
    out = {}
    for ch in DIGITS + NONE_CHAR:
        ids = tk.encode(ch).ids
        assert len(ids) == 1, (ch, ids)
        out[ch] = ids[0]
    return out


def _embedding(vocab: int, D: int, const: int, block0: int, code: int, char_id: dict[str, int],
               g: torch.Generator) -> torch.Tensor:
    """[vocab, D] fp64 embedding whose rows all have the same norm (so RMSNorm scales every token
    alike): const = 1, the class one-hot and the is-digit / not-digit flag in the relay block at
    ``block0``, and a random unit code (drawn from ``g``) at ``code``."""
    f64 = torch.float64
    emb = torch.zeros(vocab, D, dtype=f64)
    emb[:, const] = 1.0
    digit_of = {char_id[ch]: i for i, ch in enumerate(DIGITS)}
    for t in range(vocab):
        cls = digit_of.get(t, N_CLASSES - 1)
        emb[t, block0 + cls] = 1.0
        emb[t, block0 + N_CLASSES + (0 if t in digit_of else 1)] = 1.0
    codes = torch.randn(vocab, _CODE, generator=g, dtype=f64)
    emb[:, code:code + _CODE] = codes / codes.norm(dim=1, keepdim=True)
    return emb


def _rope_pairs(head_dim: int, rope_theta: float, max_len: int) -> tuple[int, int, float]:
    """(js, jf, theta_f): the gather uses the slowest rotary pair js (cos(angle) ~ 1 over the
    whole context: position-independent); the read the fastest pair jf whose angle stays below
    1 rad over ``max_len`` positions (sin is monotone there), of frequency theta_f."""
    inv_freq = [rope_theta ** (-2 * j / head_dim) for j in range(head_dim // 2)]
    js = head_dim // 2 - 1
    jf = min(j for j in range(head_dim // 2) if inv_freq[j] * max_len <= 1.0)
    return js, jf, inv_freq[jf]


def _answer_head(vocab: int, D: int, A: int, char_id: dict[str, int], rho_f: float) -> torch.Tensor:
    """[vocab, D] fp64 LM head: answer channel A + i votes for the i-th answer character with
    logit HEAD_GAIN (``rho_f``: the rms of the final residual, undone by the final norm)."""
    head = torch.zeros(vocab, D, dtype=torch.float64)
    for i, ch in enumerate(DIGITS + NONE_CHAR):
        head[char_id[ch], A + i] = HEAD_GAIN * rho_f
    return head


def _inert_attention(qd: int, D: int, g: torch.Generator
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k, v, o) fp64 projections of an inert layer: random q / k / v ([qd, D], std 0.2, drawn
    from ``g`` in that order: token-specific K/V) and a zero output ([D, qd]: writes nothing)."""
    f64 = torch.float64
    q = 0.2 * torch.randn(qd, D, generator=g, dtype=f64)
    kk = 0.2 * torch.randn(qd, D, generator=g, dtype=f64)
    v = 0.2 * torch.randn(qd, D, generator=g, dtype=f64)
    return q, kk, v, torch.zeros(D, qd, dtype=f64)


def make_planted_llada(folder: str | Path, *, k: int = 2, n_layers: int = 6, head_dim: int = 32,
                       max_sequence_length: int = 2048, rope_theta: float = 500000.0, seed: int = 0) -> str:
    """Write the planted checkpoint (safe depth ``k``, ``n_layers >= k + 2`` layers) into ``folder``."""
    if k < 0 or n_layers < k + 2:
        raise ValueError(f"need 0 <= k and n_layers >= k + 2, got k={k}, n_layers={n_layers}")
    folder, special, vocab = _start_folder(folder)
    char_id = _char_ids(folder)
    lay = planted_layout(k, head_dim)
    D = lay["d_model"]
    n_heads = D // head_dim
    ff = 2 * _FEAT + 6
    eps = 1e-5
    cfg = {
        "architectures": ["LLaDAModelLM"], "model_type": "llada", "activation_type": "silu", "alibi": False,
        "block_type": "llama", "d_model": D, "n_layers": n_layers, "n_heads": n_heads, "n_kv_heads": n_heads,
        "mlp_hidden_size": ff, "mlp_ratio": 4, "max_sequence_length": max_sequence_length, "rope": True,
        "rope_theta": rope_theta, "rms_norm_eps": eps, "layer_norm_type": "rms", "include_bias": False,
        "include_qkv_bias": False, "weight_tying": False, "vocab_size": vocab, "embedding_size": vocab,
        "mask_token_id": special["<|mask|>"], "eos_token_id": special["<|endoftext|>"],
        "pad_token_id": special["<|endoftext|>"], "scale_logits": False, "torch_dtype": "float32",
    }
    mc = parse_model_config(cfg)
    g = torch.Generator().manual_seed(seed)
    f64 = torch.float64
    const, relay, C, A, code = lay["const"], lay["relay"], lay["c"], lay["a"], lay["code"]

    def block(b: int) -> int:
        return relay + _FEAT * b

    emb = _embedding(vocab, D, const, block(0), code, char_id, g)
    # rms of the residual before the gather (const + class + flag + code: four unit entries)
    rho = math.sqrt(4.0 / D + eps)
    # ... and after it (plus block C, a convex mix of one-hots: norm <= 1)
    rho_c = math.sqrt(5.0 / D + eps)

    js, jf, theta_f = _rope_pairs(head_dim, rope_theta, max_sequence_length)
    read_scale = READ_MARGIN / (theta_f * math.cos(theta_f * max_sequence_length))

    sd: dict[str, torch.Tensor] = {"embed.weight": emb, "norm.weight": torch.ones(D, dtype=f64)}
    rho_f = math.sqrt(6.0 / D + eps)  # const, class, flag, code, C, A
    sd["lm_head.weight"] = _answer_head(vocab, D, A, char_id, rho_f)

    qd = n_heads * head_dim
    for li in range(n_layers):
        p = f"layers.{li}."
        q, kk, v, o = _inert_attention(qd, D, g)
        gate = torch.zeros(ff, D, dtype=f64)
        up = torch.zeros(ff, D, dtype=f64)
        down = torch.zeros(D, ff, dtype=f64)
        if li < k:  # relay: move block li -> block li + 1 (x = h / rho after the norm)
            gamma = 30.0 * rho  # gate pre-activation 30: silu(30) = 30 to fp64 precision
            gval = gamma / rho
            silu = gval / (1.0 + math.exp(-gval))
            for c in range(_FEAT):
                gate[c, const] = gamma
                up[c, block(li) + c] = 1.0
                # product = silu * h / rho; down restores h, adds it to the next block, removes it here
                down[block(li + 1) + c, c] = rho / silu
                down[block(li) + c, c] = -rho / silu
        elif li == k:  # gather: every query attends to the digit keys; value = class one-hot
            q[:head_dim].zero_()
            kk[:head_dim].zero_()
            v[:head_dim].zero_()
            s = math.sqrt(GATHER_SCORE * rho * rho * math.sqrt(head_dim))
            # the query reads the token's flags in block k (is-digit + not-digit = 1 for every token whose
            # features arrived there): a position resumed from the wrong layer's residual queries
            # nothing, attends uniformly and gathers "none" instead of the digit
            q[js, block(k) + N_CLASSES] = s
            q[js, block(k) + N_CLASSES + 1] = s
            kk[js, block(k) + N_CLASSES] = s  # is-digit flag
            for c in range(N_CLASSES):
                v[c, block(k) + c] = rho
                o[C + c, c] = 1.0
        elif li == k + 1:  # read: every query attends to position 0; copies its block C into A
            q[:head_dim].zero_()
            kk[:head_dim].zero_()
            v[:head_dim].zero_()
            s = math.sqrt(read_scale * rho_c * rho_c * math.sqrt(head_dim))
            q[jf, const] = s  # q = (s, 0), k = (0, s) in the pair: score = s^2 sin((i - j) theta)
            kk[jf + head_dim // 2, const] = s
            for c in range(N_CLASSES):
                v[c, C + c] = rho_c
                o[A + c, c] = 1.0
        sd.update({p + "attn_norm.weight": torch.ones(D, dtype=f64), p + "ffn_norm.weight": torch.ones(D, dtype=f64),
                   p + "q_proj.weight": q, p + "k_proj.weight": kk, p + "v_proj.weight": v, p + "o_proj.weight": o,
                   p + "gate_proj.weight": gate, p + "up_proj.weight": up, p + "down_proj.weight": down})

    from safetensors.torch import save_file
    names = checkpoint_names(mc)
    if set(names) != set(sd):
        raise AssertionError(f"planted weights do not match the LLaDA names: {sorted(set(names) ^ set(sd))}")
    tensors = {}
    for ours, (ck, shape) in names.items():
        t = sd[ours].to(torch.float32).contiguous()
        assert tuple(t.shape) == shape, (ours, t.shape, shape)
        tensors[ck] = t
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "planted.json").write_text(json.dumps({
        "safe_depth": k, "n_layers": n_layers, "gather_layer": k, "read_layer": k + 1,
        "task": "answer = the prompt's digit at every generated position ('-' if none); the answer is "
                "read from position 0's state at layer k+1, which gathered the digit at layer k",
        "answer_ids": {ch: char_id[ch] for ch in DIGITS + NONE_CHAR},
    }, indent=1))
    return str(folder)
