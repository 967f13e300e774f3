"""Dream's generation algorithms (issue 15, section 2): the unmasking algorithms of Dream's
``diffusion_generate`` against an independent re-implementation of the published algorithm
written here, their composition with blocks / caches / threshold decoding, the request and
flag plumbing, and Dream checkpoints as published (a remote tokenizer class, generation_config.json).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from bicache_sgl import Engine
from bicache_sgl.attention import create_backend
from bicache_sgl.config import ALGORITHMS, DecodeDefaults, EngineConfig, SamplingParams
from bicache_sgl.decoding import (
    dream_decide,
    dream_next_transfer,
    dream_select,
    dream_timesteps,
    dream_transfer_count,
)
from bicache_sgl.decoding.plan import DecodePlan
from bicache_sgl.io_struct import GenerateRequest
from bicache_sgl.kv_cache.manager import CacheGrant
from bicache_sgl.kv_cache.store import KVStore
from bicache_sgl.models.config import CheckpointError
from bicache_sgl.models.forward_batch import ForwardBatch
from bicache_sgl.models.loader import (
    GenerationDefaults,
    generation_defaults,
    load_model,
    load_model_config,
    load_tokenizer,
)
from bicache_sgl.scheduler.factory import RequestFactory
from bicache_sgl.scheduler.request import Req

CPU = torch.device("cpu")
G = 32  # generation length of the exactness runs
TEXTS = ["The quick brown fox", "Q: what is 2+2?\nA:", "x"]


# ----------------------------------------------------------------------------------------------
# the published algorithm, re-implemented from its description (plain torch, dense forward)
# ----------------------------------------------------------------------------------------------

def reference_generate(model, mask_id: int, prompt: list[int], gen_len: int, steps: int, alg: str, *,
                       eps: float = 1e-3, seed: int = 0, block_length: int | None = None) -> tuple[list[int], int, int]:
    """Dream's ``diffusion_generate`` for one prompt, greedy (temperature 0, no top-p/top-k,
    alg_temp 0): prompt + ``gen_len`` masks; ``steps`` steps over timesteps linspace(1, eps,
    steps + 1); each step one dense forward, logits shifted right by one position; ``origin``
    unmasks each masked position with probability 1 - s/t (a float32 uniform per masked position,
    from a generator seeded with ``seed``), the others unmask int(n_masked * (1 - s/t)) of the
    masked positions (all at the last step) with the highest confidence (top-1 probability /
    top-1 minus top-2 / negative entropy), over the full distribution, mask token included.

    ``block_length`` (not in the reference): the same loop per block, left to right, over the
    masked positions of the block only, ``steps // n_blocks`` steps each (what the server does
    with blocks). Returns (generated ids, forwards that changed something, times the mask token
    was the decision)."""
    x = torch.tensor(list(prompt) + [mask_id] * gen_len)
    P = len(prompt)
    block = block_length or gen_len
    n_blocks = gen_len // block
    spb = max(1, steps // n_blocks)
    g = torch.Generator().manual_seed(seed)
    useful = picked_mask = 0
    for b in range(n_blocks):
        in_block = torch.zeros(len(x), dtype=torch.bool)
        in_block[P + b * block:P + (b + 1) * block] = True
        ts = torch.linspace(1, eps, spb + 1)
        for i in range(spb):
            mask = (x == mask_id) & in_block
            if not bool(mask.any()):
                break
            logits = model.forward_dense(x)
            logits = torch.cat([logits[:1], logits[:-1]], dim=0)
            probs = torch.softmax(logits[mask], dim=-1)
            t, s = ts[i], ts[i + 1]
            if alg == "origin":
                p_transfer = 1 - s / t if i < spb - 1 else 1
                transfer = torch.rand(probs.shape[0], generator=g) < p_transfer
                x0 = torch.full((probs.shape[0],), mask_id)
                x0[transfer] = probs[transfer].max(dim=-1).indices
                picked_mask += int((x0[transfer] == mask_id).sum())
                useful += bool(transfer.any())
                x[mask] = x0
                continue
            conf, x0 = probs.max(dim=-1)
            if alg == "topk_margin":
                top = torch.sort(probs, dim=-1, descending=True).values
                conf = top[:, 0] - top[:, 1]
            elif alg == "entropy":
                conf = (probs * torch.log(probs + 1e-10)).sum(-1)
            n_masked = mask.sum() / 1  # float32, as the reference's batch mean over one row
            k = int(n_masked * (1 - s / t)) if i < spb - 1 else int(n_masked)
            if k > 0:
                full = torch.full(x.shape, float("-inf"))
                full[mask] = conf
                idx = torch.topk(full, k).indices
                cand = torch.full_like(x, mask_id)
                cand[mask] = x0
                picked_mask += int((cand[idx] == mask_id).sum())
                x[idx] = cand[idx]
                useful += 1
    return x[P:].tolist(), useful, picked_mask


def run_req(model, cfg, tok, prompt: list[int], params: SamplingParams, decode: DecodeDefaults,
            generation: GenerationDefaults | None = None) -> tuple[list[int], Req]:
    """Drive one Req through the batched forward (the engine's path, without the engine): the
    whole generation region, EOS and all (no end ids)."""
    plan = DecodePlan.resolve(params, decode, generation or generation_defaults(cfg))
    req = Req(GenerateRequest(list(prompt), params), plan, mask_id=cfg.mask_token_id, eos_ids=(),
              logit_shift=cfg.logit_shift, tokenizer=tok, on_event=None, seed=0)
    return drive(model, cfg, req)


def drive(model, cfg, req: Req) -> tuple[list[int], Req]:
    store, kvs = KVStore.for_sequences(cfg, req.kv_lengths(), torch.float32, CPU)
    req.admit(kvs, CacheGrant())  # no cache: the empty grant (reuses nothing)
    attn = create_backend("torch", CPU)
    while not req.finished:
        works = req.plan_step(cfg.n_layers)
        fb = ForwardBatch(works, CPU, store).build(cfg.n_layers)
        logits = model.forward_batch(fb, attn)
        ip = fb.logit_indptr
        req.apply([logits[ip[i]:ip[i + 1]] for i in range(len(works))], cfg.n_layers)
    return req.x[req.prompt_len:].tolist(), req


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: one thread (tests/conftest.py)


@pytest.fixture(scope="module")
def dream(tiny_dream):
    model, cfg = load_model(tiny_dream, "float32")
    tok = load_tokenizer(tiny_dream)
    return model, cfg, tok, [tok.encode(t) for t in TEXTS]


EXACT = DecodeDefaults(block_length=G, threshold=None, cache_mode="none")


def _params(alg: str, steps: int, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=G, temperature=0.0, dllm_algorithm=alg, steps=steps, **kw)


# ----------------------------------------------------------------------------------------------
# exactness: one block over the region, no cache, no threshold, greedy fp32
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("alg", ["maskgit_plus", "topk_margin", "entropy"])
@pytest.mark.parametrize("steps", [G, 12, 48])  # one per token, fewer (several per step), more (idle steps)
def test_greedy_equals_reference(dream, alg, steps):
    model, cfg, tok, prompts = dream
    for prompt in prompts:
        want, useful, picked_mask = reference_generate(model, cfg.mask_token_id, prompt, G, steps, alg)
        assert picked_mask == 0  # the reference never chose [MASK] here (the one case the server differs)
        got, req = run_req(model, cfg, tok, prompt, _params(alg, steps), EXACT)
        assert got == want
        # a step that unmasks nothing costs no forward here (the reference runs it)
        assert req.forward_passes == useful <= steps


@pytest.mark.parametrize("seed", [0, 7])
def test_origin_with_a_fixed_seed_equals_reference(dream, seed):
    """``origin`` draws one float32 uniform per masked position per step from the request's
    generator; greedy decisions draw nothing else, so the same seed gives the same run."""
    model, cfg, tok, prompts = dream
    for steps in (G, 12):
        for prompt in prompts[:2]:
            want, useful, picked_mask = reference_generate(model, cfg.mask_token_id, prompt, G, steps, "origin",
                                                           seed=seed)
            assert picked_mask == 0
            got, req = run_req(model, cfg, tok, prompt, _params("origin", steps, seed=seed), EXACT)
            assert got == want and req.forward_passes == useful


def test_engine_with_the_flags_equals_reference(tiny_dream, dream):
    """Through the engine (server defaults as --dllm-algorithm, --block-length G, --cache-mode
    none, --threshold 0), the answer is the reference's tokens up to the first end token."""
    model, cfg, _, prompts = dream
    eng = Engine(config=EngineConfig(model_path=tiny_dream, dtype="float32", prefix_cache="off", num_threads=1,
                                     decode=DecodeDefaults(block_length=G, threshold=0.0, cache_mode="none",
                                                           dllm_algorithm="entropy")))
    try:
        ends = set(eng.eos_ids)
        for prompt in prompts:
            want, _, _ = reference_generate(model, cfg.mask_token_id, prompt, G, 16, "entropy")
            cut = next((i for i, t in enumerate(want) if t in ends), len(want))
            out = eng.generate(input_ids=prompt, sampling_params={"max_new_tokens": G, "temperature": 0, "steps": 16})
            assert out["output_ids"] == want[:cut]
        # the request's own algorithm wins over the server's
        want, _, _ = reference_generate(model, cfg.mask_token_id, prompts[0], G, 16, "topk_margin")
        cut = next((i for i, t in enumerate(want) if t in ends), len(want))
        out = eng.generate(input_ids=prompts[0], sampling_params={"max_new_tokens": G, "temperature": 0, "steps": 16,
                                                                   "dllm_algorithm": "topk_margin"})
        assert out["output_ids"] == want[:cut]
    finally:
        eng.shutdown()


# ----------------------------------------------------------------------------------------------
# composition: blocks, in-request caches, threshold decoding, alg_temp, LLaDA
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("alg", ["maskgit_plus", "entropy", "origin"])
def test_blocks_run_the_schedule_per_block(dream, alg):
    """block_length < region: Dream's schedule inside each block, left to right, steps split
    evenly over the blocks (not the reference's output: later blocks stay masked meanwhile)."""
    model, cfg, tok, prompts = dream
    d = DecodeDefaults(block_length=8, threshold=None, cache_mode="none")
    for prompt in prompts[:2]:
        want, useful, _ = reference_generate(model, cfg.mask_token_id, prompt, G, 24, alg, seed=3, block_length=8)
        got, req = run_req(model, cfg, tok, prompt, _params(alg, 24, seed=3), d)
        assert got == want and req.forward_passes == useful


@pytest.mark.parametrize("mode", ["prefix", "dual"])
def test_caches_refreshed_every_step_equal_no_cache(dream, mode):
    """The in-request caches only approximate the logits: refreshed at every step they are exact,
    so the same positions and tokens are chosen; refreshed at block starts only they still
    finish every block with as many forwards (the schedule does not depend on the logits)."""
    model, cfg, tok, prompts = dream
    for alg in ("maskgit_plus", "topk_margin"):
        base = DecodeDefaults(block_length=16, threshold=None, cache_mode="none")
        ref, r0 = run_req(model, cfg, tok, prompts[0], _params(alg, 16), base)
        fresh = DecodeDefaults(block_length=16, threshold=None, cache_mode=mode, refresh_interval=1)
        got, r1 = run_req(model, cfg, tok, prompts[0], _params(alg, 16), fresh)
        assert got == ref and r1.forward_passes == r0.forward_passes
        stale = DecodeDefaults(block_length=16, threshold=None, cache_mode=mode)
        got, r2 = run_req(model, cfg, tok, prompts[0], _params(alg, 16), stale)
        assert cfg.mask_token_id not in got and r2.forward_passes == r0.forward_passes
        assert r2.tokens_computed < r0.tokens_computed


def test_threshold_replaces_the_schedule(dream):
    """With a threshold every position at or above it (on [0, 1]: probability, margin,
    exp(-entropy)) is unmasked, at least the most confident one per step; origin ignores it."""
    model, cfg, tok, prompts = dream
    for alg in ("maskgit_plus", "topk_margin", "entropy"):
        none_pass = DecodeDefaults(block_length=G, threshold=1.0, cache_mode="none")  # nothing reaches 1
        got, req = run_req(model, cfg, tok, prompts[0], _params(alg, 4), none_pass)
        assert req.forward_passes == G and cfg.mask_token_id not in got  # exactly one per step
        all_pass = DecodeDefaults(block_length=G, threshold=1e-9, cache_mode="none")
        got, req = run_req(model, cfg, tok, prompts[0], _params(alg, 4), all_pass)
        assert req.forward_passes == 1 and cfg.mask_token_id not in got
    exact, r0 = run_req(model, cfg, tok, prompts[0], _params("origin", 12, seed=1), EXACT)
    got, r1 = run_req(model, cfg, tok, prompts[0], _params("origin", 12, seed=1),
                      DecodeDefaults(block_length=G, threshold=0.5, cache_mode="none"))
    assert got == exact and r1.forward_passes == r0.forward_passes


def test_alg_temp_and_sampling_are_seeded(dream):
    model, cfg, tok, prompts = dream
    runs = {}
    for seed in (1, 1, 2):
        p = _params("entropy", 16, seed=seed, dllm_alg_temp=0.5).replace(temperature=0.8, top_p=0.9, top_k=40)
        runs.setdefault(seed, []).append(run_req(model, cfg, tok, prompts[0], p, EXACT)[0])
    assert runs[1][0] == runs[1][1] != runs[2][0]
    assert all(cfg.mask_token_id not in r for v in runs.values() for r in v)


def test_dream_algorithms_on_llada_and_llada_algorithms_on_dream(tiny_llada, dream):
    model, cfg, tok, prompts = dream
    got, req = run_req(model, cfg, tok, prompts[0], _params("low_confidence", G), EXACT)
    assert cfg.mask_token_id not in got and req.forward_passes == G  # LLaDA's: one per step
    lmodel, lcfg = load_model(tiny_llada, "float32")
    ltok = load_tokenizer(tiny_llada)
    ids = ltok.encode(TEXTS[0])
    d = DecodeDefaults(block_length=16, threshold=None, cache_mode="dual")
    for alg in ("origin", "maskgit_plus", "topk_margin", "entropy"):
        got, req = run_req(lmodel, lcfg, ltok, ids, _params(alg, 16, seed=2), d)
        assert len(got) == G and lcfg.mask_token_id not in got


def test_constrained_decoding_with_dream_algorithms(dream):
    """Under a regex every decision is the constrained path's token; Dream's algorithms (and
    their threshold variants) only choose which of its positions to unmask."""
    import re
    model, cfg, tok, prompts = dream
    rx = r"[0-9]{3}-[a-z]{2}"
    for alg in ("origin", "maskgit_plus", "topk_margin", "entropy"):
        for thr in (None, 0.5):
            f = RequestFactory(cfg, tok, (256,), DecodeDefaults(block_length=8, threshold=thr, cache_mode="dual"), 4096)
            sp = SamplingParams(max_new_tokens=16, temperature=0.0, dllm_algorithm=alg, steps=16, seed=4, regex=rx)
            _, req = drive(model, cfg, f.build(GenerateRequest(prompts[0], sp), None))
            assert req.finish_reason["type"] in ("stop", "length") and re.fullmatch(rx, req.text), (alg, thr, req.text)


def test_schedule_primitives():
    ts = dream_timesteps(4, 1e-3)
    assert ts.dtype == torch.float32 and len(ts) == 5 and ts[0] == 1 and abs(float(ts[-1]) - 1e-3) < 1e-9
    counts, n = [], 10
    for i in range(4):
        k = dream_transfer_count(n, i, ts)
        assert 0 <= k <= n
        counts.append(k)
        n -= k
    assert sum(counts) == 10 and n == 0 and counts[0] == int(10 * (1 - float(ts[1])))
    assert dream_transfer_count(5, 3, ts) == 5  # the last step takes every one
    g = torch.Generator().manual_seed(0)
    for _ in range(200):  # the vectorized skip-ahead finds the step the step-by-step walk finds
        steps = int(torch.randint(1, 300, (1,), generator=g))
        ts = dream_timesteps(steps, float(torch.rand(1, generator=g)) * 0.5 + 1e-4)
        n, i = int(torch.randint(1, 64, (1,), generator=g)), int(torch.randint(0, steps, (1,), generator=g))
        j = i
        while dream_transfer_count(n, j, ts) == 0:
            j += 1
        assert dream_next_transfer(n, i, ts) == (j, dream_transfer_count(n, j, ts))
    assert dream_select(torch.tensor([0.1, 0.9, 0.5]), 2, 0.0, None).tolist() == [1, 2]
    assert dream_select(torch.tensor([0.1, 0.9]), 0, 0.0, None).numel() == 0
    # the mask token is never the decision, but stays in the confidence's distribution
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0]])
    x0, conf, lp = dream_decide(logits, algorithm="maskgit_plus", temperature=0.0, top_k=-1, top_p=1.0,
                                mask_id=1, generator=None)
    probs = torch.softmax(logits, -1)
    assert x0.tolist() == [2, 0] and torch.allclose(conf, probs[[0, 1], [2, 0]])
    assert torch.isfinite(lp).all()
    _, margin, _ = dream_decide(logits, algorithm="topk_margin", temperature=0.0, top_k=-1, top_p=1.0, mask_id=1,
                                generator=None)
    top = probs.sort(-1, descending=True).values
    assert torch.allclose(margin, top[:, 0] - top[:, 1])


