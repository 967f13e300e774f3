"""A capture serves the requests after it (docs/prefix_cache.md, "Re-capture"): rows captured in a
context that shares too little with the requests that match them (a prefill-only hint: SGLang's
frontend sends the shared prefix alone before a ``run_batch``; another family's request) are
replaced by the first request that computes them in full, so later requests reuse them as deep
as the capture-context rule allows *them*; and what each request reports is what was computed.

Pool and planner checks are bookkeeping (milliseconds); the rest runs the bundled model with its
shipped profile (default flags) against cache off, offline and through the SGLang frontend."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bicache_sgl import Engine
from bicache_sgl.bicache.planner import MatchFacts, RequestFacts, plan_reuse
from bicache_sgl.bicache.policy import ProfilePolicy
from bicache_sgl.bicache.profile import MODE_STOP, BicacheProfile
from bicache_sgl.kv_cache.pool import KVPool

SHOTS = "".join(f"Question: {q}\nAnswer: 3\n\n" for q in "KDMKD")  # the hint: 115 tokens
QUESTIONS = "KDMZAQWERTYUIOPS"
SP = {"max_new_tokens": 8, "temperature": 0}


class _Shape:
    n_layers, n_kv_heads, head_dim, hidden_size, kv_dim = 4, 1, 1, 1, 1


def _pool() -> KVPool:
    return KVPool(_Shape(), 16, 64, 4 * 10, torch.float32, torch.device("cpu"))


def _bound(pool: KVPool, n: int, depth: int, ctx_len: int = 10) -> tuple[np.ndarray, np.ndarray, int]:
    slots = pool.tokens.alloc(n)
    rows = pool.rows.alloc(n * depth).reshape(depth, n)
    ctx = pool.contexts.new(np.arange(n), ctx_len)
    pool.bind_block(slots, 0, rows, ctx, fresh=True)
    return slots, rows.copy(), ctx


def test_rebind_replaces_the_rows_and_retires_those_still_read() -> None:
    pool = _pool()
    slots, old, ctx_old = _bound(pool, 3, 2)
    reader = pool.alloc_seq(5)
    pool.share_prefix(reader, slots, 2, start=1)  # a running request reads the old rows in place
    expect = pool.cls[slots].copy()
    free_before = pool.rows.num_free
    new = pool.rows.alloc(3 * 4).reshape(4, 3)
    ctx_new = pool.contexts.new(np.arange(7), 20)
    lost, replaced = pool.rebind_block(slots, 0, new, ctx_new, expect)
    assert lost.size == 0 and replaced == 3
    assert np.array_equal(pool.layer_table[:, slots], new) and (pool.layer_ctx[:, slots] == ctx_new).all()
    # the reader's rows never change under it: the old rows are retired, not freed
    assert np.array_equal(reader.rows[:2, 1:4], old)
    assert pool.retired_rows == old.size and pool.rows.num_free == free_before - new.size
    assert pool.contexts.refs().get(ctx_old, 0) == 0  # no row refers to the old context any more
    pool.free_seq(reader)
    assert pool.retired_rows == 0 and pool.rows.num_free == free_before - new.size + old.size
    assert (pool.readers == 0).all()


def test_rebind_of_a_slot_changed_since_admission_only_adds_the_layers_it_lacks() -> None:
    pool = _pool()
    slots, old, _ = _bound(pool, 2, 1)
    expect = pool.cls[slots].copy()
    # another capture upgraded slot 0 to 2 layers after our admission: its class changed
    up = pool.rows.alloc(1).reshape(1, 1)
    pool.bind_block(slots[:1], 1, up, pool.contexts.new(np.arange(3), 10))
    new = pool.rows.alloc(2 * 3).reshape(3, 2)
    ctx_new = pool.contexts.new(np.arange(5), 12)
    lost, replaced = pool.rebind_block(slots, 0, new, ctx_new, expect)
    assert replaced == 1  # slot 1 only
    assert np.array_equal(pool.layer_table[:3, slots[1]], new[:, 1])
    # slot 0 keeps its rows at layers 0 and 1 and gets layer 2; its new rows for 0 and 1 are lost
    assert pool.layer_table[0, slots[0]] == old[0, 0] and pool.layer_table[1, slots[0]] == up[0, 0]
    assert pool.layer_table[2, slots[0]] == new[2, 0]
    assert sorted(lost.tolist()) == sorted([int(new[0, 0]), int(new[1, 0])])
    assert pool.retired_rows == 0  # nobody read the replaced row: freed at once


def _stop_profile(L: int = 8) -> ProfilePolicy:
    """The shipped default profile's shape: stop table depth L from r = 70 %, 0 below."""
    prof = BicacheProfile(((0.0, 0),), L, by_mode=((MODE_STOP, ((0.0, 0), (70.0, L))),))
    return ProfilePolicy(L, prof)


