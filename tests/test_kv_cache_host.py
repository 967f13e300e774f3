"""Host-side cache bookkeeping against per-row reference definitions (no model, milliseconds)."""

from __future__ import annotations

import numpy as np
import pytest

from bicache_sgl.bicache.planner import MatchFacts, contexts_in, usable_depths
from bicache_sgl.bicache.policy import ProfilePolicy
from bicache_sgl.bicache.profile import BicacheProfile
from bicache_sgl.kv_cache.pool import KVPool, SlotAllocator
from bicache_sgl.kv_cache.store import KVStore, SeqKV


def reference_usable(policy, match: MatchFacts, seq_len: int) -> np.ndarray:
    """Per token, per layer, straight from the capture-context rule."""
    m, L = match.held.shape
    out = np.zeros(m, dtype=np.int64)
    for t in range(m):
        d = 0
        while d < L and match.held[t, d]:
            lcp, n_c = match.shared[int(match.ctx[t, d])]
            if not d < policy.target_depth(lcp / max(n_c, seq_len)):
                break
            d += 1
        out[t] = d
    return out


def test_usable_depths_over_runs_equals_the_per_row_rule() -> None:
    L = 8
    policy = ProfilePolicy(L, BicacheProfile(((0.0, 1), (20.0, 3), (50.0, 6), (80.0, 8)), L))
    rng = np.random.default_rng(0)
    for _ in range(200):
        m = int(rng.integers(1, 40))
        # runs of tokens captured together, each run with its own per-layer contexts and depth
        cuts = np.sort(rng.choice(np.arange(1, m + 1), size=min(m, int(rng.integers(1, 5))), replace=False))
        ctx = np.full((m, L), -1, dtype=np.int64)
        start = 0
        for end in cuts:
            depth = int(rng.integers(0, L + 1))
            ctx[start:end, :depth] = rng.integers(0, 4, size=depth)
            start = end
        if rng.random() < 0.3:  # a row-level oddity inside a run
            t, layer = int(rng.integers(m)), int(rng.integers(L))
            ctx[t, layer] = -1 if rng.random() < 0.5 else 3
        shared = {c: (int(rng.integers(0, 100)), int(rng.integers(50, 200))) for c in range(4)}
        match = MatchFacts(m, ((m, L),), ctx >= 0, ctx, shared)
        seq_len = int(rng.integers(50, 300))
        got, _ = usable_depths(policy, match, seq_len)
        assert got.tolist() == reference_usable(policy, match, seq_len).tolist()


class _Shape:
    n_layers, n_kv_heads, head_dim, hidden_size, kv_dim = 4, 1, 1, 1, 1


def test_share_gives_back_exactly_the_replaced_private_rows() -> None:
    import torch
    pool = KVPool(_Shape(), 16, 64, 4 * 10, torch.float32, torch.device("cpu"))
    slots = pool.tokens.alloc(3)
    rows = pool.rows.alloc(6)
    ctx = pool.contexts.new(np.arange(3), 10)
    # 3 tokens x layers 0, 1
    pool.bind(np.repeat(slots, 2), np.tile([0, 1], 3), rows, ctx)
    kv = pool.alloc_seq(10)
    assert isinstance(kv, SeqKV) and pool.request_rows.num_free == 0
    private = kv.rows.copy()
    pool.share_prefix(kv, slots, 2, start=4)
    assert pool.request_rows.num_free == 6
    assert np.array_equal(kv.rows[:2, 4:7], pool.table[slots, :2].T)
    assert sorted(pool.request_rows.free_set().tolist()) == sorted(private[:2, 4:7].ravel().tolist())
    pool.free_seq(kv)
    assert pool.request_rows.num_free == 40  # every private row back, the shared ones not
    assert sorted(pool.request_rows.free_set().tolist()) == sorted(private.ravel().tolist())


