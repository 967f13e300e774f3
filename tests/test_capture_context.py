"""bicache's safety invariant: with the prefix cache on, every answer equals cache off wherever the
profile says reuse is safe.

The rule (docs/prefix_cache.md): a cached row captured in request C's forward may serve request B
at layer l only if l < b(LCP(C, B) / max(N_C, N_B)). These tests are the regressions for the two
ways it was broken (a short shared head captured by another family's request; the same prompt
captured beside a longer generation region) and a property test over generated request streams.
"""

from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bicache_sgl import Engine
from bicache_sgl.bicache.profile import BicacheProfile
from bicache_sgl.testing.planted import expected_answer, make_planted_llada

P = {"max_new_tokens": 32, "temperature": 0, "cache_mode": "dual", "threshold": 0.9}


def fewshot(keys: str, code: str, q: str, head: str = "") -> str:
    return head + "\n\n".join(f"Question: {k}\nAnswer: {code}" for k in keys) + f"\n\nQuestion: {q}\nAnswer:"


@pytest.fixture(scope="module")
def deep_profile(tmp_path_factory) -> str:
    """A deliberately deep profile for the bundled default model: depth 8 from r = 10 %, the table
    it shipped with before issue 34. Its shipped profile is now depth 0 everywhere (no depth above
    0 kept every calibration answer equal to cache off, docs/calibration.md), which would reuse
    nothing here; these regressions check the capture-context RULE, which must hold whatever depth
    a profile allows, so they run a deep one."""
    path = tmp_path_factory.mktemp("deep_profile") / "deep.json"
    BicacheProfile(((0.0, 0),) + tuple((float(r), 8) for r in range(10, 90, 10)), 8, model="default_model",
                   criterion="agreement", threshold=0.9).save(path)
    return str(path)


@pytest.fixture(scope="module")
def engines(deep_profile):
    """The bundled default model with the cache off and with bicache under the deep profile (no
    sampled audits, so every reusing request reuses)."""
    off = Engine(prefix_cache="off", num_threads=1)
    on = Engine(prefix_cache="bicache", bicache_audit_rate=0.0, num_threads=1, bicache_profile=deep_profile)
    yield off, on
    off.shutdown()
    on.shutdown()


def test_head_captured_by_another_family_is_not_reused_at_the_family_depth(engines):
    """The issue's repro: family A fills the cache, family B's first request matches only the
    10-token head "Question: " (captured in A's context), B's second request matches 125 tokens.
    The head's rows from A's context may only serve B at b(head / N): B's first request computes
    the head in full and re-captures it in its own context (docs/prefix_cache.md, "Re-capture"),
    so B's second request reuses the whole match, every row from B's context."""
    off, on = engines
    on.flush_cache()
    for e in (off, on):
        e.generate(fewshot("YWDRU", "2", "Y"), P)
    first = on.generate(fewshot("KHIME", "0", "K"), P)["meta_info"]
    off.generate(fewshot("KHIME", "0", "K"), P)
    # B's first request: the head from A's context does not serve it at any depth
    assert first["cached_tokens"] == 10 and first["bicache_depth"] == 0 and first["reused_prefix_tokens"] == 0
    before = on.get_stats()
    want = off.generate(fewshot("KHIME", "0", "H"), P)
    got = on.generate(fewshot("KHIME", "0", "H"), P)
    assert want["text"] == " 0"
    assert got["text"] == want["text"]
    meta = got["meta_info"]
    assert meta["cached_tokens"] == 125 and meta["bicache_depth"] == 8  # the common case stays fast ...
    # ... from the head, which B's first request re-captured, up to the blank line before the last
    # "Question: ": the span cut (its opening tokens were captured beside B's first question)
    assert meta["reused_prefix_start"] == 0 and meta["reused_prefix_tokens"] == 125 - len("Question: ")
    assert before["prefix_cache_recaptures_total"] >= 1 and before["prefix_cache_recaptured_tokens_total"] >= 10
    on.check_integrity()


