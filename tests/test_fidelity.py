"""Fidelity evidence (issue 12, sections 1 and 4).

1. A planted model (bicache_sgl.testing_planted) whose safe prefix-reuse depth is K by
   construction: its prefix state is context-free up to layer K and context-dependent after it, and
   its answer reads that dependence. Through the real Engine, reuse deeper than K (``naive``,
   ``fixed:N`` with N > K) changes the answer, reuse at depth <= K (``fixed:N``, ``bicache`` with a
   profile <= K) gives exactly the tokens of ``off``; calibration (both criteria, through its CLI)
   finds K at every r.
2. The depth-d forward against an independent reference written here with plain torch ops from
   the checkpoint's tensors (float64, unbatched, no code shared with bicache_sgl.models): the prefix
   state captured by the runtime in ANOTHER context, then reused at every depth d, for several
   prefix fractions r, LLaDA (with and without GQA) and Dream (GQA, shifted logits); logits agree to
   1e-5. And same-context reuse through the Engine: the first-step logits of a repeated request
   reusing its own earlier prefix at depth d equal those of the first run for every d.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from bicache_sgl import Engine
from bicache_sgl.testing import make_tiny_llada
from bicache_sgl.testing_planted import make_planted_llada

K = 2  # the planted model's safe depth
L_PLANTED = 6
G = 8  # generation positions (one block)
SP = {"temperature": 0, "max_new_tokens": G, "block_length": G}
# no digits in the shared prefix; one digit per question
PREFIX = "System: answer with the digit that the question holds. Be brief and exact. " * 2
Q_A = "Question 3: which digit?"
Q_B = "Question 7: which one is it?"


@pytest.fixture(scope="module")
def planted(tmp_path_factory) -> str:
    return make_planted_llada(tmp_path_factory.mktemp("planted"), k=K, n_layers=L_PLANTED)


@pytest.fixture(scope="module")
def tiny_llada_gqa(tmp_path_factory) -> str:
    return make_tiny_llada(tmp_path_factory.mktemp("llada_gqa"), n_kv_heads=2, seed=3)


# ------------------------------------------------------------------------------ planted model
def test_planted_checkpoint_is_a_normal_llada_checkpoint(planted):
    from bicache_sgl.models.loader import load_model, load_tokenizer
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in Path(planted).iterdir()}
    cfg = json.loads((Path(planted) / "config.json").read_text())
    assert cfg["architectures"] == ["LLaDAModelLM"] and cfg["n_layers"] == L_PLANTED
    model, mc = load_model(planted, "float32")
    tok = load_tokenizer(planted)
    for q, want in ((Q_A, "3"), (Q_B, "7"), ("Question: none here?", "-")):
        ids = tok.encode(PREFIX + q) + [mc.mask_token_id] * G
        logits = model.forward_dense(torch.tensor(ids))[-G:]
        assert tok.decode(logits.argmax(-1)) == want * G
        top2 = logits.topk(2, dim=-1).values
        assert float((top2[:, 0] - top2[:, 1]).min()) > 20  # decisive: greedy is deterministic


def test_planted_prefix_state_is_context_free_up_to_k(planted):
    """The prefix's residual entering layers 0..K and its K/V of layers 0..K do not depend on the
    rest of the sequence (different question, different generation length); from layer K+1 on
    they do, by a wide margin. (Layer K's K/V are a function of the residual entering layer K, which
    a request resumed at depth K takes from the cache: so they are context-free too, necessarily.)"""
    from bicache_sgl.models.loader import load_model, load_tokenizer
    model, mc = load_model(planted, "float32")
    tok = load_tokenizer(planted)
    p = len(tok.encode(PREFIX))
    a = tok.encode(PREFIX + Q_A) + [mc.mask_token_id] * G
    b = tok.encode(PREFIX + Q_B) + [mc.mask_token_id] * (3 * G)
    assert a[:p] == b[:p]
    _, sa = model.forward_dense(torch.tensor(a), return_states=True)
    _, sb = model.forward_dense(torch.tensor(b), return_states=True)
    for layer, ((ha, ka, va), (hb, kb, vb)) in enumerate(zip(sa, sb)):
        diffs = [float((x[:p] - y[:p]).abs().max()) for x, y in ((ha, hb), (ka, kb), (va, vb))]
        if layer <= K:
            assert max(diffs) < 1e-6, (layer, diffs)
        else:
            assert min(diffs) > 0.5, (layer, diffs)
    # and the layers differ from one another below K (the relay moves the token's features), so a
    # runtime resuming the prefix from the wrong layer's residual would be caught
    for layer in range(1, K + 1):
        assert float((sa[layer][0] - sa[layer - 1][0]).abs().max()) > 0.5


class _Store:
    """A row store for hand-built forwards: prefix rows hold a cached state (K/V, and the residual
    a sequence resumes from), private rows the sequences' own K/V (as the engine lays them out)."""

    def __init__(self, cfg, n_private: int, n_prefix: int, dev):
        from bicache_sgl.kv_cache.store import KVStore
        self.cfg, self.dev = cfg, dev
        self.store = KVStore.allocate(n_prefix + n_private, cfg.n_kv_heads, cfg.head_dim, torch.float32, dev,
                                      prefix_rows=n_prefix, hidden=cfg.hidden_size)
        self._prefix, self._private = 0, n_prefix

    def prefix(self, k, v, h=None) -> np.ndarray:
        n = k.shape[0]
        rows = np.arange(self._prefix, self._prefix + n)
        self._prefix += n
        idx = torch.from_numpy(rows)
        self.store.k[idx], self.store.v[idx] = k.float(), v.float()
        if h is not None:
            self.store.h[idx] = h.float()
        return rows

    def seq(self, n_pos: int):
        from bicache_sgl.kv_cache.store import SeqKV
        L = self.cfg.n_layers
        rows = np.arange(self._private, self._private + L * n_pos)
        self._private += L * n_pos
        return SeqKV(rows.reshape(L, n_pos).copy(), rows)

    def reuse(self, n_pos: int, p: int, d: int, kvs, resume_h, a: int = 0):
        """A sequence whose positions [a, p) read cached K/V ``kvs[li] = (k, v)`` at layers < d
        and resume at d from ``resume_h`` (stored with the rows of layer d - 1)."""
        kv = self.seq(n_pos)
        resume_rows = None
        for li in range(d):
            h = resume_h if li == d - 1 and d < self.cfg.n_layers else None
            rows = self.prefix(kvs[li][0][a:p], kvs[li][1][a:p], h)
            kv.rows[li, a:p] = rows
            if h is not None:
                resume_rows = rows
        return kv, resume_rows