def test_planner_recaptures_a_prefix_only_capture_that_cannot_serve_the_request() -> None:
    L, P = 8, 115
    policy = _stop_profile(L)
    ctx = np.zeros((1, L), dtype=np.int64)  # one run: all 115 tokens captured together, 8 layers
    # the hint's context: its prompt is the prefix itself (lcp 115), its forward saw 115 positions
    match = MatchFacts(P, ((P, L),), ctx >= 0, ctx, {0: (P, P)}, np.zeros(1, dtype=np.int64))
    plan = plan_reuse(policy, RequestFacts(134, 166, mode=MODE_STOP), match)
    assert plan.depth == 0 and plan.reused == 0  # b(115 / 166 = 0.69) = 0
    assert plan.recapture == ((0, P),) and (0, P, 0, L) in plan.store
    # a request whose own N keeps r >= 0.7 is served by the same rows and re-captures nothing
    plan = plan_reuse(policy, RequestFacts(120, 150, mode=MODE_STOP), match)
    assert plan.depth == L and plan.reused == P and plan.recapture == ()
    # rows captured by a request that shared more with it (125 tokens: r = 0.75) serve it: kept
    match2 = MatchFacts(P, ((P, L),), ctx >= 0, ctx, {0: (125, 160)}, np.zeros(1, dtype=np.int64))
    plan = plan_reuse(policy, RequestFacts(134, 166, mode=MODE_STOP), match2)
    assert plan.depth == L and plan.recapture == ()


def _check_reports(outs: list[dict]) -> None:
    """Each request's report says what its forwards computed: the split of its match by depth
    sums to the match, and its skipped layer-tokens are that split x the forwards that read it."""
    for o in outs:
        m = o["meta_info"]
        split = {int(d): n for d, n in m["reused_tokens_by_depth"].items()}
        assert sum(split.values()) == m["cached_tokens"]
        assert m["skipped_layer_tokens"] == sum(d * n for d, n in split.items()) * m["reuse_forwards"]
        deepest = max((d for d in split if d), default=0)
        # bicache_depth never claims a depth most of the match was not served at
        assert m["bicache_depth"] in (0, deepest)
        assert m["bicache_depth"] == 0 or 2 * split[m["bicache_depth"]] > m["cached_tokens"]


@pytest.fixture(scope="module")
def engines():
    off = Engine(prefix_cache="off", num_threads=1)
    on = Engine(num_threads=1, bicache_audit_rate=0.0)  # the shipped profile, no sampled audit
    yield off, on
    off.shutdown()
    on.shutdown()


