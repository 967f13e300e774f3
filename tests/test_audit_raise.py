"""Trust earned on traffic, upward too (issue 38, item 6): audited requests probe the next depth of
their r-bucket (they are answered from their exact forward whatever the probe finds), and a bucket
rises to a probed depth only once n probes at it agreed, n the least sample whose one-sided 95%
Clopper-Pearson bound on the disagreement rate is at most --bicache-audit-raise-bound (calibration's
rule, ``profile.tolerated``). A disagreement bans the probed depth in that bucket and below."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch

from bicache_sgl import Engine
from bicache_sgl.bicache.audit import DepthAudit, next_rung, raise_samples
from bicache_sgl.bicache.policy import make_policy
from bicache_sgl.bicache.profile import PROFILE_FILENAME, BicacheProfile, flip_bound
from bicache_sgl.config import DEFAULT_PROBE_RATE
from bicache_sgl.models.loader import default_model_path
from bicache_sgl.server.metrics import Metrics
from bicache_sgl.testing.planted import expected_answer, make_planted_llada
from bicache_sgl.training import task

K, L = 1, 4  # the planted model's true safe depth, and its layers (probes may try 2 and 4)
G = 8
SP = {"temperature": 0, "max_new_tokens": G, "block_length": G}
# ends at a segment boundary (a blank line): the span cut lets the prefix be reused up to there
PREFIX = "System: answer with the digit that the question holds. Be brief and exact. " * 2 + "\n\n"
LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def planted_k1(tmp_path_factory) -> str:
    return make_planted_llada(tmp_path_factory.mktemp("planted_k1"), k=K, n_layers=L)


AGREE = torch.tensor([[0.0, 5.0, 0.0]] * 4)
ONE_OFF = torch.tensor([[0.0, 5.0, 0.0]] * 3 + [[5.0, 0.0, 0.0]])  # one masked position's top-1 differs


def test_raise_needs_the_calibration_bound_and_the_ladder_doubles_then_backs_off():
    """No profile: every bucket starts at 0 and probes 1, 2, 4, 8 (doubling); a bucket rises only at
    the n-th agreeing probe of a depth, n from the real bound; one changed top-1 (the exact
    criterion) bans that depth here and below, and the bucket then climbs one layer at a time
    below it; raising stops at the top."""
    assert raise_samples(0.05) == 59 and flip_bound(0, 59) <= 0.05 < flip_bound(0, 58)  # calibration's --max-bound
    assert raise_samples(0.5) == 5 and flip_bound(0, 5) <= 0.5 < flip_bound(0, 4)
    assert [next_rung(d) for d in (0, 1, 2, 4)] == [1, 2, 4, 8]
    audit = DepthAudit(None, rate=0.0, probe_rate=1.0, raise_bound=0.5, n_layers=8)
    assert audit.min_agreement == 1.0 and audit.ceiling == 8 and audit.raise_n == 5
    assert audit.depth(0.85) == 0 and audit.probe_depth(0.85) == 1 and audit.probe_depth(0.15) == 1
    for _ in range(4):
        audit.record(0.85, 1, AGREE, AGREE, probe=True, r_probe=0.85)
    assert audit.depth(0.85) == 0 and audit.stats()["bicache_audit_raised_total"] == 0  # 4 < n
    audit.record(0.85, 1, AGREE, AGREE, probe=True, r_probe=0.85)
    assert audit.depth(0.85) == 1 and audit.probe_depth(0.85) == 2
    assert audit.depth(0.75) == 0 and audit.depth(0.95) == 0  # other buckets earn their own depth
    for d in (2, 4):
        for _ in range(5):
            audit.record(0.85, d, AGREE, AGREE, probe=True, r_probe=0.85)
        assert audit.depth(0.85) == d
    assert audit.probe_depth(0.85) == 8
    audit.record(0.85, 8, ONE_OFF, AGREE, probe=True, r_probe=0.85)  # 75% agreement: a disagreement
    assert audit.depth(0.85) == 4  # the depth in force agreed before: not lowered by a failed probe
    assert audit.probe_depth(0.85) == 7 and audit.probe_depth(0.45) == 1  # banned 8 here and below ...
    assert audit.stats()["bicache_audit_buckets"][4]["probe_depth"] == 1  # ... only as a cap there
    for d in (7, 6):
        audit.record(0.85, d, ONE_OFF, AGREE, probe=True, r_probe=0.85)
    assert audit.probe_depth(0.85) == 5
    for _ in range(5):
        audit.record(0.85, 5, AGREE, AGREE, probe=True, r_probe=0.85)
    assert audit.depth(0.85) == 5 and audit.probe_depth(0.85) == 5  # nothing left to probe: stops
    st = audit.stats()
    assert st["bicache_audit_raised_total"] == 4 and st["bicache_audit_probes_total"] == 23
    assert st["bicache_audit_probe_disagreements_total"] == 3 and st["bicache_audit_bucket_depth"]["r80"] == 5
    assert [(c["from"], c["to"]) for c in st["bicache_audit_depth_changes"]] == [(0, 1), (1, 2), (2, 4), (4, 5)]
    # a raise credits the bucket of the rows read beyond their depth, not the one that bound the plan
    audit.record(0.35, 1, AGREE, AGREE, probe=True, r_probe=0.65)
    assert audit.stats()["bicache_audit_buckets"][6]["probes"] == {"1": 1}
    assert audit.stats()["bicache_audit_buckets"][3]["probes"] == {}


def test_a_profile_is_raised_no_higher_than_its_deepest_depth_and_not_from_an_unconfirmed_one():
    prof = BicacheProfile(((0, 0), (50, 2), (80, 4)), 8, criterion="exact", threshold=0.0)
    audit = DepthAudit(prof, rate=0.0, probe_rate=1.0, raise_bound=0.5)
    assert audit.ceiling == 4 and audit.depth(0.85) == 4 and audit.probe_depth(0.85) == 4  # at the ceiling
    assert audit.probe_depth(0.6) == 2  # depth 2 in force, never seen to agree: no probe above it yet
    audit.record(0.6, 2, AGREE, AGREE)  # an ordinary audit confirms it
    assert audit.probe_depth(0.6) == 4 and audit.probe_depth(0.3) == 1
    pol = make_policy("bicache", 8, prof, audit_rate=0.0, probe_rate=1.0, raise_bound=0.5)
    assert pol.max_node_depth == 4 and pol.probing().target_depth(0.6) == 2 and pol.store_depth(0.6) == 2
    pol.audit.record(0.6, 2, AGREE, AGREE)
    assert pol.probing().target_depth(0.6) == 4 and pol.target_depth(0.6) == 2
    assert pol.store_depth(0.6) == 4  # captures hold what the probes read
    off = make_policy("bicache", 8, prof, audit_rate=0.02)
    assert off.probing() is off and off.store_depth(0.6) == 2 and off.audit.stats()["bicache_audit_probe_rate"] == 0
    assert len(off.audit.stats()["bicache_audit_buckets"]) == 3  # no probing: the profile's own buckets
    none = make_policy("bicache", 8, None, probe_rate=0.1)
    assert none.max_node_depth == 8 and none.target_depth(0.9) == 0 and none.probing().target_depth(0.9) == 1


def test_planted_model_without_a_profile_reaches_its_true_depth_and_never_above(planted_k1, caplog):
    """The planted model (true safe depth 1: reuse at depth 2 reads the gathered digit of the context
    that filled the cache) served with no profile: probes earn depth 1 in the bucket its traffic
    has, the first probe at depth 2 disagrees (and is answered exact), depth 2 is never probed again
    nor served, and every answer is the planted task's, as cache off gives."""
    with caplog.at_level(logging.INFO, logger="bicache_sgl.bicache.audit"):
        eng = Engine(planted_k1, prefix_cache="bicache", bicache_profile="none", bicache_audit_probe_rate=1.0,
                     bicache_audit_raise_bound=0.5, threshold=None, device="cpu", num_threads=1)
        try:
            metas = []
            for i in range(24):
                prompt = PREFIX + f"Question {(i * 7) % 10} ({LETTERS[i]}): which digit?"  # each prompt new
                out = eng.generate(prompt, SP)
                assert out["text"] == expected_answer(prompt) * G, (i, out["meta_info"])
                metas.append(out["meta_info"])
            st = eng.get_stats()
        finally:
            eng.shutdown()
    depths = [m["bicache_depth"] for m in metas]
    served = [d for m, d in zip(metas, depths) if not m["bicache_audited"]]
    assert max(depths) == K and served.count(K) >= 8, (depths, [m["bicache_audited"] for m in metas])
    assert all(d == 0 for m, d in zip(metas, depths) if m["bicache_audited"])  # audited: answered exact
    assert st["bicache_audit_raised_total"] >= 1 and max(st["bicache_audit_bucket_depth"].values()) == K
    assert st["bicache_audit_probe_disagreements_total"] >= 1  # depth 2 was tried, and failed
    raised = [b for b in st["bicache_audit_buckets"] if b["raises"]]
    assert raised and all(b["depth"] == K and b["probe_depth"] == 0 for b in raised)  # stopped below 2
    assert st["bicache_audit_samples_total"] == sum(m["bicache_audited"] for m in metas)
    assert st["skipped_layer_tokens"] > 0
    assert "goes from depth 0 to 1" in caplog.text and "goes from depth 1 to 2" not in caplog.text
    # /metrics (the server renders the engine's stats): the counters and the raised bucket's gauges
    text = Metrics("planted").render(st)
    assert "bicache_sgl:bicache_audit_raised_total{" in text and "bicache_sgl:bicache_audit_probes_total{" in text
    key = next(k for k, d in st["bicache_audit_bucket_depth"].items() if d == K)
    assert any(line.startswith(f"bicache_sgl:bicache_audit_bucket_depth_{key}{{") and line.endswith(f" {K}")
               for line in text.splitlines()), text