def test_planted_model_catches_a_resume_from_the_wrong_layer(planted):
    """What makes "fixed:N equals off for N <= K" a check of the runtime and not a tautology: resuming
    the reused prefix at depth d <= K from the residual entering layer d - 1 (an off-by-one in the
    runtime) loses the token features the gather layer needs, and the answer becomes "-"."""
    from bicache_sgl.attention import create_backend
    from bicache_sgl.models.forward_batch import ForwardBatch, SeqWork
    from bicache_sgl.models.loader import load_model, load_tokenizer
    model, mc = load_model(planted, "float32")
    tok = load_tokenizer(planted)
    dev = torch.device("cpu")
    p = len(tok.encode(PREFIX))
    a = tok.encode(PREFIX + Q_A) + [mc.mask_token_id] * G
    b = tok.encode(PREFIX + Q_B) + [mc.mask_token_id] * G
    _, states = model.forward_dense(torch.tensor(a), return_states=True)  # the prefix in A's context
    N = len(b)
    for d in range(1, K + 1):
        answers = []
        for resume_layer in (d, d - 1):
            st = _Store(mc, mc.n_layers * N, mc.n_layers * p, dev)
            kv, resume_rows = st.reuse(N, p, d, [(s[1], s[2]) for s in states], states[resume_layer][0][:p])
            work = SeqWork(kv, torch.tensor(b), np.arange(N), np.arange(N - G, N), depth=d, skip=p,
                           resume_rows=resume_rows)
            out = model.forward_batch(ForwardBatch([work], dev, st.store).build(mc.n_layers),
                                      create_backend("torch", dev))
            answers.append(tok.decode(out.argmax(-1)))
        assert answers == ["7" * G, "-" * G], (d, answers)


