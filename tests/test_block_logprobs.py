"""Logprobs of block-diffusion models (docs/block_diffusion.md, section 5), on tiny LLaDA2 / SDAR
checkpoints in the real formats:

- output logprobs equal the float64 reference's log-softmax at the step that wrote each token
  (the re-statements of the published loops record it, ``testing/block_generate.py``), and
  differ from the block's final state, so a value recorded at another step would fail;
- input logprobs equal the reference's one scoring forward (scored positions masked together,
  everything before clean); with the exact prefix cache supplying the clean blocks they are the
  same and fewer rows are computed;
- over the real server: native ``/generate`` logprob fields, the SGLang frontend's ``select``
  (its choice is the one with the highest normalized logprob computed directly on the reference)
  and ``gen`` with ``return_logprob``, OpenAI completions with ``logprobs`` + ``echo`` and chat
  ``logprobs`` / ``top_logprobs``.
"""

from __future__ import annotations

import json
import urllib.request

import pytest
import torch
from reliability_support import sse_frames

from bicache_sgl.blockdiff.engine import BlockEngine, BlockEngineOptions, BlockParams
from bicache_sgl.decoding.logprobs import Logprobs
from bicache_sgl.models.block_model import load_block_model
from bicache_sgl.reference import load_block_reference, reference_block_logits
from bicache_sgl.runtime import Runtime, http_json
from bicache_sgl.testing.block import make_tiny_llada2, make_tiny_sdar
from bicache_sgl.testing.block_generate import llada2_generate, llada21_generate, sdar_generate

B = 4
TOL = 1e-5  # the model's logits are fp32 (float64 weights): the reference agrees to ~1e-7

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: one thread (tests/conftest.py)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("blocklp")
    return {"llada2": make_tiny_llada2(root / "llada2", block_length=B), "sdar": make_tiny_sdar(root / "sdar",
                                                                                             block_length=B)}


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(engine: BlockEngine, prompt: list[int], params: BlockParams, top_n: int = 0, start: int = -1):
    rec = Logprobs(top_n, None, False)
    rid = engine.submit(prompt, params, rec, start)
    while rid not in engine.done:
        engine.step()
    return engine.done.pop(rid), rec


def _scored(ref: dict, ids: list[int], start: int, mask_id: int) -> list[float | None]:
    """The reference's input logprobs of positions [start, n): one forward with [max(start, 1), n)
    masked together; position 0 has none."""
    s = max(start, 1)
    x = list(ids[:s]) + [mask_id] * (len(ids) - s)
    lsm = torch.log_softmax(reference_block_logits(ref, x, B), dim=-1)
    return [None if i == 0 else float(lsm[i, ids[i]]) for i in range(start, len(ids))]


