"""The request edge (bicache_sgl/scheduler/validate.py): one typed request with its rid, validated
once by a pure function; the engine builds a validated request without checking it again; a
request that never ran still ends with a whole meta_info (engine/wire.py)."""

from __future__ import annotations

import time

import pytest

from bicache_sgl.config import DecodeDefaults, SamplingParams
from bicache_sgl.engine.wire import failed_event
from bicache_sgl.io_struct import GenerateRequest, InvalidRequest
from bicache_sgl.models.loader import load_model_config, load_tokenizer
from bicache_sgl.scheduler.factory import RequestFactory
from bicache_sgl.scheduler.validate import RequestLimits, ValidRequest, check_context, validate_request
from bicache_sgl.testing import make_tiny_llada

CONTEXT = 256


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = make_tiny_llada(tmp_path_factory.mktemp("validate"))
    return load_model_config(folder), load_tokenizer(folder)


def limits(cfg, kv_budget: int | None = None) -> RequestLimits:
    return RequestLimits.of(cfg, DecodeDefaults(block_length=8), CONTEXT, kv_budget)


def test_rid_minted_once_per_request():
    a, b = GenerateRequest([1]), GenerateRequest([1])
    assert isinstance(a.rid, str) and len(a.rid) == 32 and a.rid != b.rid
    assert GenerateRequest([1], rid="mine").rid == "mine"


def test_validate_resolves_and_matches_the_built_request(model):
    cfg, tok = model
    g = GenerateRequest([5, 6, 7], SamplingParams(max_new_tokens=12, cfg_scale=1.0, stop_token_ids=(3, 10**6)),
                        return_logprob=True, logprob_start_len=0)
    v = validate_request(g, limits(cfg))
    assert isinstance(v, ValidRequest) and v.rid == g.rid
    assert v.plan.gen_len == 16  # 12 rounded up to whole blocks of 8
    assert v.greq.params.stop_token_ids == (3,)  # outside the vocabulary: dropped
    assert v.greq.params.temperature == 1.0 and g.params.temperature is None  # resolved on a copy
    # the sequence, its guidance shadow, its likelihood probe: what the Req then holds
    assert v.kv_tokens == 19 + 19 + 3
    req = RequestFactory(cfg, tok, cfg.eos_token_ids, DecodeDefaults(block_length=8), CONTEXT).build(g, None)
    assert req.kv_tokens == v.kv_tokens and req.plan == v.plan and req.rid == g.rid


@pytest.mark.parametrize("greq,message", [
    (GenerateRequest([]), "the prompt is empty"),
    (GenerateRequest([1, 10**6]), "outside the vocabulary"),
    (GenerateRequest([1] * 250, SamplingParams(max_new_tokens=10)), "exceeds the context length 256"),
    (GenerateRequest([1, 2], return_logprob=True, logprob_start_len=2), "logprob_start_len (2) must be <"),
    (GenerateRequest([1, 2], bicache_depth=99), "bicache_depth must be in [0, 4]"),
    (GenerateRequest([1], SamplingParams(max_new_tokens=100)), "--max-total-tokens"),
    (GenerateRequest([1], SamplingParams(step_rows="active", cache_mode="prefix")), "needs cache_mode 'dual'"),
    (GenerateRequest([1], rid=""), "rid must be a non-empty string"),
])
def test_validate_names_what_is_wrong(model, greq, message):
    cfg, _ = model
    with pytest.raises(ValueError) as e:
        validate_request(greq, limits(cfg, kv_budget=64))
    assert message in str(e.value)


