"""A profile table per generation mode, chosen per request (issue 34 follow-up).

The bundled default model's exact profile found no disagreement at depth 8 among answers that stop
at EOS in its r >= 70% bucket, while answers forced past EOS flip at depth 1 everywhere; so a
request that stops at EOS reads the "stop" table and one whose answer is forced past EOS (or may
be: ``request_mode``) the "ignore_eos" table. A profile without per-mode data keeps one table for
every mode. No model here: profiles, the policy, the planner and the audit are plain bookkeeping.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import bicache_sgl
from bicache_sgl.bicache.audit import DepthAudit
from bicache_sgl.bicache.planner import MatchFacts, RequestFacts, plan_reuse
from bicache_sgl.bicache.policy import make_policy, request_mode
from bicache_sgl.bicache.profile import MODE_IGNORE_EOS, MODE_STOP, PROFILE_FILENAME, BicacheProfile
from bicache_sgl.calibration import rederive
from bicache_sgl.config import SamplingParams
from bicache_sgl.models.loader import resolve_model_path

EOS = (2,)
SHIPPED = resolve_model_path(None) + "/" + PROFILE_FILENAME
CONTEXT = str(Path(bicache_sgl.__file__).parent / "assets" / "context_model" / PROFILE_FILENAME)


def sp(**kw) -> SamplingParams:
    return SamplingParams.from_dict({"max_new_tokens": 8, **kw})


@pytest.mark.parametrize(("params", "constrained", "mode"), [
    ({}, False, MODE_STOP),
    ({"stop": ["\n"], "stop_token_ids": [5]}, False, MODE_STOP),  # only ends the answer earlier
    ({"logit_bias": {"7": -100.0}}, False, MODE_STOP),  # not an EOS id
    ({"ignore_eos": True}, False, MODE_IGNORE_EOS),
    ({"min_new_tokens": 4}, False, MODE_IGNORE_EOS),  # EOS banned on the first positions
    ({"logit_bias": {"2": -100.0}}, False, MODE_IGNORE_EOS),  # a banned EOS
    ({"logit_bias": {"2": 5.0}}, False, MODE_IGNORE_EOS),  # either sign moves the end
    ({"repetition_penalty": 1.2}, False, MODE_IGNORE_EOS),  # penalises EOS once there is one
    ({"frequency_penalty": 0.5}, False, MODE_IGNORE_EOS),
    ({"presence_penalty": 0.5}, False, MODE_IGNORE_EOS),
    ({"regex": "[0-9]+"}, False, MODE_IGNORE_EOS),  # a constraint bans EOS until it completes
    ({}, True, MODE_IGNORE_EOS),
])
def test_request_mode_is_stop_only_when_nothing_forces_text_past_eos(params, constrained, mode):
    assert request_mode(sp(**params), EOS, constrained=constrained) == mode


def test_shipped_default_profile_has_a_stop_table_deeper_than_its_ignore_eos_table():
    prof = BicacheProfile.load(SHIPPED)
    assert prof.modes == (MODE_STOP, MODE_IGNORE_EOS)
    # stop: depth 8 from the r = 70% bucket (n = 60, no disagreement, bound 4.87%); 0 below
    assert [prof.lookup(r, MODE_STOP) for r in (0.1, 0.5, 0.69, 0.7, 0.85, 0.95)] == [0, 0, 0, 8, 8, 8]
    assert all(prof.lookup(r, MODE_IGNORE_EOS) == 0 for r in np.linspace(0, 1, 21))
    assert all(prof.lookup(r) == 0 for r in np.linspace(0, 1, 21))  # unknown mode: the conservative one
    # old readers' table is no deeper than any mode's
    assert all(b == 0 for _, b in prof.table) and prof.max_depth == 8


def test_bundled_profiles_table_by_mode_is_what_their_counts_give():
    """``python -m bicache_sgl.calibration.rederive --check`` on the shipped files: the stored
    per-mode tables are the exact rule applied to the stored counts (nothing hand-edited)."""
    rederive.main(["--check", SHIPPED, CONTEXT])
    ctx = BicacheProfile.load(CONTEXT)
    # context model, calibrated with the span cut (issue 38): stop requests at r >= 80% reuse 3
    # layers, a forced answer past EOS nothing
    assert ctx.modes == (MODE_STOP, MODE_IGNORE_EOS) and ctx.max_depth == 3
    assert ctx.table_for(MODE_STOP)[-1] == (80.0, 3) and max(b for _, b in ctx.table_for(MODE_IGNORE_EOS)) == 0


def test_per_mode_tables_are_derived_from_counts_when_the_file_has_none(tmp_path):
    d = json.loads(Path(SHIPPED).read_text())
    d.pop("table_by_mode")
    p = tmp_path / "p.json"
    p.write_text(json.dumps(d))
    assert BicacheProfile.load(p).by_mode == BicacheProfile.load(SHIPPED).by_mode


def test_old_single_table_profile_loads_unchanged_and_serves_every_mode(tmp_path):
    p = tmp_path / "old.json"
    p.write_text(json.dumps({"model": "m", "n_layers": 8, "criterion": "agreement", "threshold": 0.9,
                             "table": [[0, 0], [10, 8]],
                             # what the calibrate CLI writes for a non-exact criterion
                             "tolerance": None, "max_bound": None, "buckets": None, "buckets_by_mode": None}))
    prof = BicacheProfile.load(p)
    assert prof.by_mode == () and prof.modes == ()
    pol = make_policy("bicache", 8, prof)
    for mode in (MODE_STOP, MODE_IGNORE_EOS):
        assert pol.target_depth(0.05, mode) == 0 and pol.target_depth(0.5, mode) == 8
    assert "table_by_mode" not in prof.to_dict()
    assert prof.at_tolerance(0.1) is prof  # no counts: its table stands


def test_save_load_keeps_the_per_mode_tables(tmp_path):
    prof = BicacheProfile.load(SHIPPED)
    prof.save(tmp_path / "p.json")
    again = BicacheProfile.load(tmp_path / "p.json")
    assert again.by_mode == prof.by_mode and again.table == prof.table


def test_tolerance_rederives_each_mode_and_old_readers_get_the_minimum():
    prof = BicacheProfile.load(SHIPPED).at_tolerance(0.2)
    stop, ign = prof.table_for(MODE_STOP), prof.table_for(MODE_IGNORE_EOS)
    # stop at r = 30%: 2 of 31 disagree at every depth, 95% bound 0.19 <= 0.2: depth 8
    assert BicacheProfile.lookup_table(stop, 0.3) == 8
    assert all(BicacheProfile.lookup_table(ign, r) == 0 for r in (0.3, 0.5, 0.75))
    for r in np.linspace(0, 1, 21):
        assert BicacheProfile.lookup_table(prof.table, r) <= min(prof.lookup(r, MODE_STOP),
                                                                 prof.lookup(r, MODE_IGNORE_EOS))


def test_a_mode_the_profile_did_not_measure_reuses_nothing():
    prof = BicacheProfile(((0.0, 0), (70.0, 8)), 8, criterion="exact", by_mode=((MODE_STOP, ((0.0, 0), (70.0, 8))),))
    assert prof.lookup(0.8, MODE_STOP) == 8 and prof.lookup(0.8, MODE_IGNORE_EOS) == 0
    with pytest.raises(ValueError, match="unknown generation mode"):
        BicacheProfile(((0.0, 0),), 8, by_mode=(("greedy", ((0.0, 0),)),))


def _match(m: int, L: int, lcp: int, capture_len: int) -> MatchFacts:
    """m matched tokens, every layer held, all captured in one context sharing ``lcp`` tokens."""
    return MatchFacts(m, ((m, L),), np.ones((m, L), dtype=bool), np.zeros((m, L), dtype=np.int64),
                      {0: (lcp, capture_len)})


def test_planner_reads_the_table_of_the_requests_mode():
    pol = make_policy("bicache", 8, BicacheProfile.load(SHIPPED))
    match = _match(80, 8, 80, 100)  # r = 80 / 100
    stop = plan_reuse(pol, RequestFacts(81, 100, mode=MODE_STOP), match)
    ign = plan_reuse(pol, RequestFacts(81, 100, mode=MODE_IGNORE_EOS), match)
    assert (stop.depth, stop.reused, stop.mode) == (8, 80, MODE_STOP)
    assert (ign.depth, ign.reused) == (0, 0)
    # the same prompt at r = 60%: below the stop table's reusable range
    assert plan_reuse(pol, RequestFacts(81, 100, mode=MODE_STOP), _match(60, 8, 60, 100)).depth == 0
    # what a capture stores is sized for the deepest mode (a later stop request may reuse it)
    assert pol.store_depth(0.8) == 8 and pol.target_depth(0.8, MODE_IGNORE_EOS) == 0
    assert max(hi for *_, hi in ign.store) == 8


def test_audit_lowers_only_the_table_of_the_disagreeing_mode():
    prof = BicacheProfile(((0.0, 0), (50.0, 4)), 8, criterion="agreement",
                          by_mode=((MODE_STOP, ((0.0, 0), (50.0, 8))), (MODE_IGNORE_EOS, ((0.0, 0), (50.0, 4)))))
    audit = DepthAudit(prof, rate=1.0, min_agreement=0.9)
    pol = make_policy("bicache", 8, prof, audit_rate=1.0)
    good = torch.tensor([[0.0, 5.0], [5.0, 0.0]])
    bad = torch.tensor([[5.0, 0.0], [0.0, 5.0]])
    audit.record(0.6, 8, bad, good, MODE_STOP)
    assert audit.cap(0.6, MODE_STOP) == 4 and audit.cap(0.6, MODE_IGNORE_EOS) is None
    audit.record(0.6, 4, bad, good, MODE_IGNORE_EOS)
    assert audit.cap(0.6, MODE_IGNORE_EOS) == 2 and audit.cap(0.6, MODE_STOP) == 4
    st = audit.stats()
    assert st["bicache_audit_bucket_depth"] == {"stop_r0": 0, "stop_r50": 4, "ignore_eos_r0": 0, "ignore_eos_r50": 2}
    assert [h["mode"] for h in st["bicache_audit_depth_changes"]] == [MODE_STOP, MODE_IGNORE_EOS]
    # the policy applies its own audit's caps per mode
    pol.audit.record(0.6, 8, bad, good, MODE_STOP)
    assert pol.target_depth(0.6, MODE_STOP) == 4 and pol.target_depth(0.6, MODE_IGNORE_EOS) == 4