def test_two_overlapping_shares_free_each_private_row_once() -> None:
    """A second share over a rectangle that overlaps the first gives back only the rows still
    private, and free_seq gives back exactly the rest: every private row once, no prefix row."""
    import torch
    pool = KVPool(_Shape(), 16, 64, 4 * 10, torch.float32, torch.device("cpu"))
    slots = pool.tokens.alloc(5)
    ctx = pool.contexts.new(np.arange(5), 10)
    pool.bind_block(slots, 0, pool.rows.alloc(4 * 5).reshape(4, 5), ctx, fresh=True)
    kv = pool.alloc_seq(10)
    private = kv.rows.copy()
    pool.share_prefix(kv, slots[:3], 2, start=2)  # rows[:2, 2:5]
    pool.share_prefix(kv, slots, 3, start=1)  # rows[:3, 1:6]: overlaps the first
    assert np.array_equal(kv.rows[:3, 1:6], pool.table[slots, :3].T)
    mine = np.ones((4, 10), dtype=bool)
    mine[:3, 1:6] = False
    assert pool.request_rows.num_free == 15
    assert sorted(pool.request_rows.free_set().tolist()) == sorted(private[~mine].tolist())
    pool.free_seq(kv)
    assert pool.request_rows.num_free == 40
    assert sorted(pool.request_rows.free_set().tolist()) == sorted(private.ravel().tolist())
    pool.free_seq(kv)  # idempotent: nothing is freed twice
    assert pool.request_rows.num_free == 40


def test_share_refuses_a_layer_the_slots_do_not_hold_before_giving_back_rows() -> None:
    import torch
    pool = KVPool(_Shape(), 16, 64, 4 * 10, torch.float32, torch.device("cpu"))
    slots = pool.tokens.alloc(3)
    ctx = pool.contexts.new(np.arange(3), 10)
    pool.bind_block(slots, 0, pool.rows.alloc(2 * 3).reshape(2, 3), ctx, fresh=True)
    kv = pool.alloc_seq(10)
    private = kv.rows.copy()
    with pytest.raises(ValueError, match="depth 3"):
        pool.share_prefix(kv, slots, 3)
    assert pool.request_rows.num_free == 0 and np.array_equal(kv.rows, private) and kv.given == []


def test_pool_refuses_a_seqkv_it_did_not_allocate() -> None:
    import torch
    pool = KVPool(_Shape(), 16, 64, 4 * 10, torch.float32, torch.device("cpu"))
    _, (kv,) = KVStore.for_sequences(_Shape(), [5], torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="owned"):
        pool.free_seq(kv)
    assert pool.request_rows.num_free == 40


def test_slot_allocator_order() -> None:
    """Fresh indices come low first in ascending order; an alloc after a free hands back the freed
    indices in the order they were freed (frees of sorted rows come back as ascending runs)."""
    alloc = SlotAllocator(10, offset=100)
    assert alloc.alloc(3).tolist() == [100, 101, 102] and alloc.alloc(2).tolist() == [103, 104]
    alloc.free(np.array([101, 103]))
    alloc.free_parts([np.array([[100], [104]]), np.array([102])])
    assert alloc.num_free == 10
    assert alloc.alloc(5).tolist() == [100, 104, 102, 101, 103]
    assert alloc.alloc(5).tolist() == [105, 106, 107, 108, 109] and alloc.alloc(1) is None
    with pytest.raises(RuntimeError, match="double free"):
        alloc.free_parts([np.arange(6), np.arange(5)])
    assert alloc.num_free == 0


def test_batched_drop_layers_equals_one_call_per_slot() -> None:
    import torch
    rng = np.random.default_rng(1)
    pools = [KVPool(_Shape(), 32, 200, 4, torch.float32, torch.device("cpu")) for _ in range(2)]
    for pool in pools:
        slots = pool.tokens.alloc(20)
        ctx = pool.contexts.new(np.arange(5), 9)
        pool.bind(np.repeat(slots, 4), np.tile(np.arange(4), 20), pool.rows.alloc(80), ctx)
    keep = rng.integers(0, 5, 20)
    slots = np.arange(20)
    n_batched = pools[0].drop_layers(slots, keep)
    n_each = sum(pools[1].drop_layers(slots[i:i + 1], int(keep[i])) for i in range(20))
    assert n_batched == n_each == int((4 - np.minimum(keep, 4)).sum())
    assert np.array_equal(pools[0].table >= 0, pools[1].table >= 0)
    assert np.array_equal(pools[0].ctx, pools[1].ctx)
    assert pools[0].rows.num_free == pools[1].rows.num_free
    assert pools[0].contexts.refs() == pools[1].contexts.refs()


