"""Calibration (python -m bicache_sgl.calibrate) on tiny random checkpoints."""

import json
import random

import pytest
import torch

from bicache_sgl import calibrate as cal
from bicache_sgl.bicache.profile import BicacheProfile

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
WORDS = "the model reads a long shared prefix of few shot examples then answers one question".split()


def _text(rng, n_words):
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture()
def prompts_file(tmp_path):
    rng = random.Random(0)
    p = tmp_path / "prompts.jsonl"
    lines = [json.dumps({"prompt": _text(rng, 14)}), "", json.dumps({"text": _text(rng, 18)})]
    p.write_text("\n".join(lines) + "\n")
    return p


@pytest.fixture()
def pairs_file(tmp_path):
    rng = random.Random(1)
    p = tmp_path / "pairs.jsonl"
    p.write_text("".join(json.dumps({"prefix": _text(rng, 12), "suffix": _text(rng, 12)}) + "\n" for _ in range(2)))
    return p


def _check_outputs(out, png, n_layers):
    prof = BicacheProfile.load(out)  # validates strictly increasing r, depths in range, non-decreasing b
    assert prof.n_layers == n_layers
    bs = [b for _, b in prof.table]
    assert bs == sorted(bs)
    assert png.read_bytes()[:8] == PNG_MAGIC
    return prof, json.loads(out.read_text())


def test_kv_cosine_on_prompts(tiny_llada, prompts_file, tmp_path, capsys):
    out, png = tmp_path / "profile.json", tmp_path / "profile.png"
    rc = cal.main(["--model-path", tiny_llada, "--data", str(prompts_file), "--out", str(out), "--plot", str(png),
                   "--fractions", "20,50,80", "--gen-length", "16", "--block-length", "8", "--no-progress"])
    assert rc == 0
    prof, d = _check_outputs(out, png, 4)
    assert prof.criterion == "kv-cosine" and prof.threshold == 0.97
    assert d["samples_per_fraction"] == [2, 2, 2]
    for row_k, row_v, row in zip(d["similarity_k"], d["similarity_v"], d["similarity"]):
        # layer-0 K/V of S depend only on S's tokens and positions: exactly equal in both contexts
        assert row_k[0] == 1.0 and row_v[0] == 1.0 and row[0] == 1.0
        assert len(row) == 4 and all(-1.0 <= x <= 1.0 for x in row)
    # the chosen depths are what the similarity matrix says (layers 0..b all >= threshold)
    for r, raw, row in zip(d["fractions"], d["depth_raw"], d["similarity"]):
        assert raw == cal.depth_from_similarity(row, 0.97)
        assert prof.lookup(r / 100) >= raw
    assert d["agreement"] is None
    text = capsys.readouterr().out
    assert "| r (%) | samples |" in text and str(out) in text

    # the runtime accepts the profile
    from bicache_sgl import Engine
    eng = Engine(tiny_llada, prefix_cache="bicache", bicache_profile=str(out), max_prefix_cache_tokens=64)
    try:
        assert eng.profile.table == prof.table
    finally:
        eng.shutdown()


def test_agreement_on_pairs(tiny_dream, pairs_file, tmp_path):
    out, png = tmp_path / "p.json", tmp_path / "p.png"
    rc = cal.main(["--model-path", tiny_dream, "--data", str(pairs_file), "--out", str(out), "--plot", str(png),
                   "--criterion", "agreement", "--agreement", "0.5", "--fractions", "50,70",
                   "--gen-length", "8", "--block-length", "8", "--no-progress"])
    assert rc == 0
    prof, d = _check_outputs(out, png, 4)
    assert prof.criterion == "agreement" and prof.threshold == 0.5
    assert d["samples_per_fraction"] == [2, 2]
    for agr, sim, raw in zip(d["agreement"], d["similarity"], d["depth_raw"]):
        assert len(agr) == 5  # depths 0..L
        assert agr[0] == 1.0  # depth 0 is bit-for-bit cache-off
        assert raw == cal.depth_from_agreement(agr, 0.5)
        assert sim[0] == 1.0
    # pairs: S is the prefix; the requested fraction is reached by the suffix length
    assert all(abs(m - r / 100) < 0.02 for m, r in zip(d["mean_prefix_fraction"], d["fractions"]))