# ----------------------------------------------------------------------------------------------
# parameters: requests, flags, the 400 listing the valid names, OpenAI passthrough
# ----------------------------------------------------------------------------------------------

def test_request_parameters_and_errors():
    p = SamplingParams.from_dict({"dllm_algorithm": "Entropy", "eps": 0.01, "alg_temp": 0, "steps": 64})
    assert (p.dllm_algorithm, p.dllm_eps, p.dllm_alg_temp, p.steps) == ("entropy", 0.01, 0.0, 64)
    # one knob, one field: the wire names are aliases, and sending both spellings is refused
    assert SamplingParams.from_dict({"dllm_eps": 0.01, "dllm_alg_temp": 0.5}) == \
        SamplingParams.from_dict({"eps": 0.01, "alg_temp": 0.5})
    with pytest.raises(ValueError, match="eps and dllm_eps are one setting"):
        SamplingParams.from_dict({"eps": 0.01, "dllm_eps": 0.02})
    assert SamplingParams.from_dict({"dllm_algorithm": "LowConfidence"}).dllm_algorithm == "low_confidence"
    with pytest.raises(ValueError) as e:
        SamplingParams.from_dict({"dllm_algorithm": "speculative"})
    assert all(a in str(e.value) for a in ALGORITHMS)
    for bad in ({"eps": 0}, {"eps": 1.5}, {"alg_temp": -1}, {"eps": "x"}):
        with pytest.raises(ValueError, match="eps|alg_temp"):
            SamplingParams.from_dict(bad)
    assert SamplingParams().temperature is None and SamplingParams().resolved().temperature == 1.0

    from bicache_sgl.server.fields import check_chat_body, check_completion_body
    from bicache_sgl.server.protocol import APIError, parse_generate
    with pytest.raises(APIError) as e:
        parse_generate({"input_ids": [1, 2], "sampling_params": {"dllm_algorithm": "nope"}}, lambda t: [1],
                       context_length=64)
    assert e.value.status == 400 and "maskgit_plus" in e.value.message and "entropy" in e.value.message
    check_completion_body({"model": "m", "prompt": "a", "dllm_algorithm": "entropy", "eps": 0.01, "alg_temp": 0.1})
    check_chat_body({"model": "m", "messages": [], "dllm_algorithm": "origin"})


