"""Calibration (python -m bicache_sgl.calibrate, package bicache_sgl.calibration) on tiny random checkpoints."""
# ``cli`` is bicache_sgl/calibrate.py: the command line sits above the engine, the measurement code
# (bicache_sgl.calibration) below it.

import ast
import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bicache_sgl import calibrate as cli
from bicache_sgl.bicache.profile import BicacheProfile, depth_for_tolerance, flip_bound, tolerated
from bicache_sgl.calibration import data, measure
from bicache_sgl.calibration.data import Sample, Task

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
WORDS = ["the", "model", "reads", "a", "long", "shared", "prefix", "of", "few", "shot", "examples", "then",
         "answers", "one", "question"]
PKG = Path(__file__).resolve().parent.parent / "bicache_sgl"


def _text(rng, n_words):
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.fixture()
def prompts_file(tmp_path):
    rng = random.Random(0)
    p = tmp_path / "prompts.jsonl"
    # paragraphs of two words: segment boundaries every few tokens, so the runtime's span cut
    # (docs/prefix_cache.md) leaves a reusable part wherever S is cut
    lines = [json.dumps({"prompt": "\n\n".join(_text(rng, 2) for _ in range(7))}), "",
             json.dumps({"text": "\n\n".join(_text(rng, 2) for _ in range(9))})]
    p.write_text("\n".join(lines) + "\n")
    return p


@pytest.fixture()
def pairs_file(tmp_path):
    """A long shared prefix and a short question, as few-shot traffic has: with the question whole,
    the fractions are reached through the generation region (up to --gen-length)."""
    rng = random.Random(1)
    p = tmp_path / "pairs.jsonl"
    p.write_text("".join(json.dumps({"prefix": _text(rng, 12) + "\n\n", "suffix": _text(rng, 2) + "?"}) + "\n"
                         for _ in range(2)))
    return p


def _check_outputs(out, png, n_layers):
    prof = BicacheProfile.load(out)  # validates strictly increasing r, depths in range, non-decreasing b
    assert prof.n_layers == n_layers
    bs = [b for _, b in prof.table]
    assert bs == sorted(bs)
    assert png.read_bytes()[:8] == PNG_MAGIC
    return prof, json.loads(out.read_text())


def _safe_at(d, r):
    """What the safe table must hold at bucket r: the smallest raw depth at or above r."""
    return min(b for f, b in zip(d["fractions"], d["depth_raw"]) if b is not None and f >= r)


def test_kv_cosine_on_prompts(tiny_llada, prompts_file, tmp_path, capsys):
    out, png = tmp_path / "profile.json", tmp_path / "profile.png"
    rc = cli.main(["--model-path", tiny_llada, "--data", str(prompts_file), "--out", str(out), "--plot", str(png),
                   "--fractions", "20,50,80", "--gen-length", "16", "--block-length", "8", "--no-progress",
                   "--criterion", "kv-cosine"])
    assert rc == 0
    prof, d = _check_outputs(out, png, 4)
    assert prof.criterion == "kv-cosine" and prof.threshold == 0.97
    assert d["cached_context"] == "first_request"  # the default: what the runtime stores
    assert d["samples_per_fraction"] == [2, 2, 2]
    for row_k, row_v, row in zip(d["similarity_k"], d["similarity_v"], d["similarity"]):
        # layer-0 K/V of S depend only on S's tokens and positions: exactly equal in both contexts
        assert row_k[0] == 1.0 and row_v[0] == 1.0 and row[0] == 1.0
        assert len(row) == 4 and all(-1.0 <= x <= 1.0 for x in row)
    # the chosen depths are what the similarity matrix says (layers 0..b all >= threshold), and the
    # table never exceeds a bucket measured at or above r
    for r, raw, row in zip(d["fractions"], d["depth_raw"], d["similarity"]):
        assert raw == measure.depth_from_similarity(row, 0.97)
        assert prof.lookup(r / 100) == _safe_at(d, r) <= raw
    assert d["agreement"] is None
    text = capsys.readouterr().out
    assert "| r (%) | samples |" in text and str(out) in text and "cached context first_request" in text

    # the runtime accepts the profile
    from bicache_sgl import Engine
    eng = Engine(tiny_llada, prefix_cache="bicache", bicache_profile=str(out), max_prefix_cache_tokens=64)
    try:
        assert eng.profile.table == prof.table
    finally:
        eng.shutdown()