def test_contexts_in_is_the_sorted_distinct_ids_small_and_large() -> None:
    rng = np.random.default_rng(3)
    for shape in ((1, 4), (3, 32), (200, 32), (2000, 32)):  # both sides of the small-block path
        ctx = rng.integers(-1, 40, shape)
        ctx[:, :2] = -1
        got = contexts_in(ctx)
        assert got == [int(c) for c in np.unique(ctx) if c >= 0], shape
        assert all(type(c) is int for c in got)
    assert contexts_in(np.full((3, 4), -1)) == [] and contexts_in(np.zeros((0, 4), np.int64)) == []


def test_best_span_over_runs_is_the_best_span_a_brute_force_finds() -> None:
    """The planner's span choice against every (start, end) of the repeated tokens: the same
    gain (end - start) x depth, ties to the longer span, and a span its depth may really use."""
    from bicache_sgl.bicache.planner import best_span_runs
    rng = np.random.default_rng(2)
    for _ in range(300):
        n_runs = int(rng.integers(1, 12))
        lengths = rng.integers(1, 6, n_runs)
        per_run = rng.integers(0, 9, n_runs)
        bounds = np.concatenate([[0], np.cumsum(lengths)])
        usable = np.repeat(per_run, lengths)
        spans = [((e - s) * int(usable[s:e].min()), e - s) for s in range(len(usable))
                 for e in range(s + 1, len(usable) + 1)]
        want_gain = max(g for g, _ in spans)
        want_len = max(n for g, n in spans if g == want_gain) if want_gain else 0
        s, e, d = best_span_runs(bounds, per_run)
        assert (e - s) * d == want_gain and e - s == want_len
        assert d == 0 or (0 < d <= usable[s:e].min())


