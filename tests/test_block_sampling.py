"""Logit processing, structured generation and n > 1 for the block-diffusion families (LLaDA2.x,
SDAR) on tiny checkpoints in the real formats (docs/block_diffusion.md, section 5;
docs/structured.md, "Block-diffusion models").

- each knob (logit_bias, the three penalties, min_p, min_new_tokens, ignore_eos) changes the output
  where it should, and cache on == cache off with it set;
- regex and JSON-schema outputs fully match on LLaDA2 (with and without LLaDA2.1's token editing)
  and SDAR over several prompts, batched with unconstrained requests (batched == alone); a
  constraint no output fits aborts with a message naming max_new_tokens;
- over the real HTTP server: an SGLang frontend program with ``sgl.gen(regex=...)``, an OpenAI
  ``response_format`` json_schema call, penalties and ``n`` = 2.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from transformers import AutoTokenizer

from bicache_sgl.blockdiff.engine import BlockEngine, BlockEngineOptions, BlockParams
from bicache_sgl.blockdiff.sampling import BlockSampler
from bicache_sgl.constrained import compile_constraint
from bicache_sgl.models.block_model import load_block_model
from bicache_sgl.runtime import Runtime, http_json
from bicache_sgl.testing.block import make_tiny_llada2, make_tiny_sdar

B = 4
REGEX = r"[0-9]{2,4}-[a-z]+"
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"},
                                           "tag": {"type": "string", "maxLength": 3}},
          "required": ["n", "ok", "tag"]}

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: one thread (tests/conftest.py)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("blocksamp")
    out = {}
    for name, folder in (("llada2", make_tiny_llada2(root / "llada2", block_length=B)),
                         ("sdar", make_tiny_sdar(root / "sdar", block_length=B))):
        out[name] = (load_block_model(folder), AutoTokenizer.from_pretrained(folder))
    return out


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPTS = [_ids(n, 10 + n) for n in (5, 9, 3, 12)]


def _run(model, prompts, params, cache: bool = False):
    return BlockEngine(model, BlockEngineOptions(prefix_cache=cache)).run(prompts, params)


def _repeats(results) -> int:
    return sum(len(r.tokens) - len(set(r.tokens)) for r in results)


# ---- logit processing -------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["llada2", "sdar"])
def test_logit_bias_forces_its_token_and_a_ban_removes_one(models, name):
    model, _ = models[name]
    base = _run(model, PROMPTS, BlockParams(max_new_tokens=8))
    t = 77
    assert all(t not in r.tokens for r in base)  # the forced token is not there without the bias
    forced = _run(model, PROMPTS, BlockParams(max_new_tokens=8, logit_bias=((t, 100.0),)))
    assert all(r.tokens == [t] * 8 for r in forced)
    top = max((x for r in base for x in r.tokens), key=lambda x: sum(r.tokens.count(x) for r in base))
    banned = _run(model, PROMPTS, BlockParams(max_new_tokens=8, logit_bias=((top, -100.0),)))
    assert all(top not in r.tokens for r in banned)


@pytest.mark.parametrize("name", ["llada2", "sdar"])
@pytest.mark.parametrize("knob", [{"frequency_penalty": 2.0}, {"presence_penalty": 2.0},
                                  {"repetition_penalty": 2.0}])
def test_penalties_reduce_repeats(models, name, knob):
    model, _ = models[name]
    base = _run(model, PROMPTS, BlockParams(max_new_tokens=16))
    pen = _run(model, PROMPTS, BlockParams(max_new_tokens=16, **knob))
    assert _repeats(base) >= 20  # the tiny random models repeat a lot
    assert _repeats(pen) < _repeats(base) / 4


@pytest.mark.parametrize("name", ["llada2", "sdar"])
def test_min_p_one_makes_sampling_seed_independent(models, name):
    model, _ = models[name]

    def out(seed, **kw):
        return [r.tokens for r in _run(model, PROMPTS, BlockParams(max_new_tokens=8, temperature=1.0, seed=seed,
                                                                   **kw))]
    assert out(1) != out(2)
    assert out(1, min_p=1.0) == out(2, min_p=1.0)


def test_min_new_tokens_and_ignore_eos_keep_eos_out(tmp_path):
    """With a frequently generated token (195) as EOS the answers stop early; min_new_tokens keeps
    EOS out of its first positions, ignore_eos out of all of them (the whole length is output)."""
    model = load_block_model(make_tiny_llada2(tmp_path / "eos", block_length=B, eos_token_id=195))
    prompts = [_ids(6, s) for s in (101, 105)]  # answers that reach 195 (tests/test_block_diffusion.py)
    base = _run(model, prompts, BlockParams(max_new_tokens=12, threshold=0.3))
    assert all(r.meta["finish_reason"] == "stop" and len(r.tokens) < 10 for r in base)
    early = _run(model, prompts, BlockParams(max_new_tokens=12, threshold=0.3, min_new_tokens=10))
    assert all(195 not in r.tokens[:10] and len(r.tokens) >= 10 for r in early)
    never = _run(model, prompts, BlockParams(max_new_tokens=12, threshold=0.3, ignore_eos=True, stop_ids=()))
    assert all(195 not in r.tokens and len(r.tokens) == 12 for r in never)


KNOBS = [{"logit_bias": ((77, 3.0), (195, -2.0))}, {"frequency_penalty": 1.0}, {"presence_penalty": 0.7},
         {"repetition_penalty": 1.6}, {"min_p": 0.3, "temperature": 1.0, "seed": 5}, {"min_new_tokens": 7}]


@pytest.mark.parametrize("name", ["llada2", "sdar"])
@pytest.mark.parametrize("knob", KNOBS, ids=lambda k: next(iter(k)))
def test_cache_on_equals_cache_off_with_the_knob(models, name, knob):
    """A warm exact block cache (the shared prefix's blocks reused at full depth) gives the same
    tokens as no cache with each knob set: processing never changes what is reused."""
    model, _ = models[name]
    shared = _ids(11, 3)
    prompts = [shared + _ids(k, 40 + k) for k in (2, 5, 6)]
    params = BlockParams(max_new_tokens=10, **knob)
    off = _run(model, prompts, params)
    eng = BlockEngine(model, BlockEngineOptions(prefix_cache=True))
    eng.run([shared + [1, 2]], BlockParams(max_new_tokens=4))
    on = eng.run(prompts, params)
    assert [r.tokens for r in on] == [r.tokens for r in off]
    assert all(r.meta["cached_tokens"] >= 8 for r in on)


# ---- structured generation --------------------------------------------------------------------

def _constraint(name, models, kind):
    model, tok = models[name]
    spec = REGEX if kind == "regex" else json.dumps(SCHEMA)
    return compile_constraint(kind, spec, tok, end_ids=model.cfg.eos_token_ids)


def _text(tok, model, tokens) -> str:
    eos = set(model.cfg.eos_token_ids)
    cut = next((i for i, t in enumerate(tokens) if t in eos), len(tokens))
    return tok.decode(tokens[:cut])


def _check(kind: str, text: str) -> None:
    if kind == "regex":
        assert re.fullmatch(REGEX, text), text
    else:
        obj = json.loads(text)
        assert set(obj) == {"n", "ok", "tag"} and isinstance(obj["n"], int) and isinstance(obj["ok"], bool)
        assert isinstance(obj["tag"], str) and len(obj["tag"]) <= 3


@pytest.mark.parametrize("name,edit", [("llada2", None), ("llada2", 0.0), ("sdar", None)])
@pytest.mark.parametrize("kind", ["regex", "json_schema"])
def test_structured_outputs_fully_match_and_batched_equals_alone(models, name, edit, kind):
    """Several prompts (aligned to blocks and not), constrained and unconstrained requests in one
    batch: every constrained output fully matches, and every answer equals its run alone.
    ``edit`` 0.0: LLaDA2.1's token editing on (every confident disagreement is tried as an edit)."""
    model, tok = models[name]
    c = _constraint(name, models, kind)
    n = 16 if kind == "regex" else 40
    extra = {} if edit is None else {"edit_threshold": edit, "threshold": 0.3, "max_post_edit_steps": 4}
    cons = BlockParams(max_new_tokens=n, constraint=c, **extra)
    free = BlockParams(max_new_tokens=n, **extra)
    prompts = [_ids(k, 60 + k) for k in (4, 5, 8, 11)]
    params = [cons, free, cons, cons]
    together = _run(model, prompts, params)
    alone = [_run(model, [p], q)[0] for p, q in zip(prompts, params)]
    assert [r.tokens for r in together] == [r.tokens for r in alone]
    for r, q in zip(together, params):
        if q.constraint is not None:
            assert r.meta["finish_reason"] != "abort", r.meta
            _check(kind, _text(tok, model, r.tokens))
            assert r.structured.finished(r.tokens, {"type": "stop"}) == {"type": "stop"}
    assert not re.fullmatch(REGEX, _text(tok, model, together[1].tokens))  # unconstrained: free text


def test_token_edits_under_a_constraint_keep_only_viable_ones(models):
    """LLaDA2.1's token-to-token edits under the regex [0-9]{2,4}-[a-z]+: on the output "12__"
    (two masks left), "1" -> "a" would leave the constraint and is not kept, "2" -> "3" is; the
    window itself is left as it was."""
    model, tok = models["llada2"]
    c = _constraint("llada2", models, "regex")
    one, two, three, a = (tok.encode(ch, add_special_tokens=False)[0] for ch in "123a")
    mask = model.cfg.mask_token_id
    prompt = _ids(B, 4)  # one whole prompt block: the block [4, 8) is all output
    sampler = BlockSampler(BlockParams(max_new_tokens=12, constraint=c), prompt, mask_id=mask,
                           eos_ids=model.cfg.eos_token_ids, vocab_size=model.cfg.vocab_size)
    x = torch.tensor(prompt + [one, two, mask, mask])
    before = x.clone()
    t2t = torch.tensor([True, True, False, False])
    keep = sampler.viable_edits(x, B, 2 * B, torch.zeros(4, dtype=torch.bool), t2t, torch.tensor([a, three, 0, 0]),
                                torch.tensor([0.9, 0.8, 0.0, 0.0]))
    assert keep.tolist() == [False, True, False, False]
    assert torch.equal(x, before)


@pytest.mark.parametrize("name", ["llada2", "sdar"])
def test_structured_cache_on_equals_cache_off(models, name):
    model, _ = models[name]
    c = _constraint(name, models, "json_schema")
    shared = _ids(9, 8)
    prompts = [shared + _ids(k, 90 + k) for k in (1, 3)]
    params = BlockParams(max_new_tokens=32, constraint=c, temperature=0.8, seed=3)
    off = _run(model, prompts, params)
    eng = BlockEngine(model, BlockEngineOptions(prefix_cache=True))
    eng.run([shared], BlockParams(max_new_tokens=4))
    on = eng.run(prompts, params)
    assert [r.tokens for r in on] == [r.tokens for r in off] and all(r.meta["cached_tokens"] == 8 for r in on)


def test_a_constraint_no_output_fits_aborts_with_the_reason(models):
    model, _ = models["llada2"]
    c = _constraint("llada2", models, "regex")  # needs at least 4 tokens
    r = _run(model, [_ids(5, 1)], BlockParams(max_new_tokens=2, constraint=c))[0]
    assert r.meta["finish_reason"] == "abort"
    assert "max_new_tokens=2" in r.meta["abort"]["message"] and r.tokens == []


# ---- over the HTTP server ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(URL, folder) of the real server on a tiny LLaDA2 folder."""
    folder = make_tiny_llada2(tmp_path_factory.mktemp("srv") / "llada2", block_length=B)
    with Runtime(model_path=folder, num_threads=1, timeout=120) as rt:
        yield rt.url, folder


def test_sglang_frontend_regex_and_openai_json_schema(server):
    url, folder = server
    sgl = pytest.importorskip("sglang")

    @sgl.function
    def code(s, question):
        s += "Question: " + question + "\nCode: "
        s += sgl.gen("code", max_tokens=12, regex=REGEX, temperature=0)
        s += "\nCount: " + sgl.gen("count", dtype=int, max_tokens=8, temperature=0)
        s += "\nRecord: " + sgl.gen("rec", max_tokens=40, json_schema=json.dumps(SCHEMA), temperature=0)

    sgl.set_default_backend(sgl.RuntimeEndpoint(url))
    states = code.run_batch([{"question": q} for q in ("one", "two", "three")], num_threads=3)
    assert all(st.error() is None for st in states), [str(st.error()) for st in states]
    assert all(re.fullmatch(REGEX, st["code"]) for st in states), [st["code"] for st in states]
    assert all(re.fullmatch(r"[-+]?[0-9]+", st["count"]) for st in states), [st["count"] for st in states]
    for st in states:
        _check("json_schema", st["rec"])

    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    for q in ("Give the record.", "Another one."):
        r = client.chat.completions.create(
            model=folder, messages=[{"role": "user", "content": q}], max_tokens=40, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "rec", "schema": SCHEMA}})
        _check("json_schema", r.choices[0].message.content)