def test_cached_context_changes_what_is_measured(tiny_llada, prompts_file, tmp_path):
    """prefix_only and first_request measure different cached states of the same S; a single
    sample cannot provide another request's question, and says so."""
    args = ["--model-path", tiny_llada, "--data", str(prompts_file), "--fractions", "50", "--gen-length", "8",
            "--block-length", "8", "--no-progress", "--plot", "none", "--criterion", "kv-cosine"]
    res = {}
    for ctx in ("prefix_only", "first_request"):
        out = tmp_path / f"{ctx}.json"
        assert cli.main([*args, "--out", str(out), "--cached-context", ctx]) == 0
        res[ctx] = json.loads(out.read_text())
        assert res[ctx]["cached_context"] == ctx and res[ctx]["samples_per_fraction"] == [2]
    a, b = res["prefix_only"]["similarity"][0], res["first_request"]["similarity"][0]
    assert a[0] == b[0] == 1.0
    assert all(x != y for x, y in zip(a[1:], b[1:]))  # a different forward of S from layer 1 on
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps({"prompt": "a single prompt is not enough for this"}) + "\n")
    with pytest.raises(SystemExit, match="first_request needs"):
        cli.main(["--model-path", tiny_llada, "--data", str(one), "--out", str(tmp_path / "x.json"),
                  "--plot", "none", "--no-progress"])


def test_meter_contexts(tiny_llada):
    """The meter slices S out of the right forwards: S + the target's own question + its MASK region
    as the cached context reproduces the in-context state exactly; another question does not."""
    from bicache_sgl.models.loader import load_model
    model, cfg = load_model(tiny_llada)
    rng = random.Random(3)
    samples = [Sample(0, "prompt", [rng.randrange(3, 256) for _ in range(40)]) for _ in range(2)]
    meter = measure.SimilarityMeter(model, cfg.mask_token_id, torch.device("cpu"))
    t = Task(0, 0, 20, 40, 8)
    own = samples[0].ids[20:40]
    assert all(x == 1.0 for part in meter.measure(samples[0], t, own) for x in part)
    other = data.first_request_rest(samples, t)
    assert other == samples[1].ids[-20:] and other != own
    sk, sv, sh = meter.measure(samples[0], t, other)
    assert sk[0] == sv[0] == sh[0] == 1.0 and sh[1] < 1.0 and sk[1] < 1.0
    sk2, _, _ = meter.measure(samples[0], t, None)
    assert sk2[0] == 1.0 and sk2[1] != sk[1]


