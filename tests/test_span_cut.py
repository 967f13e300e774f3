"""The span cut (docs/prefix_cache.md, "Where the reused span ends"): rows captured in context c
serve only positions before the last segment boundary at or before LCP(prompt_c, prompt).

The planner's rule is checked without a model; the boundary tables on hand-made token texts (a
character tokenizer and a BPE-like one with a chat template's header); the effect on the context
model with the official BiCache LLaDA depth table scaled to 8 layers (issue 38): without the cut
answers change, with it every answer equals cache off at every forced depth.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from bicache_sgl.bicache.planner import MatchFacts, RequestFacts, plan_reuse, span_cuts, usable_depths
from bicache_sgl.bicache.policy import FixedPolicy
from bicache_sgl.bicache.segments import SegmentBoundaries

L = 4


def _match(ctx_rows: list[list[int]], shared: dict[int, tuple[int, int]], runs: list[int] | None = None,
           length: int | None = None, segments=None) -> MatchFacts:
    ctx = np.asarray(ctx_rows, dtype=np.int64)
    n = length if length is not None else len(ctx)
    return MatchFacts(n, tuple(segments or ((n, L),)), ctx >= 0, ctx, shared,
                      None if runs is None else np.asarray(runs, dtype=np.int64))


# ------------------------------------------------------------------------------ the planner's rule
def test_rows_serve_only_before_their_contexts_last_boundary_at_or_before_the_lcp():
    """Two capture contexts over 12 matched tokens: context 0 (tokens 0-5, its LCP with the request
    9, boundaries at 4 and 11 -> cut 4) and context 1 (tokens 6-11, LCP 12 -> cut 11)."""
    ctx = [[0] * L] * 6 + [[1] * L] * 6
    match = _match(ctx, {0: (9, 40), 1: (12, 40)})
    facts = RequestFacts(prompt_len=20, seq_len=40, boundaries=(4, 11, 15))
    assert span_cuts(match, facts.boundaries) == {0: 4, 1: 11}
    policy = FixedPolicy(L, L)
    usable, _ = usable_depths(policy, match, 40, cuts=span_cuts(match, facts.boundaries))
    assert usable.tolist() == [L] * 4 + [0] * 2 + [L] * 5 + [0]
    plan = plan_reuse(policy, facts, match)
    assert (plan.start, plan.prefix, plan.depth) == (6, 11, L) and plan.matched == 12
    # no boundaries given: the span is not cut (the rule before issue 38)
    uncut = plan_reuse(policy, RequestFacts(prompt_len=20, seq_len=40), match)
    assert (uncut.start, uncut.prefix, uncut.depth) == (0, 12, L)
    # a prompt with no boundary before the LCP: nothing of that context is reused
    assert plan_reuse(policy, RequestFacts(20, 40, boundaries=(15,)), match).depth == 0


def test_a_capture_whose_whole_sequence_is_shared_is_reused_to_its_end():
    """A prefix-only capture (N_c == its prompt == the LCP) saw nothing beside the shared tokens:
    the request extends it, so no segment of it is decided by a different continuation."""
    match = _match([[0] * L] * 7, {0: (7, 7)})
    plan = plan_reuse(FixedPolicy(L, L), RequestFacts(20, 40, boundaries=(3,)), match)
    assert (plan.start, plan.prefix, plan.depth) == (0, 7, L)


def test_a_run_is_split_at_a_cut_in_run_compressed_and_per_token_form_alike():
    """The pool's run-compressed match (one row per run) gives the same usable depths as the
    per-token form when a cut falls inside a run; deeper layers from another context (an upgrade)
    are judged by that context's own cut."""
    rows = [[0, 0, 1, 1]] * 10  # layers 0-1 captured in context 0, layers 2-3 upgraded in context 1
    shared = {0: (9, 50), 1: (6, 50)}
    facts = RequestFacts(20, 50, boundaries=(3, 7))  # cuts: context 0 -> 7, context 1 -> 3
    per_token = _match(rows, shared)
    compact = _match(rows[:1], shared, runs=[0], length=10)
    cuts = span_cuts(per_token, facts.boundaries)
    assert cuts == {0: 7, 1: 3}
    want = [4, 4, 4, 2, 2, 2, 2, 0, 0, 0]
    for m in (per_token, compact):
        assert usable_depths(FixedPolicy(L, L), m, 50, cuts=cuts)[0].tolist() == want
        plan = plan_reuse(FixedPolicy(L, L), facts, m)
        assert (plan.start, plan.prefix, plan.depth) == (0, 7, 2)


def test_a_span_ending_inside_a_node_stores_one_depth_for_the_whole_node():
    """The cut ends the span inside a node: what the request stores must give every token of the
    node the same layers (a node holds rows exactly for layers < its depth)."""
    match = _match([[0, 0, -1, -1]] * 10, {0: (9, 50)}, segments=((10, 2),))
    plan = plan_reuse(FixedPolicy(L, L), RequestFacts(30, 50, boundaries=(6,)), match)
    assert (plan.start, plan.prefix, plan.depth) == (0, 6, 2)
    in_node = [(s, e, lo, hi) for s, e, lo, hi in plan.store if s < 10]
    assert {(lo, hi) for _, _, lo, hi in in_node} == {(2, L)}
    assert sorted((s, e) for s, e, _, _ in in_node)[0][0] == 0 and max(e for _, e, _, _ in in_node) == 10