@pytest.mark.parametrize("greq,param,message", [
    (GenerateRequest([1, 10**6]), "input_ids", "token id 1000000 is outside the vocabulary [0, "),
    (GenerateRequest([1] * 257, SamplingParams(max_new_tokens=0)), "prompt", "longer than the context length 256"),
    (GenerateRequest([1] * 256, SamplingParams(max_new_tokens=1)), "prompt", "no room is left to generate"),
    (GenerateRequest([1] * 250, SamplingParams(max_new_tokens=10)), "max_new_tokens", "exceeds the context length"),
])
def test_the_context_and_vocabulary_rules_name_the_field(model, greq, param, message):
    """The one check of each rule (the server's 400 names ``param``: server/bridge.py): the offline
    engine and the server get the same refusal."""
    cfg, _ = model
    with pytest.raises(InvalidRequest) as e:
        validate_request(greq, limits(cfg))
    assert e.value.param == param and message in str(e.value)
    assert validate_request(GenerateRequest([1] * 256, SamplingParams(max_new_tokens=0)), limits(cfg)).kv_tokens == 256


def test_min_new_tokens_past_the_final_budget_is_refused_naming_it(model):
    """SGLang's rule, min_new_tokens in [0, max_new_tokens], checked once where the budget is final
    (a server has filled and fitted an implicit one before: server/protocol.py fit_to_context)."""
    cfg, _ = model
    with pytest.raises(InvalidRequest) as e:
        validate_request(GenerateRequest([1, 2], SamplingParams(max_new_tokens=8, min_new_tokens=9)), limits(cfg))
    assert e.value.param == "min_new_tokens"
    msg = str(e.value)
    assert msg.startswith("min_new_tokens must be in [0, max_new_tokens]") and "9 > max_new_tokens 8" in msg
    # SamplingParams itself accepts it (its max_new_tokens may still be a provisional default)
    assert SamplingParams(max_new_tokens=8, min_new_tokens=9).min_new_tokens == 9
    for mx, mn in ((8, 8), (8, 0), (0, 0)):
        validate_request(GenerateRequest([1, 2], SamplingParams(max_new_tokens=mx, min_new_tokens=mn)), limits(cfg))


def test_offline_engine_refuses_min_new_tokens_past_max_new_tokens(model, tmp_path):
    from bicache_sgl import Engine

    with Engine(make_tiny_llada(tmp_path / "m"), prefix_cache="off", block_length=8) as eng:
        with pytest.raises(InvalidRequest, match=r"^min_new_tokens must be in \[0, max_new_tokens\]") as e:
            eng.generate("x", {"max_new_tokens": 4, "min_new_tokens": 5})
        assert e.value.param == "min_new_tokens"
        out = eng.generate("x", {"max_new_tokens": 4, "min_new_tokens": 4, "temperature": 0})
        assert out["meta_info"]["completion_tokens"] == 4  # min == max: every position generated


def test_block_models_count_the_context_in_whole_blocks():
    check_context(60, 4, 64, block=8)  # 64 positions: fits
    with pytest.raises(InvalidRequest, match=r"in whole blocks of 8 \(72 tokens\)") as e:
        check_context(60, 5, 64, block=8)
    assert e.value.param == "max_new_tokens"


def test_a_validated_request_is_trusted(model):
    """The engine process builds what the server process validated without checking again: a
    request validated against a larger budget is built by a factory with a smaller one."""
    cfg, tok = model
    g = GenerateRequest([1, 2], SamplingParams(max_new_tokens=40))
    v = validate_request(g, limits(cfg, kv_budget=None))
    small = RequestFactory(cfg, tok, cfg.eos_token_ids, DecodeDefaults(block_length=8), CONTEXT, kv_budget=8)
    with pytest.raises(ValueError, match="--max-total-tokens"):
        small.build(g, None)  # a plain request is validated
    assert small.build(v, None).rid == g.rid  # a ValidRequest is not


def test_failed_event_carries_the_whole_meta():
    ev = failed_event("r1", "the engine process exited", prompt_tokens=7, since=time.perf_counter() - 1.0)
    assert ev.finished and ev.error == "the engine process exited"
    m = ev.meta_info
    assert m["id"] == "r1" and m["prompt_tokens"] == 7 and m["completion_tokens"] == 0 and m["cached_tokens"] == 0
    assert m["finish_reason"] == ev.finish_reason == {"type": "abort", "message": "the engine process exited"}
    assert m["e2e_latency"] >= 1.0
    assert failed_event("r2", "server shutting down", prompt_tokens=1, since=0.0, error=False).error is None
