"""A profile on first run (issue 11, section 3): ``bicache_profile="auto"``, the default when no
bicache_profile.json is beside the model and none is given. The cache dir is a tmp dir per test
(``$BICACHE_SGL_CACHE``), so every test starts cold."""

import itertools
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from bicache_sgl import Engine
from bicache_sgl.bicache.profile import PROFILE_FILENAME, BicacheProfile
from bicache_sgl.calibration import auto, profile_cache, synth
from bicache_sgl.config import DEFAULT_PROBATION, EngineConfig
from bicache_sgl.models.loader import default_model_path
from bicache_sgl.testing.planted import expected_answer, make_planted_llada
from bicache_sgl.training import task

K = 2  # the planted model's safe depth
# ends with a blank line, a segment boundary: the span cut (docs/prefix_cache.md) leaves it reusable
PLANTED_PREFIX = "System: answer with the digit that the question holds. Be brief and exact. " * 2 + "\n\n"
PLANTED_SP = {"temperature": 0, "max_new_tokens": 8, "block_length": 8}


@pytest.fixture(autouse=True)
def _cold_cache_one_thread(tmp_path, monkeypatch):
    monkeypatch.setenv(auto.CACHE_ENV, str(tmp_path / "cache"))
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture()
def bundled_copy(tmp_path):
    """The bundled model's files without its profile."""
    src, dst = Path(default_model_path()), tmp_path / "model"
    dst.mkdir()
    for f in src.iterdir():
        if f.is_file() and f.name != PROFILE_FILENAME:
            shutil.copy(f, dst / f.name)
    return dst


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    return make_planted_llada(tmp_path_factory.mktemp("planted"), k=K, n_layers=6)


def _counts():
    return dict(auto.stats)


def test_bundled_copy_first_run_profile_is_exact_and_restart_uses_the_cache(bundled_copy, caplog):
    """The bundled model without its profile: the first-run profile is measured with the exact
    criterion, and each bucket's verdict has its reason in the counts (a depth above 0: no sample
    differed up to it, within the first-run bound; 0: a sample differed at depth 1). Requests that
    share a few-shot block match it and answer exactly as with the cache off (reused or audited);
    a restart uses the cached profile."""
    items = task.heldout_items(3, 6, seed=0)
    assert items[0]["prefix"] == items[1]["prefix"] == items[2]["prefix"]
    sp = {"temperature": 0, "max_new_tokens": 8}
    before = _counts()
    with caplog.at_level(logging.INFO, logger="bicache_sgl.calibration.auto"):
        eng = Engine(str(bundled_copy))
    try:
        assert _counts()["calibrations"] == before["calibrations"] + 1
        assert "calibrating a bicache profile" in caplog.text and "auto-calibration first-step agreement" in caplog.text
        prof = eng.profile
        assert prof is not None and prof.criterion == "exact" and prof.threshold == 0.0
        verdicts = [bk for bk in prof.extra["buckets"] if bk is not None and bk["depth"] is not None]
        assert verdicts
        for bk in verdicts:
            by = bk["disagreements_by_depth"]
            if bk["depth"] > 0:
                assert by[bk["depth"]] == 0 and bk["flip_bound95"] <= auto.AUTO_MAX_BOUND, bk
            else:
                assert by[1] > 0, bk
        outs = [eng.generate(it["prompt"], sp) for it in items]
        assert all(o["meta_info"]["cached_tokens"] > 0 for o in outs[1:])  # the block is matched
        assert all(o["meta_info"]["bicache_depth"] <= prof.max_depth for o in outs)
    finally:
        eng.shutdown()
    off = Engine(str(bundled_copy), prefix_cache="off")
    try:
        assert [off.generate(it["prompt"], sp)["output_ids"] for it in items] == [o["output_ids"] for o in outs]
    finally:
        off.shutdown()
    cached = list((Path(auto.cache_dir()) / "profiles").glob("*.json"))
    assert len(cached) == 1 and BicacheProfile.load(cached[0]).table == prof.table

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="bicache_sgl.calibration.auto"):
        eng = Engine(str(bundled_copy))  # a restart: the cached profile, no calibration
    try:
        assert _counts()["calibrations"] == before["calibrations"] + 1
        assert _counts()["cache_hits"] == before["cache_hits"] + 1
        assert "using cached profile" in caplog.text and "calibrating a bicache profile" not in caplog.text
        assert eng.profile.table == prof.table
    finally:
        eng.shutdown()