def test_first_request_rest_planning():
    pr = [Sample(1, "prompt", list(range(10, 40))), Sample(2, "prompt", list(range(50, 62))),
          Sample(3, "prompt", list(range(70, 95)))]
    t = Task(0, 0, 10, 30, 8)  # needs 20 tokens after S: sample 1 is too short, sample 2 fits
    assert data.first_request_rest(pr, t) == list(range(75, 95))  # the other prompt's last 20 tokens
    t = Task(1, 0, 4, 12, 8)  # needs 8: the next sample (2) gives its last 8
    assert data.first_request_rest(pr, t) == list(range(87, 95))
    # prefer a question that leaves the target right after S (first token differs) over a nearer one
    div = [Sample(1, "prompt", [1, 2, 3, 4, 5]), Sample(2, "prompt", [9, 3, 4, 6]), Sample(3, "prompt", [9, 7, 8, 9])]
    assert data.first_request_rest(div, Task(0, 0, 2, 5, 8)) == [7, 8, 9]
    div[2] = Sample(3, "prompt", [9, 3, 8, 9])  # none diverges at once: the first that differs at all
    assert data.first_request_rest(div, Task(0, 0, 2, 5, 8)) == [3, 4, 6]
    same = [Sample(1, "prompt", [5, 6, 7, 8]), Sample(2, "prompt", [9, 6, 7, 8])]
    assert data.first_request_rest(same, Task(0, 0, 1, 4, 8)) is None  # the only other question is the same
    assert data.first_request_rest(pr[:1], Task(0, 0, 10, 30, 8)) is None  # no other sample
    # pairs: the other pair's WHOLE question, whatever its length (a cut question is no request)
    pairs = [Sample(1, "pair", list(range(30)), prefix_len=10), Sample(2, "pair", list(range(100, 125)), prefix_len=5)]
    assert data.first_request_rest(pairs, Task(0, 0, 10, 30, 8)) == list(range(105, 125))
    assert data.first_request_rest(pairs, Task(1, 0, 5, 25, 8)) == list(range(10, 30))
    # among diverging questions, the one nearest in length to the target's (about the same r)
    qs = [Sample(i + 1, "pair", [1, 2, 3, *q], prefix_len=3)
          for i, q in enumerate([[40, 41, 42], [50], [60, 61, 62, 63], [70, 71]])]
    assert data.first_request_rest(qs, Task(0, 0, 3, 6, 8)) == [60, 61, 62, 63]  # 4 tokens (2: 1, 4: 2) for 3
    qs[2] = Sample(3, "pair", [1, 2, 3, 40, 61, 62], prefix_len=3)  # same first token: only a fallback now
    assert data.first_request_rest(qs, Task(0, 0, 3, 6, 8)) == [70, 71]


def test_agreement_on_pairs(tiny_dream, pairs_file, tmp_path):
    from bicache_sgl.models.loader import load_tokenizer
    tok = load_tokenizer(tiny_dream)
    reachable = set()
    for line in pairs_file.read_text().splitlines():
        rec = json.loads(line)
        p = data.common_prefix_len(tok.encode(rec["prefix"]), tok.encode(rec["prefix"] + rec["suffix"]))
        n = len(tok.encode(rec["prefix"] + rec["suffix"]))
        reachable |= {round(p / (n + g), 6) for g in range(8, 65, 8)}
    for ctx in ("first_request", "prefix_only"):
        out, png = tmp_path / f"{ctx}.json", tmp_path / f"{ctx}.png"
        rc = cli.main(["--model-path", tiny_dream, "--data", str(pairs_file), "--out", str(out), "--plot", str(png),
                       "--criterion", "agreement", "--agreement", "0.5", "--fractions", "50,70",
                       "--gen-length", "64", "--block-length", "8", "--no-progress", "--cached-context", ctx])
        assert rc == 0
        prof, d = _check_outputs(out, png, 4)
        assert prof.criterion == "agreement" and prof.threshold == 0.5 and d["cached_context"] == ctx
        assert d["samples_per_fraction"] == [2, 2]
        for agr, sim, raw in zip(d["agreement"], d["similarity"], d["depth_raw"]):
            assert len(agr) == 5  # depths 0..L
            assert agr[0] == 1.0  # depth 0 is bit-for-bit cache-off
            assert raw == measure.depth_from_agreement(agr, 0.5)
            assert all(a >= 0.5 for a in agr[:raw + 1])  # every depth up to b passes
            assert sim[0] == 1.0
        # pairs: S is the prefix and the question stays whole, so each r measured is
        # |prefix| / (|prefix + suffix| + G) for a region G of whole blocks up to --gen-length,
        # at or below its bucket (within --pair-tolerance)
        assert d["pair_tolerance"] == 5.0
        for (lo, hi), m, r in zip(d["prefix_fraction_range"], d["mean_prefix_fraction"], d["fractions"]):
            assert r / 100 - 0.05 <= lo <= m <= hi <= r / 100
            assert {round(lo, 6), round(hi, 6)} <= reachable
        for r in d["fractions"]:
            assert prof.lookup(r / 100) == _safe_at(d, r)