def test_server_flags(capsys):
    from bicache_sgl.server.args import parse_args
    a = parse_args(["--dllm-algorithm", "MaskGIT_Plus", "--dllm-eps", "0.01", "--dllm-alg-temp", "0.3"])
    d = a.engine_config().decode
    assert (d.dllm_algorithm, d.dllm_eps, d.dllm_alg_temp) == ("maskgit_plus", 0.01, 0.3)
    d = parse_args([]).engine_config().decode  # unset: the checkpoint's generation_config, else built-in
    assert (d.dllm_algorithm, d.dllm_eps, d.dllm_alg_temp) == (None, None, None)
    assert parse_args(["--remasking", "random"]).engine_config().decode.dllm_algorithm == "random"
    with pytest.raises(SystemExit):
        parse_args(["--dllm-algorithm", "Speculative"])
    err = capsys.readouterr().err
    assert "--dllm-algorithm Speculative is not implemented" in err and "topk_margin" in err
    with pytest.raises(SystemExit):
        parse_args(["--dllm-eps", "2"])


# ----------------------------------------------------------------------------------------------
# Dream checkpoints as published: remote tokenizer class, generation_config.json
# ----------------------------------------------------------------------------------------------

DREAM_CHAT = ("{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n{{ m['content'] }}"
              "<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n"
              "{% endif %}")


