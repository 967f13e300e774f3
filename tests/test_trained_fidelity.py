"""The shipped context-dependent model (bicache_sgl/assets/context_model, docs/fidelity.md): cheap
checks of its claims through the serving Engine on a handful of held-out few-shot requests.

Each family's first question runs first and stores the shared prefix (computed in its own context);
the family's other questions reuse it. Reusing every layer (``naive``) changes answers; ``bicache``
with the shipped profile (calibrated with the agreement criterion) gives exactly ``off``'s tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ASSET = Path(__file__).resolve().parents[1] / "bicache_sgl" / "assets" / "context_model"
SHOTS, NUM_QUESTIONS, G = 5, 40, 8  # r ~ 0.8 (the few-shot evaluation's default shape)

needs_model = pytest.mark.skipif(not (ASSET / "model.safetensors").exists(),
                                 reason="the context-dependent model is not in bicache_sgl/assets/context_model")


@needs_model
def test_checkpoint_profile_and_recipe():
    cfg = json.loads((ASSET / "config.json").read_text())
    assert cfg["architectures"] == ["LLaDAModelLM"]
    prof = json.loads((ASSET / "bicache_profile.json").read_text())
    assert prof["criterion"] == "exact" and prof["n_layers"] == cfg["n_layers"] and prof["tolerance"] == 0.0
    # every bucket's depth has its reason in the counts: no sample differed up to it (pooled over the
    # generation modes, depth 1 already changed answers of this model in every bucket: table 0)
    for bk in prof["buckets"]:
        if bk is not None and bk["depth"] is not None:
            assert bk["disagreements_by_depth"][bk["depth"]] == 0
            assert bk["depth"] == cfg["n_layers"] or bk["disagreements_by_depth"][bk["depth"] + 1] > 0
    assert all(0 <= b < cfg["n_layers"] for _, b in prof["table"])  # never the full depth: naive is unsafe
    info = json.loads((ASSET / "train_info.json").read_text())
    assert info["finished"] and "train_context" in info["command"] and info["args"]["task"] == "group"


@pytest.fixture(scope="module")
def results():
    from bicache_sgl.training import task
    from bicache_sgl.training.evaluate import make_engine, score_modes

    items = task.heldout_items(NUM_QUESTIONS, SHOTS, seed=0, kind="group")
    def engine(mode):  # "naive-uncut": every layer, the span up to the divergence (before issue 38)
        return make_engine(str(ASSET), prefix_cache=mode.split("-")[0], device="cpu",
                           bicache_span_cut="none" if mode.endswith("-uncut") else "segment")
    return score_modes(engine, items, ["off", "naive-uncut", "naive", "bicache"], gen_length=G)


@needs_model
def test_off_answers_the_task(results):
    assert results["off"]["accuracy"] >= 0.9, results["off"]["accuracy"]


@needs_model
def test_naive_reuse_breaks_it_without_the_span_cut(results):
    """Every layer, up to where the prompts diverge: the last "Question: " captured beside another
    question is reused, and answers change."""
    off, naive = results["off"], results["naive-uncut"]
    assert naive["mean_depth"] > 0 and naive["mean_cached_tokens"] > 0  # the prefix really was reused
    assert naive["accuracy"] <= off["accuracy"] - 0.10, (naive["accuracy"], off["accuracy"])
    assert naive["agreement"] < 0.8, naive["agreement"]


@needs_model
def test_with_the_span_cut_every_layer_keeps_the_answers(results):
    """The same requests, every layer, the span ending at the blank line before the last turn
    (docs/prefix_cache.md "Where the reused span ends"): reused, and answered as cache off."""
    naive = results["naive"]
    assert naive["mean_depth"] > 0
    assert naive["output_ids"] == results["off"]["output_ids"]


@needs_model
def test_bicache_with_the_shipped_profile_equals_off(results):
    bic = results["bicache"]
    assert bic["mean_cached_tokens"] > 0  # the prefix was matched (reused at the profile's depth)
    assert bic["output_ids"] == results["off"]["output_ids"]
    assert bic["accuracy"] == results["off"]["accuracy"]


def test_fidelity_table_on_the_planted_model(tmp_path):
    """The fidelity-table pipeline (bicache_sgl.bench.fidelity) on the planted model, whose answer is
    known: exact up to its safe depth 2, broken beyond it."""
    from bicache_sgl.bench import fidelity as fb
    from bicache_sgl.bicache.profile import BicacheProfile

    spec = fb.planted_spec(str(tmp_path / "planted"), calibrate=False)
    BicacheProfile(((0.0, 0), (10.0, 2)), 6, model="planted").save(spec.profile)
    rows = fb.fidelity_table([spec], rs=[0.8], fixed=[2, 3], num_questions=6, log=lambda s: None)
    by = {r["mode"]: r for r in rows}
    assert by["off"]["acc"] == 1.0 and by["naive"]["acc"] == 0.0 and by["naive"]["agree"] == 0.0
    assert by["bicache"]["agree"] == by["fixed:2"]["agree"] == 1.0 and by["fixed:3"]["agree"] == 0.0
    assert by["bicache"]["depth"] == 2 and by["naive"]["depth"] == 6
    assert by["naive"]["kl_ans"] > 1 and by["fixed:2"]["kl"] < 1e-6 and by["fixed:2"]["top1"] == 1.0
    assert 0 < by["fixed:2"]["saved"] < by["naive"]["saved"]
    assert "| planted |" in fb.markdown(rows)