def test_none_keeps_depth_zero(bundled_copy, caplog):
    before = _counts()
    with caplog.at_level(logging.WARNING):
        eng = Engine(str(bundled_copy), bicache_profile="none")
    try:
        assert _counts() == before and eng.profile is None and "no bicache profile" in caplog.text
        items = task.heldout_items(2, 6, seed=1)
        eng.generate(items[0]["prompt"], {"temperature": 0, "max_new_tokens": 8})
        m = eng.generate(items[1]["prompt"], {"temperature": 0, "max_new_tokens": 8})["meta_info"]
        assert m["cached_tokens"] > 0 and m["bicache_depth"] == 0
    finally:
        eng.shutdown()
    assert not (Path(auto.cache_dir()) / "profiles").exists()


def test_planted_model_without_a_profile_answers_as_cache_off_and_reuses_after_probation(planted):
    """No profile and no calibration data: the first-run profile is measured on synthesised prompts,
    never deeper than the safe depth K; every request answers as cache off does (the planted task's
    answer) from the first one, the first reusing ones audited on probation, then reused."""
    eng = Engine(planted)
    try:
        prof = eng.profile
        assert prof is not None and prof.n_layers == 6
        assert all(b <= K for _, b in prof.table), prof.table  # never beyond what is safe by construction
        assert prof.lookup(0.8) == K, prof.table  # and it finds the safe depth, not just 0
        for d in prof.extra["depth_first_step"]:
            assert d is None or d <= K
        # served: every request answers its own digit; reuse starts once the bucket is trusted
        probation = eng.get_stats()["bicache_audit_probation"]
        assert probation == DEFAULT_PROBATION
        metas = []
        for i in range(probation + 12):
            d = str(i % 10)
            out = eng.generate(PLANTED_PREFIX + f"Question {d}: which digit?", PLANTED_SP)
            assert out["text"] == expected_answer(d) * 8, (i, out["meta_info"])
            metas.append(out["meta_info"])
        audited = [m["bicache_audited"] for m in metas]
        # every reusing request is audited until its bucket earned trust (the shared fraction that
        # bounds a request's depth puts it in one of two buckets here: its digit seen before or not)
        assert audited[1:probation + 1] == [True] * probation, audited
        depths = [m["bicache_depth"] for m in metas]
        assert all(d <= K for d in depths) and sum(d > 0 for d in depths[-6:]) >= 3, (depths, audited)
        assert eng.get_stats()["bicache_audit_trusted_buckets"] >= 1
    finally:
        eng.shutdown()


def test_first_run_calibration_loads_the_weights_once(planted, monkeypatch):
    """The calibration runs on the engine's own loaded model (a measurement stack on it), never on
    a second copy: the checkpoint's weights are read exactly once for the whole start-up."""
    from bicache_sgl.models import loader
    reads, real = [], loader.load_state_dict  # counted; the real loader still reads the checkpoint
    monkeypatch.setattr(loader, "load_state_dict", lambda path, *a, **kw: reads.append(path) or real(path, *a, **kw))
    before = _counts()
    eng = Engine(planted)
    try:
        assert _counts()["calibrations"] == before["calibrations"] + 1  # it did calibrate, cold
        assert eng.profile is not None and sum(map(sum, eng.profile.extra["samples_first_step"].values())) > 0
        assert reads == [str(planted)], reads  # one read of the weights: serving and calibration share them
        assert eng.model is eng.runner.model
    finally:
        eng.shutdown()


class _Clock:
    """auto's clock, advancing a fixed step per reading: the budget counts measurements, not seconds
    (deterministic on a loaded machine)."""

    def __init__(self, step: float) -> None:
        self.t, self.step = 0.0, step

    def monotonic(self) -> float:
        self.t += self.step
        return self.t


