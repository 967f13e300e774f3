"""Block-diffusion families (LLaDA2.x MoE, SDAR dense): forward, block structure, decoding and
exact whole-block prefix reuse, on tiny checkpoints in the real formats (docs/block_diffusion.md).

- the packed forward equals the independent float64 reference (bicache_sgl/reference.py), and the
  MoE routing really varies between tokens;
- the block structure is real: a change in a later block leaves every earlier block's logits
  unchanged, a change in the same block changes them;
- decoding (BlockEngine: the natural K/V cache, current block's rows only) is token-identical to
  independent re-statements of the published generate loops run on the float64 reference;
- exact reuse (hypothesis): request streams with shared prefixes (aligned or not), batches,
  multi-turn conversations and flushes give the answers of cache off, token for token, with the
  reused span block-aligned and at full depth.
"""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bicache_sgl.attention.block_causal import block_causal_attention, block_causal_mask_dense
from bicache_sgl.attention.torch_backend import sdpa_batched
from bicache_sgl.blockdiff.engine import BlockEngine, BlockEngineOptions, BlockParams
from bicache_sgl.kv_cache.block_prefix import BlockPrefixCache
from bicache_sgl.models.block_config import parse_block_config
from bicache_sgl.models.block_model import BlockKV, RowsWork, load_block_model
from bicache_sgl.models.config import CheckpointError
from bicache_sgl.reference import load_block_reference, reference_block_logits
from bicache_sgl.testing.block import make_tiny_llada2, make_tiny_sdar
from bicache_sgl.testing.block_generate import llada2_generate, sdar_generate

B = 4


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: one thread (tests/conftest.py)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("block")
    return {
        "llada2": make_tiny_llada2(root / "llada2", block_length=B),
        "llada2_softmax": make_tiny_llada2(root / "llada2_softmax", score_function="softmax", n_group=2, topk_group=1,
                                           num_shared_experts=0, seed=3, block_length=B),
        "sdar": make_tiny_sdar(root / "sdar", block_length=B),
    }


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("name", ["llada2", "llada2_softmax", "sdar"])
def test_forward_equals_float64_reference_and_routing_varies(folders, name):
    model = load_block_model(folders[name])
    ref = load_block_reference(folders[name])
    assert model.cfg.decode.block_length == B
    ids = _ids(14, 1)  # three whole blocks and a partial one
    routes: list = []
    want = reference_block_logits(ref, ids, B, routes)
    got = model.forward_dense(torch.tensor(ids)).double()
    assert (got - want).abs().max().item() < 1e-4 * max(1.0, want.abs().max().item())
    assert (got.argmax(-1) == want.argmax(-1)).all()
    if name.startswith("llada2"):
        chosen = {r[2] for r in routes}
        experts = {e for r in routes for e in r[2]}
        assert len(chosen) >= 4 and len(experts) >= 4, "degenerate routing: every token to the same experts"
        assert all(len(r[2]) == 2 for r in routes)


@pytest.mark.parametrize("name", ["llada2", "sdar"])
def test_block_structure_is_real(folders, name):
    # float64: an MoE expert's GEMM over a different set of tokens rounds differently in the
    # last bits, so "unchanged" is checked to 1e-9, far below the 1e-3 a real dependence gives
    model = load_block_model(folders[name], dtype=torch.float64)
    ids = _ids(14, 2)
    base = model.forward_dense(torch.tensor(ids))
    later = list(ids)
    later[9] = (later[9] + 1) % 256  # block 2 (positions 8..11)
    out = model.forward_dense(torch.tensor(later))
    assert (out[:8] - base[:8]).abs().max() < 1e-9, "an earlier block saw a later block"
    assert (out[8:12] - base[8:12]).abs().max() > 1e-3, "the block's own positions did not see the change"
    same = list(ids)
    same[5] = (same[5] + 1) % 256  # block 1: positions 4..7 see it, block 0 does not
    out = model.forward_dense(torch.tensor(same))
    assert (out[:4] - base[:4]).abs().max() < 1e-9
    assert (out[4] - base[4]).abs().max() > 1e-3 and (out[7] - base[7]).abs().max() > 1e-3


