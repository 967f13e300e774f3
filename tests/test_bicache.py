"""bicache: exactness at the ends (fixed:0 == off, fixed:L == naive), mixed depths in one batch,
eviction safety, flush, computation accounting, profiles and the depth policy."""

import json
import threading
import time

import numpy as np
import pytest

from bicache_sgl import Engine, GenerateRequest, SamplingParams
from bicache_sgl.bicache.planner import MatchFacts, RequestFacts, plan_reuse
from bicache_sgl.bicache.policy import OffPolicy, ProfilePolicy, make_policy
from bicache_sgl.bicache.profile import BicacheProfile, find_profile
from bicache_sgl.kv_cache.memory import MAX_POOL_TOKENS, plan_memory, prefix_bytes_per_token
from bicache_sgl.kv_cache.pool import SlotAllocator
from bicache_sgl.models.config import parse_model_config
from bicache_sgl.scheduler.scheduler import Admission

PREFIX = "System: you are a helpful assistant. Examples follow.\nQuestion: a\nAnswer: 1\n\n" * 2
# questions start with distinct characters, so each matches exactly the shared prefix
QUESTIONS = ["Alpha: tell me", "Beta: answer", "Gamma: what now", "Delta: why"]
SP = {"max_new_tokens": 16, "temperature": 0}


def make_engine(folder, mode, **kw):
    kw.setdefault("block_length", 8)
    kw.setdefault("threshold", None)
    return Engine(folder, prefix_cache=mode, **kw)


def run_seq(eng, prompts, sp=SP, warm=True):
    """Warm the cache with the shared prefix, then run each prompt alone, in order."""
    if warm:
        eng.generate(PREFIX, {"max_new_tokens": 0})
    return [eng.generate(p, sp) for p in prompts]


@pytest.mark.parametrize("cache_mode", ["none", "dual"])
def test_fixed0_equals_off_and_fixedL_equals_naive(tiny_llada, cache_mode):
    sp = {**SP, "cache_mode": cache_mode}
    prompts = [PREFIX + q for q in QUESTIONS]
    outs = {}
    for mode in ("off", "fixed:0", "fixed:4", "naive"):
        eng = make_engine(tiny_llada, mode)
        outs[mode] = run_seq(eng, prompts, sp)
        eng.check_integrity()
        eng.shutdown()
    ids = {m: [o["output_ids"] for o in v] for m, v in outs.items()}
    assert ids["fixed:0"] == ids["off"]
    assert ids["fixed:4"] == ids["naive"]
    # the prefix was found in the tree (reported as cached) in every cached mode, reused only at depth > 0
    assert all(o["meta_info"]["cached_tokens"] >= len(PREFIX) - 1 for o in outs["fixed:0"])
    assert all(o["meta_info"]["bicache_depth"] == 0 for o in outs["fixed:0"])
    assert all(o["meta_info"]["bicache_depth"] == 4 for o in outs["naive"])
    assert all(o["meta_info"]["cached_tokens"] == 0 for o in outs["off"])


def test_fixed0_gives_the_same_tokens_as_off_on_dream(tiny_dream):
    prompts = [PREFIX + q for q in QUESTIONS[:2]]
    res = []
    for mode in ("off", "fixed:0"):
        eng = make_engine(tiny_dream, mode)
        res.append([o["output_ids"] for o in run_seq(eng, prompts)])
        eng.shutdown()
    assert res[0] == res[1]


def _profile_file(tmp_path, table, n_layers=4):
    p = tmp_path / "profile.json"
    BicacheProfile(tuple(table), n_layers, model="tiny").save(p)
    return str(p)