@pytest.mark.parametrize("name,plen,gen,kw", [
    ("llada2", 5, 7, {}),  # prompt tail shares a block; one token per step (4 steps per block)
    ("llada2", 6, 10, {"steps": 2, "threshold": 0.99}),  # two tokens per step
    ("sdar", 6, 6, {}),
    ("llada21", 5, 7, {"threshold": 0.7, "edit_threshold": 0.0, "max_post_edit_steps": 4}),  # token editing
])
def test_output_logprobs_equal_the_reference_at_the_writing_step(folders, name, plen, gen, kw):
    folder = folders["sdar" if name == "sdar" else "llada2"]
    model = load_block_model(folder, dtype=torch.float64)
    ref = load_block_reference(folder)
    cfg = model.cfg
    prompt = _ids(plen, 31 + plen)
    res, rec = _run(BlockEngine(model), prompt, BlockParams(max_new_tokens=gen, **kw), top_n=3)
    trace: dict[int, float] = {}
    fn = lambda ids: reference_block_logits(ref, ids, B)  # noqa: E731
    if name == "llada2":
        want = llada2_generate(fn, prompt, mask_id=cfg.mask_token_id, eos_id=cfg.eos_token_ids[0], gen_length=gen,
                               block_length=B, steps=kw.get("steps", cfg.decode.steps),
                               threshold=kw.get("threshold", cfg.decode.threshold), trace=trace)
    elif name == "sdar":
        want = sdar_generate(fn, prompt, mask_id=cfg.mask_token_id, stop_ids=cfg.eos_token_ids, gen_length=gen,
                             block_length=B, denoising_steps=cfg.decode.steps,
                             confidence_threshold=cfg.decode.threshold, trace=trace)
    else:
        want, edits = llada21_generate(fn, prompt, mask_id=cfg.mask_token_id, eos_id=cfg.eos_token_ids[0],
                                       gen_length=gen, block_length=B, threshold=kw["threshold"],
                                       edit_threshold=kw["edit_threshold"],
                                       max_post_edit_steps=kw["max_post_edit_steps"], trace=trace)
        assert edits > 0  # the last write of some position is an edit
    assert res.tokens == want
    meta = rec.meta(plen, res.tokens)
    got = meta["output_token_logprobs"]
    assert [e[1] for e in got] == res.tokens and meta["output_token_logprobs_length"] == gen
    for i, (lp, _, _) in enumerate(got):
        assert abs(lp - trace[plen + i]) < TOL, (i, lp, trace[plen + i])
    # greedy: the written token was the step's most likely one, so it heads its top list
    for (lp, tok, _), top in zip(got, meta["output_top_logprobs"]):
        assert len(top) == 3 and top[0][1] == tok and abs(top[0][0] - lp) < 1e-12
        assert top[0][0] >= top[1][0] >= top[2][0]
    # the check discriminates: the block's final state (every block committed) gives other values
    final = torch.log_softmax(reference_block_logits(ref, prompt + res.tokens, B), dim=-1)
    moved = max(abs(float(final[plen + i, t]) - trace[plen + i]) for i, t in enumerate(res.tokens))
    assert moved > 1e-3


def test_output_logprobs_follow_the_top_k_filter(folders):
    """Sampling with top_k 1 keeps only the most likely token: its logprob in the filtered
    distribution (the one reported, as the bidirectional engine does) is exactly 0 (unfiltered,
    about -4 on this model)."""
    model = load_block_model(folders["llada2"])
    prompt = _ids(6, 4)
    res, rec = _run(BlockEngine(model), prompt, BlockParams(max_new_tokens=6, temperature=1.0, top_k=1, seed=0))
    assert [e[0] for e in rec.meta(6, res.tokens)["output_token_logprobs"]] == [0.0] * 6


@pytest.mark.parametrize("name", ["llada2", "sdar"])
@pytest.mark.parametrize("start", [-1, 0, 5, 8, 10])
def test_input_logprobs_equal_the_reference_scoring_forward(folders, name, start):
    """A prefill-only request (select's choices) scores [start, n), every position for start -1
    (as the bidirectional engine); a generating request with start >= 0 reports the same input
    logprobs and decodes the same tokens as without logprobs."""
    model = load_block_model(folders[name], dtype=torch.float64)
    ref = load_block_reference(folders[name])
    prompt = _ids(11, 5)  # blocks [0, 4), [4, 8), [8, 11)
    res, rec = _run(BlockEngine(model, BlockEngineOptions(prefix_cache=False)), prompt,
                    BlockParams(max_new_tokens=0), start=start)
    assert res.tokens == [] and res.meta["finish_reason"] == "length"
    got = rec.meta(11, [])["input_token_logprobs"]
    want = _scored(ref, prompt, max(start, 0), model.cfg.mask_token_id)
    assert [e[1] for e in got] == prompt[max(start, 0):]
    assert len(got) == len(want)
    for (lp, _, _), w in zip(got, want):
        assert (lp is None and w is None) or abs(lp - w) < TOL
    if start < 0:
        return
    plain = BlockEngine(model).run([prompt], BlockParams(max_new_tokens=6))[0]
    gen, rec2 = _run(BlockEngine(model), prompt, BlockParams(max_new_tokens=6), start=start)
    assert gen.tokens == plain.tokens
    packed = rec2.meta(11, gen.tokens)["input_token_logprobs"]  # scored in the decode's first forward
    assert [e[1] for e in packed] == [e[1] for e in got]
    # fp32 logits: the packed forward's batch shape picks other GEMM kernels on some CPUs (2e-8 seen)
    assert all((x[0] is None and y[0] is None) or abs(x[0] - y[0]) < TOL for x, y in zip(packed, got))