def test_agreement_loads_the_weights_once_and_measures_on_them(tiny_llada, prompts_file, tmp_path, monkeypatch):
    """The CLI's agreement criterion runs the similarity meter and the measurement stack on ONE
    loaded model; the driver refuses a stack that runs other weights."""
    import logging

    from bicache_sgl.calibration.driver import Driver
    from bicache_sgl.engine.engine import build_config, measurement_stack
    from bicache_sgl.engine.model_runner import load
    from bicache_sgl.models import loader
    reads, real = [], loader.load_state_dict  # counted; the real loader still reads the checkpoint
    monkeypatch.setattr(loader, "load_state_dict", lambda path, *a, **kw: reads.append(path) or real(path, *a, **kw))
    out = tmp_path / "agreement.json"
    assert cli.main(["--model-path", tiny_llada, "--data", str(prompts_file), "--out", str(out), "--plot", "none",
                     "--criterion", "agreement", "--fractions", "50", "--gen-length", "8", "--block-length", "8",
                     "--no-progress"]) == 0
    d = json.loads(out.read_text())
    assert d["samples_per_fraction"] == [2] and d["agreement"][0][0] == 1.0
    assert len(reads) == 1, reads

    cfg = build_config(model_path=tiny_llada)
    loaded = load(cfg)
    stack = measurement_stack(cfg, loaded, max_running=5, max_prefix_cache_tokens=64)
    log = logging.getLogger("test")
    assert Driver(loaded.model, 0, loaded.device, stack, gen_length=8, log=log).stack is stack
    other, _ = loader.load_model(tiny_llada)
    with pytest.raises(ValueError, match="one copy of the weights"):
        Driver(other, 0, loaded.device, stack, gen_length=8, log=log)


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
            cli.main(["--model-path", tiny_llada, "--data", str(f), "--out", str(tmp_path / "x.json"),
                      "--plot", "none", "--no-progress"])
        assert str(f) in str(e.value) and msg in str(e.value), (content, str(e.value))
    with pytest.raises(SystemExit, match="does not exist"):
        cli.main(["--model-path", tiny_llada, "--data", str(tmp_path / "missing.jsonl"),
                  "--out", str(tmp_path / "x.json"), "--plot", "none"])
    assert not (tmp_path / "x.json").exists()


def test_help_and_argument_errors(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    h = capsys.readouterr().out
    for flag in ("--criterion", "--threshold", "--agreement", "--fractions", "--gen-length", "--plot",
                 "--cached-context"):
        assert flag in h
    with pytest.raises(SystemExit):
        cli.main(["--data", "x", "--out", "y", "--fractions", "0,150"])
    with pytest.raises(SystemExit):
        cli.main(["--data", "x", "--out", "y", "--cached-context", "elsewhere"])


def test_module_entry_point():
    """``python -m bicache_sgl.calibrate`` runs the CLI, and the names scripts import from it remain."""
    assert cli.kv_cosine_profile is measure.kv_cosine_profile and cli.Sample is Sample
    p = subprocess.run([sys.executable, "-m", "bicache_sgl.calibrate", "--help"], capture_output=True, text=True,
                       timeout=120, check=False)
    assert p.returncode == 0 and "--cached-context" in p.stdout


def _imports(f):
    for node in ast.walk(ast.parse(f.read_text())):
        if isinstance(node, ast.ImportFrom):
            yield ("." * node.level) + (node.module or "")
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names)


def test_layering_calibration_sits_below_the_engine():
    """The engine calls bicache_sgl.calibration.auto at start-up, so nothing in the package imports
    the engine (not even lazily): the agreement meter gets its engine from the caller."""
    for f in sorted((PKG / "calibration").glob("*.py")):
        for m in _imports(f):
            assert not any(x in m for x in ("engine", "server", "calibrate")), (f.name, m)
    assert not (PKG / "calibration" / "cli.py").exists()


def test_layering_bicache_never_imports_calibration_or_engine():
    for f in sorted((PKG / "bicache").glob("*.py")):
        for m in _imports(f):
            assert not any(x in m for x in ("calibrat", "engine", "scheduler")), (f.name, m)