# ------------------------------------------------------------------------------ boundary tables
def test_boundaries_of_a_character_tokenizer_are_the_blank_lines_and_end_ids():
    texts = ["<eos>", "<mask>", "\n", " ", "Q", ":", "A", "1"]
    sb = SegmentBoundaries.from_texts(texts, end_turn_ids=[0], special_ids=[0, 1])
    ids = [4, 5, 2, 6, 5, 2, 2, 4, 5, 0, 4]  # "Q:\nA:\n\nQ:<eos>Q"
    assert sb.positions(ids) == (7, 10)
    assert sb.positions([]) == () and sb.positions([99, 2, 2]) == (3,)  # an unknown id is ordinary


def test_a_template_header_blank_line_is_not_a_boundary_but_the_turn_end_is():
    """BPE-like: "\\n\\n" is one token; after a header's special token it opens the turn (not a
    boundary); the end-of-turn special token is one; a text token ending in a blank line is one."""
    texts = ["<|eot|>", "<|hdr_end|>", "\n\n", "hi", ".\n\n", "\n", "user"]
    sb = SegmentBoundaries.from_texts(texts, end_turn_ids=[0], special_ids=[0, 1])
    ids = [6, 1, 2, 3, 4, 3, 0, 6, 1, 2, 3, 5, 5]
    assert sb.positions(ids) == (5, 7, 13)
    assert SegmentBoundaries.from_texts(["a", "b"]).empty


def test_boundaries_come_from_the_context_models_tokenizer():
    from bicache_sgl.models.loader import load_tokenizer
    tok = load_tokenizer(str(ASSET))
    sb = SegmentBoundaries.from_tokenizer(tok, [0])
    text = "Question: K\nAnswer: 7\n\nQuestion: D\nAnswer: 7\n\nQuestion: K\nAnswer:"
    ids = tok.encode(text)
    assert [text[:p].endswith("\n\n") for p in sb.positions(ids)] == [True, True]
    assert len(sb.positions(ids)) == text.count("\n\n")


# ------------------------------------------------------------------------------ the context model
ASSET = Path(__file__).resolve().parents[1] / "bicache_sgl" / "assets" / "context_model"
needs_model = pytest.mark.skipif(not (ASSET / "model.safetensors").exists(),
                                 reason="the context-dependent model is not in bicache_sgl/assets/context_model")
# The official BiCache LLaDA-8B-Instruct table (policies/bicache_llada.json of sands-lab/ACache:
# prefix ratio % -> layers of 32), scaled to 8 layers (ceil(d / 4): its depth >= 1 rule kept)
OFFICIAL_LLADA = {0: 1, 5: 2, 10: 3, 13: 5, 15: 7, 20: 8, 21: 9, 30: 10, 49: 11, 54: 13, 66: 14, 68: 15, 73: 16,
                  87: 17, 93: 18, 95: 19, 97: 20, 98: 22, 99: 32}


def official_table_8() -> tuple[tuple[float, int], ...]:
    return tuple((float(r), max(1, math.ceil(d * 8 / 32))) for r, d in sorted(OFFICIAL_LLADA.items()))


@pytest.fixture(scope="module")
def fewshot(tmp_path_factory):
    """The issue's setup: 24 held-out few-shot requests (5 shots, the group task, each family's
    first question first), served by cache off and by bicache under the scaled official table,
    with and without the span cut, and at forced depths 2 and 8 with and without it."""
    from bicache_sgl.bicache.profile import BicacheProfile
    from bicache_sgl.training import task
    from bicache_sgl.training.evaluate import make_engine, score_modes

    prof = tmp_path_factory.mktemp("official") / "official8.json"
    BicacheProfile(official_table_8(), 8, model="context_model", criterion="kv-cosine", threshold=0.97).save(prof)
    items = task.heldout_items(24, 5, seed=0, kind="group")

    def engine(mode: str):
        name, cut = mode.split("/")
        kw = {"bicache_profile": str(prof)} if name == "bicache" else {}
        return make_engine(str(ASSET), prefix_cache=name, bicache_span_cut=cut, bicache_audit_rate=0.0, **kw)

    modes = ["off/segment", "bicache/none", "bicache/segment", "fixed:2/none", "fixed:2/segment",
             "fixed:8/none", "fixed:8/segment"]
    return score_modes(engine, items, modes, gen_length=8)


@needs_model
def test_without_the_cut_the_official_table_changes_answers_of_the_context_model(fewshot):
    for mode in ("bicache/none", "fixed:2/none", "fixed:8/none"):
        assert fewshot[mode]["mean_depth"] > 0 and fewshot[mode]["agreement"] < 0.9, (mode, fewshot[mode]["agreement"])


@needs_model
def test_with_the_cut_every_answer_equals_cache_off_up_to_depth_8(fewshot):
    off = fewshot["off/segment"]
    assert off["accuracy"] >= 0.95
    for mode in ("bicache/segment", "fixed:2/segment", "fixed:8/segment"):
        r = fewshot[mode]
        assert r["output_ids"] == off["output_ids"], mode
        # it still reuses: every request after its family's first at depth > 0
        assert r["mean_depth"] > 0 and r["skipped_layer_tokens"] > 0
        assert sum(m["bicache_depth"] > 0 for m in r["metas"]) >= 19, mode
        # the span ends at a blank line, before the last "Question: "
        assert all(m["reused_prefix_tokens"] == 0 or m["cached_tokens"] - (m["reused_prefix_start"]
                   + m["reused_prefix_tokens"]) >= len("Question: ") for m in r["metas"])
