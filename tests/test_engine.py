"""Decoding and batched execution: cache-mode exactness, batched == alone, stop conditions."""

import threading

import numpy as np
import pytest
import torch

from bicache_sgl import Engine, SamplingParams
from bicache_sgl.attention import create_backend
from bicache_sgl.config import DecodeDefaults
from bicache_sgl.decoding import num_transfer_schedule, select_transfer
from bicache_sgl.decoding.plan import DecodePlan
from bicache_sgl.io_struct import GenerateRequest
from bicache_sgl.kv_cache.store import KVStore
from bicache_sgl.models.forward_batch import ForwardBatch, SeqWork
from bicache_sgl.models.loader import load_model, load_tokenizer
from bicache_sgl.scheduler.request import Req
from bicache_sgl.testing.together import run_together

PROMPTS = ["The quick brown fox jumps", "Q: what is 2+2?\nA:", "lorem ipsum dolor sit amet, consectetur", "x"]


@pytest.fixture(scope="module", params=["tiny_llada", "tiny_dream"])
def engine(request):
    eng = Engine(request.getfixturevalue(request.param), prefix_cache="off", block_length=8, threshold=None)
    yield eng
    eng.shutdown()


def _gen(eng, prompts, **sp):
    params = {"max_new_tokens": 16, "temperature": 0, **sp}
    return [o["output_ids"] for o in eng.generate(list(prompts), params)]


def test_schedule_and_threshold_rules():
    assert num_transfer_schedule(10, 4) == [3, 3, 2, 2]
    assert num_transfer_schedule(8, 8) == [1] * 8
    assert sum(num_transfer_schedule(31, 5)) == 31
    conf = torch.tensor([0.2, 0.95, 0.5, 0.91], dtype=torch.float64)
    assert sorted(select_transfer(conf, 1, 0.9).tolist()) == [1, 3]
    assert select_transfer(conf, 1, 0.99).tolist() == [1]  # at least one, the most confident
    assert sorted(select_transfer(conf, 2, None).tolist()) == [1, 3]


@pytest.mark.parametrize("mode", ["prefix", "dual"])
def test_cache_modes_with_per_step_refresh_equal_none(engine, mode):
    ref = _gen(engine, PROMPTS, cache_mode="none")
    assert _gen(engine, PROMPTS, cache_mode=mode, refresh_interval=1) == ref


def test_dual_cache_logits_match_full_forward(tiny_llada, tiny_dream):
    """A dual-cache partial forward right after a refresh sees exactly the same context, so its
    block logits equal the full forward's (within fp tolerance)."""
    for folder in (tiny_llada, tiny_dream):
        model, cfg = load_model(folder, "float32")
        attn = create_backend("torch", torch.device("cpu"))
        ids = torch.tensor([7, 8, 9, 10, 11, 12, 13] + [cfg.mask_token_id] * 16)
        N, bs, be = len(ids), 7, 15
        want = np.arange(bs, be) - cfg.logit_shift
        store, (kv,) = KVStore.for_sequences(cfg, [N], torch.float32, torch.device("cpu"))
        cpu = torch.device("cpu")
        full = model.forward_batch(ForwardBatch([SeqWork(kv, ids, np.arange(N), want)], cpu, store)
                                   .build(cfg.n_layers), attn)
        part = model.forward_batch(ForwardBatch([SeqWork(kv, ids, np.arange(bs - cfg.logit_shift, be), want)],
                                                cpu, store).build(cfg.n_layers), attn)
        assert torch.allclose(full, part, atol=1e-5)


def test_dual_and_prefix_cache_compute_fewer_tokens(engine):
    metas = {m: engine.generate(PROMPTS[0], {"max_new_tokens": 16, "temperature": 0, "cache_mode": m})["meta_info"]
             for m in ("none", "prefix", "dual")}
    assert metas["none"]["forward_passes"] == metas["dual"]["forward_passes"] == 16
    n = metas["none"]["prompt_tokens"] + 16
    assert metas["none"]["tokens_computed"] == 16 * n
    assert metas["prefix"]["tokens_computed"] < metas["none"]["tokens_computed"]
    assert metas["dual"]["tokens_computed"] < metas["prefix"]["tokens_computed"]