def test_budget_runs_out_low_buckets_get_depth_zero(planted, caplog, monkeypatch):
    monkeypatch.setattr(auto, "time", _Clock(0.1))
    with caplog.at_level(logging.INFO, logger="bicache_sgl.calibration.auto"):
        eng = Engine(planted, calibration_budget_s=1.0)
    eng.shutdown()
    prof = eng.profile
    assert "ran out before r = " in caplog.text and not prof.extra["auto"]["complete"]
    raw, fr = prof.extra["depth_raw"], prof.extra["fractions"]
    counts = [sum(x) for x in zip(*prof.extra["samples_first_step"].values())]
    measured = [f for f, n in zip(fr, counts) if n]
    assert measured and min(measured) > fr[0]  # high r first: the lowest buckets were not reached
    assert all(d == 0 for f, d in zip(fr, raw) if f < min(measured))  # unmeasured: depth 0
    assert all(b <= K for _, b in prof.table)
    # what was measured saw no disagreement up to K (the planted model's safe depth); a handful of
    # samples is too few for a depth above 0 under the exact criterion's bound, so the table is 0
    for f in measured:
        bk = prof.extra["buckets"][fr.index(f)]
        assert bk["disagreements_by_depth"][K] == 0 and bk["n"] > 0, bk
    # a restart with the same budget uses the partial profile; a larger budget calibrates again
    before = _counts()
    Engine(planted, calibration_budget_s=1.0).shutdown()
    assert _counts()["cache_hits"] == before["cache_hits"] + 1
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="bicache_sgl.calibration.auto"):
        Engine(planted, calibration_budget_s=2.0).shutdown()
    assert _counts()["calibrations"] == before["calibrations"] + 1 and "cut short" in caplog.text


def test_calibration_data_file(planted, tmp_path):
    data = tmp_path / "prompts.jsonl"
    words = "we read a long shared system prompt and then answer one short question about it " * 2
    # 12 prompts: enough for the first-run bound (0 disagreements in 12: 22% <= auto.AUTO_MAX_BOUND)
    # (a blank line after the shared part: the runtime reuses up to a segment boundary)
    data.write_text("".join(json.dumps({"prompt": f"{words}\n\nQuestion: which digit? {d}"}) + "\n"
                            for d in "385172946038"))
    eng = Engine(planted, calibration_data=str(data), calibration_budget_s=60)
    eng.shutdown()
    prof = eng.profile
    assert prof.extra["auto"]["settings"]["data"]["file"].startswith("sha256:")
    assert set(prof.extra["samples_first_step"]) == {"data"}
    assert all(b <= K for _, b in prof.table) and prof.lookup(0.5) == K
    with pytest.raises(ValueError, match="does not exist"):
        Engine(planted, calibration_data=str(tmp_path / "missing.jsonl"))


def test_resolve_profile_choices(bundled_copy, tmp_path):
    """None: the file beside the model, else auto (bicache mode only); "none"; a file."""
    from bicache_sgl.engine.model_runner import load
    cfg = EngineConfig(model_path=str(bundled_copy), bicache_profile="none")
    loaded = load(cfg)

    def boom(**kw):
        raise AssertionError("must not build a calibration engine")

    assert auto.resolve_profile(cfg, loaded, boom) is None
    for mode in ("off", "naive", "fixed:2"):  # no profile is used: nothing is calibrated
        assert auto.resolve_profile(cfg.replace(prefix_cache=mode, bicache_profile=None), loaded, boom) is None
        assert auto.resolve_profile(cfg.replace(prefix_cache=mode, bicache_profile="auto"), loaded, boom) is None
    shutil.copy(Path(default_model_path()) / PROFILE_FILENAME, bundled_copy / PROFILE_FILENAME)
    beside = auto.resolve_profile(cfg.replace(bicache_profile=None), loaded, boom)
    assert beside.table == BicacheProfile.load(Path(default_model_path()) / PROFILE_FILENAME).table
    own = tmp_path / "own.json"
    BicacheProfile(((0.0, 0), (50.0, 3)), 8).save(own)
    assert auto.resolve_profile(cfg.replace(bicache_profile=str(own)), loaded, boom).lookup(0.6) == 3
    # --bicache-tolerance re-derives an exact profile's table from its per-bucket counts
    exact = tmp_path / "exact.json"
    BicacheProfile(((0.0, 0), (50.0, 0)), 8, criterion="exact", threshold=0.0,
                   extra={"tolerance": 0.0, "buckets": [{"r": 50.0, "n": 300,
                                                          "disagreements_by_depth": [0, 1, 1, 5, 8, 8, 8, 8, 8]}]}
                   ).save(exact)
    at = {t: auto.resolve_profile(cfg.replace(bicache_profile=str(exact), bicache_tolerance=t), loaded, boom)
          for t in (0.0, 0.02, 0.05)}
    assert [at[t].lookup(0.6) for t in (0.0, 0.02, 0.05)] == [0, 2, 8]