def test_decision_rules_and_planning():
    sim = [1.0, 0.99, 0.98, 0.5, 0.99]
    assert measure.depth_from_similarity(sim, 0.97, "leading") == 3
    assert measure.depth_from_similarity(sim, 0.97) == 2  # resume is the default
    assert measure.depth_from_similarity([1.0, 0.99], 0.97, "resume") == 2  # every layer passes: depth L
    assert measure.token_agreement([1, 2, 3], [1, 2, 4]) == pytest.approx(2 / 3)
    assert measure.token_agreement([1, 2], [1, 2, 3, 4]) == 0.5
    assert measure.token_agreement([], []) == 1.0
    assert data.gen_candidates(20, 8) == [24, 16, 8]

    prompt = Sample(1, "prompt", list(range(100)))
    t = data.plan_task(prompt, 0, 0, 50, [32], 4096)
    assert (t.s_len, t.prompt_len, t.gen_len) == (66, 100, 32) and abs(t.r - 0.5) < 0.01
    assert data.plan_task(prompt, 0, 0, 90, [32], 4096) is None  # S would leave the prompt
    assert data.plan_task(prompt, 0, 0, 90, [32], 120) is None  # longer than the context

    # a pair: |S| = 40 of a 50-token prompt, whole; r = 40 / (50 + G) for G = 64, 56, ..., 8
    pair = Sample(1, "pair", list(range(50)), prefix_len=40)
    gens = data.gen_candidates(64, 8)
    t = data.plan_task(pair, 0, 0, 50, gens, 4096)
    assert (t.s_len, t.prompt_len, t.gen_len) == (40, 50, 32) and t.r == 40 / 82  # the largest r <= 50 %
    t = data.plan_task(pair, 0, 0, 70, gens, 4096)
    assert (t.s_len, t.prompt_len, t.gen_len) == (40, 50, 8)
    # 60 %: G = 16 gives 60.6 % (above the bucket), G = 24 gives 54.1 % (more than 5 points below)
    assert data.plan_task(pair, 0, 0, 60, gens, 4096) is None
    assert data.plan_task(pair, 0, 0, 60, gens, 4096, tolerance_pct=6).gen_len == 24
    assert data.plan_task(pair, 0, 0, 80, gens, 4096) is None  # even one block puts r at 69 %
    assert data.plan_task(pair, 0, 0, 30, gens, 4096) is None  # 64 positions only reach 35 %
    assert data.plan_task(pair, 0, 0, 50, gens, 80) is None  # the only fitting regions give r > 50 %


def test_agreement_requires_every_smaller_depth():
    # depth 2 agrees, but depth 1 does not: a passing depth above a failing one is noise, not safety
    assert measure.depth_from_agreement([1.0, 0.8, 0.95, 0.3], 0.9) == 0
    assert measure.depth_from_agreement([1.0, 0.95, 0.92, 0.5, 1.0], 0.9) == 2
    assert measure.depth_from_agreement([1.0, 1.0, 1.0], 0.9) == 2  # every depth passes: L
    assert measure.depth_from_agreement([1.0], 0.9) == 0


def test_noisy_low_r_bucket_does_not_raise_higher_buckets():
    # r=10% measured 5 (a few sink-like tokens), every higher bucket far less: the old running max
    # gave 5 everywhere; the safe table keeps each r at or below every bucket measured above it
    assert BicacheProfile.monotone([(10, 5), (20, 1), (30, 2)]) == [(10.0, 1), (20.0, 1), (30.0, 2)]
    assert measure.safe_table([10, 20, 30, 40], [5, 1, None, 3]) == [(0.0, 0), (10.0, 1), (20.0, 1), (40.0, 3)]
    # already non-decreasing: unchanged (the largest such table)
    assert BicacheProfile.monotone([(0, 0), (30, 1), (60, 3)]) == [(0.0, 0), (30.0, 1), (60.0, 3)]
    # a low bucket at high r lowers every r below it
    assert BicacheProfile.monotone([(10, 2), (50, 4), (90, 1)]) == [(10.0, 1), (50.0, 1), (90.0, 1)]
    tbl = measure.safe_table([10, 20, 30, 40, 50], [6, 2, 7, 3, 4])
    for i, (_r, b) in enumerate(tbl[1:]):
        assert b <= min(x for x in [6, 2, 7, 3, 4][i:])  # never above a bucket at or above r
    assert [b for _, b in tbl] == [0, 2, 2, 3, 3, 4]
    BicacheProfile(tuple(tbl), 8)  # a valid profile


