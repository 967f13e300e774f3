"""The online audit: reusing requests on probation (and a sample after it) also run their first
forward without reuse and are answered from it; a bucket whose reuse disagrees drops to a depth
that agreed, or half the failed one (and every lower bucket with it), and is on probation again."""

from __future__ import annotations

import logging
import shutil

import numpy as np
import pytest
import torch

from bicache_sgl import Engine
from bicache_sgl.bicache.audit import DepthAudit, compare
from bicache_sgl.bicache.profile import PROFILE_FILENAME, BicacheProfile
from bicache_sgl.testing.planted import expected_answer, make_planted_llada

K, L = 2, 6
G = 8
SP = {"temperature": 0, "max_new_tokens": G, "block_length": G}
# ends with a blank line: a segment boundary, so the span cut (docs/prefix_cache.md) leaves the
# whole prefix reusable and these tests exercise the depth rule on it
PREFIX = "System: answer with the digit that the question holds. Be brief and exact. " * 2 + "\n\n"


@pytest.fixture(scope="module")
def planted(tmp_path_factory) -> str:
    return make_planted_llada(tmp_path_factory.mktemp("planted_audit"), k=K, n_layers=L)


def test_compare_and_caps_err_safe():
    a = torch.tensor([[0.0, 5.0, 0.0], [3.0, 0.0, 0.0]])
    assert compare(a, a) == (1.0, 0.0)
    agree, kl = compare(a, torch.tensor([[0.0, 5.0, 0.0], [0.0, 3.0, 0.0]]))
    assert agree == 0.5 and kl > 0
    audit = DepthAudit(BicacheProfile(((0, 0), (30, 2), (60, 8)), 8), rate=1.0, min_agreement=0.9)
    assert audit.cap(0.7) is None
    audit.record(0.7, 8, a, a)  # agrees: nothing changes
    assert audit.cap(0.7) is None and audit.lowered == 0
    bad = torch.tensor([[5.0, 0.0, 0.0], [0.0, 3.0, 0.0]])
    audit.record(0.7, 8, bad, a)  # disagrees at depth 8 in the r >= 0.6 bucket: nothing lower agreed
    assert audit.cap(0.7) == 4 and audit.cap(0.4) is None  # halved; the lower bucket (2) is below it already
    audit.record(0.7, 3, a, a)  # depth 3 agreed here (a node-limited request) ...
    audit.record(0.7, 4, bad, a)  # ... so the next failure drops to it, not to 2
    assert audit.cap(0.7) == 3
    audit.record(0.4, 2, bad, a)
    assert audit.cap(0.4) == 1 and audit.cap(0.7) == 3  # a lower bucket never lowers a higher one
    audit.record(0.7, 2, a, a)
    assert audit.cap(0.7) == 3  # caps never rise again
    st = audit.stats()
    assert st["bicache_audit_samples_total"] == 6 and st["bicache_audit_lowered_total"] == 3
    assert st["bicache_audit_disagreements_total"] == 3 and st["bicache_audit_served_exact_total"] == 6
    assert [(c["from"], c["to"]) for c in st["bicache_audit_depth_changes"]] == [(8, 4), (4, 3), (2, 1)]
    with pytest.raises(ValueError, match="rate"):
        DepthAudit(BicacheProfile(((0, 0),), 4), rate=1.5)


def test_probation_audits_every_request_until_trust_is_earned():
    a = torch.tensor([[0.0, 5.0, 0.0]])
    bad = torch.tensor([[5.0, 0.0, 0.0]])
    audit = DepthAudit(BicacheProfile(((0, 0), (50, 4)), 4), rate=0.0, probation=3)
    assert audit.should_audit(0.7) and not audit.trusted(0.7)
    for _ in range(3):
        audit.record(0.7, 4, a, a)
    assert audit.trusted(0.7) and not audit.should_audit(0.7)  # rate 0 after probation
    audit.record(0.7, 4, bad, a)  # trust is lost with one disagreement, at the lower depth
    assert not audit.trusted(0.7) and audit.should_audit(0.7) and audit.cap(0.7) == 2
    audit.record(0.7, 1, a, a)  # a lower, node-limited depth agreeing does not earn trust in depth 2
    assert audit.stats()["bicache_audit_buckets"][1]["streak"] == 0
    with pytest.raises(ValueError, match="probation"):
        DepthAudit(BicacheProfile(((0, 0),), 4), rate=0.0, probation=-1)