def test_n_two_and_penalties_over_http(server):
    url, folder = server
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    r = client.completions.create(model=folder, prompt="Two samples:", max_tokens=8, temperature=1.0, n=2)
    assert len(r.choices) == 2 and {c.index for c in r.choices} == {0, 1}
    assert r.choices[0].text != r.choices[1].text  # each copy its own request and seed
    seeded = client.completions.create(model=folder, prompt="Two samples:", max_tokens=8, temperature=1.0, n=2,
                                       seed=7)
    assert seeded.choices[0].text == seeded.choices[1].text  # one seed for both, as the server sends it
    body = {"text": "Repeat after me", "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
    base = http_json(f"{url}/generate", body)
    body["sampling_params"].update(frequency_penalty=2.0, logit_bias={"77": -100})
    pen = http_json(f"{url}/generate", body)
    ids = pen["output_ids"]
    assert len(ids) - len(set(ids)) < len(base["output_ids"]) - len(set(base["output_ids"])) and 77 not in ids
    short = http_json(f"{url}/generate", {"text": "x", "sampling_params": {"max_new_tokens": 2, "regex": REGEX}})
    reason = short["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "max_new_tokens=2" in reason["message"] and short["output_ids"] == []
    many = http_json(f"{url}/generate", {"text": "x", "sampling_params": {"max_new_tokens": 4, "n": 2,
                                                                          "min_new_tokens": 4}})
    assert isinstance(many, list) and len(many) == 2 and all(len(m["output_ids"]) == 4 for m in many)


def test_min_new_tokens_past_max_new_tokens_is_400_naming_it_on_block_models(server):
    """The block-diffusion client checks the min_new_tokens rule the bidirectional engine checks
    (scheduler/validate.py check_min_new_tokens): over max_new_tokens is a 400 naming it."""
    import urllib.error

    url, _ = server
    with pytest.raises(urllib.error.HTTPError) as e:
        http_json(f"{url}/generate", {"text": "x", "sampling_params": {"max_new_tokens": 4, "min_new_tokens": 5}})
    assert e.value.code == 400
    assert json.loads(e.value.read())["error"]["message"].startswith("min_new_tokens must be in [0, max_new_tokens]")
