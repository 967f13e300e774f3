"""Naive reuse breaks a LLaDA-MoE and bicache does not (issue 29, section 3): the planted model
rebuilt in the LLaDA-MoE format with its answer decided by a router (bicache_sgl.testing.
planted_moe, safe depth K by construction). Through the real Engine: reuse deeper than K
(``naive``, ``fixed:K+1``) answers the other context's digit, depth <= K (``fixed:K``, ``bicache``
with a profile <= K) gives exactly ``off``'s tokens; calibration (the agreement criterion, through
its CLI) finds at most K. The model is a normal LLaDA-MoE checkpoint: the independent reference
agrees with the runtime on it, and its routing differs between tokens and contexts."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from bicache_sgl import Engine
from bicache_sgl.bicache.profile import BicacheProfile
from bicache_sgl.models.loader import load_model
from bicache_sgl.reference import load_reference_model, reference_logits
from bicache_sgl.testing.planted_moe import make_planted_llada_moe

K, L = 2, 6
G = 8
SP = {"temperature": 0, "max_new_tokens": G, "block_length": G}
# ends at a segment boundary (a blank line): the span cut lets B reuse A's rows up to there
PREFIX = "System: answer with the digit that the question holds. Be brief and exact. " * 2 + "\n\n"
Q_A, Q_B = "Question 3: which digit?", "Question 7: which digit?"


@pytest.fixture(scope="module")
def planted_moe(tmp_path_factory) -> str:
    return make_planted_llada_moe(tmp_path_factory.mktemp("planted_moe"), k=K, n_layers=L)


def test_a_normal_llada_moe_checkpoint_whose_routing_carries_the_answer(planted_moe):
    model, cfg = load_model(planted_moe, "float32")
    assert cfg.arch == "llada_moe" and cfg.qk_norm and cfg.moe.top_k == 2
    from bicache_sgl.models.loader import load_tokenizer
    tok = load_tokenizer(planted_moe)
    ids = tok.encode(PREFIX + Q_A) + [cfg.mask_token_id] * G
    ref = reference_logits(load_reference_model(planted_moe), ids).float()
    routed: list[torch.Tensor] = []
    hooks = [layer.router.register_forward_hook(lambda m, i, o: routed.append(o.argmax(-1))) for layer in model.layers]
    try:
        ours = model.forward_dense(torch.tensor(ids))
    finally:
        for h in hooks:
            h.remove()
    assert float((ours - ref).abs().max()) < 1e-4 * float(ref.abs().max())
    answer = tok.convert_tokens_to_ids("3")
    assert (ours[-G:].argmax(-1) == answer).all()
    # relay layers: digits to expert 0, the other tokens to expert 1
    digit = torch.tensor([t == answer for t in ids])
    for li in range(K):
        assert (routed[li][digit] == 0).all() and (routed[li][~digit] == 1).all()
    # read layer: every position (the generated ones included) goes to the expert of digit 3
    assert (routed[K + 1] == 3).all()


def _a_then_b(folder, mode, **kw):
    eng = Engine(folder, prefix_cache=mode, device="cpu", threshold=None, **kw)
    try:
        ra = eng.generate(PREFIX + Q_A, SP)
        rb = eng.generate(PREFIX + Q_B, SP)
        if mode != "off":
            assert rb["meta_info"]["cached_tokens"] >= len(PREFIX) - 1, rb["meta_info"]
        return ra, rb
    finally:
        eng.shutdown()


def _profile(tmp_path, table, name):
    path = tmp_path / name
    BicacheProfile(tuple(table), L, model="planted-moe").save(path)
    return str(path)


def test_naive_reuse_breaks_and_depth_at_most_k_equals_off(planted_moe, tmp_path):
    off = _a_then_b(planted_moe, "off")
    assert off[0]["text"] == "3" * G and off[1]["text"] == "7" * G
    _, rb = _a_then_b(planted_moe, "naive")
    assert rb["meta_info"]["bicache_depth"] == L and rb["text"] == "3" * G  # A's digit: A's context's routing
    for d, want in ((K, "7"), (K + 1, "3")):
        _, rb = _a_then_b(planted_moe, f"fixed:{d}")
        assert rb["meta_info"]["bicache_depth"] == d and rb["text"] == want * G, d
    prof = _profile(tmp_path, [(0, 0), (20, 1), (50, K)], "ok.json")
    ra, rb = _a_then_b(planted_moe, "bicache", bicache_profile=prof)
    assert rb["meta_info"]["bicache_depth"] == K
    assert [ra["output_ids"], rb["output_ids"]] == [o["output_ids"] for o in off]


def test_calibration_finds_at_most_k(planted_moe, tmp_path):
    """The agreement criterion through the CLI, at two prefix fractions r (each request's length
    puts it at its bucket: |prefix| / (|prefix + suffix| + gen) = r, one token per character)."""
    filler = " is the question: tell me which digit it is, please, in as few characters as you can" * 7
    prefix, gen, fractions = PREFIX[:58] + "\n\n", 4, (30.0, 70.0)  # ends at a boundary: the span cut
    data = tmp_path / "data.jsonl"
    with data.open("w") as f:
        for r in fractions:
            n = math.ceil(len(prefix) / (r / 100) - 1e-9)
            for d in "37":
                f.write(json.dumps({"prefix": prefix, "suffix": d + filler[:n - gen - len(prefix) - 1]}) + "\n")
    out = tmp_path / "profile.json"
    cmd = [sys.executable, "-m", "bicache_sgl.calibrate", "--model-path", planted_moe, "--data", str(data),
           "--out", str(out), "--plot", "none", "--criterion", "agreement", "--gen-length", str(gen),
           "--block-length", str(gen), "--fractions", ",".join(f"{r:g}" for r in fractions), "--device", "cpu",
           "--num-threads", "1", "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    r = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    table = {float(a): int(b) for a, b in json.loads(out.read_text())["table"]}
    assert [a for a in table if a > 0] == list(fractions), table  # every bucket was measured
    assert all(b <= K for b in table.values()), table  # never deeper than the safe depth
    assert all(b == K for a, b in table.items() if a > 0), table  # ... nor needlessly shallow