def test_audit_lowers_a_too_deep_profile_on_the_planted_model(planted, tmp_path):
    """The planted model's safe depth is K; a profile allowing K + 2 answers the wrong question.
    Every audited request is answered from its exact forward, so every answer is right; the first
    disagreement halves the depth to K, and from then on reuse at K agrees."""
    prof = tmp_path / "too_deep.json"
    BicacheProfile(((0, 0), (50, 2 * K)), L, model="planted").save(prof)
    eng = Engine(planted, prefix_cache="bicache", bicache_profile=str(prof), bicache_audit_rate=1.0,
                 threshold=None, device="cpu")
    try:
        eng.generate(PREFIX + "Question 3: which digit?", SP)  # stores the prefix at depth 2K
        right = []
        for d in "5846":
            prompt = PREFIX + f"Question {d}: which digit?"
            out = eng.generate(prompt, SP)
            assert out["meta_info"]["bicache_audited"] and out["meta_info"]["bicache_depth"] == 0
            right.append(out["text"] == expected_answer(prompt) * G)
        assert right == [True] * 4
        st = eng.get_stats()
        assert st["bicache_audit_lowered_total"] == 1 and st["bicache_audit_samples_total"] == 4
        assert st["bicache_audit_disagreements_total"] == 1 and st["bicache_audit_served_exact_total"] == 4
        assert [b["depth"] for b in st["bicache_audit_buckets"]] == [0, K]
    finally:
        eng.shutdown()


def test_audited_requests_answer_as_cache_off(tiny_llada, tmp_path):
    """The audit's shadow forward rides in the same batch and the audited request continues from
    it: its tokens equal those of an engine with the prefix cache off (tiny model)."""
    prof = tmp_path / "p.json"
    BicacheProfile(((0, 0), (50, 4)), 4, model="tiny").save(prof)
    prefix = "Shared instructions for every question in this batch, long enough to matter. " * 2
    prompts = [prefix + q for q in ("Alpha?", "Beta?", "Gamma?")]
    outs = {}
    for mode, rate in (("off", 0.0), ("bicache", 1.0)):
        eng = Engine(tiny_llada, prefix_cache=mode, bicache_profile=str(prof), bicache_audit_rate=rate,
                     bicache_audit_min_agreement=0.0, block_length=8, threshold=None)
        try:
            eng.generate(prefix, {"max_new_tokens": 0})
            outs[mode] = [o["output_ids"] for o in eng.generate(prompts, {"temperature": 0, "max_new_tokens": 16})]
            st = eng.get_stats()
            if rate:
                assert st["bicache_audit_samples_total"] == 3  # every reusing request was audited
                assert st["prefix_cache_stored_layer_tokens"] > 0
        finally:
            eng.shutdown()
    assert outs["off"] == outs["bicache"]


def test_exact_profile_audit_holds_reuse_to_its_promise():
    """For a profile of the exact criterion a disagreement is any changed top-1 at tolerance 0 (or
    more than the tolerance), whatever min_agreement allows other criteria."""
    exact = torch.tensor([[0.0, 5.0, 0.0]] * 20)
    one_off = exact.clone()
    one_off[3] = torch.tensor([5.0, 0.0, 0.0])  # 95% top-1 agreement
    table = ((0, 0), (50, 4))
    lenient = DepthAudit(BicacheProfile(table, 4, criterion="agreement", threshold=0.9), rate=1.0)
    lenient.record(0.7, 4, one_off, exact)
    assert lenient.cap(0.7) is None  # 95% >= 90%: the agreement profile's rule lets it pass
    strict = DepthAudit(BicacheProfile(table, 4, criterion="exact", threshold=0.0), rate=1.0)
    strict.record(0.7, 4, one_off, exact)
    assert strict.cap(0.7) == 2 and strict.min_agreement == 1.0
    tolerant = DepthAudit(BicacheProfile(table, 4, criterion="exact", threshold=0.1), rate=1.0)
    tolerant.record(0.7, 4, one_off, exact)
    assert tolerant.cap(0.7) is None  # within its 10% tolerance