def test_mixed_depth_batch_equals_alone(tiny_llada, tmp_path):
    """Requests with different prefix fractions get different depths; in one batch they give the
    tokens each gives alone."""
    prof = _profile_file(tmp_path, [(0, 0), (50, 1), (70, 2), (85, 3)])
    specs = [(PREFIX + "Alpha: x", 8), (PREFIX + "Beta: y", 32), (PREFIX + "Gamma: z", 16),
             ("Unrelated prompt with no shared prefix", 16)]
    eng = make_engine(tiny_llada, "bicache", bicache_profile=prof)
    alone = []
    for p, n in specs:
        eng.generate(PREFIX, {"max_new_tokens": 0})
        alone.append(eng.generate(p, {**SP, "max_new_tokens": n}))
    depths = [o["meta_info"]["bicache_depth"] for o in alone]
    assert len(set(depths)) >= 3, depths  # the batch really mixes depths
    eng.shutdown()

    eng = make_engine(tiny_llada, "bicache", bicache_profile=prof)
    eng.generate(PREFIX, {"max_new_tokens": 0})
    done, lock = {}, threading.Lock()
    greqs = [GenerateRequest(eng.encode(p), SamplingParams.from_dict({**SP, "max_new_tokens": n})) for p, n in specs]

    def cb(ev):
        if ev.finished:
            with lock:
                done[ev.rid] = ev
    rids = eng.submit_many(greqs, [cb] * len(greqs))
    t0 = time.time()
    while len(done) < len(rids) and time.time() - t0 < 120:
        time.sleep(0.01)
    together = [done[r] for r in rids]
    assert [e.meta_info["bicache_depth"] for e in together] == depths
    assert [e.output_ids for e in together] == [o["output_ids"] for o in alone]
    eng.check_integrity()
    eng.shutdown()


def test_eviction_never_changes_a_running_request(tiny_llada):
    """A request runs with a reused prefix while a flood of other prefixes forces eviction."""
    target = PREFIX + "Alpha: long answer please"
    sp = {**SP, "max_new_tokens": 48}
    eng = make_engine(tiny_llada, "fixed:2", max_prefix_cache_tokens=400)
    ref = run_seq(eng, [target], sp)[0]
    assert ref["meta_info"]["bicache_depth"] == 2
    eng.shutdown()

    eng = make_engine(tiny_llada, "fixed:2", max_prefix_cache_tokens=400)
    eng.generate(PREFIX, {"max_new_tokens": 0})
    result = {}
    rid = eng.submit(GenerateRequest(eng.encode(target), SamplingParams.from_dict(sp)),
                     lambda ev: result.setdefault("ev", ev) if ev.finished else None)
    rng = np.random.default_rng(0)
    flood = ["".join(chr(97 + c) for c in rng.integers(0, 26, 150)) for _ in range(8)]
    for f in flood:  # 8 x 150 new tokens through a 400-token pool, while the target runs
        eng.generate(f, {"max_new_tokens": 0})
    assert "ev" not in result, "the target finished before the flood: the test proves nothing"
    t0 = time.time()
    while "ev" not in result and time.time() - t0 < 60:
        time.sleep(0.01)
    assert rid == result["ev"].rid
    assert result["ev"].output_ids == ref["output_ids"]
    st = eng.cache.stats()
    assert st["evicted_tokens"] > 0 and st["prefix_cache_trimmed_layer_tokens_total"] > 0
    eng.check_integrity()
    assert eng.flush_cache()
    eng.check_integrity()
    st = eng.cache.stats()
    # 400 tokens at depth 2 = 800 layer-tokens; token slots for every row at depth 1
    assert st["prefix_cache_free_layer_tokens"] == st["prefix_cache_capacity_layer_tokens"] == 800
    assert st["prefix_cache_free_tokens"] == st["prefix_cache_capacity_tokens"] == 800
    eng.shutdown()


def test_full_cache_never_fails_a_request(tiny_llada):
    eng = make_engine(tiny_llada, "naive", max_prefix_cache_tokens=0)
    outs = run_seq(eng, [PREFIX + q for q in QUESTIONS[:2]])
    assert all(len(o["output_ids"]) == 16 and o["meta_info"]["bicache_depth"] == 0 for o in outs)
    eng.check_integrity()
    eng.shutdown()


