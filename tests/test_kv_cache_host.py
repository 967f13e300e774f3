"""Host-side cache bookkeeping against per-row reference definitions (no model, milliseconds)."""

from __future__ import annotations

import numpy as np

from bicache_sgl.bicache.planner import MatchFacts, usable_depths
from bicache_sgl.bicache.policy import ProfilePolicy
from bicache_sgl.bicache.profile import BicacheProfile
from bicache_sgl.kv_cache.pool import KVPool
from bicache_sgl.kv_cache.store import SeqKV


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