def test_shipped_profile_bucket_is_lowered_and_logged(planted, tmp_path, caplog):
    """A profile shipped beside the model (not a first-run one, not given by flag) is audited too:
    on probation (asked for here; 0 by default for a shipped profile) its first reusing request is
    audited, the too-deep bucket is lowered with a WARNING naming the profile, and every answer is
    the planted task's."""
    model = tmp_path / "shipped"
    shutil.copytree(planted, model)
    BicacheProfile(((0, 0), (50, 2 * K)), L, model="shipped-planted", criterion="exact",
                   threshold=0.0).save(model / PROFILE_FILENAME)
    with caplog.at_level(logging.WARNING, logger="bicache_sgl.bicache.audit"):
        eng = Engine(str(model), prefix_cache="bicache", bicache_audit_probation=2, threshold=None, device="cpu")
        try:
            assert eng.profile.model == "shipped-planted" and "auto" not in eng.profile.extra
            eng.generate(PREFIX + "Question 3: which digit?", SP)
            for d in "584":
                prompt = PREFIX + f"Question {d}: which digit?"
                assert eng.generate(prompt, SP)["text"] == expected_answer(prompt) * G
            st = eng.get_stats()
            assert st["bicache_audit_lowered_total"] >= 1 and st["bicache_audit_bucket_depth"]["r50"] <= K
        finally:
            eng.shutdown()
    assert "of the profile shipped-planted (exact) goes from depth 4 to 2" in caplog.text


def test_online_audit_allocates_adds_swaps_records_and_gives_back(tiny_llada):
    """The audit's one object (OnlineAudit) on a real pool and real requests: an audited request
    gets its shadow at admission, its first forward carries the shadow (which takes over the
    capture), the forward's exact logits replace its own and its K/V becomes the shadow's (no reuse
    after), the comparison is recorded, and at release every row goes back. With no room for a
    shadow the request reuses nothing; a request's own bicache_depth is never audited."""
    from bicache_sgl.bicache.audit import OnlineAudit
    from bicache_sgl.bicache.planner import ReusePlan
    from bicache_sgl.config import DecodeDefaults, SamplingParams
    from bicache_sgl.io_struct import GenerateRequest
    from bicache_sgl.kv_cache.manager import CacheGrant
    from bicache_sgl.kv_cache.pool import KVPool
    from bicache_sgl.kv_cache.store import Capture
    from bicache_sgl.models.loader import load_model_config, load_tokenizer
    from bicache_sgl.scheduler.factory import RequestFactory

    mc = load_model_config(tiny_llada)
    L = mc.n_layers
    factory = RequestFactory(mc, load_tokenizer(tiny_llada), mc.eos_token_ids, DecodeDefaults(block_length=8), 256)
    depths = DepthAudit(BicacheProfile(((0, 0), (50, L)), L), rate=1.0)

    def admitted(pool: KVPool, audit: OnlineAudit, **kw) -> object:
        req = factory.build(GenerateRequest(list(range(10, 30)), SamplingParams(max_new_tokens=8), **kw), None)
        req.admit([pool.alloc_request(n) for n in req.kv_lengths()],
                  CacheGrant(ReusePlan(16, 16, 2, 0.8, 0, req.seq_len), capture=Capture({})))
        audit.admit(req, req.facts())
        return req

    seq = 20 + 8
    pool = KVPool(mc, 16, 64, 2 * L * seq, torch.float32, torch.device("cpu"))  # the request and one shadow
    audit = OnlineAudit(depths, pool)
    req = admitted(pool, audit)
    assert pool.request_rows.num_free == 0 and req.choice.depth == 2  # the shadow is allocated, reuse kept
    own_kv, capture = req.kv, req.grant.capture
    works = audit.add(req, req.plan_step(L))
    assert len(works) == 2 and works[0].kv is own_kv and works[0].depth == 2 and works[0].capture is None
    shadow = works[1]
    assert shadow.kv is not own_kv and shadow.depth == 0 and shadow.capture is capture
    assert np.array_equal(shadow.positions, works[0].positions)
    n = len(works[0].logit_positions)
    reused, exact = torch.zeros(n, 16), torch.zeros(n, 16)
    exact[:, 3] = 1.0  # every top-1 differs: a disagreement
    assert audit.apply(req, [reused, exact])[0] is exact
    assert req.kv is shadow.kv and req.served_exact and req.choice.depth == 0
    st = depths.stats()
    assert st["bicache_audit_samples_total"] == 1 and st["bicache_audit_disagreements_total"] == 1
    assert len(audit.add(req, req.plan_step(L))) == 1  # the shadow served its one forward
    for kv in req.detach_kv():
        pool.free_seq(kv)
    audit.release(req)
    assert pool.request_rows.num_free == 2 * L * seq  # the request's rows and the ones it left

    tight = KVPool(mc, 16, 64, L * seq, torch.float32, torch.device("cpu"))  # the request only
    audit = OnlineAudit(depths, tight)
    req = admitted(tight, audit)
    assert req.choice.depth == 0 and len(audit.add(req, req.plan_step(L))) == 1  # no shadow: no reuse
    forced = admitted(pool, OnlineAudit(depths, pool), bicache_depth=2)
    assert forced.choice.depth == 2 and pool.request_rows.num_free == L * seq  # its own depth: not audited