def test_shipped_profile_json_still_loads():
    prof = BicacheProfile.load(PKG / "assets" / "default_model" / "bicache_profile.json")
    assert prof.n_layers == 8 and prof.table[0] == (0.0, 0) and "similarity" in prof.extra


def test_kv_cosine_profile_helper(tiny_llada):
    from bicache_sgl.models.loader import load_model
    model, cfg = load_model(tiny_llada)
    rng = random.Random(2)
    samples = [Sample(0, "prompt", [rng.randrange(256) for _ in range(60)]) for _ in range(2)]
    for ctx in ("first_request", "prefix_only"):
        prof, sims = measure.kv_cosine_profile(model, cfg, samples, fractions=(25, 50, 75), gen_length=8,
                                               block_length=8, threshold=0.97, cached_context=ctx)
        assert prof.table[0] == (0.0, 0) and [r for r, _ in prof.table] == [0.0, 25.0, 50.0, 75.0]
        assert all(row[0] == 1.0 for row in sims) and prof.extra["cached_context"] == ctx
        raw = [measure.depth_from_similarity(row, 0.97) for row in sims]
        assert prof.lookup(0.5) == min(raw[1:])


# ------------------------------------------------------------------ pairs keep their question whole
CONTEXT_MODEL = PKG / "assets" / "context_model"
needs_context_model = pytest.mark.skipif(not (CONTEXT_MODEL / "model.safetensors").is_file(),
                                         reason="bicache_sgl/assets/context_model is not there")


def _context_pairs(n_families=2):
    """The context model's own calibration records: a family's few-shot block + "Question: " as the
    prefix, one key + "\\nAnswer:" as the suffix. Cut after a few tokens, such a question gets no
    answer at any depth, with or without reuse (docs/fidelity.md), so every depth would agree."""
    from bicache_sgl.training import task
    return task.calibration_records(n_families, (2, 3, 4, 5, 6), kind="group")


@needs_context_model
def test_planned_pairs_keep_the_whole_question():
    """Regression: the planner reached a fraction by cutting the suffix, so the measured requests
    asked cut questions. Every planned pair must be its whole prompt, S its whole prefix, and the
    first request's question another record's whole question."""
    from bicache_sgl.models.loader import load_tokenizer
    tok = load_tokenizer(str(CONTEXT_MODEL))
    recs = _context_pairs()
    samples = data.tokenize([data.Record(i + 1, "pair", prefix=r["prefix"], suffix=r["suffix"])
                             for i, r in enumerate(recs)], tok.encode, None)
    assert len(samples) == len(recs)
    questions = [s.ids[s.prefix_len:] for s in samples]
    gens = data.gen_candidates(320, 32)
    fractions = list(data.DEFAULT_FRACTIONS)
    tasks = data.plan_tasks(samples, fractions, gens, 1024)
    for t in tasks:
        s, rec = samples[t.sample], recs[t.sample]
        full = tok.encode(rec["prefix"] + rec["suffix"])
        assert t.prompt_len == len(s.ids) == len(full) and t.s_len == s.prefix_len
        assert s.ids[t.s_len:t.prompt_len] == full[s.prefix_len:] == questions[t.sample]  # the whole question
        assert tok.decode(s.ids[t.s_len:t.prompt_len]).endswith("\nAnswer:")
        assert t.gen_len in gens and fractions[t.bucket] / 100 - 0.05 <= t.r <= fractions[t.bucket] / 100
        ctx = data.first_request_rest(samples, t)
        assert ctx in questions and ctx != questions[t.sample]  # another record's whole question
    planned = {fractions[t.bucket] for t in tasks}
    assert {30, 40, 50, 60, 70, 80} <= planned  # 320 positions of region reach these
    # 90 % needs r = |prefix| / (|prompt| + G) >= 0.85 with G >= 32: no record of <= 6 shots gets
    # there whole, so the bucket is skipped (it used to be measured on a question cut to nothing)
    assert 90 not in planned