def test_prefill_hint_then_extending_requests_reuse_at_the_depth_the_profile_allows(engines):
    """The issue's reproduction: the shared prefix alone (max_new_tokens 0), then 16 requests that
    extend it, 8 at a time. Before, the hint's rows (context: the prefix, r = 115 / 166 below the
    profile's 70 %) served nobody and later requests reused only the 10 tokens captured after
    them. Now the first batch re-captures the prefix, every later request reuses its whole match
    at the profile's depth, and the reports add up to what the server skipped and off computed."""
    off, on = engines
    on.flush_cache()
    prompts = [SHOTS + f"Question: {q}\nAnswer:" for q in QUESTIONS]
    on.generate(SHOTS, {"max_new_tokens": 0})
    before = on.get_stats()
    outs = on.generate(prompts[:8], SP) + on.generate(prompts[8:], SP)
    after = on.get_stats()
    want = off.generate(prompts[:8], SP) + off.generate(prompts[8:], SP)
    assert [o["text"] for o in outs] == [w["text"] for w in want]
    _check_reports(outs)
    later = [o["meta_info"] for o in outs[8:]]
    # the match runs into the last turn's "Question: "; the span ends at the blank line before it
    # (the span cut): the whole hinted prefix, at the profile's depth
    assert all(m["cached_tokens"] == 125 and m["reused_prefix_start"] == 0 and m["reused_prefix_tokens"] == 115
               and m["bicache_depth"] == 8 for m in later), later
    assert after["prefix_cache_recaptures_total"] > before["prefix_cache_recaptures_total"]
    skipped = after["skipped_layer_tokens"] - before["skipped_layer_tokens"]
    assert skipped == sum(o["meta_info"]["skipped_layer_tokens"] for o in outs) >= 8 * 115 * 8
    by_depth = {d: after["reused_tokens_by_depth"].get(d, 0) - before["reused_tokens_by_depth"].get(d, 0)
                for d in after["reused_tokens_by_depth"]}
    assert by_depth.get("8", 0) == sum(o["meta_info"]["reused_tokens_by_depth"].get("8", 0) for o in outs)
    # what was skipped is what cache off computed and bicache did not, request by request
    for o, w in zip(outs, want):
        if o["meta_info"]["forward_passes"] == w["meta_info"]["forward_passes"]:
            assert (w["meta_info"]["computed_layer_tokens"] - o["meta_info"]["computed_layer_tokens"]
                    == o["meta_info"]["skipped_layer_tokens"])
    on.check_integrity()


def test_a_repeated_hint_does_not_recapture_its_own_rows(engines):
    """A prefix-only capture sent twice: the second matches rows of its own context (r = 1), which
    serve it fully, so nothing is replaced (re-capture is for rows that did not serve)."""
    _, on = engines
    on.flush_cache()
    on.generate(SHOTS, {"max_new_tokens": 0})
    before = on.get_stats()["prefix_cache_recaptures_total"]
    on.generate(SHOTS, {"max_new_tokens": 0})
    assert on.get_stats()["prefix_cache_recaptures_total"] == before
    on.check_integrity()


def _server_counters(url: str) -> dict:
    import requests

    return requests.get(url + "/get_server_info", timeout=30).json()["internal_states"][0]


def test_frontend_run_batch_reuses_the_hinted_prefix_and_reports_add_up():
    """SGLang's frontend ``run_batch`` over a real server (default flags): it sends the common
    prefix alone first (``max_new_tokens`` 0), then the questions. The questions reuse the
    prefix in all 8 layers once the first ones re-captured it, and the server's counters
    (/get_server_info, /metrics) equal the sum of the per-request reports."""
    import requests
    import sglang as sgl

    from bicache_sgl.runtime import Runtime

    with Runtime(num_threads=1, max_running_requests=8, timeout=180) as rt:
        sgl.set_default_backend(sgl.RuntimeEndpoint(rt.url))

        @sgl.function
        def few_shot(s, question):
            s += SHOTS + "Question: " + question + "\nAnswer:"
            s += sgl.gen("answer", max_tokens=8, stop=["\n", "Question"])

        before = _server_counters(rt.url)
        states = few_shot.run_batch([{"question": q} for q in QUESTIONS * 2], num_threads=4)
        after = _server_counters(rt.url)
        metas = [st.get_meta_info("answer") for st in states]
        metrics = requests.get(rt.url + "/metrics", timeout=30).text
    assert all(st["answer"].strip() == "3" for st in states)
    outs = [{"meta_info": m} for m in metas]
    _check_reports(outs)
    skipped = after["skipped_layer_tokens"] - before["skipped_layer_tokens"]
    assert skipped == sum(m["skipped_layer_tokens"] for m in metas)
    served8 = sum(m["reused_tokens_by_depth"].get("8", 0) for m in metas)
    assert after["reused_tokens_by_depth"].get("8", 0) - before["reused_tokens_by_depth"].get("8", 0) == served8
    # most questions reuse the whole hinted prefix at the profile's depth (8: r = 125 / 166 >= 70 %)
    deep = [m for m in metas if m["bicache_depth"] == 8 and m["reused_prefix_tokens"] >= 115]
    assert len(deep) >= len(metas) - 8, [(m["cached_tokens"], m["reused_tokens_by_depth"]) for m in metas]
    assert skipped >= len(deep) * 115 * 8
    deep_total = after["reused_tokens_by_depth"]["8"]
    line = f'bicache_sgl:reused_tokens_by_depth_8{{model_name="bicache-default"}} {deep_total}'
    assert line in metrics