def test_step_rows_active_computes_only_rows_that_can_change(tiny_llada):
    """step_rows 'active': after a block's refresh a step computes the still-masked positions plus
    the one unmasked by the previous forward (one token per step here), not the whole block."""
    eng = Engine(tiny_llada, prefix_cache="off", block_length=8, threshold=None)
    try:
        sp = {"max_new_tokens": 16, "temperature": 0}
        block = eng.generate(PROMPTS[0], {**sp, "step_rows": "block"})["meta_info"]
        active = eng.generate(PROMPTS[0], {**sp, "step_rows": "active"})["meta_info"]
        n = block["prompt_tokens"] + 16
        refreshes = 2 * n  # one full refresh per block (dual cache computes the whole sequence)
        # steps 1..7 of a block: block mode 8 rows each; active mode (8 - s) masked + 1 just unmasked
        assert block["tokens_computed"] == refreshes + 2 * 7 * 8
        assert active["tokens_computed"] == refreshes + 2 * sum(9 - s for s in range(1, 8))
        assert active["forward_passes"] == block["forward_passes"] == 16
        # refreshed at every step there is nothing to skip: exactly the block mode's tokens
        assert _gen(eng, PROMPTS, refresh_interval=1, step_rows="active") == _gen(eng, PROMPTS, refresh_interval=1)
        with pytest.raises(ValueError, match="step_rows 'active' needs cache_mode 'dual'"):
            eng.generate("hi", {"max_new_tokens": 4, "step_rows": "active", "cache_mode": "prefix"})
        with pytest.raises(ValueError, match="step_rows must be one of"):
            eng.generate("hi", {"max_new_tokens": 4, "step_rows": "some"})
    finally:
        eng.shutdown()
    with pytest.raises(ValueError, match="needs cache_mode 'dual'"):
        DecodeDefaults(step_rows="active", cache_mode="none")


def test_step_rows_active_with_dream_shifted_logits(tiny_dream):
    """Dream reads a position's logits from the row before it: 'active' computes those rows too,
    so it runs, computes fewer rows than 'block', and equals it when refreshed at every step."""
    eng = Engine(tiny_dream, prefix_cache="off", block_length=8, threshold=None)
    try:
        sp = {"max_new_tokens": 16, "temperature": 0}
        block = eng.generate(PROMPTS[1], {**sp, "step_rows": "block"})["meta_info"]
        active = eng.generate(PROMPTS[1], {**sp, "step_rows": "active"})
        assert len(active["output_ids"]) == 16
        assert active["meta_info"]["tokens_computed"] < block["tokens_computed"]
        assert _gen(eng, PROMPTS, refresh_interval=1, step_rows="active") == _gen(eng, PROMPTS, refresh_interval=1)
    finally:
        eng.shutdown()


def test_batched_equals_alone(engine):
    """Requests of different lengths, budgets and block sizes in one running batch (one forward
    per step) give the tokens each gives alone."""
    specs = [(PROMPTS[0], {"max_new_tokens": 16}), (PROMPTS[1], {"max_new_tokens": 8, "cache_mode": "none"}),
             (PROMPTS[2], {"max_new_tokens": 24, "block_length": 4, "cache_mode": "prefix"}),
             (PROMPTS[3], {"max_new_tokens": 16, "threshold": 0.05}),
             (PROMPTS[1], {"max_new_tokens": 16, "temperature": 0.8, "seed": 7, "remasking": "random"})]
    alone = [engine.generate(p, {"temperature": 0, **sp})["output_ids"] for p, sp in specs]
    greqs = [GenerateRequest(engine.encode(p), SamplingParams.from_dict({"temperature": 0, **sp})) for p, sp in specs]
    before = engine.get_stats()["num_forward_passes"]
    together = run_together(engine, greqs)
    assert [e.output_ids for e in together] == alone
    # they really ran in the same forwards: fewer batched forwards than their own forward counts summed
    batched_forwards = engine.get_stats()["num_forward_passes"] - before
    assert batched_forwards < sum(e.meta_info["forward_passes"] for e in together)