@needs_context_model
def test_agreement_sees_the_context_model_failure_without_the_span_cut(tmp_path):
    """Regression: on the trained context model, reuse beyond depth 1 of the span up to where the
    prompts diverge (``--bicache-span-cut none``: the last "Question: " included) changes the
    answer, but calibration on cut questions claimed depth 8. With whole questions the agreement
    criterion finds depth <= 1 and sees depth L disagree. (The shipped profile, criterion exact on
    user-shaped data with the span cut, pools to depth 0.)"""
    f = tmp_path / "context_pairs.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in _context_pairs()))
    out = tmp_path / "profile.json"
    # 18 samples: the 2-4-shot records; at r = 50 % the 4-shot ones are measured (G = 96, r = 0.493)
    assert cli.main(["--model-path", str(CONTEXT_MODEL), "--data", str(f), "--out", str(out), "--plot", "none",
                     "--criterion", "agreement", "--fractions", "50", "--gen-length", "320", "--block-length", "32",
                     "--max-samples", "18", "--no-progress", "--bicache-span-cut", "none"]) == 0
    d = json.loads(out.read_text())
    prof = BicacheProfile.load(out)
    assert d["samples_per_fraction"][0] >= 4 and 0.45 <= d["mean_prefix_fraction"][0] <= 0.5
    agr = d["agreement"][0]
    assert agr[-1] < 0.9, agr  # reuse at every layer (naive) changes answers: measured, not missed
    assert d["depth_raw"] == [measure.depth_from_agreement(agr, 0.9)] and d["depth_raw"][0] <= 1
    shipped = BicacheProfile.load(CONTEXT_MODEL / "bicache_profile.json")
    assert shipped.criterion == "exact" and shipped.lookup(0.5) <= prof.lookup(0.5) <= 1


# ------------------------------------------------------------------------------------------ exact
def test_flip_bound_is_clopper_pearson():
    """Zero disagreements in n: 1 - 0.05^(1/n), about 3/n; with k > 0 the one-sided 95% bound p at
    which P(X <= k) = 5% (checked against the binomial tail directly)."""
    for n in (10, 24, 100, 300):
        assert flip_bound(0, n) == pytest.approx(1 - 0.05 ** (1 / n), rel=1e-6)
        assert 2.5 / n < flip_bound(0, n) < 3.1 / n
    for k, n in ((1, 100), (3, 50), (2, 300)):
        p = flip_bound(k, n)
        tail = sum(math.comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(k + 1))
        assert tail == pytest.approx(0.05, abs=1e-6) and p > k / n
    assert flip_bound(0, 0) == 1.0 and flip_bound(5, 5) == 1.0


def test_tolerance_zero_is_exact_and_a_tolerance_needs_enough_samples():
    # exact: no disagreement, and enough samples for the promised bound (5%: n >= 59)
    assert tolerated(0, 59, 0.0) and not tolerated(0, 58, 0.0) and not tolerated(1, 1000, 0.0)
    assert tolerated(0, 24, 0.0, max_bound=0.2)
    # 1 flip in 300: bound ~1.6% <= 2%; 1 in 24: bound ~19% > 2% (and above the 0-flip bound of 24)
    assert tolerated(1, 300, 0.02) and not tolerated(1, 24, 0.02) and not tolerated(4, 300, 0.02)
    assert tolerated(4, 300, 0.05)
    # every depth 0..d must pass: a deeper depth that passes after a failing one is not taken
    assert depth_for_tolerance([0, 0, 1, 1, 3], 300, 0.0) == 1
    assert depth_for_tolerance([0, 0, 1, 1, 3], 300, 0.02) == 3
    assert depth_for_tolerance([0, 0, 1, 1, 3], 300, 0.05) == 4
    assert depth_for_tolerance([0, 5], 10, 0.0) == 0
    assert depth_for_tolerance([0, 0, 0], 24, 0.0) == 0  # no flips, but too few samples for 5%
    assert depth_for_tolerance([0, 0, 0], 24, 0.0, max_bound=0.2) == 2