def test_checkpoint_fingerprint(tmp_path, monkeypatch):
    a = tmp_path / "a"
    a.mkdir()
    (a / "config.json").write_text("{}")
    (a / "model.safetensors").write_bytes(b"x" * 100)
    (a / PROFILE_FILENAME).write_text("{}")
    fa = auto.checkpoint_fingerprint(a)
    assert set(fa) == {"config.json", "model.safetensors"}  # the profile itself is not part of the key
    b = tmp_path / "b"
    shutil.copytree(a, b, copy_function=shutil.copy)  # a copy (new mtimes) of small files: same content key
    assert auto.checkpoint_fingerprint(b) == fa
    (b / "model.safetensors").write_bytes(b"y" * 100)
    assert auto.checkpoint_fingerprint(b)["model.safetensors"] != fa["model.safetensors"]
    # large files: size and mtime (hashing gigabytes at every start would cost what the cache saves)
    monkeypatch.setattr(profile_cache, "CONTENT_HASH_MAX_BYTES", 10)
    big = auto.checkpoint_fingerprint(b)["model.safetensors"]
    assert big.startswith("size:100,mtime_ns:")
    # a Hugging Face hub snapshot links each file to a blob named by its digest
    blob = tmp_path / "blobs" / ("ab" * 32)
    blob.parent.mkdir()
    blob.write_bytes(b"z" * 100)
    (b / "model.safetensors").unlink()
    (b / "model.safetensors").symlink_to(blob)
    assert auto.checkpoint_fingerprint(b)["model.safetensors"] == "blob:" + "ab" * 32


def test_synthesised_prompts():
    from bicache_sgl.models.loader import load_tokenizer
    tok = load_tokenizer(default_model_path())
    made = synth.synthesize(tok, 12, min_tokens=150, max_tokens=240)
    assert made == synth.synthesize(tok, 12, min_tokens=150, max_tokens=240)  # deterministic
    assert [g for g, _ in made] == ["text", "fewshot", "chat", "headed", "twoblock", "multiturn"] * 2
    for g, text in made:
        assert 140 <= len(tok.encode(text)) <= 420
        digits = [c for c in text if c.isdigit()]
        if g == "text":
            assert text[-1].isdigit()  # the question's number is the last token: never in a shared prefix
        elif g == "chat":
            # one digit, in the user turn, rendered by the model's chat template (the bundled
            # models': the system text, a blank line, then "Question: <user>\nAnswer:")
            assert len(digits) == 1 and "\n\nQuestion: " in text and text.endswith("\nAnswer:")
        elif g == "twoblock":  # a second block of another form after the first, and its question
            assert text.startswith(synth.HEADED_HEAD) and text.endswith("?\nA:")
            assert text.index("Question: ") < text.index("\nQ: ")
        elif g == "multiturn":  # earlier turns with the assistant's answers, then the next question,
            # rendered by the bundled chat template (one "Question: ... Answer:" pair per turn)
            assert text.count("\nAnswer: ") >= 1 and text.count("Question: ") >= 2 and text.endswith("\nAnswer:")
        else:
            assert text.endswith("?\nAnswer:") and "Question: " in text
        if g == "headed":
            assert text.startswith(synth.HEADED_HEAD) and len(digits) == 1
    last_digits = [next(c for c in reversed(t) if c.isdigit()) for _, t in made]
    assert all(x != y for x, y in itertools.pairwise(last_digits))  # neighbours ask different things