def test_families_sharing_a_head_answer_as_cache_off(engines):
    """8 families x 6 questions, every family behind the same "Question: " head (the issue's
    families workload): bicache equals cache off on every answer and still reuses."""
    off, on = engines
    on.flush_cache()
    keys = ["YWDRU", "KHIME", "ABCFG", "LMNOP", "QRSTV", "DEFHJ", "UVWXZ", "BCDGK"]
    prompts = [fewshot(k, str(i), k[j]) for i, k in enumerate(keys) for j in range(5)]
    prompts += [fewshot(k, str(i), "Z") for i, k in enumerate(keys)]
    assert len(prompts) == 48
    want = [off.generate(p, P)["text"] for p in prompts]
    outs = [on.generate(p, P) for p in prompts]
    assert [o["text"] for o in outs] == want
    assert sum(o["meta_info"]["bicache_depth"] > 0 for o in outs) >= 40


def test_prompt_captured_beside_a_longer_generation_is_not_reused_at_full_depth(engines):
    """The same prompt sent first with 256 generated positions (ignore_eos) and then with 16 under a
    regex: its state was captured beside 256 masks, so the second request may reuse it only at
    b(P / (P + 256)), and answers as with bicache_depth 0."""
    off, on = engines
    on.flush_cache()
    prompt = fewshot("KHIME", "0", "H")
    long = {"max_new_tokens": 256, "ignore_eos": True, "temperature": 0}
    short = {"max_new_tokens": 16, "temperature": 0, "regex": "[0-9 ]+"}
    on.generate(prompt, long)
    got = on.generate(prompt, short)
    assert got["text"] == off.generate(prompt, short)["text"]  # depth 0 is cache off
    n_prompt = got["meta_info"]["prompt_tokens"]
    prof = on.profile
    assert got["meta_info"]["bicache_depth"] <= prof.lookup(n_prompt / (n_prompt + 256))


# ------------------------------------------------------------------------ the property test
# The planted model (bicache_sgl/testing/planted.py, safe depth K) answers the digit its prompt holds,
# read through position 0's state: reuse at depth <= K is exact whatever the capture context, and
# deeper reuse answers the digit of the context that captured position 0. With prompts
# SYSTEM + "Question {digit}: " + tail, a capture context shares the digit iff their common prefix
# reaches past it, so its TRUE profile is K below r* = (digit position + 1) / (shortest sequence)
# and every layer from r* on (LCP / max(N_C, N_B) >= r* implies LCP > digit position). A request
# stream served by that profile answers exactly as cache off iff every reused row obeys the rule:
# a short head captured beside another digit, reused at the depth of the whole match, answers that
# other digit.
PK, PL = 2, 6
# two system heads of the same length (so the digit is at one position), sharing "System: ", each
# ending with a blank line (a segment boundary: the span cut leaves the head reusable)
HEADS = ["System: answer with the digit that the question holds. Be brief and exact.\n\n",
         "System: the digit in the question is the answer; write only that, exactly.\n\n"]
assert len(HEADS[0]) == len(HEADS[1])
TAILS = ["which digit does this question hold, tell me please now", "which digit does this question hold? Say it",
         "what is the digit here", "what is the digit in this very question, if you know it"]
GENS = [8, 16]


def _planted_prompt(head: int, digit: int, tail: int) -> str:
    return HEADS[head] + f"Question {digit}: " + TAILS[tail]


def _true_profile(folder) -> BicacheProfile:
    prompts = [_planted_prompt(h, d, t) for h in (0, 1) for d in range(10) for t in range(len(TAILS))]
    digit_pos = len(HEADS[0]) + len("Question ")  # byte tokenizer: one token per character
    n_min = min(len(p) for p in prompts) + min(GENS)
    r_star = 100.0 * (digit_pos + 1) / n_min
    return BicacheProfile(((0, PK), (round(r_star + 0.5, 1), PL)), PL, model="planted-true")