def _engine(folder, mode, **kw):
    return Engine(folder, prefix_cache=mode, device="cpu", threshold=None, **kw)


def _a_then_b(folder, mode, warm=None, **kw):
    """Request A, then request B sharing A's long prefix with another question (B can reuse the
    prefix state A's first forward stored, computed in A's context)."""
    eng = _engine(folder, mode, **kw)
    try:
        if warm is not None:
            eng.generate(warm, {"max_new_tokens": 0})
        ra = eng.generate(PREFIX + Q_A, SP)
        rb = eng.generate(PREFIX + Q_B, SP)
        if warm is None and mode != "off":
            # B's prefix was found in the tree: every prefix token but the last one (each prompt's last
            # token is always recomputed)
            assert rb["meta_info"]["cached_tokens"] >= len(PREFIX) - 1, rb["meta_info"]
        return ra, rb
    finally:
        eng.shutdown()


@pytest.fixture(scope="module")
def off_outputs(planted):
    ra, rb = _a_then_b(planted, "off")
    assert ra["text"] == "3" * G and rb["text"] == "7" * G
    assert rb["meta_info"]["cached_tokens"] == 0 and rb["meta_info"]["bicache_depth"] == 0
    return ra, rb


def test_naive_reuse_breaks_the_planted_model(planted, off_outputs):
    ra, rb = _a_then_b(planted, "naive")
    assert rb["meta_info"]["bicache_depth"] == L_PLANTED
    assert ra["output_ids"] == off_outputs[0]["output_ids"]  # A computed its own prefix
    # B answers A's question: its prefix state (all layers) was computed in A's context
    assert rb["text"] == "3" * G != off_outputs[1]["text"]
    # a prefix-only fill (an explicit cache_prefix request) breaks it too: no digit in that context
    _, rb2 = _a_then_b(planted, "naive", warm=PREFIX)
    assert rb2["meta_info"]["bicache_depth"] == L_PLANTED
    assert rb2["text"] == "-" * G


@pytest.mark.parametrize("n", range(L_PLANTED + 1))
def test_fixed_depth_is_exact_up_to_k_and_breaks_beyond(planted, off_outputs, n):
    ra, rb = _a_then_b(planted, f"fixed:{n}")
    m = rb["meta_info"]
    assert m["bicache_depth"] == n
    if n > 0:
        assert m["reused_prefix_tokens"] == m["cached_tokens"] >= len(PREFIX) - 1
    assert ra["output_ids"] == off_outputs[0]["output_ids"]
    if n <= K:
        assert rb["output_ids"] == off_outputs[1]["output_ids"]
    else:
        assert rb["output_ids"] != off_outputs[1]["output_ids"] and rb["text"] == "3" * G


def _profile(tmp_path, table, name="profile.json"):
    from bicache_sgl.bicache.profile import BicacheProfile
    path = tmp_path / name
    BicacheProfile(tuple(table), L_PLANTED, model="planted").save(path)
    return str(path)


def test_bicache_with_a_profile_at_most_k_equals_off(planted, off_outputs, tmp_path):
    prof = _profile(tmp_path, [(0, 0), (20, 1), (50, K)])
    ra, rb = _a_then_b(planted, "bicache", bicache_profile=prof)
    assert rb["meta_info"]["bicache_depth"] == K  # B's r is ~0.8: the profile's deepest entry
    assert [ra["output_ids"], rb["output_ids"]] == [o["output_ids"] for o in off_outputs]
    # the profile is what makes bicache safe: one layer too deep and the answer is A's
    prof = _profile(tmp_path, [(0, 0), (50, K + 1)], "too_deep.json")
    _, rb = _a_then_b(planted, "bicache", bicache_profile=prof)
    assert rb["meta_info"]["bicache_depth"] == K + 1 and rb["text"] == "3" * G