@pytest.mark.parametrize("cache_mode", ["none", "dual"])
def test_computation_drops_by_the_expected_amount(tiny_llada, cache_mode):
    L, d = 4, 2
    eng = make_engine(tiny_llada, f"fixed:{d}")
    p = run_seq(eng, [PREFIX + "Alpha: q"], {**SP, "cache_mode": cache_mode})[0]["meta_info"]
    eng.shutdown()
    off = make_engine(tiny_llada, "off")
    q = run_seq(off, [PREFIX + "Alpha: q"], {**SP, "cache_mode": cache_mode}, warm=False)[0]["meta_info"]
    off.shutdown()
    reused = p["reused_prefix_tokens"]
    assert reused == p["cached_tokens"] == len(PREFIX)
    # S is skipped in layers < d of every forward that computes it: every step for `none`,
    # the block-start refreshes (2 blocks of 8) for `dual`
    forwards_with_s = 16 if cache_mode == "none" else 2
    assert p["skipped_layer_tokens"] == forwards_with_s * reused * d
    assert p["computed_layer_tokens"] == q["computed_layer_tokens"] - p["skipped_layer_tokens"]
    assert q["computed_layer_tokens"] == q["tokens_computed"] * L


def test_prefix_aware_admission_computes_a_shared_prefix_once(tiny_llada):
    eng = make_engine(tiny_llada, "fixed:2")
    outs = eng.generate([PREFIX + q for q in QUESTIONS], SP)
    cached = sorted(o["meta_info"]["cached_tokens"] for o in outs)
    assert cached[0] == 0 and all(c >= len(PREFIX) for c in cached[1:]), cached
    st = eng.get_stats()
    assert st["cache_hit_rate"] > 0 and st["saved_compute_fraction"] > 0
    eng.shutdown()


def test_profile_lookup_and_validation(tmp_path):
    prof = BicacheProfile(((0, 0), (30, 1), (60, 3)), 4)
    assert [prof.lookup(r) for r in (0.0, 0.29, 0.3, 0.59, 0.6, 1.0)] == [0, 0, 1, 1, 3, 3]
    # errs safe: a noisy high bucket at low r never raises the depth at higher r (running min from high r)
    assert BicacheProfile.monotone([(10, 2), (20, 1), (30, 3)]) == [(10.0, 1), (20.0, 1), (30.0, 3)]
    with pytest.raises(ValueError, match="non-decreasing"):
        BicacheProfile(((0, 2), (50, 1)), 4)
    with pytest.raises(ValueError, match="outside"):
        BicacheProfile(((0, 9),), 4)
    path = _profile_file(tmp_path, [(0, 0), (50, 2)])
    assert BicacheProfile.load(path).lookup(0.7) == 2
    with pytest.raises(ValueError, match="is for 4 layers"):
        find_profile(str(tmp_path), path, 8)
    (tmp_path / "bad.json").write_text(json.dumps({"table": [[0, 1]]}))
    with pytest.raises(ValueError, match="invalid"):
        BicacheProfile.load(tmp_path / "bad.json")


def test_profile_none_means_depth_zero_with_a_warning(tiny_llada, caplog):
    with caplog.at_level("WARNING"):
        eng = make_engine(tiny_llada, "bicache", bicache_profile="none")
    assert "no bicache profile" in caplog.text
    out = run_seq(eng, [PREFIX + "Alpha: q"])[0]["meta_info"]
    assert out["cached_tokens"] > 0 and out["bicache_depth"] == 0
    eng.shutdown()


def _own_match(segments, prompt_len, seq_len, L=4):
    """A match whose rows were all captured by an earlier copy of the same request."""
    length = segments[-1][0]
    held = np.zeros((length, L), dtype=bool)
    s = 0
    for e, d in segments:
        held[s:e, :d] = True
        s = e
    ctx = np.where(held, 0, -1).astype(np.int64)
    return MatchFacts(length, tuple(segments), held, ctx, {0: (prompt_len, seq_len)})