def test_scoring_reuses_the_cached_clean_blocks_exactly(folders):
    """SGLang's select first sends the prefix with max_new_tokens 0 (it fills the exact block
    cache), then each choice scored from near the prefix's end: the clean whole blocks before the
    first scored position come from the cache (fewer rows computed) and the logprobs are those of
    computing them."""
    model = load_block_model(folders["llada2"], dtype=torch.float64)
    prompt = _ids(11, 9)
    eng = BlockEngine(model)
    warm = eng.run([prompt[:9]], BlockParams(max_new_tokens=0))[0]  # no logprobs: caches blocks [0, 8)
    assert warm.meta["computed_rows"] == 8
    hit, rec = _run(eng, prompt, BlockParams(max_new_tokens=0), start=9)
    assert hit.meta["cached_tokens"] == 8
    assert hit.meta["computed_rows"] == 3  # the scoring rows [8, 11); the prompt's whole blocks were cached
    cold, rec_cold = _run(BlockEngine(model, BlockEngineOptions(prefix_cache=False)), prompt,
                          BlockParams(max_new_tokens=0), start=9)
    assert cold.meta["computed_rows"] == 8 + 11
    a, b = rec.meta(11, [])["input_token_logprobs"], rec_cold.meta(11, [])["input_token_logprobs"]
    assert [e[1] for e in a] == [e[1] for e in b] == prompt[9:]
    assert max(abs(x[0] - y[0]) for x, y in zip(a, b)) < 1e-10


# ---- over the real server ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = make_tiny_llada2(tmp_path_factory.mktemp("srvlp") / "llada2", block_length=B)
    with Runtime(model_path=folder, num_threads=1, timeout=120) as rt:
        yield rt, folder


@pytest.fixture(scope="module")
def tok_ref(server):
    from transformers import AutoTokenizer
    _, folder = server
    return AutoTokenizer.from_pretrained(folder), load_block_reference(folder), load_block_model(folder).cfg


