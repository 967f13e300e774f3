"""An independent float64 reference of the forward, written with plain torch ops from a checkpoint's
tensors: no code shared with ``bicache_sgl.models`` (the checkpoint is read with safetensors alone,
names mapped here), unbatched, one head at a time.

It is what the runtime's forwards are checked against: the dense forward (``reference_logits``,
tests/test_models.py), the depth-d forward whose positions [a, p) reuse a prefix state computed
in another context (``reference_depth_forward``, tests/test_fidelity.py), and the self-test
(``python -m bicache_sgl.selftest``).

A reference model is a plain dict (``load_reference_model``): ``L``, ``H``, ``Hkv``, ``D``, ``hd``,
``eps``, ``theta``, ``shift`` (1 for Dream: position i-1's output predicts token i), ``emb``
[V, D], ``lnf`` [D], ``head`` [V, D] and ``layers``: per layer the weights ``an`` (attention
norm), ``q``/``k``/``v``/``o`` (with biases ``qb``/``kb``/``vb``/``ob`` or None), ``qn``/``kn``
(per-head QK-norm or None), ``fn`` (MLP norm), ``g``/``u``/``dn`` (SwiGLU gate, up, down) or
``moe`` (router, experts, top-k, expert bias, shared expert), all float64 on the CPU.

Each format has its own branch with its own name map (LLaDA, Dream, LLaDA-MoE), chosen from
the folder's config.json; tests/test_families.py checks that every registered family has one.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

RefState = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (residual entering the layer [N, D], K [N, Hkv, hd], V)


def load_reference_model(folder: str | Path) -> dict[str, Any]:
    """The checkpoint's tensors, read with safetensors alone, in float64 and plain names (LLaDA
    or Dream format, single file or sharded)."""
    from safetensors.torch import load_file
    cfg = json.loads((Path(folder) / "config.json").read_text())
    sd = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        sd.update({k: v.double() for k, v in load_file(str(f)).items()})
    if set(cfg.get("architectures") or []) & {"LLaDAMoEModelLM", "LLaDAMoEModel"}:
        return _llada_moe(cfg, sd)
    if cfg.get("model_type") == "llada":
        P = "model.transformer."
        layer_names = {"an": "attn_norm", "q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "attn_out",
                       "fn": "ff_norm", "g": "ff_proj", "u": "up_proj", "dn": "ff_out"}
        m = {"L": cfg["n_layers"], "H": cfg["n_heads"], "Hkv": cfg.get("n_kv_heads") or cfg["n_heads"],
             "D": cfg["d_model"], "eps": cfg["rms_norm_eps"], "theta": cfg["rope_theta"], "shift": 0,
             "emb": sd[P + "wte.weight"], "lnf": sd[P + "ln_f.weight"],
             "head": sd[P + "wte.weight"] if cfg["weight_tying"] else sd[P + "ff_out.weight"]}
        blk = P + "blocks.{i}."
    else:
        layer_names = {"an": "input_layernorm", "q": "self_attn.q_proj", "k": "self_attn.k_proj",
                       "v": "self_attn.v_proj", "o": "self_attn.o_proj", "fn": "post_attention_layernorm",
                       "g": "mlp.gate_proj", "u": "mlp.up_proj", "dn": "mlp.down_proj"}
        m = {"L": cfg["num_hidden_layers"], "H": cfg["num_attention_heads"], "Hkv": cfg["num_key_value_heads"],
             "D": cfg["hidden_size"], "eps": cfg["rms_norm_eps"], "theta": cfg["rope_theta"], "shift": 1,
             "emb": sd["model.embed_tokens.weight"], "lnf": sd["model.norm.weight"], "head": sd["lm_head.weight"]}
        blk = "model.layers.{i}."
    m["layers"] = []
    for i in range(m["L"]):
        pre = blk.format(i=i)
        w = {k: sd[pre + n + ".weight"] for k, n in layer_names.items()}
        for k in ("q", "k", "v"):
            w[k + "b"] = sd.get(pre + layer_names[k] + ".bias")
        w["qn"] = w["kn"] = w["moe"] = None
        m["layers"].append(w)
    m["hd"] = m["D"] // m["H"]
    return m


def _llada_moe(cfg: dict, sd: dict[str, torch.Tensor]) -> dict[str, Any]:
    """LLaDA-MoE (LLaDAMoEModelLM): Qwen2-like names under ``model.``, per-head q/k RMSNorm, and
    per layer either a routed mixture of SwiGLU experts (``mlp.gate`` router, ``mlp.experts.{e}``,
    optional ``mlp.expert_bias`` and ``shared_expert``) or, where moe_layer_freq is 0, a dense
    SwiGLU (``mlp.gate_proj``/``up_proj``/``down_proj``)."""
    L = cfg["num_hidden_layers"]
    freq = cfg.get("moe_layer_freq") or [1] * L
    m = {"L": L, "H": cfg["num_attention_heads"], "Hkv": cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
         "D": cfg["hidden_size"], "eps": cfg["rms_norm_eps"], "theta": cfg["rope_theta"], "shift": 0,
         "emb": sd["model.embed_tokens.weight"], "lnf": sd["model.norm.weight"], "head": sd["lm_head.weight"],
         "layers": []}
    m["hd"] = m["D"] // m["H"]
    for i in range(L):
        pre = f"model.layers.{i}."
        a = pre + "self_attn."
        w = {"an": sd[pre + "input_layernorm.weight"], "fn": sd[pre + "post_attention_layernorm.weight"],
             "q": sd[a + "q_proj.weight"], "k": sd[a + "k_proj.weight"], "v": sd[a + "v_proj.weight"],
             "o": sd[a + "o_proj.weight"], "qb": sd.get(a + "q_proj.bias"), "kb": sd.get(a + "k_proj.bias"),
             "vb": sd.get(a + "v_proj.bias"), "ob": sd.get(a + "o_proj.bias"),
             "qn": sd.get(a + "q_norm.weight"), "kn": sd.get(a + "k_norm.weight"), "moe": None}
        if freq[i]:
            w["moe"] = {"router": sd[pre + "mlp.gate.weight"], "k": cfg["num_experts_per_tok"],
                        "bias": sd.get(pre + "mlp.expert_bias"),
                        "experts": [tuple(sd[f"{pre}mlp.experts.{e}.{n}.weight"] for n in ("gate_proj", "up_proj",
                                                                                          "down_proj"))
                                    for e in range(cfg["num_experts"])],
                        "shared": (tuple(sd[f"{pre}shared_expert.{n}.weight"] for n in ("gate_proj", "up_proj",
                                                                                       "down_proj"))
                                   if pre + "shared_expert.gate_proj.weight" in sd else None)}
        else:
            w["g"], w["u"], w["dn"] = (sd[f"{pre}mlp.{n}.weight"] for n in ("gate_proj", "up_proj", "down_proj"))
        m["layers"].append(w)
    return m


def _swiglu(x: torch.Tensor, g: torch.Tensor, u: torch.Tensor, dn: torch.Tensor) -> torch.Tensor:
    gate = x @ g.T
    return (gate * torch.sigmoid(gate) * (x @ u.T)) @ dn.T


def _moe(moe: dict, x: torch.Tensor) -> torch.Tensor:
    """Every expert on every row, combined with a [n, E] weight matrix that is zero outside each
    row's top-k (softmax router probabilities, plus the expert bias, not renormalised), plus the
    shared expert."""
    probs = torch.softmax(x @ moe["router"].T, dim=-1)
    if moe["bias"] is not None:
        probs = probs + moe["bias"]
    ranked = torch.argsort(probs, dim=-1, descending=True)[:, :moe["k"]]
    weight = torch.zeros_like(probs).scatter(1, ranked, probs.gather(1, ranked))
    out = sum(weight[:, e:e + 1] * _swiglu(x, *ex) for e, ex in enumerate(moe["experts"]))
    if moe["shared"] is not None:
        out = out + _swiglu(x, *moe["shared"])
    return out


def _rms(x: torch.Tensor, g: torch.Tensor, eps: float) -> torch.Tensor:
    return g * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """x [n, heads, hd] at positions pos [n]; rotates the pairs (j, j + hd/2) by pos * theta^(-2j/hd)."""
    hd = x.shape[-1]
    half = hd // 2
    freq = theta ** (-2.0 * torch.arange(half, dtype=torch.float64) / hd)
    ang = pos.double()[:, None] * freq[None]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def _proj(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return x @ w.T + (b if b is not None else 0.0)


def _qkv(m: dict, w: dict, x: torch.Tensor, pos: torch.Tensor) -> RefState:
    n, H, Hkv, hd = x.shape[0], m["H"], m["Hkv"], m["hd"]
    hn = _rms(x, w["an"], m["eps"])
    q, k = _proj(hn, w["q"], w["qb"]).view(n, H, hd), _proj(hn, w["k"], w["kb"]).view(n, Hkv, hd)
    if w["qn"] is not None:  # QK-norm: each head's q and k, before RoPE
        q, k = _rms(q, w["qn"], m["eps"]), _rms(k, w["kn"], m["eps"])
    q, k = _rope(q, pos, m["theta"]), _rope(k, pos, m["theta"])
    v = _proj(hn, w["v"], w["vb"]).view(n, Hkv, hd)
    return q, k, v


def _attend_and_mlp(m: dict, w: dict, x: torch.Tensor, q: torch.Tensor, keys: torch.Tensor,
                    vals: torch.Tensor) -> torch.Tensor:
    """x [n, D] rows whose queries q attend (bidirectionally) to keys/vals [N, Hkv, hd]."""
    H, Hkv, hd = m["H"], m["Hkv"], m["hd"]
    heads = []
    for h in range(H):
        kh, vh = keys[:, h // (H // Hkv)], vals[:, h // (H // Hkv)]
        heads.append(torch.softmax(q[:, h] @ kh.T / math.sqrt(hd), dim=-1) @ vh)
    x = x + _proj(torch.cat(heads, dim=-1), w["o"], w.get("ob"))
    hn = _rms(x, w["fn"], m["eps"])
    if w["moe"] is not None:
        return x + _moe(w["moe"], hn)
    gate = hn @ w["g"].T
    return x + (gate * torch.sigmoid(gate) * (hn @ w["u"].T)) @ w["dn"].T


def reference_states(m: dict, ids: Sequence[int]) -> list[RefState]:
    """Plain dense forward: per layer (residual entering it, K after RoPE, V), all positions."""
    pos = torch.arange(len(ids))
    x = m["emb"][torch.tensor(list(ids))]
    states = []
    for w in m["layers"]:
        q, k, v = _qkv(m, w, x, pos)
        states.append((x, k, v))
        x = _attend_and_mlp(m, w, x, q, k, v)
    return states


def reference_depth_forward(m: dict, ids: Sequence[int], p: int, d: int, cached: Sequence[RefState] | None,
                            a: int = 0) -> torch.Tensor:
    """Outputs (unshifted logits, [N, V]) of the sequence ``ids`` whose positions [a, p) reuse
    ``cached`` (reference_states of another sequence with the same first p tokens) at depth d:
    in layers < d those positions are not computed and their K/V are the cached ones; at layer d
    they resume from the cached residual entering layer d. Positions < a (a recomputed head) and
    >= p are computed at every layer. Rows in [a, p) are NaN when d == L. ``d == 0`` is the plain
    dense forward (``cached`` unused)."""
    N, L = len(ids), m["L"]
    pos = torch.arange(N)
    x = m["emb"][torch.tensor(list(ids))].clone()
    if d > 0:
        x[a:p] = float("nan")  # never computed below d: any use of it would show
    keep = torch.cat([torch.arange(a), torch.arange(p, N)])  # positions computed below d
    for li, w in enumerate(m["layers"]):
        if li == d and 0 < d < L:
            x[a:p] = cached[d][0][a:p]
        if li < d and p > a:
            q, k, v = _qkv(m, w, x[keep], pos[keep])
            # keys in position order: the head, the cached span, the rest
            k = torch.cat([k[:a], cached[li][1][a:p], k[a:]])
            v = torch.cat([v[:a], cached[li][2][a:p], v[a:]])
            x[keep] = _attend_and_mlp(m, w, x[keep], q, k, v)
        else:
            q, k, v = _qkv(m, w, x, pos)
            x = _attend_and_mlp(m, w, x, q, k, v)
    return _rms(x, m["lnf"], m["eps"]) @ m["head"].T


def reference_logits(m: dict, ids: Sequence[int]) -> torch.Tensor:
    """Per-position logits [N, V] as each model defines them: row i predicts token i (for Dream
    the output at i - 1, shifted here; row 0 repeats row 0)."""
    out = reference_depth_forward(m, ids, 0, 0, None)
    if m["shift"]:
        out = torch.cat([out[:1], out[:-1]], dim=0)
    return out


# ---- block-diffusion families (LLaDA2.x MoE, SDAR) ------------------------------------------------
# Own names, own routing, own rotary: nothing here comes from bicache_sgl.models.


def load_block_reference(folder: str | Path) -> dict[str, Any]:
    """A LLaDA2 (LLaDA2MoeModelLM) or SDAR (SDARForCausalLM) checkpoint in float64 plain dicts:
    ``family``, sizes, ``rd`` (rotated dims per head), ``emb``, ``lnf``, ``head`` and per layer
    ``an``/``fn`` norms, ``q``/``k``/``v``/``o`` projections, ``qn``/``kn`` (QK-norm) and either a
    dense ``mlp`` (g, u, d) or ``moe`` (router ``r``, ``bias``, ``experts`` [(g, u, d)], ``shared``)."""
    from safetensors.torch import load_file
    cfg = json.loads((Path(folder) / "config.json").read_text())
    sd: dict[str, torch.Tensor] = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        sd.update({k: v.double() for k, v in load_file(str(f)).items()})
    llada2 = cfg.get("model_type") == "llada2_moe"
    H, D = cfg["num_attention_heads"], cfg["hidden_size"]
    hd = cfg.get("head_dim") or D // H
    Hkv = cfg.get("num_key_value_heads") or H
    m: dict[str, Any] = {
        "family": "llada2" if llada2 else "sdar", "L": cfg["num_hidden_layers"], "H": H, "Hkv": Hkv, "hd": hd,
        "eps": cfg["rms_norm_eps"], "theta": float(cfg["rope_theta"]),
        "rd": int(hd * cfg.get("partial_rotary_factor", 1.0)) if llada2 else hd,
        "emb": sd["model.word_embeddings.weight" if llada2 else "model.embed_tokens.weight"],
        "lnf": sd["model.norm.weight"], "head": sd["lm_head.weight"], "layers": []}
    for i in range(m["L"]):
        p = f"model.layers.{i}."
        w: dict[str, Any] = {"an": sd[p + "input_layernorm.weight"], "fn": sd[p + "post_attention_layernorm.weight"]}
        if llada2:
            qkv = sd[p + "attention.query_key_value.weight"]
            w["q"], w["k"], w["v"] = qkv[:H * hd], qkv[H * hd:(H + Hkv) * hd], qkv[(H + Hkv) * hd:]
            w["o"] = sd[p + "attention.dense.weight"]
            w["qn"] = sd.get(p + "attention.query_layernorm.weight")
            w["kn"] = sd.get(p + "attention.key_layernorm.weight")
        else:
            for part in "qkvo":
                w[part] = sd[f"{p}self_attn.{part}_proj.weight"]
            w["qn"], w["kn"] = sd[p + "self_attn.q_norm.weight"], sd[p + "self_attn.k_norm.weight"]
        if llada2 and cfg.get("num_experts") and i >= cfg.get("first_k_dense_replace", 0):
            E = cfg["num_experts"]
            mp = p + "mlp."
            w["moe"] = {
                "r": sd[mp + "gate.weight"], "bias": sd.get(mp + "gate.expert_bias"),
                "experts": [tuple(sd[f"{mp}experts.{e}.{n}_proj.weight"] for n in ("gate", "up", "down"))
                            for e in range(E)],
                "shared": tuple(sd[f"{mp}shared_experts.{n}_proj.weight"] for n in ("gate", "up", "down"))
                if cfg.get("num_shared_experts") else None,
                "k": cfg["num_experts_per_tok"], "groups": cfg.get("n_group", 1), "keep": cfg.get("topk_group", 1),
                "scale": float(cfg.get("routed_scaling_factor", 1.0)), "score": cfg.get("score_function", "sigmoid"),
                "renorm": cfg.get("norm_topk_prob", True)}
        else:
            w["mlp"] = tuple(sd[f"{p}mlp.{n}_proj.weight"] for n in ("gate", "up", "down"))
        m["layers"].append(w)
    return m


def _ref_rope_partial(x: torch.Tensor, pos: torch.Tensor, theta: float, rd: int) -> torch.Tensor:
    """Rotate dims [0, rd) of each head as pairs (j, j + rd/2) by pos * theta^(-2j/rd); the rest
    unchanged."""
    half = rd // 2
    freq = theta ** (-2.0 * torch.arange(half, dtype=torch.float64) / rd)
    ang = pos.double()[:, None] * freq[None]
    c, s = ang.cos()[:, None, :], ang.sin()[:, None, :]
    a, b = x[..., :half], x[..., half:rd]
    return torch.cat([a * c - b * s, b * c + a * s, x[..., rd:]], dim=-1)


def _ref_swiglu(x: torch.Tensor, g: torch.Tensor, u: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    a = x @ g.T
    return (a * torch.sigmoid(a) * (x @ u.T)) @ d.T


def _ref_moe_token(mo: dict, x: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """One token's MoE output and the experts it chose (written per token, on purpose)."""
    logits = mo["r"] @ x
    E, G = logits.shape[0], mo["groups"]
    per = E // G
    if mo["score"] == "sigmoid":
        score = 1.0 / (1.0 + torch.exp(-logits))
        pick = score + (mo["bias"] if mo["bias"] is not None else 0.0)
        gscore = [sorted(pick[g * per:(g + 1) * per].tolist(), reverse=True)[:2] for g in range(G)]
        gscore = [sum(v) for v in gscore]
    else:
        score = torch.exp(logits - logits.max())
        score = score / score.sum()
        pick = score
        gscore = [max(pick[g * per:(g + 1) * per].tolist()) for g in range(G)]
    groups = sorted(range(G), key=lambda g: -gscore[g])[:mo["keep"]]
    eligible = [e for e in range(E) if e // per in groups]
    chosen = sorted(eligible, key=lambda e: -float(pick[e]))[:mo["k"]]
    wts = [float(score[e]) for e in chosen]
    if mo["renorm"] and mo["k"] > 1:
        tot = sum(wts) + 1e-20
        wts = [v / tot for v in wts]
    out = torch.zeros_like(x)
    for e, wt in zip(chosen, wts):
        out = out + mo["scale"] * wt * _ref_swiglu(x[None], *mo["experts"][e])[0]
    if mo["shared"] is not None:
        out = out + _ref_swiglu(x[None], *mo["shared"])[0]
    return out, chosen


def reference_block_logits(m: dict, ids: Sequence[int], block_length: int,
                           routes: list | None = None) -> torch.Tensor:
    """Logits [N, V] (float64, unshifted) of the whole sequence with block-causal attention: the
    query at position i sees key j iff j // block_length <= i // block_length. ``routes``, when a
    list, receives (layer, position, chosen experts) of every MoE token."""
    N = len(ids)
    pos = torch.arange(N)
    x = m["emb"][torch.tensor(list(ids))].clone()
    H, Hkv, hd = m["H"], m["Hkv"], m["hd"]
    allowed = (pos[None, :] // block_length) <= (pos[:, None] // block_length)  # [N, N] fine here: tiny
    for li, w in enumerate(m["layers"]):
        hn = _rms(x, w["an"], m["eps"])
        q, k, v = (hn @ w["q"].T).view(N, H, hd), (hn @ w["k"].T).view(N, Hkv, hd), (hn @ w["v"].T).view(N, Hkv, hd)
        if w["qn"] is not None:
            q, k = _rms(q, w["qn"], m["eps"]), _rms(k, w["kn"], m["eps"])
        q, k = _ref_rope_partial(q, pos, m["theta"], m["rd"]), _ref_rope_partial(k, pos, m["theta"], m["rd"])
        heads = []
        for h in range(H):
            kh, vh = k[:, h // (H // Hkv)], v[:, h // (H // Hkv)]
            s = (q[:, h] @ kh.T) / math.sqrt(hd)
            s = s.masked_fill(~allowed, float("-inf"))
            heads.append(torch.softmax(s, dim=-1) @ vh)
        x = x + torch.cat(heads, dim=-1) @ w["o"].T
        hn = _rms(x, w["fn"], m["eps"])
        if "moe" in w:
            rows = []
            for i in range(N):
                y, chosen = _ref_moe_token(w["moe"], hn[i])
                rows.append(y)
                if routes is not None:
                    routes.append((li, i, tuple(chosen)))
            x = x + torch.stack(rows)
        else:
            x = x + _ref_swiglu(hn, *w["mlp"])
    return _rms(x, m["lnf"], m["eps"]) @ m["head"].T
