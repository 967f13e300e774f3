"""The online audit: a sample of reusing requests also runs its first forward without reuse; a
bucket whose reuse disagrees is capped one layer lower (and every lower bucket with it)."""

from __future__ import annotations

import pytest
import torch

from bicache_sgl import Engine
from bicache_sgl.bicache.audit import DepthAudit, compare
from bicache_sgl.bicache.profile import BicacheProfile
from bicache_sgl.testing_planted import expected_answer, make_planted_llada

K, L = 2, 6
G = 8
SP = {"temperature": 0, "max_new_tokens": G, "block_length": G}
PREFIX = "System: answer with the digit that the question holds. Be brief and exact. " * 2


@pytest.fixture(scope="module")
def planted(tmp_path_factory) -> str:
    return make_planted_llada(tmp_path_factory.mktemp("planted_audit"), k=K, n_layers=L)


def test_compare_and_caps_err_safe():
    a = torch.tensor([[0.0, 5.0, 0.0], [3.0, 0.0, 0.0]])
    assert compare(a, a) == (1.0, 0.0)
    agree, kl = compare(a, torch.tensor([[0.0, 5.0, 0.0], [0.0, 3.0, 0.0]]))
    assert agree == 0.5 and kl > 0
    audit = DepthAudit(BicacheProfile(((0, 0), (30, 2), (60, 4)), 4), rate=1.0, min_agreement=0.9)
    assert audit.cap(0.7) is None
    audit.record(0.7, 4, a, a)  # agrees: nothing changes
    assert audit.cap(0.7) is None and audit.lowered == 0
    bad = torch.tensor([[5.0, 0.0, 0.0], [0.0, 3.0, 0.0]])
    audit.record(0.7, 4, bad, a)  # disagrees at depth 4 in the r >= 0.6 bucket
    assert audit.cap(0.7) == 3 and audit.cap(0.4) == 3 and audit.cap(0.1) == 3  # lower buckets too
    audit.record(0.4, 2, bad, a)
    assert audit.cap(0.4) == 1 and audit.cap(0.7) == 3  # a lower bucket never lowers a higher one
    audit.record(0.7, 2, a, a)
    assert audit.cap(0.7) == 3  # caps never rise again
    st = audit.stats()
    assert st["bicache_audit_samples_total"] == 4 and st["bicache_audit_lowered_total"] == 2
    with pytest.raises(ValueError, match="rate"):
        DepthAudit(BicacheProfile(((0, 0),), 4), rate=1.5)


def test_audit_lowers_a_too_deep_profile_on_the_planted_model(planted, tmp_path):
    """The planted model's safe depth is K; a profile allowing K + 2 answers the wrong question.
    With every reusing request audited, the depth falls to K within two audited requests, and
    from then on the answers are right."""
    prof = tmp_path / "too_deep.json"
    BicacheProfile(((0, 0), (50, K + 2)), L, model="planted").save(prof)
    eng = Engine(planted, prefix_cache="bicache", bicache_profile=str(prof), bicache_audit_rate=1.0,
                 threshold=None, device="cpu")
    try:
        eng.generate(PREFIX + "Question 3: which digit?", SP)  # stores the prefix at depth K + 2
        depths, right = [], []
        for d in "5846":
            prompt = PREFIX + f"Question {d}: which digit?"
            out = eng.generate(prompt, SP)
            depths.append(out["meta_info"]["bicache_depth"])
            right.append(out["text"] == expected_answer(prompt) * G)
        assert depths == [K + 2, K + 1, K, K]
        assert right == [False, False, True, True]
        st = eng.get_stats()
        assert st["bicache_audit_lowered_total"] == 2 and st["bicache_audit_samples_total"] == 4
        assert [b["cap"] for b in st["bicache_audit_buckets"]] == [K, K]
    finally:
        eng.shutdown()


def test_audit_does_not_change_outputs(tiny_llada, tmp_path):
    """The audit's shadow forward rides in the same batch: the audited requests' tokens equal
    those of an engine without the audit (tiny model, an agreeing shallow profile)."""
    prof = tmp_path / "p.json"
    BicacheProfile(((0, 0), (50, 1)), 4, model="tiny").save(prof)
    prefix = "Shared instructions for every question in this batch, long enough to matter. " * 2
    prompts = [prefix + q for q in ("Alpha?", "Beta?", "Gamma?")]
    outs = {}
    for rate in (0.0, 1.0):
        eng = Engine(tiny_llada, prefix_cache="bicache", bicache_profile=str(prof), bicache_audit_rate=rate,
                     bicache_audit_min_agreement=0.0, block_length=8, threshold=None)
        try:
            eng.generate(prefix, {"max_new_tokens": 0})
            outs[rate] = [o["output_ids"] for o in eng.generate(prompts, {"temperature": 0, "max_new_tokens": 16})]
            st = eng.get_stats()
            if rate:
                assert st["bicache_audit_samples_total"] == 3  # every reusing request was audited
            else:
                assert st["bicache_audit_rate"] == 0 and "bicache_audit_samples_total" not in st
        finally:
            eng.shutdown()
    assert outs[0.0] == outs[1.0]