def test_cached_rows_equal_the_dense_forward(folders):
    """The serving forward (rows against a K/V buffer of earlier blocks) equals the dense one."""
    model = load_block_model(folders["llada2"], dtype=torch.float64)
    ids = torch.tensor(_ids(16, 3))
    dense = model.forward_dense(ids)
    kv = BlockKV.empty(model.cfg, 16, torch.float64, torch.device("cpu"))
    first = model.forward_rows([RowsWork(ids[:8], 0, kv, logit_from=4)])[0]
    assert torch.allclose(first, dense[4:8], atol=1e-10)
    second = model.forward_rows([RowsWork(ids[8:16], 8, kv)])[0]  # two blocks at once, against 8 cached rows
    assert torch.allclose(second, dense[8:16], atol=1e-10)


@pytest.mark.parametrize("q_start,m,chunk", [(0, 23, 512), (0, 23, 8), (8, 12, 4), (5, 11, 8)])
def test_block_attention_equals_the_dense_block_mask(q_start, m, chunk):
    g = torch.Generator().manual_seed(0)
    N = q_start + m
    q = torch.randn(m, 4, 8, generator=g)
    k, v = torch.randn(N, 2, 8, generator=g), torch.randn(N, 2, 8, generator=g)
    got = block_causal_attention(q, k, v, q_start, B, chunk_rows=chunk)
    mask = block_causal_mask_dense(N, B)[q_start:]
    want = sdpa_batched(q[None], k[None], v[None], mask[None, None])[0]
    assert torch.allclose(got, want, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashInfer's block-causal path needs CUDA")
def test_flashinfer_block_attention_equals_torch():
    pytest.importorskip("flashinfer")
    from bicache_sgl.attention.block_flashinfer import block_causal_attention_flashinfer
    g = torch.Generator(device="cuda").manual_seed(0)
    for q_start, m in ((0, 200), (64, 32)):
        N = q_start + m
        q = torch.randn(m, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(N, 2, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(N, 2, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        got = block_causal_attention_flashinfer(q, k, v, q_start, 32, chunk_rows=64)
        want = block_causal_attention(q.float(), k.float(), v.float(), q_start, 32)
        assert (got.float() - want).abs().max() < 3e-2


def _published(name: str, folder: str, cfg, prompt: list[int], gen: int, **kw) -> list[int]:
    ref = load_block_reference(folder)

    def fn(ids):
        return reference_block_logits(ref, ids, B)

    if name == "sdar":
        return sdar_generate(fn, prompt, mask_id=cfg.mask_token_id, stop_ids=cfg.eos_token_ids, gen_length=gen,
                             block_length=B, denoising_steps=kw.get("steps", cfg.decode.steps),
                             confidence_threshold=kw.get("threshold", cfg.decode.threshold))
    return llada2_generate(fn, prompt, mask_id=cfg.mask_token_id, eos_id=cfg.eos_token_ids[0], gen_length=gen,
                           block_length=B, steps=kw.get("steps", cfg.decode.steps),
                           threshold=kw.get("threshold", cfg.decode.threshold))


@pytest.mark.parametrize("name,plen,gen,kw", [
    ("llada2", 5, 7, {}),  # prompt tail shares a block with the answer; gen not a block multiple
    ("llada2", 8, 6, {"threshold": 0.3}),  # aligned prompt; threshold transfers several per step
    ("llada2", 3, 9, {"steps": 2, "threshold": 0.99}),  # steps < block length: two tokens per step
    ("sdar", 6, 7, {}),
    ("sdar", 4, 6, {"threshold": 0.3}),
])
def test_decoding_is_token_identical_to_the_published_generate(folders, name, plen, gen, kw):
    model = load_block_model(folders[name], dtype=torch.float64)
    prompt = _ids(plen, plen + gen)
    got = BlockEngine(model).run([prompt], BlockParams(max_new_tokens=gen, **kw))[0]
    want = _published(name, folders[name], model.cfg, prompt, gen, **kw)
    assert got.tokens == want
    assert len(got.tokens) == gen  # no EOS in this vocabulary's draws: the full length


def test_eos_stops_at_its_block_as_published(tmp_path, folders):
    """With a frequently generated token (195) as EOS, generation stops after the block holding it
    and the answer is cut after it, as the published loop does; the same weights with another
    EOS id decode the same tokens and go on (more forwards)."""
    folder = make_tiny_llada2(tmp_path / "eos", block_length=B, eos_token_id=195)
    model = load_block_model(folder, dtype=torch.float64)
    same_weights = load_block_model(folders["llada2"], dtype=torch.float64)
    for seed in (101, 105):  # prompts whose answers reach 195 (found by running them)
        prompt = _ids(6, seed)
        res = BlockEngine(model).run([prompt], BlockParams(max_new_tokens=12, threshold=0.3))[0]
        assert res.tokens == _published("llada2", folder, model.cfg, prompt, 12, threshold=0.3)
        assert res.tokens[-1] == 195 and 195 not in res.tokens[:-1] and res.meta["finish_reason"] == "stop"
        on = BlockEngine(same_weights).run([prompt], BlockParams(max_new_tokens=12, threshold=0.3))[0]
        assert on.tokens[:len(res.tokens)] == res.tokens and len(on.tokens) == 12
        assert res.meta["forwards"] < on.meta["forwards"]


@pytest.mark.parametrize("name", ["llada2", "sdar"])
def test_batched_requests_at_different_blocks_equal_alone(folders, name):
    model = load_block_model(folders[name])
    prompts = [_ids(n, 50 + n) for n in (3, 9, 14, 4)]
    params = [BlockParams(max_new_tokens=g) for g in (5, 11, 3, 8)]
    together = BlockEngine(model, BlockEngineOptions(prefix_cache=False)).run(prompts, params)
    alone = [BlockEngine(model, BlockEngineOptions(prefix_cache=False)).run([p], q)[0]
             for p, q in zip(prompts, params)]
    assert [r.tokens for r in together] == [r.tokens for r in alone]


def test_kv_budget_admission_waits_and_answers_are_unchanged(folders):
    """A budget that holds one request's window at a time: the others wait (no second buffer is
    allocated, the windows and the cache never exceed it), and every answer and its reuse equal an
    unbounded engine's; a request larger than the whole budget is refused at submit."""
    model = load_block_model(folders["llada2"])
    prompts = [_ids(9, 70 + i) for i in range(3)]
    params = BlockParams(max_new_tokens=7)  # 9 + 7 = 16 positions: a window of 16 (B = 4)
    free = BlockEngine(model).run(prompts, params)
    eng = BlockEngine(model, BlockEngineOptions(kv_budget=16 + 4))
    rids = [eng.submit(p, params) for p in prompts]
    eng.step()
    assert (eng.num_running, eng.num_waiting) == (1, 2)
    while any(r not in eng.done for r in rids):
        eng.step()
        assert eng.num_running <= 1 and eng.kv_in_use <= 20
    assert eng.num_waiting == 0
    assert [eng.done[r].tokens for r in rids] == [r.tokens for r in free]
    assert [eng.done[r].meta["cached_tokens"] for r in rids] == [r.meta["cached_tokens"] for r in free]
    with pytest.raises(ValueError, match="K/V budget of 20"):
        eng.submit(_ids(9, 1), BlockParams(max_new_tokens=12))  # 24 positions


def test_kv_budget_evicts_the_prefix_cache_before_admission_waits(folders):
    """A cache grown while nothing ran is evicted (least recently used leaves first) to admit a
    request instead of making it wait; the blocks it reuses go last, so its reuse is kept."""
    model = load_block_model(folders["llada2"])
    old, kept = _ids(12, 90), _ids(12, 91)
    params = BlockParams(max_new_tokens=8)  # windows of 20 positions; 16 of them committed at the end
    eng = BlockEngine(model, BlockEngineOptions(kv_budget=40))
    eng.run([old], params)
    eng.run([kept], params)  # its prompt blocks evict two of old's while it runs, its end adds one
    assert eng.cache.n_tokens == 24
    rid = eng.submit(kept, params)
    eng.step()  # admitted at once: 20 + 24 > 40, so one cached block (old's, the older) went first
    assert eng.num_running == 1 and eng.cache.n_tokens == 20 and eng.kv_in_use == 40
    while rid not in eng.done:
        eng.step()
    again = eng.done[rid]
    assert again.meta["cached_tokens"] == 12  # its own three prompt blocks were kept
    assert len(eng.cache.of(B).match(old, 12)) == 1
    ref = BlockEngine(model, BlockEngineOptions(prefix_cache=False)).run([kept], params)[0]
    assert again.tokens == ref.tokens


def test_prefix_cache_shrink_takes_lru_leaves_and_keeps_paths():
    cache = BlockPrefixCache(block_length=2, max_blocks=10)
    k = torch.zeros(1, 8, 1, 2)
    cache.insert([1, 1, 2, 2, 3, 3], 6, k, k)
    cache.insert([1, 1, 4, 4, 5, 5, 6, 6], 8, k, k)  # shares the first block
    assert cache.n_blocks == 6
    assert cache.shrink(3) == 3  # the older branch goes first, deepest first: (3,3), (2,2), then (6,6)
    assert len(cache.match([1, 1, 4, 4, 5, 5], 6)) == 3 and len(cache.match([1, 1, 2, 2], 4)) == 1
    assert cache.insert([1, 1, 7, 7], 4, k, k, room=2) == 1 and cache.n_blocks == 2
    assert len(cache.match([1, 1, 7, 7], 4)) == 2  # the path just inserted is kept


def test_prefix_cache_matches_whole_blocks_and_evicts_lru():
    cache = BlockPrefixCache(block_length=2, max_blocks=3)
    k = torch.arange(2 * 6).float().view(1, 6, 1, 2)
    assert cache.insert([1, 2, 3, 4, 5, 6], 6, k, k) == 3
    assert len(cache.match([1, 2, 3, 4, 9, 9], 6)) == 2  # stops at the first differing block
    assert len(cache.match([1, 2, 3, 4, 5], 5)) == 2  # a partial block never matches
    got = cache.match([1, 2, 3, 4], 4)
    assert torch.equal(got[1][0], k[:, 2:4])
    cache.insert([7, 7, 8, 8], 4, k, k)  # 5 blocks > 3: the least recently used leaves go
    assert cache.n_blocks == 3 and len(cache.match([7, 7, 8, 8], 4)) == 2
    cache.flush()
    assert cache.n_blocks == 0 and cache.match([7, 7], 2) == []


def test_config_errors_name_the_key(folders):
    raw = json.loads((__import__("pathlib").Path(folders["llada2"]) / "config.json").read_text())
    for key, value, match in (("num_hidden_layers", None, "num_hidden_layers"),
                              ("score_function", "softmax", "score_function"),
                              ("norm_head", True, "norm_head"), ("topk_group", 9, "n_group"),
                              ("partial_rotary_factor", 0.1, "rotary dim")):
        bad = dict(raw)
        bad[key] = value
        with pytest.raises(CheckpointError, match=match):
            parse_block_config(bad)


# ---- exact reuse: the differential test -----------------------------------------------------------

_ENGINES: dict = {}


def _engine_pair(folder: str):
    if folder not in _ENGINES:
        model = load_block_model(folder)
        _ENGINES[folder] = model
    model = _ENGINES[folder]
    return (BlockEngine(model, BlockEngineOptions(prefix_cache=True, cache_blocks=64)),
            BlockEngine(model, BlockEngineOptions(prefix_cache=False)))


_event = st.one_of(
    st.tuples(st.just("batch"), st.lists(st.tuples(st.integers(0, 2), st.integers(0, 9), st.integers(1, 9),
                                                   st.sampled_from([None, None, 8])),  # the request's block length
                                         min_size=1, max_size=3)),
    st.tuples(st.just("turn"), st.tuples(st.integers(0, 5), st.integers(1, 9))),
    st.just(("flush",)),
)


@pytest.mark.parametrize("name", ["llada2", "sdar"])
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(events=st.lists(_event, min_size=2, max_size=5), data=st.data())
def test_exact_reuse_equals_cache_off(folders, name, events, data):
    """Shared prefixes of every length (3 roots x cut points, aligned or not), batches mixing
    block lengths (the model's and a request's 8: reuse never crosses them), multi-turn turns
    (prompt + answer + new text) and flushes: cache on == cache off, token for token; the reused
    span is [0, R) with R a multiple of the request's block length, at full depth."""
    on, off = _engine_pair(folders[name])
    L = on.cfg.n_layers
    roots = [_ids(13, 700 + i) for i in range(3)]
    history: list[list[int]] = []
    for ev in events:
        if ev[0] == "flush":
            on.flush_cache()
            continue
        if ev[0] == "batch":
            prompts = [roots[r][:cut + 3] + _ids(extra % 3, r * 10 + extra) for r, cut, extra, _ in ev[1]]
            gens, lengths = [g for _, _, g, _ in ev[1]], [bl for *_, bl in ev[1]]
        else:
            if not history:
                continue
            prev = history[data.draw(st.integers(0, len(history) - 1))]
            prompts, gens = [prev + _ids(ev[1][0] + 1, 900 + ev[1][0])], [ev[1][1]]
            lengths = [data.draw(st.sampled_from([None, 8]))]
        params = [BlockParams(max_new_tokens=g, block_length=bl) for g, bl in zip(gens, lengths)]
        got = on.run(prompts, params)
        want = [off.run([p], q)[0] for p, q in zip(prompts, params)]
        for p, q, r_on, r_off in zip(prompts, params, got, want):
            assert r_on.tokens == r_off.tokens
            R, b = r_on.meta["cached_tokens"], q.block_length or B
            assert r_on.meta["block_length"] == b
            assert R % b == 0 and (len(p) // b) * b >= R and r_on.meta["reused_span"] == [0, R]
            assert r_on.meta["bicache_depth"] == (L if R else 0)
            history.append(p + r_on.tokens)


@pytest.mark.parametrize("name", ["llada2", "sdar"])
def test_multi_turn_reuses_the_answer_blocks(folders, name):
    """The second turn (prompt + answer + new text) reuses the first turn's committed answer
    blocks, not only its prompt, and still equals cache off."""
    on, off = _engine_pair(folders[name])
    first = _ids(8, 11)
    a1 = on.run([first], BlockParams(max_new_tokens=12))[0]
    second = first + a1.tokens + _ids(3, 12)
    r2 = on.run([second], BlockParams(max_new_tokens=5))[0]
    assert r2.tokens == off.run([second], BlockParams(max_new_tokens=5))[0].tokens
    assert r2.meta["cached_tokens"] > len(first)  # answer blocks came from the cache
    assert r2.meta["computed_rows"] < off.run([second], BlockParams(max_new_tokens=5))[0].meta["computed_rows"]


@pytest.mark.parametrize("shared", [8, 9, 11, 12])
def test_reused_span_is_the_shared_whole_blocks(folders, shared):
    """Two prompts sharing their first ``shared`` tokens: the second reuses floor(shared / B) * B
    of them (a partial shared block is recomputed), at depth L, and answers as cache off."""
    on, off = _engine_pair(folders["llada2"])
    on.flush_cache()
    base = _ids(16, 31)
    a = base[:shared] + _ids(5, 32)
    b = base[:shared] + [(t + 1) % 256 for t in _ids(5, 33)]
    on.run([a], BlockParams(max_new_tokens=4))
    r = on.run([b], BlockParams(max_new_tokens=4))[0]
    assert r.meta["cached_tokens"] == (shared // B) * B and r.meta["bicache_depth"] == on.cfg.n_layers
    assert r.tokens == off.run([b], BlockParams(max_new_tokens=4))[0].tokens


@pytest.mark.parametrize("name", ["llada2", "sdar"])
def test_bf16_forward_tracks_the_reference(folders, name):
    """bf16 weights and activations (router in fp32, RoPE in fp32): within bf16's precision of the
    float64 reference, and the same argmax on most positions."""
    model = load_block_model(folders[name], dtype=torch.bfloat16)
    ids = _ids(14, 5)
    want = reference_block_logits(load_block_reference(folders[name]), ids, B)
    got = model.forward_dense(torch.tensor(ids)).double()
    assert (got - want).abs().max().item() < 0.1 * want.abs().max().item()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.85


@pytest.mark.parametrize("plen,gen,thr,edit", [(5, 5, 0.7, 0.0), (8, 8, 0.3, 0.0)])
def test_llada21_token_editing_is_token_identical_to_the_joint_rule(folders, plen, gen, thr, edit):
    """LLaDA2.1's token editing (SGLang's JointThreshold) against an independent re-statement on
    the float64 reference; the re-statement counts its edits, so the check cannot pass without
    any token-to-token edit."""
    from bicache_sgl.testing.block_generate import llada21_generate
    model = load_block_model(folders["llada2"], dtype=torch.float64)
    ref = load_block_reference(folders["llada2"])
    prompt = _ids(plen, 77 + plen)
    got = BlockEngine(model).run([prompt], BlockParams(max_new_tokens=gen, threshold=thr, edit_threshold=edit,
                                                       max_post_edit_steps=4))[0]
    want, edits = llada21_generate(lambda ids: reference_block_logits(ref, ids, B), prompt,
                                   mask_id=model.cfg.mask_token_id, eos_id=model.cfg.eos_token_ids[0], gen_length=gen,
                                   block_length=B, threshold=thr, edit_threshold=edit, max_post_edit_steps=4)
    assert got.tokens == want
    assert edits > 0


# ---- per-request block length, cache_mode none ----------------------------------------------------

@pytest.mark.parametrize("name,plen,gen", [("sdar", 6, 13), ("sdar", 8, 9), ("llada2", 5, 11)])
def test_request_block_length_decodes_as_the_published_generate_with_it(folders, name, plen, gen):
    """SDAR's (and LLaDA2's) published generate takes block_length: a request with block_length 8
    on a checkpoint of block length 4 decodes as the re-stated generate with block_length 8 (its
    blocks, its block-causal attention), which differs from the answer at 4."""
    model = load_block_model(folders[name], dtype=torch.float64)
    cfg = model.cfg
    ref = load_block_reference(folders[name])
    prompt = _ids(plen, 40 + plen)

    def published(bl: int) -> list[int]:
        def fn(ids):
            return reference_block_logits(ref, ids, bl)
        if name == "sdar":
            return sdar_generate(fn, prompt, mask_id=cfg.mask_token_id, stop_ids=cfg.eos_token_ids, gen_length=gen,
                                 block_length=bl, denoising_steps=cfg.decode.steps,
                                 confidence_threshold=cfg.decode.threshold)
        return llada2_generate(fn, prompt, mask_id=cfg.mask_token_id, eos_id=cfg.eos_token_ids[0], gen_length=gen,
                               block_length=bl, steps=cfg.decode.steps, threshold=cfg.decode.threshold)

    got = BlockEngine(model).run([prompt], BlockParams(max_new_tokens=gen, block_length=8))[0]
    assert got.meta["block_length"] == 8
    assert got.tokens == published(8)
    assert published(8) != published(B)  # the block length changes this answer


@pytest.mark.parametrize("name", ["llada2", "sdar"])
def test_reuse_is_keyed_by_block_length(folders, name):
    """The same prompt at block length 4, then 8, then 8 again, then 4 again: a request reuses only
    blocks computed with its own block length (the first at 8 reuses nothing, though the 4-blocks
    of its prompt are cached), and every answer equals cache off."""
    on, off = _engine_pair(folders[name])
    on.flush_cache()
    prompt = _ids(19, 77)
    seen = []
    for bl in (None, 8, 8, None):
        p = BlockParams(max_new_tokens=6, block_length=bl)
        r = on.run([prompt], p)[0]
        assert r.tokens == off.run([prompt], p)[0].tokens
        seen.append(r.meta["cached_tokens"])
    assert seen == [0, 0, 16, 16]
    assert on.cache.lengths == [4, 8]


def test_caches_of_two_block_lengths_share_one_budget(folders):
    """Under a K/V budget the caches of every block length together stay within what the running
    windows leave; admitting a request evicts the other length's blocks before its own."""
    model = load_block_model(folders["sdar"])
    eng = BlockEngine(model, BlockEngineOptions(kv_budget=48))
    a, b = _ids(16, 5), _ids(32, 6)
    eng.run([a], BlockParams(max_new_tokens=4, block_length=8))  # window 24; caches its 2 committed 8-blocks
    assert eng.cache.n_tokens == 16 and eng.cache.of(8).n_tokens == 16
    rid = eng.submit(b, BlockParams(max_new_tokens=4))  # window 36: 12 left, so one 8-block goes
    eng.step()
    assert eng.cache.of(8).n_tokens == 8 and eng.kv_in_use <= 48
    while rid not in eng.done:
        eng.step()
        assert eng.kv_in_use <= 48
    r = eng.done[rid]
    assert r.tokens == BlockEngine(model, BlockEngineOptions(prefix_cache=False)).run(
        [b], BlockParams(max_new_tokens=4))[0].tokens


@pytest.mark.parametrize("name", ["llada2", "sdar"])
def test_use_cache_false_neither_reuses_nor_stores(folders, name):
    """cache_mode "none" (BlockParams.use_cache False): the request reuses no cached block though
    its prompt is cached, stores none of its own (a later request of its prompt finds nothing
    beyond what others stored), and answers as cache off."""
    on, off = _engine_pair(folders[name])
    on.flush_cache()
    shared, own = _ids(12, 90), _ids(12, 91)
    on.run([shared], BlockParams(max_new_tokens=4))
    r = on.run([shared], BlockParams(max_new_tokens=4, use_cache=False))[0]
    assert r.meta["cached_tokens"] == 0
    assert r.tokens == off.run([shared], BlockParams(max_new_tokens=4))[0].tokens
    before = on.cache.n_tokens
    on.run([own], BlockParams(max_new_tokens=4, use_cache=False))
    assert on.cache.n_tokens == before
    assert on.run([own], BlockParams(max_new_tokens=4))[0].meta["cached_tokens"] == 0
