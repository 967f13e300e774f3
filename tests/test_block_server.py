"""The HTTP server on a tiny LLaDA2 folder (real format, real tokenizer): native /generate (its
output equals the offline block engine's), exact reuse reported in meta_info (whole blocks, full
depth) for a repeated prompt and for a second turn that repeats the first answer, streaming per
block, stop strings, the OpenAI client, an SGLang frontend program, and refusals that name the
field."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from bicache_sgl.blockdiff.engine import BlockEngine, BlockEngineOptions, BlockParams
from bicache_sgl.models.block_model import load_block_model
from bicache_sgl.runtime import Runtime, http_json
from bicache_sgl.testing.block import make_tiny_llada2, make_tiny_sdar

B = 4
PROMPT = "The block-diffusion server answers this prompt."


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = make_tiny_llada2(tmp_path_factory.mktemp("srv") / "llada2", block_length=B)
    with Runtime(model_path=folder, num_threads=1, timeout=120) as rt:
        yield rt, folder


def _url(rt) -> str:
    return rt.url if hasattr(rt, "url") else rt.endpoint


def _post(url: str, body: dict) -> tuple[int, dict]:
    try:
        return 200, http_json(url, body)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def test_generate_equals_the_offline_engine_and_reuse_is_exact(server):
    rt, folder = server
    url = _url(rt)
    from transformers import AutoTokenizer
    ids = AutoTokenizer.from_pretrained(folder)(PROMPT)["input_ids"]
    first = http_json(f"{url}/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 9, "temperature": 0}})
    offline = BlockEngine(load_block_model(folder), BlockEngineOptions(prefix_cache=False)).run(
        [ids], BlockParams(max_new_tokens=9))[0]
    # the server's output stops before the EOS id (SGLang's convention); the engine's answer keeps it
    want = offline.tokens[:-1] if offline.meta["finish_reason"] == "stop" else offline.tokens
    assert first["output_ids"] == want
    again = http_json(f"{url}/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 9, "temperature": 0}})
    assert again["output_ids"] == first["output_ids"]
    m = again["meta_info"]
    assert m["cached_tokens"] == (len(ids) // B) * B and m["bicache_depth"] == 3 and m["reused_prefix_start"] == 0
    assert m["prefix_reuse_rule"] == "exact-block"
    # a second turn repeating the first answer reuses blocks past the first prompt
    turn2 = ids + first["output_ids"] + ids[:5]
    r2 = http_json(f"{url}/generate", {"input_ids": turn2, "sampling_params": {"max_new_tokens": 5, "temperature": 0}})
    assert r2["meta_info"]["cached_tokens"] > (len(ids) // B) * B
    assert r2["meta_info"]["cached_tokens"] % B == 0


def test_info_metrics_and_flush_routes(server):
    rt, _ = server
    url = _url(rt)
    info = http_json(f"{url}/get_model_info")
    assert info["model_type"] == "llada2" and info["n_layers"] == 3
    stats = http_json(f"{url}/get_server_info")
    assert "block_prefix_cache_blocks" in json.dumps(stats)
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        assert r.status == 200
    req = urllib.request.Request(f"{url}/flush_cache", data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200
    again = http_json(f"{url}/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    assert again["meta_info"]["cached_tokens"] == 0  # the flush emptied the block cache


def test_streaming_emits_blocks_and_ends_with_the_full_answer(server):
    rt, _ = server
    url = _url(rt)
    body = {"text": PROMPT, "stream": True, "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
    req = urllib.request.Request(f"{url}/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    chunks = []
    with urllib.request.urlopen(req, timeout=60) as resp:
        for line in resp:
            line = line.decode().strip()
            if line.startswith("data:") and line != "data: [DONE]":
                chunks.append(json.loads(line[5:]))
    assert len(chunks) >= 3  # one per finished block (12 tokens in blocks of 4), then the final one
    whole = http_json(f"{url}/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 12, "temperature": 0}})
    assert chunks[-1]["text"] == whole["text"]


def test_stop_string_cuts_the_text(server):
    rt, _ = server
    url = _url(rt)
    base = http_json(f"{url}/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 12, "temperature": 0}})
    text = base["text"]
    stop = text[3:5] if len(text) >= 5 else text[-1:]
    cut = http_json(f"{url}/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 12, "temperature": 0,
                                                                             "stop": [stop]}})
    assert cut["text"] == text[:text.index(stop)]
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


@pytest.mark.parametrize("params,field", [({"regex": "[0-9]+"}, "regex"), ({"dllm_algorithm": "entropy"},
                                                                          "dllm_algorithm"),
                                          ({"block_length": 8}, "block_length"), ({"steps": 16}, "steps")])
def test_unsupported_parameters_are_refused_by_name(server, params, field):
    rt, _ = server
    code, body = _post(f"{_url(rt)}/generate", {"text": "x", "sampling_params": {"max_new_tokens": 4, **params}})
    assert code == 400 and field in json.dumps(body)


def test_openai_chat_and_sglang_frontend(server):
    rt, folder = server
    url = _url(rt)
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    msgs = [{"role": "user", "content": "Say something."}]
    r1 = client.chat.completions.create(model=folder, messages=msgs, max_tokens=8, temperature=0)
    assert isinstance(r1.choices[0].message.content, str) and r1.usage.completion_tokens > 0
    msgs += [{"role": "assistant", "content": r1.choices[0].message.content}, {"role": "user", "content": "More."}]
    r2 = client.chat.completions.create(model=folder, messages=msgs, max_tokens=8, temperature=0)
    assert r2.usage.prompt_tokens > r1.usage.prompt_tokens

    sgl = pytest.importorskip("sglang")

    @sgl.function
    def qa(s, question):
        s += "Question: " + question + "\nAnswer:"
        s += sgl.gen("answer", max_tokens=8, temperature=0)

    sgl.set_default_backend(sgl.RuntimeEndpoint(url))
    states = qa.run_batch([{"question": "one"}, {"question": "two"}], num_threads=2)
    assert all(st.error() is None for st in states), [str(st.error()) for st in states]
    assert all(isinstance(st["answer"], str) for st in states)


@pytest.mark.parametrize("flags,name", [({"bicache_profile": "p.json"}, "--bicache-profile"),
                                        ({"bicache_audit_rate": 0.5}, "--bicache-audit-rate"),
                                        ({"prefix_cache": "fixed:2"}, "--prefix-cache"),
                                        ({"attention_backend": "nope"}, "--attention-backend")])
def test_flags_without_meaning_for_block_families_are_refused(flags, name):
    from bicache_sgl.blockdiff.client import check_engine_flags
    from bicache_sgl.config import EngineConfig
    check_engine_flags(EngineConfig(), "llada2")  # the defaults are fine
    with pytest.raises(ValueError, match=name):
        check_engine_flags(EngineConfig(**flags), "llada2")


def test_engine_client_serves_sdar_and_aborts(tmp_path):
    """The EngineClient the server uses, in process, on a tiny SDAR folder: its final event equals
    the offline engine (EOS excluded, as the server reports it) with the exact-reuse fields; an
    aborted request ends with finish_reason abort."""
    import threading

    from bicache_sgl.blockdiff.client import BlockEngineClient
    from bicache_sgl.config import EngineConfig, SamplingParams
    from bicache_sgl.io_struct import GenerateRequest

    folder = make_tiny_sdar(tmp_path / "sdar", block_length=B)
    client = BlockEngineClient(EngineConfig(model_path=folder, num_threads=1))
    try:
        events: dict[str, list] = {}
        done = {k: threading.Event() for k in ("a", "b", "c")}

        def keep(key):
            def cb(ev):
                events.setdefault(key, []).append(ev)
                if ev.finished:
                    done[key].set()
            return cb

        ids = list(range(40, 51))
        params = SamplingParams(max_new_tokens=10, temperature=0)
        client.submit(GenerateRequest(input_ids=ids, params=params), keep("a"))
        assert done["a"].wait(60)
        client.submit(GenerateRequest(input_ids=ids, params=params), keep("b"))
        assert done["b"].wait(60)
        offline = BlockEngine(load_block_model(folder), BlockEngineOptions(prefix_cache=False)).run(
            [ids], BlockParams(max_new_tokens=10, stop_ids=client.eos_ids))[0]
        want = offline.tokens[:-1] if offline.meta["finish_reason"] == "stop" else offline.tokens
        first, second = events["a"][-1], events["b"][-1]
        assert first.output_ids == want == second.output_ids
        assert second.meta_info["cached_tokens"] == 8 and second.meta_info["bicache_depth"] == 3
        rid = client.submit(GenerateRequest(input_ids=ids, params=SamplingParams(max_new_tokens=4000)), keep("c"))
        client.abort(rid)
        assert done["c"].wait(60)
        assert events["c"][-1].finish_reason["type"] == "abort"
    finally:
        client.shutdown()