_pgen = st.tuples(st.just("gen"), st.integers(0, 1), st.integers(0, 3), st.integers(0, len(TAILS) - 1),
                  st.sampled_from(GENS))
_pprefix = st.tuples(st.just("prefix"), st.integers(0, 1), st.integers(0, 3), st.integers(-70, 40))
_pbatch = st.tuples(st.just("batch"), st.lists(_pgen, min_size=2, max_size=4))
_pflush = st.tuples(st.just("flush"))
STREAMS = st.lists(st.one_of(_pgen, _pgen, _pgen, _pprefix, _pbatch, _pflush), min_size=4, max_size=12)

CHECKED = {"streams": 0, "requests": 0, "reused": 0, "deep": 0, "recaptured": 0}


@pytest.fixture(scope="module")
def planted_engines(tmp_path_factory):
    """Cache off, bicache with the true profile, and bicache with the true profile under a prefix
    pool too small for the streams (evictions, trims, re-insertions) with half the reusing
    requests audited."""
    folder = make_planted_llada(tmp_path_factory.mktemp("planted_stream"), k=PK, n_layers=PL)
    prof = tmp_path_factory.mktemp("profile") / "true.json"
    _true_profile(folder).save(prof)
    kw = {"threshold": None, "device": "cpu", "bicache_profile": str(prof), "num_threads": 1}
    engines = [Engine(folder, prefix_cache="off", **kw),
               Engine(folder, prefix_cache="bicache", bicache_audit_rate=0.0, **kw),
               Engine(folder, prefix_cache="bicache", bicache_audit_rate=0.5, max_prefix_cache_tokens=300, **kw)]
    yield engines
    for e in engines:
        e.shutdown()


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(stream=STREAMS)
def test_generated_request_streams_answer_as_cache_off(planted_engines, stream):
    """Streams of requests with short shared heads, nested and branching prefixes, explicit
    prefix-only captures, generation lengths that differ, batches of mixed depths, flushes,
    eviction and re-insertion under a tiny pool and audits on and off: every answer of both
    bicache engines equals cache off."""
    off, *ons = planted_engines
    for eng in ons:
        eng.flush_cache()
    for op in stream:
        if op[0] == "flush":
            for eng in ons:
                eng.flush_cache()
            continue
        if op[0] == "prefix":  # an explicit cache_prefix: a prefix-only capture of some leading part
            text = _planted_prompt(op[1], op[2], 0)
            for eng in ons:
                eng.generate(text[:len(HEADS[0]) + op[3]], {"max_new_tokens": 0})
            continue
        gens = [op] if op[0] == "gen" else op[1]
        prompts = [_planted_prompt(g[1], g[2], g[3]) for g in gens]
        sp = {"temperature": 0, "max_new_tokens": gens[0][4], "block_length": 8}
        want = [o["text"] for o in off.generate(prompts, sp)]
        assert want == [expected_answer(p) * gens[0][4] for p in prompts]  # the planted task itself
        for eng in ons:
            outs = eng.generate(prompts, sp)
            assert [o["text"] for o in outs] == want, (op, [o["meta_info"] for o in outs])
            CHECKED["requests"] += len(outs)
            CHECKED["reused"] += sum(o["meta_info"]["bicache_depth"] > 0 for o in outs)
            CHECKED["deep"] += sum(o["meta_info"]["bicache_depth"] > PK for o in outs)
    for eng in ons:
        eng.check_integrity()
    CHECKED["recaptured"] = sum(e.get_stats()["prefix_cache_recaptures_total"] for e in ons)
    CHECKED["streams"] += 1


def test_the_property_test_exercised_deep_and_shallow_reuse():
    """Run after the property test (same module): it checked requests that reused, some of them
    beyond the depth that is safe in every context, and rows re-captured over held ones (a
    prefix-only capture, another head's) with running readers of the replaced rows."""
    if CHECKED["streams"] == 0:
        pytest.skip("the property test did not run in this session")
    print(f"property test: {CHECKED}")
    assert CHECKED["reused"] > 0 and CHECKED["deep"] > 0 and CHECKED["recaptured"] > 0, CHECKED