def test_planner_over_node_segments():
    prof = BicacheProfile(((0, 0), (50, 2), (80, 4)), 4)
    pol = make_policy("bicache", 4, prof)
    assert isinstance(pol, ProfilePolicy) and pol.max_node_depth == 4
    facts = RequestFacts(prompt_len=91, seq_len=100)
    # one node of 90 tokens at depth 4 in a 100-token sequence: r = 0.91 -> b = 4
    c = plan_reuse(pol, facts, _own_match(((90, 4),), 91, 100))
    assert (c.start, c.prefix, c.depth) == (0, 90, 4)
    # deeper part of the match holds fewer layers: 60 tokens at depth 4 then 30 at depth 1
    c = plan_reuse(pol, facts, _own_match(((60, 4), (90, 1)), 91, 100))
    assert (c.prefix, c.depth, c.matched) == (60, 4, 90)  # 60 x 4 beats 90 x 1
    off = make_policy("off", 4)
    assert isinstance(off, OffPolicy) and not off.uses_cache
    assert plan_reuse(off, facts, _own_match(((90, 4),), 91, 100)).depth == 0
    naive = make_policy("naive", 4)
    assert naive.max_node_depth == 4 and plan_reuse(naive, facts, _own_match(((90, 4),), 91, 100)).depth == 4
    fixed = make_policy("fixed:3", 4)
    assert fixed.max_node_depth == 3
    assert plan_reuse(fixed, facts, _own_match(((90, 2),), 91, 100)).depth == 2  # capped by the node
    assert make_policy("bicache", 4, None).max_node_depth == 0  # no profile: nothing stored, nothing reused
    # per-request overrides: exact requests reuse nothing; bicache_depth fixes the depth
    assert plan_reuse(pol, RequestFacts(91, 100, exact=True), _own_match(((90, 4),), 91, 100)).depth == 0
    assert plan_reuse(pol, RequestFacts(91, 100, forced_depth=1), _own_match(((90, 4),), 91, 100)).depth == 1


def test_planner_bounds_each_row_by_its_capture_context():
    """A 10-token head captured by another family's request (sharing only the head) may be reused
    only at b(10 / N); the family's own 80 tokens behind it at the family's depth. The span then
    starts after the head, which is recomputed."""
    prof = BicacheProfile(((0, 0), (50, 2), (80, 4)), 4)
    pol = make_policy("bicache", 4, prof)
    held = np.ones((90, 4), dtype=bool)
    ctx = np.zeros((90, 4), dtype=np.int64)
    ctx[10:] = 1  # the head from context 0 (another family), the rest from context 1 (the family's first)
    match = MatchFacts(90, ((10, 4), (90, 4)), held, ctx, {0: (10, 100), 1: (91, 100)})
    plan = plan_reuse(pol, RequestFacts(91, 100), match)
    assert (plan.start, plan.prefix, plan.depth) == (10, 90, 4)
    assert plan.r == 0.91  # the binding shared fraction: the family's context
    # the head is computed in full: its missing layers are stored from this request's context
    # (none here: it holds all 4), the span is not rewritten
    assert all(not (s < 10 < e) for s, e, _, _ in plan.store)
    # the same prompt captured beside many more generation positions: shared 91 / 400
    match = MatchFacts(90, ((90, 4),), held, np.zeros((90, 4), dtype=np.int64), {0: (91, 400)})
    assert plan_reuse(pol, RequestFacts(91, 100), match).depth == 0
    # an upgrade wrote layers 2-3 from another context that shares less: only layers 0-1 usable
    ctx = np.zeros((90, 4), dtype=np.int64)
    ctx[:, 2:] = 1
    match = MatchFacts(90, ((90, 4),), held, ctx, {0: (91, 100), 1: (60, 100)})
    plan = plan_reuse(pol, RequestFacts(91, 100), match)
    assert (plan.start, plan.prefix, plan.depth) == (0, 90, 2) and plan.r == 0.6


