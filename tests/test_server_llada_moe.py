"""A tiny LLaDA-MoE checkpoint served through every client (issue 29): raw HTTP (SGLang's native
API), the ``openai`` package and the ``sglang`` frontend, on one real server subprocess with
bicache on (a given profile, so no first-run calibration). The full protocol suite is
tests/test_server_live.py on LLaDA; this checks the MoE family end to end: recognised and loaded
from its folder, generation and prefix reuse, the family's chat template and end-of-turn token."""

from __future__ import annotations

import json

import pytest

requests = pytest.importorskip("requests")

BLOCK = 8
NAME = "tiny-llada-moe"
SHARED = "System: answer briefly. Examples follow.\nQ: a\nA: 1\n\n" * 3


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from bicache_sgl.runtime import Runtime
    from bicache_sgl.testing import make_tiny_llada_moe

    folder = tmp_path_factory.mktemp("server_llada_moe")
    model = make_tiny_llada_moe(folder / "model")
    profile = folder / "profile.json"
    profile.write_text(json.dumps({"n_layers": 4, "table": [[0, 0], [10, 2], [40, 3]]}))
    rt = Runtime(model_path=model, block_length=BLOCK, threshold="none", context_length=384,
                 max_running_requests=8, num_threads=1, bicache_profile=str(profile), served_model_name=NAME,
                 timeout=180, log_path=str(folder / "server.log"))
    rt.model_path = model
    yield rt
    rt.shutdown()


@pytest.fixture(scope="module")
def tokenizer(server):
    from bicache_sgl.models.loader import load_tokenizer
    return load_tokenizer(server.model_path)


def gen(server, payload):
    r = requests.post(server.url + "/generate", json=payload, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_raw_http_generation_and_prefix_reuse(server):
    info = requests.get(server.url + "/get_model_info", timeout=30).json()
    assert info["model_type"] == "llada_moe" and info["n_layers"] == 4
    sp = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    first = gen(server, {"text": SHARED + "Q: b\nA:", "sampling_params": sp})
    assert len(first["output_ids"]) == 16 and first["meta_info"]["finish_reason"]["type"] == "length"
    again = gen(server, {"text": SHARED + "Q: c\nA:", "sampling_params": sp})
    assert again["meta_info"]["cached_tokens"] > len(SHARED) // 2
    assert again["meta_info"]["bicache_depth"] >= 1  # the profile's depth for this reuse fraction
    batch = gen(server, {"text": ["x", SHARED + "Q: d\nA:"], "sampling_params": sp})
    assert [len(o["output_ids"]) for o in batch] == [16, 16]


def test_the_family_end_of_turn_token_ends_a_generation(server, tokenizer):
    role_end = tokenizer.convert_tokens_to_ids("<|role_end|>")
    out = gen(server, {"text": "Q: stop?\nA:", "sampling_params": {"max_new_tokens": 16, "temperature": 0,
                                                                   "logit_bias": {str(role_end): 50.0}}})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": role_end}
    assert len(out["output_ids"]) < 16


def test_openai_completion_and_chat_with_the_family_template(server, tokenizer):
    openai = pytest.importorskip("openai")
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in oai.models.list().data] == [NAME]
    r = oai.completions.create(model=NAME, prompt="Once upon a time", max_tokens=8, temperature=0,
                               extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 8 and r.choices[0].finish_reason == "length"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    r = oai.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0)
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered.startswith("<role>SYSTEM</role>Be brief.<|role_end|><role>HUMAN</role>Hi there")
    assert r.usage.prompt_tokens == len(tokenizer.encode(rendered))
    assert r.choices[0].message.role == "assistant"


def test_sglang_frontend_gen_and_select(server):
    sgl = pytest.importorskip("sglang")
    sgl.set_default_backend(server.endpoint)
    try:
        @sgl.function
        def program(s):
            s += "Q: Is the sky blue?\nA:" + sgl.gen("reason", max_tokens=8, temperature=0)
            s += "\nVerdict: " + sgl.select("verdict", choices=["yes", "no"])
            s += "\nDigits: " + sgl.gen("digits", max_tokens=4, regex="[0-9]+")

        state = program.run()
        state.sync()
        assert state.error() is None
        assert state["verdict"] in ("yes", "no") and state["digits"].isdigit()
        assert state.get_meta_info("reason")["completion_tokens"] <= 8
    finally:
        sgl.set_default_backend(None)