def _random_pool_history(rng, pool, L: int) -> np.ndarray:
    """Bind rectangles and flat rows and drop layers at random; returns the slots used."""
    slots = pool.tokens.alloc(24)
    # one capture over every slot first, so the history starts from one class of many slots
    first = pool.contexts.new(np.arange(2), 8)
    pool.bind_block(slots, 0, pool.rows.alloc(L * 24).reshape(L, 24), first)
    for step in range(30):
        ctx = pool.contexts.new(np.arange(step % 5), 9 + step)
        op = rng.random()
        if op < 0.45:  # a stored range: one rectangle over a contiguous or scattered slot set
            s = int(rng.integers(0, 23))
            e = int(rng.integers(s + 1, 25))
            lo = int(rng.integers(0, L))
            hi = int(rng.integers(lo + 1, L + 1))
            sl = slots[s:e] if rng.random() < 0.5 else rng.permutation(slots)[: e - s]
            block = pool.rows.alloc((hi - lo) * len(sl))
            if block is None:
                continue
            pool.rows.free(pool.bind_block(sl, lo, block.reshape(hi - lo, len(sl)), ctx))
        elif op < 0.6:  # flat rows (any slots and layers)
            n = int(rng.integers(1, 10))
            sl, layers = rng.choice(slots, n), rng.integers(0, L, n)
            flat = np.unique(sl * L + layers)
            rows = pool.rows.alloc(len(flat))
            if rows is None:
                continue
            pool.rows.free(pool.bind(flat // L, flat % L, rows, ctx))
        elif op < 0.8:
            pool.drop_layers(rng.choice(slots, int(rng.integers(1, 8)), replace=False), int(rng.integers(0, L)))
        else:
            sl = rng.choice(slots, int(rng.integers(1, 8)), replace=False)
            pool.drop_layers(sl, rng.integers(0, L + 1, len(sl)))
        pool.contexts.forget(ctx)
    return slots


def test_capture_classes_cut_a_match_into_runs_of_equal_rows() -> None:
    """Equal class => equal capture-context row after any history of binds and drops, so the
    planner's run form of a match (one row per class run) gives the per-row answer."""
    import torch
    L = 6
    policy = ProfilePolicy(L, BicacheProfile(((0.0, 1), (20.0, 3), (50.0, 6)), L))
    for seed in range(20):
        rng = np.random.default_rng(seed)
        pool = KVPool(_Shape6(), 32, 2000, 4, torch.float32, torch.device("cpu"))
        slots = _random_pool_history(rng, pool, L)
        pool.check_exact_classes(np.arange(pool.token_capacity))
        order = rng.permutation(slots)
        cls = pool.cls[order]
        runs = np.concatenate([[0], np.flatnonzero(cls[1:] != cls[:-1]) + 1])
        ids = {int(c) for c in pool.ctx[order].ravel() if c >= 0}
        shared = {c: (int(rng.integers(0, 60)), int(rng.integers(20, 80))) for c in ids}
        full = MatchFacts(len(order), ((len(order), L),), pool.ctx[order] >= 0, pool.ctx[order], shared)
        ctx_r = pool.ctx[order[runs]]
        compact = MatchFacts(len(order), ((len(order), L),), ctx_r >= 0, ctx_r, shared, runs)
        want = reference_usable(policy, full, 70)
        assert usable_depths(policy, compact, 70)[0].tolist() == want.tolist()
        assert usable_depths(policy, full, 70)[0].tolist() == want.tolist()


def test_a_class_shared_by_unequal_rows_is_caught() -> None:
    import torch
    pool = KVPool(_Shape6(), 8, 64, 4, torch.float32, torch.device("cpu"))
    slots = pool.tokens.alloc(4)
    ctx = pool.contexts.new(np.arange(3), 10)
    pool.rows.free(pool.bind_block(slots[:2], 0, pool.rows.alloc(4).reshape(2, 2), ctx))
    pool.check_exact_classes(slots)
    pool.cls[slots[2]] = pool.cls[slots[0]]  # a label joining a row-less slot to a captured one
    try:
        pool.check_exact_classes(slots)
    except AssertionError as e:
        assert "capture class" in str(e)
    else:
        raise AssertionError("check_exact_classes missed two unequal rows under one class")


def test_bind_block_equals_flat_bind() -> None:
    import torch
    rng = np.random.default_rng(5)
    for _ in range(30):
        pools = [KVPool(_Shape6(), 16, 400, 4, torch.float32, torch.device("cpu")) for _ in range(2)]
        pre = rng.integers(0, 2, (16, 6)).astype(bool)  # rows bound before (a concurrent upgrade)
        sl = rng.permutation(16)[: int(rng.integers(1, 16))] if rng.random() < 0.5 else np.arange(3, 12)
        lo, hi = sorted(rng.choice(7, 2, replace=False).tolist())
        lost = []
        for pool in pools:
            c0 = pool.contexts.new(np.arange(2), 5)
            pool.tokens.alloc(16)
            s, layer = np.nonzero(pre)
            pool.bind(s, layer, pool.rows.alloc(len(s)), c0)
            c1 = pool.contexts.new(np.arange(4), 7)
            block = np.arange(300, 300 + (hi - lo) * len(sl)).reshape(hi - lo, len(sl))
            if pool is pools[0]:
                lost.append(pool.bind_block(sl, lo, block, c1))
            else:
                layers = np.arange(lo, hi)
                lost.append(pool.bind(np.tile(sl, hi - lo), np.repeat(layers, len(sl)), block.ravel(), c1))
            pool.contexts.forget(c1)
        assert np.array_equal(pools[0].table, pools[1].table)
        assert np.array_equal(pools[0].ctx, pools[1].ctx)
        assert sorted(lost[0].tolist()) == sorted(lost[1].tolist())
        assert pools[0].contexts.refs() == pools[1].contexts.refs()


class _Shape6:
    n_layers, n_kv_heads, head_dim, hidden_size, kv_dim = 6, 1, 1, 1, 1


def test_copy_rows_to_equals_the_gathered_rows() -> None:
    import torch
    rng = np.random.default_rng(7)
    pool = KVPool(_Shape6(), 64, 64 * 6, 4, torch.float32, torch.device("cpu"))
    slots = pool.tokens.alloc(64)
    ctx = pool.contexts.new(np.arange(3), 10)
    pool.bind_block(slots, 0, pool.rows.alloc(6 * 64).reshape(6, 64), ctx)
    for runs in (1, 3, 40):  # contiguous runs of slots, and scattered slots (one gather)
        cut = np.sort(rng.choice(np.arange(1, 64), runs - 1, replace=False)) if runs > 1 else []
        parts = np.split(rng.permutation(64), cut) if runs == 40 else np.split(np.arange(64), cut)
        sl = np.concatenate([np.sort(p) for p in parts])[:50]
        out = np.full((6, 50), -7, dtype=np.int64)
        pool.copy_rows_to(out, sl, 4)
        assert np.array_equal(out[:4], pool.table[sl, :4].T) and (out[4:] == -7).all()


def test_capture_rows_per_layer_are_the_rows_commit_binds() -> None:
    """Over a replay with upgrades (several stored ranges per request), every layer's capture
    (positions, device rows) names exactly the rows the commit then binds for those tokens, and
    the integrity check (capture classes included) holds after every request."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "examples" / "bench_host.py"
    spec = importlib.util.spec_from_file_location("bench_host_for_test", path)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # dataclasses look their module up
    spec.loader.exec_module(bench)
    from bicache_sgl.bicache.planner import RequestFacts

    L = 8
    cache = bench.make_cache(L, 6000, 6000 * L, L * (256 + bench.GEN))
    bench.fill(cache, 60, 0)
    trace = bench.Trace(256, 0)
    multi, prompt = 0, trace.next()
    for i in range(40):
        # every third request repeats the previous prompt beside a short generation region: a
        # larger shared fraction, so it reuses and upgrades its own rows (several stored ranges)
        prompt, n = (prompt, len(prompt) + 16) if i % 3 == 2 else (trace.next(), None)
        n = n or len(prompt) + bench.GEN
        grant = cache.admit(prompt, RequestFacts(len(prompt), n))
        kv = cache.pool.alloc_seq(n)
        cache.share(grant, kv)
        slots = np.concatenate([grant.matched_slots, grant.new_slots])
        layers = dict(grant.capture.layers) if grant.capture is not None else {}
        multi += len(grant.plan.store) > 1
        cache.commit(prompt, grant, n)
        kept = np.isin(slots, cache.index.all_values())  # a new token cached meanwhile is given back
        for layer, (pos, rows) in layers.items():
            k = kept[pos]
            assert np.array_equal(cache.pool.table[slots[pos][k], layer], rows.numpy()[k]), layer
            assert k.sum() >= len(pos) - 1
        cache.release(grant)
        cache.pool.free_seq(kv)
        cache.check_integrity()
    assert multi > 0  # the replay did store several ranges in one request


def test_free_parts_leaves_the_free_list_free_leaves() -> None:
    from bicache_sgl.kv_cache.pool import SlotAllocator
    a, b = SlotAllocator(200), SlotAllocator(200)
    for alloc in (a, b):
        alloc.alloc(120)
    grid = np.arange(100).reshape(4, 25)
    parts = [grid[2:], grid[:2, :5], grid[:2, 20:], np.array([110, 111])]
    a.free_parts(parts)
    b.free(np.concatenate([p.ravel() for p in parts]))
    assert np.array_equal(a.free_set(), b.free_set()) and a.num_free == b.num_free
    assert np.array_equal(a.alloc(a.num_free), b.alloc(b.num_free))


def test_planner_small_and_array_paths_agree() -> None:
    """The planner judges a few runs in plain Python and many with numpy: both give the per-row
    rule's usable depths and the brute-force best span, on both sides of each threshold."""
    from bicache_sgl.bicache import planner
    L = 8
    policy = ProfilePolicy(L, BicacheProfile(((0.0, 1), (20.0, 3), (50.0, 6), (80.0, 8)), L))
    rng = np.random.default_rng(5)
    for m in (30, 2 * planner._SMALL_RUN_CELLS // L):  # small path, then the array path
        for _ in range(10):
            ctx = rng.integers(-1, 4, (m, L))
            ctx[rng.random(m) < 0.5] = ctx[0]  # runs of equal rows among single rows
            shared = {c: (int(rng.integers(0, 100)), int(rng.integers(50, 200))) for c in range(4)}
            match = MatchFacts(m, ((m, L),), ctx >= 0, ctx, shared)
            assert (match.run_rows()[1].size <= planner._SMALL_RUN_CELLS) == (m == 30)
            got, _ = usable_depths(policy, match, 120)
            assert got.tolist() == reference_usable(policy, match, 120).tolist()
    for n_runs in (5, planner._SMALL_RUNS + 1, 150):
        for _ in range(20):
            lengths = rng.integers(1, 6, n_runs)
            per_run = rng.integers(0, 9, n_runs)
            bounds = np.concatenate([[0], np.cumsum(lengths)])
            got = planner.best_span_runs(bounds, per_run)
            assert got == planner._best_span_small(bounds.tolist(), per_run.tolist())
            usable = np.repeat(per_run, lengths)
            s, e, d = got
            best = max((e2 - s2) * int(usable[s2:e2].min()) for s2 in range(len(usable))
                       for e2 in range(s2 + 1, min(len(usable), s2 + 60) + 1))
            assert (e - s) * d >= best and (d == 0 or d <= usable[s:e].min())


def test_held_depth_by_class_is_the_per_row_held_depth() -> None:
    """One ctx column per class run (one column for a single class) gives the depth a read of
    every row of every slot gives, after any history of binds and drops."""
    import torch
    L = 6
    for seed in range(20):
        rng = np.random.default_rng(100 + seed)
        pool = KVPool(_Shape6(), 32, 2000, 4, torch.float32, torch.device("cpu"))
        slots = _random_pool_history(rng, pool, L)
        for _ in range(20):
            sl = rng.permutation(slots)[: int(rng.integers(1, len(slots) + 1))]
            assert pool.held_depth_by_class(sl) == pool.held_depth(sl)
            one = sl[pool.cls[sl] == pool.cls[sl[0]]]  # a single class
            assert pool.held_depth_by_class(one) == pool.held_depth(one)


def test_int32_tables_and_allocator_hand_out_int64_ids() -> None:
    """The pool stores row and context ids as int32 where they fit; what it hands out (row ids,
    the rows a SeqKV reads) is int64, and an allocator refuses a range its dtype cannot hold."""
    import torch
    pool = KVPool(_Shape(), 16, 64, 4 * 10, torch.float32, torch.device("cpu"))
    assert pool.layer_table.dtype == pool.layer_ctx.dtype == np.int32
    rows = pool.rows.alloc(8)
    assert rows.dtype == np.int64 and pool.request_rows.alloc(4).dtype == np.int64
    assert pool.rows.free_set().dtype == pool.request_rows.free_set().dtype == np.int32
    kv = pool.alloc_seq(3)
    assert kv.rows.dtype == np.int64 and kv.rows.min() >= 64  # request rows follow the prefix rows
    pool.free_seq(kv)
    assert pool.request_rows.num_free == 4 * 10 - 4
    slots = pool.tokens.alloc(2)
    ctx = pool.contexts.new(np.arange(3), 10)
    pool.bind_block(slots, 0, rows.reshape(4, 2), ctx, fresh=True)
    assert pool.rows_of(slots, 4).dtype == np.int64
    assert np.array_equal(pool.rows_of(slots, 4), rows.reshape(4, 2))
    with pytest.raises(ValueError, match="int32"):
        SlotAllocator(10, offset=np.iinfo(np.int32).max - 5, dtype=np.int32)


def test_capture_context_ids_are_reused_only_once_forgotten() -> None:
    """A forgotten context's id is given again (ids stay below the live count, so they fit the
    int32 ctx table); a context still referred to by a row keeps its id and its record."""
    from bicache_sgl.kv_cache.pool import CaptureContexts
    c = CaptureContexts()
    a, b = c.new(np.arange(3), 10), c.new(np.arange(4), 11)
    c.ref(a, 2)
    c.forget(b)  # never bound: dropped, its id spare
    c.forget(b)  # a second forget is a no-op (the id is not spared twice)
    b2, d = c.new(np.arange(5), 12), c.new(np.arange(6), 13)
    assert b2 == b and d not in (a, b) and c.seq_len(b2) == 12 and c.tokens(a).tolist() == [0, 1, 2]
    c.unref(np.array([a, a]))
    assert c.new(np.arange(1), 1) == a and len(c) == 3
