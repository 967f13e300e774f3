"""Nodes hold prefix state only to the depth their requests need (issue: safe depth as designed):
store at b(r), upgrade when a higher-r request uses a node, trim deep layers of cold nodes under
memory pressure, and every cached layer-token accounted for."""

import threading

import numpy as np
import pytest

from bicache_sgl import Engine, GenerateRequest, SamplingParams
from bicache_sgl.bicache.profile import BicacheProfile

PREFIX = "System: you are a helpful assistant. Examples follow.\nQuestion: a\nAnswer: 1\n\n" * 2
SP = {"temperature": 0}


def _engine(folder, tmp_path, mode="bicache", **kw):
    prof = tmp_path / "profile.json"
    # b(r): 1 layer below r = 0.5, 4 layers (all of the tiny model) from r = 0.7
    BicacheProfile(((0, 0), (30, 1), (50, 2), (70, 4)), 4, model="tiny").save(prof)
    return Engine(folder, prefix_cache=mode, bicache_profile=str(prof), block_length=8, threshold=None, **kw)


def _layer_tokens_per_cached_token(st):
    return st["prefix_cache_stored_layer_tokens"] / st["prefix_cache_used_tokens"]


def test_low_r_stores_few_layers_then_a_high_r_request_upgrades(tiny_llada, tmp_path):
    eng = _engine(tiny_llada, tmp_path)
    try:
        # low r: a long generation region -> (prompt) / (prompt + 256) ~ 0.4 -> b = 1
        low = eng.generate(PREFIX + "Alpha: q", {**SP, "max_new_tokens": 256, "steps_per_block": 1})
        st = eng.get_stats()
        assert low["meta_info"]["cached_tokens"] == 0
        assert _layer_tokens_per_cached_token(st) == 1.0  # every cached token holds one layer
        assert st["prefix_cache_depth_histogram"] == {"1": st["prefix_cache_used_tokens"]}
        assert st["prefix_cache_stored_bytes"] == st["prefix_cache_used_tokens"] * st[
            "prefix_cache_bytes_per_layer_token"]
        # high r on the same prefix: b(0.9) = 4 but the node holds 1 -> reuse at 1, upgrade to 4
        hi = eng.generate(PREFIX + "Beta: q", {**SP, "max_new_tokens": 8})["meta_info"]
        assert hi["cached_tokens"] >= len(PREFIX) and hi["bicache_depth"] == 1
        st = eng.get_stats()
        assert st["prefix_cache_upgrades_total"] >= 1
        # the next high-r request uses the upgraded depth
        nxt = eng.generate(PREFIX + "Gamma: q", {**SP, "max_new_tokens": 8})["meta_info"]
        assert nxt["bicache_depth"] == 4 and nxt["reused_prefix_tokens"] >= len(PREFIX)
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_upgraded_layers_are_the_upgrading_requests_own_state(tiny_llada, tmp_path):
    """X (low r) stores depth 1. X2, the same prompt with a short generation (high r), reuses it at
    depth 1 and writes layers 1-3 of the prefix from its own first forward. X3 = X2 again reuses
    depth 4: every prefix K/V it reads is what X2's own first forward used (layer 0's K/V are
    projections of the embeddings, context-free), so with one block (one refresh) X3's tokens
    must equal X2's exactly. Garbage or misplaced rows would change them."""
    eng = _engine(tiny_llada, tmp_path)
    try:
        prompt = PREFIX + "Alpha: q"
        eng.generate(prompt, {**SP, "max_new_tokens": 256, "steps_per_block": 1})
        x2 = eng.generate(prompt, {**SP, "max_new_tokens": 8})
        x3 = eng.generate(prompt, {**SP, "max_new_tokens": 8})
        assert (x2["meta_info"]["bicache_depth"], x3["meta_info"]["bicache_depth"]) == (1, 4)
        assert x3["output_ids"] == x2["output_ids"]
        assert eng.get_stats()["prefix_cache_upgrades_total"] >= 1
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_trim_drops_deep_layers_of_cold_nodes_before_evicting(tiny_llada, tmp_path):
    # room for 400 tokens at full depth (1600 layer-tokens); three 160-token prefixes at depth 4
    # need 1920: the coldest node is trimmed (4 -> 2 layers), nothing is evicted
    eng = _engine(tiny_llada, tmp_path, mode="fixed:4", max_prefix_cache_tokens=400)
    try:
        for c in "ABC":
            eng.generate(c * 160, {"max_new_tokens": 0})
        st = eng.get_stats()
        assert st["evicted_tokens"] == 0
        assert st["prefix_cache_trimmed_layer_tokens_total"] > 0
        hist = {int(k): v for k, v in st["prefix_cache_depth_histogram"].items()}
        assert hist.get(2, 0) >= 159 and hist.get(4, 0) >= 2 * 159, hist  # the first (coldest) one was trimmed
        assert st["prefix_cache_stored_layer_tokens"] <= st["prefix_cache_capacity_layer_tokens"]
        # the trimmed prefix still serves at the depth it kept
        again = eng.generate("A" * 160 + "?", {**SP, "max_new_tokens": 8})["meta_info"]
        assert again["cached_tokens"] >= 159 and again["bicache_depth"] == 2
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_locked_nodes_are_never_trimmed_and_running_requests_keep_their_state(tiny_llada, tmp_path):
    """A request reusing a node runs while other traffic forces trims: its output equals its
    output in a quiet engine, and its locked path keeps its depth."""
    quiet = _engine(tiny_llada, tmp_path, mode="fixed:4", max_prefix_cache_tokens=400)
    target = "T" * 160
    try:
        quiet.generate(target, {"max_new_tokens": 0})
        want = quiet.generate(target + "!", {**SP, "max_new_tokens": 32})["output_ids"]
    finally:
        quiet.shutdown()
    eng = _engine(tiny_llada, tmp_path, mode="fixed:4", max_prefix_cache_tokens=400)
    try:
        eng.generate(target, {"max_new_tokens": 0})
        done, out = threading.Event(), {}

        def cb(ev):
            if ev.finished:
                out["ev"] = ev
                done.set()
        eng.submit(GenerateRequest(eng.encode(target + "!"), SamplingParams.from_dict({**SP, "max_new_tokens": 32})),
                   cb)
        # prefill-only floods, one after another while the target runs (it needs 32 forwards):
        # each needs room, so the cold, unlocked ones are trimmed or evicted, never the target's
        for c in "UVWXYZ":
            eng.generate(c * 160, {"max_new_tokens": 0})
            if not done.is_set():
                assert eng.get_stats()["prefix_cache_protected_tokens"] >= 159  # the target's path stays locked
        assert done.wait(120)
        assert out["ev"].output_ids == want and out["ev"].meta_info["bicache_depth"] == 4
        st = eng.get_stats()
        assert st["prefix_cache_trimmed_layer_tokens_total"] > 0 or st["evicted_tokens"] > 0
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_pool_bytes_are_proportional_to_depth_held(tiny_llada, tmp_path):
    """The same prompts cost 4x the layer-tokens at fixed:4 as at fixed:1."""
    used = {}
    for mode in ("fixed:1", "fixed:4"):
        eng = _engine(tiny_llada, tmp_path, mode=mode)
        try:
            eng.generate([PREFIX + q for q in ("A", "B")], {"max_new_tokens": 0})
            st = eng.get_stats()
            used[mode] = (st["prefix_cache_used_tokens"], st["prefix_cache_stored_layer_tokens"],
                          st["prefix_cache_stored_bytes"])
            eng.check_integrity()
        finally:
            eng.shutdown()
    assert used["fixed:1"][0] == used["fixed:4"][0]
    assert used["fixed:4"][1] == 4 * used["fixed:1"][1]
    assert used["fixed:4"][2] == 4 * used["fixed:1"][2]