def _published_dream(src: str, dst, *, fast_file: bool = True, generation: dict | None = None) -> str:
    """A copy of a tiny Dream checkpoint with Dream's published tokenizer files: a
    tokenizer_config.json naming the remote DreamTokenizer (auto_map), its chat template and
    special tokens in the config, special_tokens_map.json, tokenization_dream.py, vocab.json and
    merges.txt; tokenizer.json kept only with ``fast_file``."""
    dst.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(f"{src}/{f}", dst / f)
    tk = json.loads(Path(src, "tokenizer.json").read_text())
    added = {str(a["id"]): {"content": a["content"], "lstrip": False, "normalized": False, "rstrip": False,
                            "single_word": False, "special": True} for a in tk["added_tokens"]}
    (dst / "tokenizer_config.json").write_text(json.dumps({
        "add_bos_token": False, "add_prefix_space": False, "added_tokens_decoder": added,
        "additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>"],
        "auto_map": {"AutoTokenizer": ["tokenization_dream.DreamTokenizer", None]},
        "bos_token": "<|endoftext|>", "chat_template": DREAM_CHAT, "clean_up_tokenization_spaces": False,
        "eos_token": "<|endoftext|>", "errors": "replace", "mask_token": "<|mask|>", "model_max_length": 131072,
        "pad_token": "<|endoftext|>", "split_special_tokens": False, "tokenizer_class": "DreamTokenizer",
        "unk_token": None}))
    (dst / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "mask_token": "<|mask|>",
                                                             "pad_token": "<|endoftext|>"}))
    (dst / "tokenization_dream.py").write_text("raise RuntimeError('checkpoint code must never run')\n")
    (dst / "vocab.json").write_text(json.dumps(tk["model"]["vocab"]))
    (dst / "merges.txt").write_text("#version: 0.2\n")
    if fast_file:
        shutil.copy(f"{src}/tokenizer.json", dst / "tokenizer.json")
    if generation is not None:
        (dst / "generation_config.json").write_text(json.dumps(generation))
    return str(dst)