def test_run_sync_steps_on_the_callers_thread(tiny_llada):
    """run_sync (profilers, tools) gives the tokens generate gives, with no engine thread."""
    eng = Engine(tiny_llada, prefix_cache="off", block_length=8, threshold=None)
    try:
        sp = SamplingParams(max_new_tokens=8, temperature=0)
        evs = eng.run_sync([GenerateRequest(eng.encode(p), sp) for p in PROMPTS])
        assert eng._thread is None
        assert all(ev.finished and not ev.error for ev in evs)
        assert [ev.output_ids for ev in evs] == _gen(eng, PROMPTS, max_new_tokens=8)
        with pytest.raises(RuntimeError, match="thread is not running"):
            eng.run_sync([GenerateRequest(eng.encode("x"), sp)])
    finally:
        eng.shutdown()


def test_one_forward_per_step_for_the_whole_batch(tiny_llada):
    eng = Engine(tiny_llada, prefix_cache="off", block_length=8, threshold=None)
    try:
        eng.generate(PROMPTS[:3], {"max_new_tokens": 16, "temperature": 0})
        # three requests of 16 steps each, running together: 16 batched forwards, not 48
        assert eng.get_stats()["num_forward_passes"] == 16
    finally:
        eng.shutdown()


def test_sampling_is_seeded_and_cfg_changes_output(engine):
    a = _gen(engine, [PROMPTS[0]], temperature=1.0, seed=3)
    b = _gen(engine, [PROMPTS[0]], temperature=1.0, seed=3)
    c = _gen(engine, [PROMPTS[0]], temperature=1.0, seed=4)
    assert a == b and a != c
    base = engine.generate(PROMPTS[1], {"max_new_tokens": 16, "temperature": 0})
    cfg = engine.generate(PROMPTS[1], {"max_new_tokens": 16, "temperature": 0, "cfg_scale": 2.0})
    assert len(cfg["output_ids"]) == 16 and cfg["output_ids"] != base["output_ids"]


def test_threshold_decoding_needs_fewer_forwards(engine):
    fixed = engine.generate(PROMPTS[0], {"max_new_tokens": 16, "temperature": 0})["meta_info"]
    fast = engine.generate(PROMPTS[0], {"max_new_tokens": 16, "temperature": 0, "threshold": 0.001})["meta_info"]
    assert fixed["forward_passes"] == 16
    assert fast["forward_passes"] == 2  # everything above the threshold: one step per block


def test_meta_info_and_max_new_tokens_rounding(engine):
    out = engine.generate(PROMPTS[1], {"max_new_tokens": 5, "temperature": 0})
    m = out["meta_info"]
    assert len(out["output_ids"]) == 5 and m["completion_tokens"] == 5
    assert m["finish_reason"] == {"type": "length", "length": 5}
    assert m["forward_passes"] == 8  # the region is one whole block of 8
    assert m["prompt_tokens"] == len(engine.encode(PROMPTS[1]))
    assert out["text"] == engine.tokenizer.decode(out["output_ids"], skip_special_tokens=True)


def _req(tok, gen_ids, eos, **sp):
    params = SamplingParams.from_dict({"max_new_tokens": len(gen_ids), **sp})
    plan = DecodePlan.resolve(params, DecodeDefaults(block_length=len(gen_ids)))
    r = Req(GenerateRequest([1, 2, 3], params), plan, mask_id=258, eos_ids=(eos,), logit_shift=0, tokenizer=tok,
            on_event=None, seed=0)
    r.x[3:] = torch.tensor(gen_ids)
    r.final_len = len(gen_ids)
    r._check_stop()
    return r


def test_stop_conditions(tiny_llada):
    tok = load_tokenizer(tiny_llada)
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    body = tok.encode("Answer 42\nQuestion: next")
    r = _req(tok, body + [eos, eos], eos)
    assert r.finish_reason == {"type": "length", "length": len(body) + 2} or r.finished
    r = _req(tok, tok.encode("Answer 42") + [eos] + tok.encode("junk"), eos)
    assert r.text == "Answer 42" and r.finish_reason == {"type": "stop", "matched": eos}
    r = _req(tok, body, eos, stop=["Question"])
    assert r.text == "Answer 42\n" and r.finish_reason == {"type": "stop", "matched": "Question"}
    assert tok.decode(r.out_ids).startswith("Answer 42\n")
    nl = tok.encode("\n")[0]
    r = _req(tok, body, eos, stop_token_ids=[nl])
    assert r.text == "Answer 42" and r.finish_reason == {"type": "stop", "matched": nl}
    r = _req(tok, tok.encode("ab") + [eos] + tok.encode("cd"), eos, ignore_eos=True)
    assert r.finish_reason["type"] == "length" and len(r.out_ids) == 5
    r = _req(tok, [eos] + tok.encode("abc"), eos, min_new_tokens=2)
    assert r.finish_reason["type"] == "length"  # EOS inside the first min_new_tokens does not stop