@pytest.mark.parametrize("seed", [0, 1])
def test_random_traffic_keeps_every_row_accounted_for(tiny_llada, tmp_path, seed):
    """Mixed r, shared and unshared prefixes, a small pool (upgrades, trims and evictions all
    happen): the pool's integrity holds after every request."""
    rng = np.random.default_rng(seed)
    eng = _engine(tiny_llada, tmp_path, max_prefix_cache_tokens=300)
    try:
        bases = [c * 120 for c in "PQRS"]
        for _ in range(14):
            prompt = bases[rng.integers(4)] + "xyz"[rng.integers(3)] * int(rng.integers(1, 20))
            eng.generate(prompt, {**SP, "max_new_tokens": int(rng.choice([8, 64, 256])), "steps_per_block": 2})
            eng.check_integrity()
        st = eng.get_stats()
        assert st["prefix_cache_upgrades_total"] + st["prefix_cache_trimmed_layer_tokens_total"] + \
            st["evicted_tokens"] > 0
    finally:
        eng.shutdown()


def test_server_reports_node_depth_upgrades_and_audit(tiny_llada, tmp_path):
    """The counters reach /get_server_info (internal_states[0]) and /metrics through the real server."""
    import urllib.request

    from bicache_sgl.runtime import Runtime
    prof = tmp_path / "profile.json"
    BicacheProfile(((0, 0), (30, 1), (50, 2), (70, 4)), 4, model="tiny").save(prof)
    with Runtime(tiny_llada, bicache_profile=str(prof), block_length=8, threshold=0, skip_server_warmup=True,
                 bicache_audit_rate=1.0, bicache_audit_min_agreement=0.0) as rt:
        rt.generate(PREFIX + "Alpha: q", {**SP, "max_new_tokens": 256, "steps_per_block": 1})  # stores depth 1
        rt.generate(PREFIX + "Beta: q", {**SP, "max_new_tokens": 8})  # reuses at 1, upgrades to 4
        st = rt.internal_state()
        assert st["prefix_cache_upgrades_total"] >= 1 and st["prefix_cache_trimmed_layer_tokens_total"] == 0
        assert st["prefix_cache_stored_layer_tokens"] > st["prefix_cache_used_tokens"]  # some tokens hold > 1 layer
        assert set(st["prefix_cache_depth_histogram"]) >= {"4"}
        assert st["bicache_audit_samples_total"] == 1  # the one reusing request was audited ...
        assert st["bicache_audit_served_exact_total"] == 1  # ... and answered from its exact forward
        assert [b["depth"] for b in st["bicache_audit_buckets"]] == [0, 1, 2, 4]
        with urllib.request.urlopen(rt.url + "/metrics", timeout=30) as r:
            text = r.read().decode()
        for name in ("prefix_cache_stored_layer_tokens", "prefix_cache_upgrades_total",
                     "prefix_cache_trimmed_layer_tokens_total", "prefix_cache_depth_histogram_4",
                     "bicache_audit_samples_total", "bicache_audit_served_exact_total",
                     "bicache_audit_disagreements_total", "bicache_audit_depth_changes_total",
                     "bicache_audit_bucket_depth_r70", "bicache_audit_bucket_trusted_r70"):
            assert f"bicache_sgl:{name}" in text, name