def test_default_probe_rate_is_on_only_without_a_profile_of_the_models_own(planted_k1, tmp_path):
    """Default flags: a model with no profile, or a first-run one (here one that reached no verdict:
    every depth 0), probes at DEFAULT_PROBE_RATE; a shipped or given profile does not probe."""
    first_run = tmp_path / "first_run.json"
    BicacheProfile(((0, 0),), L, model="planted", criterion="exact", threshold=0.0,
                   extra={"auto": {"complete": False}}).save(first_run)
    given = tmp_path / "given.json"
    BicacheProfile(((0, 0), (50, 1)), L, model="planted", criterion="exact", threshold=0.0).save(given)
    for choice, rate in (("none", DEFAULT_PROBE_RATE), (str(first_run), DEFAULT_PROBE_RATE), (str(given), 0.0)):
        eng = Engine(planted_k1, prefix_cache="bicache", bicache_profile=choice, device="cpu", num_threads=1)
        try:
            assert eng.get_stats()["bicache_audit_probe_rate"] == rate, choice
        finally:
            eng.shutdown()


@pytest.fixture(scope="module")
def bundled_copy(tmp_path_factory) -> Path:
    """The bundled model's files without its profile (what a user with a checkpoint and no profile has)."""
    src, dst = Path(default_model_path()), tmp_path_factory.mktemp("bundled") / "model"
    dst.mkdir()
    for f in src.iterdir():
        if f.is_file() and f.name != PROFILE_FILENAME:
            shutil.copy(f, dst / f.name)
    return dst


