"""Fidelity evidence (issue 12, sections 1 and 4).

1. A planted model (bicache_sgl.testing.planted) whose safe prefix-reuse depth is K by
   construction: its prefix state is context-free up to layer K and context-dependent after it, and
   its answer reads that dependence. Through the real Engine, reuse deeper than K (``naive``,
   ``fixed:N`` with N > K) changes the answer, reuse at depth <= K (``fixed:N``, ``bicache`` with a
   profile <= K) gives exactly the tokens of ``off``; calibration (both criteria, through its CLI)
   finds K at every r.
2. The depth-d forward against an independent reference (bicache_sgl.reference: plain torch ops on
   the checkpoint's tensors, float64, unbatched, no code shared with bicache_sgl.models): the prefix
   state captured by the runtime in ANOTHER context, then reused at every depth d, for several
   prefix fractions r, LLaDA (with and without GQA), Dream (GQA, shifted logits) and LLaDA-MoE
   (QK-norm, routed experts); logits agree to 1e-5. And same-context reuse through the Engine: the
   first-step logits of a repeated request reusing its own earlier prefix at depth d equal those of
   the first run for every d.
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
from bicache_sgl.selftest.depth_forward import DEFAULT_CASES, PrefixRowStore, compare_depth_forward
from bicache_sgl.testing import make_tiny_llada
from bicache_sgl.testing.planted import make_planted_llada

K = 2  # the planted model's safe depth
L_PLANTED = 6
G = 8  # generation positions (one block)
SP = {"temperature": 0, "max_new_tokens": G, "block_length": G}
# no digits in the shared prefix; one digit per question
# ends with a blank line: a segment boundary, so the span cut (docs/prefix_cache.md) leaves the
# whole prefix reusable and these tests exercise the depth rule on it
PREFIX = "System: answer with the digit that the question holds. Be brief and exact. " * 2 + "\n\n"
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
            st = PrefixRowStore(mc, mc.n_layers * N, mc.n_layers * p, dev)
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
        # the match runs into "Question " (both questions open with it); the span ends at the prefix's
        # blank line, before the segment the two questions decide
        assert m["reused_prefix_tokens"] == len(PREFIX) and m["cached_tokens"] >= len(PREFIX)
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
    prefix = PREFIX[:58] + "\n\n"  # 60 characters ending at a segment boundary (the span cut's)
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
@pytest.mark.parametrize("fixture", ["tiny_llada", "tiny_llada_gqa", "tiny_dream", "tiny_llada_moe"])
def test_depth_d_forward_matches_an_independent_reference(fixture, request):
    """The runtime's packed forward (``forward_batch``) of a sequence whose first p positions reuse
    a prefix state computed in another context, at every depth d, alone and all depths in one
    batch, against ``reference_depth_forward`` (bicache_sgl.reference) fed the same cached state
    (the harness: bicache_sgl.selftest.depth_forward)."""
    from bicache_sgl.attention import create_backend
    from bicache_sgl.models.loader import load_model_config

    folder = request.getfixturevalue(fixture)
    cfg = load_model_config(folder)
    dev = torch.device("cpu")
    rep = compare_depth_forward(folder, dev, create_backend("torch", dev))
    L = cfg.n_layers
    assert rep.logit_shift == rep.ref_shift and (fixture in ("tiny_llada", "tiny_llada_moe")
                                                 or cfg.n_kv_heads < cfg.n_heads)
    # the runtime's dense forward reproduces the reference's cached state of the other context
    assert rep.states_err < 1e-5, (fixture, rep.states_err)
    # every depth alone, then all depths in one batch (mixed depths in one forward), for the span
    # from position 0 and one that leaves a recomputed head of p // 3 tokens
    assert len(rep.errors) == len(DEFAULT_CASES) * 2 * (L + 1) * 2
    for p, a, d, kind, err in rep.errors:
        assert err < 1e-5, (fixture, p, a, d, kind, err)
    # a head recomputed: the result differs from reusing the whole prefix
    assert len(rep.head_effect) == len(DEFAULT_CASES)
    for p, diff in rep.head_effect.items():
        assert diff > 1e-4, (fixture, p, diff)
    # the comparison has teeth: reuse from another context moves the logits far beyond the
    # tolerance at every depth (at d = 1 through the residual entering layer 1)
    assert len(rep.reuse_effect) == len(DEFAULT_CASES) * L
    for p, d, diff in rep.reuse_effect:
        assert diff > 1e-2, (fixture, p, d, diff)


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