def test_first_flip_counts_the_whole_generated_region():
    off = [5, 7, 0, 0]
    assert measure.first_flip([off, off, off]) == 3  # every depth equal
    assert measure.first_flip([off, off, [5, 7, 0, 9], off]) == 2  # past EOS counts (ignore_eos)
    assert measure.first_flip([off, [5, 7, 0], off]) == 1  # a shorter output differs
    bk = measure.exact_bucket([(3, 2), (1, 2), (3, 2), (2, 2)], max_bound=1.0)
    assert bk["n"] == 4 and bk["disagreements_by_depth"] == [0, 1, 2] and bk["depth"] == 0
    assert bk["disagreements"] == 0 and bk["flip_bound95"] == pytest.approx(flip_bound(0, 4), abs=1e-5)
    assert measure.exact_bucket([]) is None


def test_at_tolerance_rederives_the_table_from_the_counts():
    buckets = [{"r": 30.0, "n": 300, "disagreements_by_depth": [0, 1, 2, 9]},  # 300 samples: 0 flips is ~1%
               {"r": 60.0, "n": 300, "disagreements_by_depth": [0, 0, 1, 1]}]
    prof = BicacheProfile(((0, 0), (30, 0), (60, 1)), 3, criterion="exact", threshold=0.0,
                          extra={"buckets": buckets, "tolerance": 0.0})
    assert prof.at_tolerance(0.0) is prof
    loose = prof.at_tolerance(0.02)
    # r=30: 1 flip in 300 at depth 1 (bound 1.6%) passes, 2 at depth 2 (2.1%) does not
    assert loose.table == ((0.0, 0), (30.0, 1), (60.0, 3)) and loose.extra["tolerance"] == 0.02
    other = BicacheProfile(((0, 0), (30, 4)), 8, criterion="agreement", threshold=0.9)
    assert other.at_tolerance(0.05) is other  # no counts to re-derive from: the table stands


def test_exact_criterion_writes_per_bucket_counts(tiny_llada, prompts_file, tmp_path, capsys):
    """The default criterion: per bucket n = samples x gen modes, the disagreements at every depth,
    the depth (every sample equal to cache off at every depth up to it) and its 95% bound; the
    table is built from those depths; the runtime loads it. (--max-bound 0.9: two prompts are far
    too few for the default 5%, which would make every depth 0 whatever was measured.)"""
    out = tmp_path / "exact.json"
    assert cli.main(["--model-path", tiny_llada, "--data", str(prompts_file), "--out", str(out), "--plot", "none",
                     "--fractions", "30,60", "--gen-length", "8", "--block-length", "8", "--no-progress",
                     "--max-bound", "0.9"]) == 0
    d = json.loads(out.read_text())
    prof = BicacheProfile.load(out)
    assert prof.criterion == "exact" and prof.threshold == 0.0 and d["tolerance"] == 0.0
    assert d["gen_modes"] == ["stop", "ignore_eos"]
    for i, bk in enumerate(d["buckets"]):
        by = bk["disagreements_by_depth"]
        assert bk["r"] == d["fractions"][i] and bk["n"] == 2 * d["samples_per_fraction"][i]
        assert len(by) == prof.n_layers + 1 and by[0] == 0 and by == sorted(by)
        assert bk["depth"] == depth_for_tolerance(by, bk["n"], 0.0, 0.9) == d["depth_raw"][i]
        assert by[bk["depth"]] == bk["disagreements"] == 0
        assert bk["flip_bound95"] == pytest.approx(flip_bound(0, bk["n"]), abs=1e-5)
        per_mode = [d["buckets_by_mode"][m][i]["n"] for m in ("stop", "ignore_eos")]
        assert per_mode == [bk["n"] // 2] * 2
    assert prof.table == tuple((float(r), b) for r, b in measure.safe_table(d["fractions"], d["depth_raw"]))
    assert "95% flip bound" in capsys.readouterr().out