def test_bundled_model_without_its_profile_earns_depth_on_repeats_of_one_prefix(bundled_copy):
    """40 requests sharing one few-shot prefix (r about 0.75-0.8), no profile: probes earn the
    bucket a depth > 0, the later requests are served reusing it, and every answer equals cache off."""
    items = task.heldout_items(5, 5, seed=0)
    assert len({it["prefix"] for it in items}) == 1
    prompts = [items[i % 5]["prompt"] for i in range(40)]
    sp = {"temperature": 0, "max_new_tokens": 8}
    off = Engine(str(bundled_copy), prefix_cache="off", num_threads=1)
    try:
        ref = [off.generate(p, sp)["output_ids"] for p in prompts]
    finally:
        off.shutdown()
    eng = Engine(str(bundled_copy), bicache_profile="none", bicache_audit_probe_rate=0.5,
                 bicache_audit_raise_bound=0.5, num_threads=1)
    try:
        outs = [eng.generate(p, sp) for p in prompts]
        st = eng.get_stats()
    finally:
        eng.shutdown()
    assert [o["output_ids"] for o in outs] == ref
    metas = [o["meta_info"] for o in outs]
    served = [m["bicache_depth"] for m in metas[20:] if not m["bicache_audited"]]
    assert st["bicache_audit_raised_total"] >= 1 and max(st["bicache_audit_bucket_depth"].values()) > 0
    assert sum(d > 0 for d in served) >= 5, [(m["bicache_depth"], m["bicache_audited"]) for m in metas]
    assert max(served) <= max(st["bicache_audit_bucket_depth"].values())
    assert st["skipped_layer_tokens"] > 0 and st["bicache_audit_probes_total"] >= st["bicache_audit_raise_samples"]