def test_remote_tokenizer_class_loads_from_tokenizer_json(tiny_dream, tmp_path):
    folder = _published_dream(tiny_dream, tmp_path / "dream")
    tok, ref = load_tokenizer(folder), load_tokenizer(tiny_dream)
    text = "héllo <|mask|> world"
    assert tok.encode(text) == ref.encode(text)
    assert (tok.eos_token, tok.mask_token, tok.pad_token) == ("<|endoftext|>", "<|mask|>", "<|endoftext|>")
    assert tok.convert_tokens_to_ids("<|mask|>") == ref.convert_tokens_to_ids("<|mask|>")
    assert "<|start_header_id|>" in tok.all_special_tokens
    assert tok.chat_template == DREAM_CHAT
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert rendered.startswith("<|start_header_id|>user") and rendered.endswith("assistant<|end_header_id|>\n")


def test_remote_tokenizer_class_without_tokenizer_json_is_a_clear_error(tiny_dream, tmp_path):
    folder = _published_dream(tiny_dream, tmp_path / "dream", fast_file=False)
    with pytest.raises(CheckpointError) as e:
        load_tokenizer(folder)
    msg = str(e.value)
    assert "DreamTokenizer" in msg and "tokenizer.json" in msg and "--tokenizer-path" in msg
    assert "trust-remote-code" in msg