# ------------------------------------------------------------------------ trust earned on live traffic
PLANTED_K, PLANTED_L, G = 2, 6, 8
SP = {"temperature": 0, "max_new_tokens": G, "block_length": G}


@pytest.fixture(scope="module")
def planted(tmp_path_factory) -> str:
    return make_planted_llada(tmp_path_factory.mktemp("planted_cc"), k=PLANTED_K, n_layers=PLANTED_L)


def test_a_too_deep_first_run_profile_answers_as_cache_off_from_the_first_request(planted, tmp_path):
    """A first-run profile (marked ``auto``) that allows every layer on the planted model (safe
    depth K): probation audits every reusing request and answers it from its exact forward, so
    every answer is right; the bucket falls to K and reuse resumes there once trust is earned."""
    prof = tmp_path / "auto.json"
    BicacheProfile(((0, 0), (30, PLANTED_L)), PLANTED_L, model="planted", extra={"auto": {"complete": True}}).save(prof)
    eng = Engine(planted, prefix_cache="bicache", bicache_profile=str(prof), bicache_audit_rate=0.0,
                 bicache_audit_probation=4, threshold=None, device="cpu")
    try:
        depths = []
        for i in range(14):
            prompt = HEADS[0] * 2 + f"Question {i % 10}: which digit?"  # the heads end at a boundary
            out = eng.generate(prompt, SP)
            assert out["text"] == expected_answer(prompt) * G, (i, out["meta_info"])
            depths.append(out["meta_info"]["bicache_depth"])
        st_ = eng.get_stats()
        assert st_["bicache_audit_disagreements_total"] >= 1
        assert st_["bicache_audit_buckets"][1]["depth"] <= PLANTED_K
        assert depths[:5] == [0] * 5 and sum(depths[-4:]) > 0  # exact while on probation, reuse after
    finally:
        eng.shutdown()


# ------------------------------------------------------------------------ multi-turn reuse of answers
def test_multiturn_reuse_of_cached_answers_answers_as_cache_off(engines, deep_profile):
    """With cache_output, each finished request's prompt + answer is inserted (one prefill-only
    forward, the answer final); turn t + 1 then matches turn t's answer too, reused under the
    capture-context rule, and every turn's answer equals cache off."""
    off, _ = engines
    on = Engine(prefix_cache="bicache", bicache_audit_rate=0.0, cache_output=True, num_threads=1,
                bicache_profile=deep_profile)
    try:
        for keys, code in (("YWDRU", "2"), ("KHIME", "0"), ("ABCFG", "7")):
            conv = {e: "\n\n".join(f"Question: {k}\nAnswer: {code}" for k in keys) for e in (off, on)}
            prev_len = None
            for q in keys[::-1] + "Z":
                outs = {}
                for e in (off, on):
                    conv[e] += f"\n\nQuestion: {q}\nAnswer:"
                    outs[e] = e.generate(conv[e], P)
                    conv[e] += outs[e]["text"]
                assert outs[on]["text"] == outs[off]["text"], (keys, q)
                meta = outs[on]["meta_info"]
                if prev_len is not None:  # the previous turn's prompt AND answer came from the cache
                    assert meta["cached_tokens"] >= prev_len, (meta, prev_len)
                    assert meta["bicache_depth"] > 0
                prev_len = meta["prompt_tokens"] + meta["completion_tokens"]
        assert on.get_stats()["prefix_cache_output_captures_total"] == 18  # 3 conversations x 6 turns
        deadline = time.time() + 30
        while on.has_work() and time.time() < deadline:  # the last capture may still run
            time.sleep(0.01)
        on.check_integrity()
    finally:
        on.shutdown()