def test_generate_returns_logprob_fields_equal_to_the_offline_engine(server, tok_ref):
    rt, folder = server
    tok, ref, cfg = tok_ref
    ids = tok("Logprobs of a block model.")["input_ids"]
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 6, "temperature": 0}, "return_logprob": True,
            "logprob_start_len": 0, "top_logprobs_num": 2, "return_text_in_logprobs": True}
    out = http_json(f"{rt.url}/generate", body)
    m = out["meta_info"]
    offline, rec = _run(BlockEngine(load_block_model(folder), BlockEngineOptions(prefix_cache=False)), ids,
                        BlockParams(max_new_tokens=6), top_n=2, start=0)
    n_out = len(out["output_ids"])
    assert [e[1] for e in m["output_token_logprobs"]] == out["output_ids"] == offline.tokens[:n_out]
    want = rec.meta(len(ids), out["output_ids"])
    for key in ("input_token_logprobs", "output_token_logprobs"):
        assert len(m[key]) == len(want[key])
        for g, w in zip(m[key], want[key]):
            assert g[1] == w[1] and isinstance(g[2], str)
            assert (g[0] is None and w[0] is None) or abs(g[0] - w[0]) < 1e-4
    assert m["input_token_logprobs"][0][0] is None and len(m["input_token_logprobs"]) == len(ids)
    assert all(len(t) == 2 for t in m["output_top_logprobs"]) and m["input_top_logprobs"][0] is None
    # the input entries are the reference's scoring forward
    for g, w in zip(m["input_token_logprobs"][1:], _scored(ref, ids, 1, cfg.mask_token_id)):
        assert abs(g[0] - w) < 1e-4
    # streaming: every frame (one per finished block) carries the logprobs of its output so far
    req = urllib.request.Request(f"{rt.url}/generate", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        frames = [f for f in sse_frames(resp) if f != "[DONE]"]
    assert len(frames) >= 2
    for f in frames:
        assert [e[1] for e in f["meta_info"]["output_token_logprobs"]] == f["output_ids"]
    last = frames[-1]["meta_info"]["output_token_logprobs"]  # fp32: the cached prompt blocks round differently
    assert [e[1:] for e in last] == [e[1:] for e in m["output_token_logprobs"]]
    assert all(abs(g[0] - w[0]) < 1e-4 for g, w in zip(last, m["output_token_logprobs"]))


def test_sglang_select_picks_the_highest_normalized_logprob(server, tok_ref):
    sgl = pytest.importorskip("sglang")
    from sglang.lang.choices import token_length_normalized, unconditional_likelihood_normalized
    rt, _ = server
    tok, ref, cfg = tok_ref
    choices = ["yes", "no", "maybe so"]

    @sgl.function
    def program(s, method):
        s += "Q: Is the sky blue?\nA:"
        s += sgl.gen("reason", max_tokens=6, temperature=0, return_logprob=True, top_logprobs_num=2)
        s += "\nVerdict: " + sgl.select("verdict", choices=choices, choices_method=method)

    sgl.set_default_backend(sgl.RuntimeEndpoint(rt.url))
    try:
        state = program.run(method=token_length_normalized)
        assert state.error() is None, state.error()
        gen_meta = state.get_meta_info("reason")
        assert len(gen_meta["output_token_logprobs"]) == gen_meta["completion_tokens"] > 0
        assert all(len(t) == 2 for t in gen_meta["output_top_logprobs"])
        # the direct computation on the float64 reference, with the frontend's rule: choices
        # scored from two tokens before the prefix's end, the first entry dropped when the
        # prefix ends with its text (token healing), the mean of the non-null values
        prefix = state.text()[:-len(state["verdict"])]
        start = max(len(tok(prefix)["input_ids"]) - 2, 0)
        direct = []
        for c in choices:
            ids = tok(prefix + c)["input_ids"]
            lps = _scored(ref, ids, start, cfg.mask_token_id)
            if prefix.endswith(tok.decode([ids[start]])):
                lps = lps[1:]
            vals = [v for v in lps if v]
            direct.append(sum(vals) / len(vals))
        got = state.get_meta_info("verdict")["normalized_prompt_logprobs"]
        assert max(abs(g - d) for g, d in zip(got, direct)) < 1e-4
        ranked = sorted(direct, reverse=True)
        assert ranked[0] - ranked[1] > 1e-3  # a clear winner: the choice below is meaningful
        assert state["verdict"] == choices[direct.index(ranked[0])]
        # the method that also scores each choice alone (input_ids, whole prompt)
        state2 = program.run(method=unconditional_likelihood_normalized)
        assert state2.error() is None and state2["verdict"] in choices
        assert len(state2.get_meta_info("verdict")["normalized_prompt_logprobs"]) == 3
    finally:
        sgl.set_default_backend(None)


def test_openai_completions_echo_logprobs_and_chat_logprobs(server, tok_ref):
    openai = pytest.importorskip("openai")
    rt, folder = server
    tok, ref, cfg = tok_ref
    client = openai.OpenAI(base_url=f"{rt.url}/v1", api_key="none")
    prompt = "Echo this prompt."
    r = client.completions.create(model=folder, prompt=prompt, max_tokens=5, temperature=0, logprobs=2, echo=True)
    lp = r.choices[0].logprobs
    ids = tok(prompt)["input_ids"]
    n_out = r.usage.completion_tokens
    assert len(lp.tokens) == len(ids) + n_out and lp.token_logprobs[0] is None
    assert r.choices[0].text.startswith(prompt)
    # echo: entry i is log p(token_i | tokens before it), positions i.. masked (left to right)
    for i in range(1, len(ids)):
        assert abs(lp.token_logprobs[i] - _scored(ref, ids, i, cfg.mask_token_id)[0]) < 1e-4
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[len(ids):])
    assert all(1 <= len(t) <= 2 for t in lp.top_logprobs[len(ids):])

    c = client.chat.completions.create(model=folder, messages=[{"role": "user", "content": "Hi."}], max_tokens=5,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens > 0
    assert all(e.logprob <= 0 and len(e.top_logprobs) == 2 for e in content)
    assert all(abs(e.top_logprobs[0].logprob - e.logprob) < 1e-9 for e in content)  # greedy: the top token