class _R:
    def __init__(self, prompt, kv_tokens=10):
        self.prompt, self.kv_tokens, self.internal = prompt, kv_tokens, False
        self.prompt_ids = np.asarray(prompt, dtype=np.int64)


def test_scheduler_and_allocator_bookkeeping():
    s = Admission(max_running=3, kv_budget=1000)
    shared = list(range(40))
    a, b, c, d = _R(shared + [100]), _R(shared + [101]), _R([7] * 30), _R(shared + [102])
    for r in (a, b, c, d):
        s.add(r)
    picked = s.select(0, lambda r: 0)
    assert picked == [a, c]  # b and d wait for a to compute their shared prefix
    picked = s.select(2, lambda r: 40)
    assert picked == [b]
    alloc = SlotAllocator(10)
    x = alloc.alloc(6)
    assert alloc.alloc(5) is None and alloc.num_free == 4
    alloc.free(x)
    assert alloc.num_free == 10 and sorted(alloc.free_set().tolist()) == list(range(10))
    with pytest.raises(RuntimeError, match="double free"):
        alloc.free(np.arange(3))


def test_pool_bytes_per_token_for_real_shapes():
    llada = parse_model_config({"architectures": ["LLaDAModelLM"], "d_model": 4096, "n_layers": 32, "n_heads": 32,
                                "n_kv_heads": 32, "mlp_hidden_size": 12288, "vocab_size": 126464})
    dream = parse_model_config({"architectures": ["DreamModel"], "hidden_size": 3584, "num_hidden_layers": 28,
                                "num_attention_heads": 28, "num_key_value_heads": 4, "intermediate_size": 18944,
                                "vocab_size": 152064})
    import torch
    assert prefix_bytes_per_token(llada, 1, torch.bfloat16) == 24 * 1024  # K+V 16 KiB + h 8 KiB per layer
    assert prefix_bytes_per_token(dream, 1, torch.bfloat16) == 2 * 512 * 2 + 3584 * 2  # 9 KiB per layer
    assert prefix_bytes_per_token(llada, 32, torch.bfloat16) == 768 * 1024


def test_scheduler_admits_against_the_kv_budget():
    """Requests wait while their private K/V does not fit; finishing frees budget; order is kept
    (a large request is not overtaken by smaller ones behind it)."""
    s = Admission(max_running=8, kv_budget=100)
    big, small1, small2 = _R([1], 70), _R([2], 40), _R([3], 20)
    for r in (big, small1, small2):
        s.add(r)
    assert s.select(0, lambda r: 0) == [big] and s.kv_in_use == 70
    assert s.select(1, lambda r: 0) == []  # small1 (40) does not fit the 30 left; small2 waits behind it
    s.finished(big)
    assert s.select(0, lambda r: 0) == [small1, small2] and s.kv_in_use == 60


def test_memory_plan_is_safe_for_depth_zero_on_a_large_gpu():
    """Depth 0 stores no tensor bytes per token: the pool's token count stays capped instead of
    becoming 0.3 x free bytes (which would need a host free list of hundreds of GB)."""
    import torch
    cfg = parse_model_config({"architectures": ["LLaDAModelLM"], "d_model": 4096, "n_layers": 32, "n_heads": 32,
                              "n_kv_heads": 32, "mlp_hidden_size": 12288, "vocab_size": 126464})
    h200_free = 120 << 30
    plan = plan_memory(cfg, torch.bfloat16, torch.device("cuda"), 0, free_bytes=h200_free)
    assert plan.pool_tokens == MAX_POOL_TOKENS["cuda"] and plan.pool_bytes == 0
    assert plan.request_bytes <= h200_free
    deep = plan_memory(cfg, torch.bfloat16, torch.device("cuda"), 32, free_bytes=h200_free)
    assert deep.pool_bytes <= 0.3 * h200_free and deep.pool_bytes + deep.request_bytes <= h200_free
    cpu = plan_memory(cfg, torch.bfloat16, torch.device("cpu"), 4, max_total_tokens=5000)
    assert cpu.request_tokens == 5000