def test_eos_stops_generation_early(tiny_llada):
    """A request stops after the first block containing EOS: later blocks are never computed."""
    eng = Engine(tiny_llada, prefix_cache="off", block_length=4, threshold=None)
    try:
        tok = eng.tokenizer
        # A model that always prefers EOS: add a large logit bias to its LM head output.
        eos = eng.model_config.eos_token_ids[0]
        inner = eng.model.lm_logits

        def biased(h):
            out = inner(h)
            out[:, eos] += 100.0
            return out
        eng.model.lm_logits = biased
        out = eng.generate("hello", {"max_new_tokens": 32, "temperature": 0})
        assert out["output_ids"] == [] and out["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}
        assert out["meta_info"]["forward_passes"] == 4  # one block of 4 steps, not 8 blocks
        ig = eng.generate("hello", {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True})
        assert len(ig["output_ids"]) == 6 and eos not in ig["output_ids"]
        assert tok is not None
    finally:
        eng.shutdown()


def test_bad_requests_are_value_errors(engine):
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.generate(input_ids=[], sampling_params={"max_new_tokens": 4})
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate(input_ids=[1, 10**9], sampling_params={"max_new_tokens": 4})
    with pytest.raises(ValueError, match="exceeds the context length"):
        engine.generate("hi", {"max_new_tokens": 10**6})
    with pytest.raises(ValueError, match="max_new_tokens must be >= 0"):
        engine.generate("hi", {"max_new_tokens": -1})
    with pytest.raises(ValueError, match="remasking"):
        engine.generate("hi", {"remasking": "bogus"})
    # the engine still serves afterwards
    assert len(engine.generate("hi", {"max_new_tokens": 4, "temperature": 0})["output_ids"]) == 4


def test_prefill_only_and_input_logprobs(engine):
    pre = engine.generate("some prefix text", {"max_new_tokens": 0})
    assert pre["output_ids"] == [] and pre["meta_info"]["completion_tokens"] == 0
    out = engine.generate("abcdef", {"max_new_tokens": 0}, return_logprob=True, logprob_start_len=2,
                          top_logprobs_num=3, return_text_in_logprobs=True)
    lps = out["meta_info"]["input_token_logprobs"]
    ids = engine.encode("abcdef")
    assert [t for _, t, _ in lps] == ids[2:]
    assert all(lp is not None and lp <= 0 for lp, _, _ in lps)
    tops = out["meta_info"]["input_top_logprobs"]
    assert all(len(t) == 3 and t[0][0] >= t[1][0] >= t[2][0] for t in tops)
    gen = engine.generate("abc", {"max_new_tokens": 8, "temperature": 0}, return_logprob=True)
    olp = gen["meta_info"]["output_token_logprobs"]
    assert [t for _, t, _ in olp] == gen["output_ids"] and all(lp <= 0 for lp, _, _ in olp)


def test_default_greedy_threshold_decisions_made_together_equal_the_per_request_path(monkeypatch):
    """The server's default sampling (temperature 0, threshold 0.9) on the bundled model: the
    scheduler decides a batch's greedy threshold requests together (``decide_greedy``). A zero
    logit bias changes no logit but sends a request down the per-request path (bias, ban,
    ``decide``): every request, batched with others, must give the tokens it gives alone there."""
    from bicache_sgl.scheduler import scheduler as sched

    rows = []
    real = sched.decide_greedy
    monkeypatch.setattr(sched, "decide_greedy", lambda parts, banned: rows.append(len(parts)) or real(parts, banned))
    eng = Engine(None, prefix_cache="off", max_running_requests=8)
    try:
        prompts = ["Question: K\nAnswer: 5\n\nQuestion: D\nAnswer: 5\n\nQuestion: K\nAnswer:",
                   "Question: A\nAnswer:", "Question: Q\nAnswer: 2\n\nQuestion: Q\nAnswer:", "x"]
        specs = [{"max_new_tokens": 16}, {"max_new_tokens": 32, "ignore_eos": True}, {"max_new_tokens": 8},
                 {"max_new_tokens": 24, "ignore_eos": True}]
        greqs = [GenerateRequest(eng.encode(p), SamplingParams.from_dict({"temperature": 0, **s}))
                 for p, s in zip(prompts, specs)]
        together = [e.output_ids for e in run_together(eng, greqs)]
        assert max(rows) > 1  # several requests were decided in one call
        rows.clear()
        alone = [eng.generate(p, {"temperature": 0, "logit_bias": {"5": 0.0}, **s})["output_ids"]
                 for p, s in zip(prompts, specs)]
        assert not rows  # the biased requests decided on their own
        assert together == alone
        assert any(len(o) > 1 for o in together)
    finally:
        eng.shutdown()


def test_a_logit_position_outside_the_computed_rows_is_refused(tiny_llada):
    """ForwardBatch.build maps logit positions to computed rows; one that is not computed (or
    negative, or past every row) is an error, not a wrong row's logits."""
    _, cfg = load_model(tiny_llada)
    cpu = torch.device("cpu")
    store, kvs = KVStore.for_sequences(cfg, [10, 6], torch.float32, cpu)
    ids = [torch.randint(2, cfg.vocab_size, (n,)) for n in (10, 6)]
    ok = ForwardBatch([SeqWork(kvs[0], ids[0], np.arange(4, 8), np.array([5, 7])),
                       SeqWork(kvs[1], ids[1], np.arange(6), np.array([0]))], cpu, store).build(cfg.n_layers)
    assert ok.logit_rows.tolist() == [1, 3, 4]
    for bad in ([3], [8], [-1], [9]):
        with pytest.raises(ValueError, match="not among the computed positions"):
            ForwardBatch([SeqWork(kvs[0], ids[0], np.arange(4, 8), np.array(bad)),
                          SeqWork(kvs[1], ids[1], np.arange(6), np.array([0]))], cpu, store).build(cfg.n_layers)


def test_a_callback_with_many_gets_each_steps_events_in_one_call(tiny_llada):
    """The engine process's sink takes a step's events as one list (one wake of its sender per
    step): every event arrives, in order per request, the same events a plain callback gets."""
    eng = Engine(tiny_llada, prefix_cache="off", block_length=4, threshold=None)
    try:
        class Sink:
            def __init__(self):
                self.calls, self.events, self.done = [], [], threading.Event()

            def __call__(self, ev):  # not used: ``many`` wins
                raise AssertionError("the per-event path was taken")

            def many(self, evs):
                self.calls.append(len(evs))
                self.events.extend(evs)
                if sum(e.finished for e in self.events) == len(PROMPTS):
                    self.done.set()

        sink, plain, got = Sink(), [], threading.Event()

        def on_event(ev):
            plain.append(ev)
            if sum(e.finished for e in plain) == len(PROMPTS):
                got.set()
        sp = SamplingParams.from_dict({"max_new_tokens": 8, "temperature": 0})
        eng.submit_many([GenerateRequest(eng.encode(p), sp) for p in PROMPTS], [sink] * len(PROMPTS))
        assert sink.done.wait(60)
        eng.submit_many([GenerateRequest(eng.encode(p), sp) for p in PROMPTS], [on_event] * len(PROMPTS))
        assert got.wait(60)
        assert max(sink.calls) > 1 and len(sink.calls) < len(sink.events)  # several events per call
        key = lambda evs: sorted((e.output_ids, e.text, e.finished) for e in evs)  # noqa: E731
        assert key(sink.events) == key(plain)
        for rid in {e.rid for e in sink.events}:  # in order: blocks grow, the final one is last
            mine = [e for e in sink.events if e.rid == rid]
            assert [e.finished for e in mine] == [False] * (len(mine) - 1) + [True]
    finally:
        eng.shutdown()