def test_bad_data_lines_name_the_line(tiny_llada, tmp_path):
    cases = [
        ('{"prompt": "fine"}\n{"prompt": "oops"\n', "line 2: not valid JSON"),
        ('{"prompt": "fine"}\n\n["a list"]\n', "line 3: expected a JSON object"),
        ('{"question": "x"}\n', "line 1: expected"),
        ('{"prefix": "only a prefix"}\n', "line 1: a prefix/suffix pair needs both"),
        ('{"prompt": ""}\n', "line 1: \"prompt\" must be a non-empty string"),
        ('\n\n', "holds no samples"),
    ]
    for i, (content, msg) in enumerate(cases):
        f = tmp_path / f"bad{i}.jsonl"
        f.write_text(content)
        with pytest.raises(SystemExit) as e:
            cal.main(["--model-path", tiny_llada, "--data", str(f), "--out", str(tmp_path / "x.json"),
                      "--plot", "none", "--no-progress"])
        assert str(f) in str(e.value) and msg in str(e.value), (content, str(e.value))
    with pytest.raises(SystemExit, match="does not exist"):
        cal.main(["--model-path", tiny_llada, "--data", str(tmp_path / "missing.jsonl"),
                  "--out", str(tmp_path / "x.json"), "--plot", "none"])
    assert not (tmp_path / "x.json").exists()


def test_help_and_argument_errors(capsys):
    with pytest.raises(SystemExit) as e:
        cal.main(["--help"])
    assert e.value.code == 0
    h = capsys.readouterr().out
    for flag in ("--criterion", "--threshold", "--agreement", "--fractions", "--gen-length", "--plot"):
        assert flag in h
    with pytest.raises(SystemExit):
        cal.main(["--data", "x", "--out", "y", "--fractions", "0,150"])


def test_decision_rules_and_planning():
    sim = [1.0, 0.99, 0.98, 0.5, 0.99]
    assert cal.depth_from_similarity(sim, 0.97, "leading") == 3
    assert cal.depth_from_similarity(sim, 0.97) == 2  # resume is the default
    assert cal.depth_from_similarity([1.0, 0.99], 0.97, "resume") == 2  # every layer passes: depth L
    assert cal.depth_from_agreement([1.0, 0.8, 0.95, 0.3], 0.9) == 2  # the largest passing depth
    assert cal.token_agreement([1, 2, 3], [1, 2, 4]) == pytest.approx(2 / 3)
    assert cal.token_agreement([1, 2], [1, 2, 3, 4]) == 0.5
    assert cal.token_agreement([], []) == 1.0
    assert cal.gen_candidates(20, 8) == [24, 16, 8]

    prompt = cal.Sample(1, "prompt", list(range(100)))
    t = cal.plan_task(prompt, 0, 0, 50, [32], 4096)
    assert (t.s_len, t.prompt_len, t.gen_len) == (66, 100, 32) and abs(t.r - 0.5) < 0.01
    assert cal.plan_task(prompt, 0, 0, 90, [32], 4096) is None  # S would leave the prompt
    assert cal.plan_task(prompt, 0, 0, 90, [32], 120) is None  # longer than the context

    pair = cal.Sample(1, "pair", list(range(100)), prefix_len=40)
    t = cal.plan_task(pair, 0, 0, 50, [16, 8], 4096)
    assert (t.s_len, t.prompt_len, t.gen_len) == (40, 64, 16)
    t = cal.plan_task(pair, 0, 0, 80, [16, 8], 4096)  # needs a smaller generation region
    assert (t.s_len, t.prompt_len, t.gen_len) == (40, 42, 8)
    assert cal.plan_task(pair, 0, 0, 20, [16, 8], 4096) is None  # suffix too short to reach 20%


def test_kv_cosine_profile_helper(tiny_llada):
    from bicache_sgl.models.loader import load_model
    model, cfg = load_model(tiny_llada)
    rng = random.Random(2)
    samples = [cal.Sample(0, "prompt", [rng.randrange(256) for _ in range(60)]) for _ in range(2)]
    prof, sims = cal.kv_cosine_profile(model, cfg, samples, fractions=(25, 50, 75), gen_length=8, block_length=8,
                                       threshold=0.97)
    assert prof.table[0] == (0.0, 0) and [r for r, _ in prof.table] == [0.0, 25.0, 50.0, 75.0]
    assert all(row[0] == 1.0 for row in sims)
    assert prof.lookup(0.5) == max(cal.depth_from_similarity(row, 0.97) for row in sims[:2])