GEN = {"_from_model_config": True, "alg": "entropy", "alg_temp": None, "bos_token_id": 256, "eos_token_id": 256,
       "eps": 0.01, "mask_token_id": None, "output_history": False, "pad_token_id": 256, "steps": 16,
       "temperature": 0.0, "top_k": None, "top_p": 0.95, "transformers_version": "4.46.2"}


def test_generation_config_defaults_and_precedence(tiny_dream, tmp_path, caplog):
    folder = _published_dream(tiny_dream, tmp_path / "dream", generation=GEN)
    cfg = load_model_config(folder)
    g = generation_defaults(cfg)
    assert g == GenerationDefaults(steps=16, algorithm="entropy", eps=0.01, alg_temp=None, temperature=0.0,
                                   top_p=0.95)
    assert generation_defaults(load_model_config(tiny_dream)) == GenerationDefaults()  # no file: nothing
    tok = load_tokenizer(folder)

    def plan(sp: dict, decode: DecodeDefaults | None = None):
        f = RequestFactory(cfg, tok, (256,), decode or DecodeDefaults(), 4096)
        r = f.build(GenerateRequest([65, 66], SamplingParams.from_dict({"max_new_tokens": 32, **sp})), None)
        return r.plan, r.params

    pl, p = plan({})  # generation_config over the built-in defaults
    assert (pl.algorithm, pl.eps, pl.alg_temp, pl.steps_per_block, p.temperature, p.top_p) == \
        ("entropy", 0.01, 0.0, 16, 0.0, 0.95)
    flags = DecodeDefaults(dllm_algorithm="topk_margin", dllm_eps=0.1, dllm_alg_temp=0.2, steps_per_block=4)
    pl, p = plan({}, flags)
    assert (pl.algorithm, pl.eps, pl.alg_temp, pl.steps_per_block) == ("topk_margin", 0.1, 0.2, 4)
    pl, p = plan({"dllm_algorithm": "origin", "eps": 0.2, "alg_temp": 0.5, "steps": 8, "temperature": 0.7,
                  "top_p": 1.0}, DecodeDefaults(dllm_algorithm="topk_margin", dllm_eps=0.1))  # the request over all
    assert (pl.algorithm, pl.eps, pl.alg_temp, pl.steps_per_block, p.temperature, p.top_p) == \
        ("origin", 0.2, 0.5, 8, 0.7, 1.0)
    pl, _ = plan({"remasking": "random"})  # a request's remasking is a request value too
    assert pl.algorithm == "random"
    with pytest.raises(ValueError, match="at most 65536 steps"):
        plan({"steps": 1 << 20})
    assert plan({"steps": 1 << 20, "dllm_algorithm": "low_confidence"})[0].steps_per_block == 32  # one per token

    # bad values are left out with a warning; a file that is not JSON is an error
    bad = dict(GEN, alg="apd", temperature=-1, steps=2.5, eps=0.05)
    (tmp_path / "dream" / "generation_config.json").write_text(json.dumps(bad))
    with caplog.at_level(logging.WARNING):
        g = generation_defaults(load_model_config(folder))
    assert g == GenerationDefaults(eps=0.05, top_p=0.95)
    assert "alg" in caplog.text and "temperature" in caplog.text
    (tmp_path / "dream" / "generation_config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="generation_config.json"):
        load_model_config(folder)


def test_engine_serves_a_published_dream_checkpoint(tiny_dream, tmp_path):
    """The whole folder as published loads without running its code, and its
    generation_config.json (greedy entropy, 16 steps) is what a bare request gets."""
    folder = _published_dream(tiny_dream, tmp_path / "dream", generation=dict(GEN, top_p=None))
    eng = Engine(folder, prefix_cache="off", block_length=G, threshold=0.0, cache_mode="none", dtype="float32",
                 num_threads=1)
    try:
        prompt = eng.tokenizer.encode(TEXTS[1])
        outs = [eng.generate(input_ids=prompt, sampling_params={"max_new_tokens": G, "seed": s})["output_ids"]
                for s in (1, 2)]
        assert outs[0] == outs[1]  # temperature 0 from generation_config: no seed dependence
        model, cfg = load_model(folder, "float32")
        want, _, _ = reference_generate(model, cfg.mask_token_id, prompt, G, 16, "entropy", eps=0.01)
        cut = next((i for i, t in enumerate(want) if t in set(eng.eos_ids)), len(want))
        assert outs[0] == want[:cut]
        sampled = {tuple(eng.generate(input_ids=prompt, sampling_params={"max_new_tokens": G, "seed": s,
                                                                         "temperature": 1.0})["output_ids"])
                   for s in (1, 2, 3)}
        assert len(sampled) > 1  # the request's temperature wins
    finally:
        eng.shutdown()


# ----------------------------------------------------------------------------------------------
# through the HTTP server: the flag, the per-request field on both APIs, the 400
# ----------------------------------------------------------------------------------------------

def test_live_server_flag_request_field_and_400(tiny_dream, tmp_path):
    requests = pytest.importorskip("requests")
    from bicache_sgl.runtime import Runtime

    folder = _published_dream(tiny_dream, tmp_path / "dream", generation=dict(GEN, top_p=None))
    with Runtime(model_path=folder, dllm_algorithm="maskgit_plus", block_length=G, threshold="0", cache_mode="none",
                 disable_radix_cache=True, dtype="float32", num_threads=1, skip_server_warmup=True, timeout=180,
                 log_path=str(tmp_path / "server.log")) as rt:
        model, cfg = load_model(folder, "float32")
        tok = load_tokenizer(folder)
        ids = tok.encode(TEXTS[0])
        ends = {256, 257}  # <|endoftext|>, <|eot_id|>
        for sp, alg in (({}, "maskgit_plus"), ({"dllm_algorithm": "topk_margin"}, "topk_margin")):
            r = requests.post(rt.url + "/generate", json={"input_ids": ids, "sampling_params": {
                "max_new_tokens": G, "steps": 16, **sp}}, timeout=120)
            assert r.status_code == 200, r.text
            want, _, _ = reference_generate(model, cfg.mask_token_id, ids, G, 16, alg, eps=0.01)
            cut = next((i for i, t in enumerate(want) if t in ends), len(want))
            assert r.json()["output_ids"] == want[:cut]  # greedy: generation_config's temperature 0
        r = requests.post(rt.url + "/v1/completions", json={"model": folder, "prompt": TEXTS[0], "max_tokens": G,
                                                            "dllm_algorithm": "origin", "alg_temp": 0.0, "seed": 3},
                          timeout=120)
        assert r.status_code == 200, r.text
        r = requests.post(rt.url + "/generate", json={"text": "a", "sampling_params": {"dllm_algorithm": "nope"}},
                          timeout=30)
        assert r.status_code == 400 and all(a in r.text for a in ALGORITHMS)