# ------------------------------------------------------------------------------- calibration
FRACTIONS = [10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0, 90.0]
CAL_GEN = 4  # the calibration's generation region (--gen-length, one block)


def _calibration_data(path: Path) -> str:
    """prefix/suffix pairs: one shared prefix without digits; per bucket, two questions (digits 3
    and 7) whose length puts the whole request (calibration keeps a question whole and adds only the
    generation region) at that bucket's r: |prefix| / (|prefix + suffix| + CAL_GEN) = 60 / N with
    N = ceil(60 / r), i.e. at r or just below (the byte tokenizer: one token per character)."""
    filler = " is the question: tell me which digit it is, please, in as few characters as you can" * 7
    prefix = PREFIX[:60]
    with path.open("w") as f:
        for r in FRACTIONS:
            n = math.ceil(len(prefix) / (r / 100) - 1e-9)
            for d in "37":
                f.write(json.dumps({"prefix": prefix, "suffix": d + filler[:n - CAL_GEN - len(prefix) - 1]}) + "\n")
    return str(path)


def _calibrate(planted, tmp_path, *args) -> dict:
    out = tmp_path / "profile.json"
    cmd = [sys.executable, "-m", "bicache_sgl.calibrate", "--model-path", planted,
           "--data", _calibration_data(tmp_path / "data.jsonl"), "--out", str(out), "--plot", "none",
           "--gen-length", str(CAL_GEN), "--block-length", str(CAL_GEN), "--device", "cpu", "--num-threads", "1",
           "--no-progress",
           *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    r = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return json.loads(out.read_text())


@pytest.mark.parametrize("criterion", ["kv-cosine", "agreement"])
def test_calibration_finds_k_at_every_r(planted, tmp_path, criterion):
    """Both criteria, with the CLI's defaults otherwise (the cached state computed inside another
    request's context, the ``resume`` depth rule)."""
    res = _calibrate(planted, tmp_path, "--criterion", criterion, "--fractions", ",".join(f"{r:g}" for r in FRACTIONS))
    table = {float(r): int(b) for r, b in res["table"]}
    assert [r for r in table if r > 0] == FRACTIONS, table  # every bucket was measured
    assert all(b <= K for b in table.values()), f"calibration allows more than the safe depth {K}: {table}"
    # ... and it is not needlessly shallow either: layers <= K are exactly context-free
    assert all(b == K for r, b in table.items() if r > 0), table


# ------------------------------------------------------- independent reference of the depth-d forward
def _raw_model(folder: str) -> dict:
    """The checkpoint's tensors, read with safetensors alone, in float64 and plain names."""
    from safetensors.torch import load_file
    cfg = json.loads((Path(folder) / "config.json").read_text())
    sd = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        sd.update({k: v.double() for k, v in load_file(str(f)).items()})
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
        m["layers"].append(w)
    m["hd"] = m["D"] // m["H"]
    return m


def _rms(x, g, eps):
    return g * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def _rope(x, pos, theta):
    """x [n, heads, hd] at positions pos [n]; rotates the pairs (j, j + hd/2) by pos * theta^(-2j/hd)."""
    hd = x.shape[-1]
    half = hd // 2
    freq = theta ** (-2.0 * torch.arange(half, dtype=torch.float64) / hd)
    ang = pos.double()[:, None] * freq[None]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def _proj(x, w, b):
    return x @ w.T + (b if b is not None else 0.0)


def _qkv(m, w, x, pos):
    n, H, Hkv, hd = x.shape[0], m["H"], m["Hkv"], m["hd"]
    hn = _rms(x, w["an"], m["eps"])
    q = _rope(_proj(hn, w["q"], w["qb"]).view(n, H, hd), pos, m["theta"])
    k = _rope(_proj(hn, w["k"], w["kb"]).view(n, Hkv, hd), pos, m["theta"])
    v = _proj(hn, w["v"], w["vb"]).view(n, Hkv, hd)
    return q, k, v


def _attend_and_mlp(m, w, x, q, keys, vals):
    """x [n, D] rows whose queries q attend (bidirectionally) to keys/vals [N, Hkv, hd]."""
    H, Hkv, hd = m["H"], m["Hkv"], m["hd"]
    heads = []
    for h in range(H):
        kh, vh = keys[:, h // (H // Hkv)], vals[:, h // (H // Hkv)]
        heads.append(torch.softmax(q[:, h] @ kh.T / math.sqrt(hd), dim=-1) @ vh)
    x = x + torch.cat(heads, dim=-1) @ w["o"].T
    hn = _rms(x, w["fn"], m["eps"])
    gate = hn @ w["g"].T
    return x + (gate * torch.sigmoid(gate) * (hn @ w["u"].T)) @ w["dn"].T


def reference_states(m, ids):
    """Plain dense forward: per layer (residual entering it, K after RoPE, V), all positions."""
    pos = torch.arange(len(ids))
    x = m["emb"][torch.tensor(ids)]
    states = []
    for w in m["layers"]:
        q, k, v = _qkv(m, w, x, pos)
        states.append((x, k, v))
        x = _attend_and_mlp(m, w, x, q, k, v)
    return states


def reference_depth_forward(m, ids, p, d, cached, a=0):
    """Outputs (unshifted logits, [N, V]) of the sequence ``ids`` whose positions [a, p) reuse
    ``cached`` (reference_states of another sequence with the same first p tokens) at depth d:
    in layers < d those positions are not computed and their K/V are the cached ones; at layer d
    they resume from the cached residual entering layer d. Positions < a (a recomputed head) and
    >= p are computed at every layer. Rows in [a, p) are NaN when d == L."""
    N, L = len(ids), m["L"]
    pos = torch.arange(N)
    x = m["emb"][torch.tensor(ids)].clone()
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


def _sequences(mask_id, p, n_rest, seed):
    """A main sequence and another context sharing its first p tokens (byte ids), each ending in G masks."""
    g = np.random.default_rng(seed)
    prefix = g.integers(0, 256, p).tolist()
    main = prefix + g.integers(0, 256, n_rest).tolist() + [mask_id] * G
    other = prefix + g.integers(0, 256, n_rest + 3).tolist() + [mask_id] * (G + 4)
    return main, other


@pytest.mark.parametrize("fixture", ["tiny_llada", "tiny_llada_gqa", "tiny_dream"])
def test_depth_d_forward_matches_an_independent_reference(fixture, request):
    """The runtime's packed forward (``forward_batch``) of a sequence whose first p positions reuse
    a prefix state computed in another context, at every depth d, alone and all depths in one
    batch, against ``reference_depth_forward`` fed the same cached state."""
    from bicache_sgl.attention import create_backend
    from bicache_sgl.models.forward_batch import ForwardBatch, SeqWork
    from bicache_sgl.models.loader import load_model

    folder = request.getfixturevalue(fixture)
    model, cfg = load_model(folder, "float32")
    m = _raw_model(folder)
    L, shift, dev = cfg.n_layers, cfg.logit_shift, torch.device("cpu")
    assert shift == m["shift"] and (fixture == "tiny_llada" or cfg.n_kv_heads < cfg.n_heads)
    attn = create_backend("torch", dev)

    for p, n_rest in ((3, 20), (12, 10), (24, 4)):  # r = p / N from 0.10 to 0.67
        main, other = _sequences(cfg.mask_token_id, p, n_rest, seed=p)
        N = len(main)
        want = np.arange(N - G, N)  # the masked positions; their logits come from rows want - shift
        # the cached state: the prefix inside the other context's dense forward (the reference's),
        # which the runtime's own dense forward reproduces
        cached = reference_states(m, other)
        _, ours = model.forward_dense(torch.tensor(other), return_states=True)
        for li, ((h_r, k_r, v_r), (h_o, k_o, v_o)) in enumerate(zip(cached, ours)):
            for a, b in ((h_r, h_o), (k_r, k_o), (v_r, v_o)):
                assert torch.allclose(a, b.double(), atol=1e-5), (fixture, li)

        def work(st, d, a=0, main=main, p=p, cached=cached, want=want):
            """The runtime's unit of work: this sequence at depth d, its positions [a, p) skipped
            below d (their K/V read in place from prefix rows, as the engine shares pool rows)."""
            resume = cached[d][0][a:p] if 0 < d < L else None
            kv, resume_rows = st.reuse(len(main), p, d, [(c[1], c[2]) for c in cached], resume, a)
            return SeqWork(kv, torch.tensor(main), np.arange(len(main)), want - shift, depth=d, skip=p - a,
                           skip_from=a, resume_rows=resume_rows)

        def store(N=N, p=p):
            return _Store(cfg, 2 * (L + 1) * L * N, 2 * (L + 1) * L * p, dev)

        # the reused span from position 0, and one that leaves a recomputed head of p // 3 tokens
        by_a = {}
        for a in (0, p // 3):
            refs = by_a[a] = [reference_depth_forward(m, main, p, d, cached, a)[want - shift] for d in range(L + 1)]
            # every depth alone, then all depths in one batch (mixed depths in one forward)
            alone = []
            for d in range(L + 1):
                st = store()
                alone.append(model.forward_batch(ForwardBatch([work(st, d, a)], dev, st.store).build(L),
                                                 attn).double())
            st = store()
            mixed = model.forward_batch(ForwardBatch([work(st, d, a) for d in range(L + 1)], dev,
                                                     st.store).build(L), attn).double()
            for d in range(L + 1):
                err = float((alone[d] - refs[d]).abs().max())
                assert err < 1e-5, (fixture, p, a, d, err)
                err = float((mixed[d * G:(d + 1) * G] - refs[d]).abs().max())
                assert err < 1e-5, (fixture, p, a, d, "mixed", err)
            if a:  # a head recomputed: the result differs from reusing the whole prefix
                assert any(float((refs[d] - by_a[0][d]).abs().max()) > 1e-4 for d in range(1, L + 1)), (fixture, p)
        refs = by_a[0]
        # the comparison has teeth: reuse from another context moves the logits far beyond the
        # tolerance at every depth (at d = 1 through the residual entering layer 1)
        for d in range(1, L + 1):
            assert float((refs[d] - refs[0]).abs().max()) > 1e-2, (fixture, p, d)


# ------------------------------------------------------------------------ same-context reuse
def _record_logits(eng) -> list[torch.Tensor]:
    """Every batched forward's logits from now on, in order (the model is called as
    ``model.forward_batch(fb, attn)`` by the engine)."""
    seen: list[torch.Tensor] = []
    orig = eng.model.forward_batch

    def record(fb, *a, **kw):
        out = orig(fb, *a, **kw)
        seen.append(out.clone())
        return out
    eng.model.forward_batch = record
    return seen


@pytest.mark.parametrize("fixture", ["tiny_llada", "tiny_dream"])
def test_same_context_reuse_gives_the_same_first_step_logits_at_every_depth(fixture, request):
    """Request A, then A' identical to it reusing the prefix A stored at depth d: the stored state
    came from the very same context, so A''s first forward equals A's (to fp32 rounding)."""
    from bicache_sgl.models.loader import load_model_config
    folder = request.getfixturevalue(fixture)
    prompt = "System: you are a helpful assistant. Examples follow.\nQuestion: a\nAnswer: 1\n\n" * 2 + "Q: why?"
    L = load_model_config(folder).n_layers
    for d in range(L + 1):
        eng = _engine(folder, f"fixed:{d}")
        first = _record_logits(eng)
        try:
            ra = eng.generate(prompt, SP)
            n_a = len(first)
            rb = eng.generate(prompt, SP)
        finally:
            eng.shutdown()
        assert rb["meta_info"]["bicache_depth"] == d
        assert rb["meta_info"]["cached_tokens"] == len(eng.encode(prompt)) - 1
        la, lb = first[0], first[n_a]
        assert la.shape == lb.shape == (G, la.shape[1])
        err = float((la - lb).abs().max())
        assert err < 1e-5, (fixture, d, err)
        assert ra["output_ids"] == rb["output_ids"]
