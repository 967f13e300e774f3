"""The HTTP server against real clients on loopback: raw HTTP (SGLang's native API), the
``openai`` package, the ``sglang`` frontend and ``sglang.bench_serving``.

One real server subprocess (tiny random LLaDA checkpoint, block length 8) serves the whole
module; nothing is mocked. The model is random, so the tests assert protocol, bookkeeping and
behaviour (lengths, stop handling, logprob shapes, caching, aborts), not content.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest
from reliability_support import sse_frames

requests = pytest.importorskip("requests")

BLOCK = 8
CONTEXT = 384


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from bicache_sgl.runtime import Runtime
    from bicache_sgl.testing import make_tiny_llada

    folder = tmp_path_factory.mktemp("server_llada")
    model = make_tiny_llada(folder)
    profile = folder / "profile.json"
    profile.write_text(json.dumps({"n_layers": 4, "table": [[0, 0], [10, 2], [40, 3]]}))
    rt = Runtime(model_path=model, block_length=BLOCK, steps_per_block=2, threshold="none",
                 context_length=CONTEXT, max_running_requests=8, num_threads=1, bicache_profile=str(profile),
                 served_model_name="tiny-llada", timeout=180, log_path=str(folder / "server.log"),
                 # SGLang harness flags this server does not know: accepted with a warning
                 disable_cuda_graph=True, cuda_graph_bs=4, grammar_backend="none")
    rt.model_path = model
    rt.cache_slack = 1  # a cached prompt leaves at most its last token to compute (a block engine: more)
    yield rt
    rt.shutdown()


@pytest.fixture(scope="module")
def tokenizer(server):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(server.model_path)


def post(server, path, payload=None, **kw):
    return requests.post(server.url + path, json=payload, timeout=120, **kw)


def gen(server, payload):
    r = post(server, "/generate", payload)
    assert r.status_code == 200, r.text
    return r.json()


def sse_events(resp):
    """Parsed ``data:`` frames of an SSE response; the last item is the string '[DONE]'."""
    return sse_frames(resp.iter_lines(decode_unicode=False))


# ------------------------------------------------------------------------------------------------
# launch, info, health
# ------------------------------------------------------------------------------------------------

def test_launch_log_ready_line_and_unknown_flags(server):
    log = server.log_text()
    ready = [ln for ln in log.splitlines() if "The server is fired up and ready to roll!" in ln]
    assert len(ready) == 1 and server.url in ready[0]
    assert "ignoring unsupported SGLang flags" in log and "--cuda-graph-bs" in log


def test_health_and_ready(server):
    for path in ("/health", "/health_generate", "/ready"):
        assert requests.get(server.url + path, timeout=30).status_code == 200


def test_model_info_both_routes(server):
    for path in ("/get_model_info", "/model_info"):
        info = requests.get(server.url + path, timeout=10).json()
        assert info["model_path"] == server.model_path
        assert info["tokenizer_path"] == server.model_path
        assert info["is_generation"] is True


def test_server_info_internal_states(server):
    gen(server, {"text": "warm", "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
    for path in ("/get_server_info", "/server_info"):
        info = requests.get(server.url + path, timeout=10).json()
        st = info["internal_states"][0]
        # tokens per forward under its own name; the SGLang name is an alias bench_serving reads
        assert st["avg_tokens_per_forward"] > 0 and st["avg_spec_accept_length"] == st["avg_tokens_per_forward"]
        assert st["forward_passes_total"] > 0
        assert "prefix_cache_capacity_tokens" in st and "cache_hit_rate" in st
        assert st["num_running_reqs"] == 0 and st["num_waiting_reqs"] == 0  # idle between tests
        assert info["block_length"] == BLOCK and info["api_key"] is None


def test_metrics_prometheus_text(server):
    gen(server, {"text": "metrics", "sampling_params": {"max_new_tokens": 8}})
    r = requests.get(server.url + "/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    lines = {ln.split(" ")[0].split("{")[0]: ln for ln in r.text.splitlines() if ln and not ln.startswith("#")}
    assert float(lines["sglang:prompt_tokens_total"].rsplit(" ", 1)[1]) > 0
    assert float(lines["sglang:generation_tokens_total"].rsplit(" ", 1)[1]) > 0
    assert "sglang:e2e_request_latency_seconds_bucket" in lines
    assert "bicache_sgl:prefix_cache_capacity_tokens" in lines
    assert "# TYPE sglang:num_running_reqs gauge" in r.text


def _cached_after_prefill(server, prompt: str) -> int:
    gen(server, {"text": prompt, "sampling_params": {"max_new_tokens": 0}})
    return gen(server, {"text": prompt + " and more", "sampling_params": {"max_new_tokens": 0}})["meta_info"][
        "cached_tokens"]


def test_flush_cache_variants_empty_the_cache(server):
    prompt = "a prompt that is cached, then flushed by every variant of the route"
    for call in (lambda: requests.post(server.url + "/flush_cache", timeout=30),
                 lambda: requests.post(server.url + "/flush_cache", json={"empty_cache": True}, timeout=30),
                 lambda: requests.get(server.url + "/flush_cache", timeout=30),
                 lambda: requests.post(server.url + "/flush_cache?timeout=5", timeout=30)):
        # byte tokenizer: 1 token per char
        assert _cached_after_prefill(server, prompt) >= len(prompt) - server.cache_slack
        r = call()
        assert r.status_code == 200 and r.text.startswith("Cache flushed.")
        out = gen(server, {"text": prompt + " and more", "sampling_params": {"max_new_tokens": 0}})
        assert out["meta_info"]["cached_tokens"] == 0
    r = requests.post(server.url + "/flush_cache?timeout=-1", timeout=30)
    assert r.status_code == 400 and "timeout" in r.json()["error"]["message"]


def test_concate_and_append_route_answers_what_it_does(server):
    r = post(server, "/concate_and_append_request", {"src_rids": ["a", "b"], "dst_rid": "c"})
    assert r.status_code == 200 and r.json()["success"] is True and "nothing to splice" in r.json()["message"]
    r = post(server, "/concate_and_append_request", {"src_rids": "a"})
    assert r.status_code == 400 and "src_rids" in r.json()["error"]["message"]


@pytest.mark.parametrize("method", ["GET", "POST"])
@pytest.mark.parametrize("path", ["/start_profile", "/stop_profile"])
def test_profiling_is_501(server, method, path):
    r = requests.request(method, server.url + path, timeout=10)
    assert r.status_code == 501 and "is not implemented" in r.json()["error"]["message"]


# ------------------------------------------------------------------------------------------------
# /generate
# ------------------------------------------------------------------------------------------------

def test_generate_single(server, tokenizer):
    out = gen(server, {"text": "Q: capital of France?\nA:", "rid": "my-rid",
                       "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True,
                                           "regex": None, "json_schema": None, "logit_bias": None,
                                           "custom_params": None, "stop_regex": []},
                       "lora_path": None, "image_data": None, "sampling_seed": None, "unknown_key": 1})
    m = out["meta_info"]
    assert m["id"] == "my-rid"
    assert m["prompt_tokens"] == len(tokenizer.encode("Q: capital of France?\nA:"))
    assert m["completion_tokens"] == len(out["output_ids"]) == 12
    assert m["finish_reason"] == {"type": "length", "length": 12}
    assert m["e2e_latency"] > 0
    for key in ("cached_tokens", "bicache_depth", "prefix_fraction", "forward_passes"):
        assert key in m
    assert "input_token_logprobs" not in m
    assert out["text"] == tokenizer.decode(out["output_ids"])


def test_generate_batch_input_ids_and_n(server, tokenizer):
    ids_a, ids_b = tokenizer.encode("first prompt"), tokenizer.encode("second, longer prompt")
    outs = gen(server, {"input_ids": [ids_a, ids_b], "sampling_params": {"max_new_tokens": 4, "n": 2}})
    assert isinstance(outs, list) and len(outs) == 4
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [len(ids_a)] * 2 + [len(ids_b)] * 2
    assert len({o["meta_info"]["id"] for o in outs}) == 4
    single_ids = gen(server, {"input_ids": ids_a, "sampling_params": {"max_new_tokens": 4}})
    assert isinstance(single_ids, dict)
    per_prompt = gen(server, {"text": ["a b", "c d e"], "sampling_params": [{"max_new_tokens": 4},
                                                                           {"max_new_tokens": 8}]})
    assert [o["meta_info"]["completion_tokens"] <= lim for o, lim in zip(per_prompt, (4, 8))] == [True, True]


def test_generate_prefill_only(server, tokenizer):
    out = gen(server, {"text": "only the prompt", "sampling_params": {"max_new_tokens": 0}})
    assert out["text"] == "" and out["output_ids"] == []
    assert out["meta_info"]["completion_tokens"] == 0
    assert out["meta_info"]["prompt_tokens"] == len(tokenizer.encode("only the prompt"))


def test_generate_logprobs(server, tokenizer):
    prompt = "logprob test prompt"
    n = len(tokenizer.encode(prompt))
    out = gen(server, {"text": prompt, "sampling_params": {"max_new_tokens": 8, "temperature": 0},
                       "return_logprob": True, "logprob_start_len": 2, "top_logprobs_num": 3,
                       "return_text_in_logprobs": True})
    m = out["meta_info"]
    assert len(m["input_token_logprobs"]) == n - 2
    assert [e[1] for e in m["input_token_logprobs"]] == tokenizer.encode(prompt)[2:]
    assert all(e[0] is not None and e[0] <= 0 and isinstance(e[2], str) for e in m["input_token_logprobs"])
    assert len(m["output_token_logprobs"]) == m["completion_tokens"] == m["output_token_logprobs_length"]
    assert [e[1] for e in m["output_token_logprobs"]] == out["output_ids"]
    assert all(len(t) == 3 for t in m["output_top_logprobs"])
    # rank 0 of the top list is the greedy choice at temperature 0
    assert all(t[0][1] == e[1] for t, e in zip(m["output_top_logprobs"], m["output_token_logprobs"]))
    full = gen(server, {"text": prompt, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
                        "logprob_start_len": 0})["meta_info"]["input_token_logprobs"]
    assert len(full) == n and full[0][0] is None and full[0][2] is None  # no text unless asked


def test_generate_stop_string_and_token(server):
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    prompt = "stop string test"
    post(server, "/flush_cache")
    base = gen(server, {"text": prompt, "sampling_params": params})
    text, ids = base["text"], base["output_ids"]
    stop = text[6:8]
    assert stop
    post(server, "/flush_cache")
    out = gen(server, {"text": prompt, "sampling_params": {**params, "stop": stop}})
    assert out["text"] == text[:text.find(stop)]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    post(server, "/flush_cache")
    out = gen(server, {"text": prompt, "sampling_params": {**params, "stop_token_ids": [ids[5]]}})
    assert out["output_ids"] == ids[:ids.index(ids[5])]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": ids[5]}


def test_generate_stream_cumulative(server):
    r = post(server, "/generate", {"text": "streaming", "stream": True,
                                   "sampling_params": {"max_new_tokens": 24, "ignore_eos": True}}, stream=True)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) >= 2  # one per final block, then the finish
    final = chunks[-1]
    assert final["meta_info"]["finish_reason"]["type"] == "length"
    assert final["meta_info"]["completion_tokens"] == 24
    for c in chunks[:-1]:
        assert c["meta_info"]["finish_reason"] is None
        assert final["text"].startswith(c["text"])
        assert final["output_ids"][:len(c["output_ids"])] == c["output_ids"]
        assert c["meta_info"]["completion_tokens"] == len(c["output_ids"])


def test_generate_stream_batch_has_index(server):
    r = post(server, "/generate", {"text": ["one", "two"], "stream": True, "sampling_params": {"max_new_tokens": 8}},
             stream=True)
    chunks = sse_events(r)[:-1]
    assert {c["index"] for c in chunks} == {0, 1}
    assert sum(1 for c in chunks if c["meta_info"]["finish_reason"]) == 2


def _running(server) -> int:
    return requests.get(server.url + "/get_server_info", timeout=10).json()["internal_states"][0]["num_running_reqs"]


def test_client_disconnect_aborts_request(server):
    # a long streaming generation; read the first block, then hang up
    payload = {"text": "disconnect me", "stream": True,
               "sampling_params": {"max_new_tokens": 320, "ignore_eos": True, "steps_per_block": 8}}
    with requests.post(server.url + "/generate", json=payload, stream=True, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith(b"data:"):
                break
    deadline = time.time() + 15
    while _running(server) and time.time() < deadline:
        time.sleep(0.2)
    assert _running(server) == 0
    # non-streaming: the request is aborted while waiting
    import socket

    body = json.dumps({"text": "disconnect me too", "sampling_params": {"max_new_tokens": 320, "ignore_eos": True,
                                                                        "steps_per_block": 8}}).encode()
    host, port = server.url.split("//")[1].split(":")
    s = socket.create_connection((host, int(port)))
    s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
              + str(len(body)).encode() + b"\r\n\r\n" + body)
    deadline = time.time() + 10
    while not _running(server) and time.time() < deadline:
        time.sleep(0.05)
    s.close()
    deadline = time.time() + 15
    while _running(server) and time.time() < deadline:
        time.sleep(0.2)
    assert _running(server) == 0
    assert requests.get(server.url + "/health_generate", timeout=30).status_code == 200


def test_prefix_cache_reports_cached_tokens(server):
    post(server, "/flush_cache")
    prefix = "You are a helpful assistant. Here is a long shared system prompt for caching. " * 2
    gen(server, {"text": prefix, "sampling_params": {"max_new_tokens": 0}})
    out = gen(server, {"text": prefix + "Question?", "sampling_params": {"max_new_tokens": 8}})
    m = out["meta_info"]
    assert m["cached_tokens"] >= len(prefix) - server.cache_slack  # byte tokenizer: one token per character
    assert m["bicache_depth"] > 0


# ------------------------------------------------------------------------------------------------
# bad input: 4xx with a JSON error, never a 500, and the server keeps serving
# ------------------------------------------------------------------------------------------------

BAD_GENERATE = [
    ("malformed json", b'{"text": "abc", '),
    ("invalid utf-8", b'{"text": "\xff\xfe abc"}'),
    ("not an object", b'[1, 2, 3]'),
    ("no prompt", {"sampling_params": {}}),
    ("text and input_ids", {"text": "a", "input_ids": [1]}),
    ("text wrong type", {"text": 5}),
    ("empty text", {"text": ""}),
    ("empty batch", {"text": []}),
    ("empty input_ids", {"input_ids": []}),
    ("input_ids wrong type", {"input_ids": [1, "a"]}),
    ("token out of range", {"input_ids": [1, 10**6]}),
    ("negative token", {"input_ids": [-1]}),
    ("sampling_params not an object", {"text": "a", "sampling_params": "fast"}),
    ("max_new_tokens wrong type", {"text": "a", "sampling_params": {"max_new_tokens": "x"}}),
    ("negative max_new_tokens", {"text": "a", "sampling_params": {"max_new_tokens": -1}}),
    ("huge max_new_tokens", {"text": "a", "sampling_params": {"max_new_tokens": 10**12}}),
    ("prompt longer than context", {"input_ids": [65] * (CONTEXT + 1)}),
    ("prompt + generation over context",
     {"input_ids": [65] * (CONTEXT - 4), "sampling_params": {"max_new_tokens": 16}}),
    ("negative temperature", {"text": "a", "sampling_params": {"temperature": -1}}),
    ("bad top_p", {"text": "a", "sampling_params": {"top_p": 0}}),
    ("n = 0", {"text": "a", "sampling_params": {"n": 0}}),
    ("stop wrong type", {"text": "a", "sampling_params": {"stop": 5}}),
    ("bad remasking", {"text": "a", "sampling_params": {"remasking": "nope"}}),
    ("logprob_start_len below -1", {"text": "abc", "return_logprob": True, "logprob_start_len": -5}),
    ("logprob_start_len past prompt", {"text": "abc", "return_logprob": True, "logprob_start_len": 100}),
    ("logprob_start_len wrong type", {"text": "abc", "return_logprob": True, "logprob_start_len": "x"}),
    ("top_logprobs_num negative", {"text": "abc", "return_logprob": True, "top_logprobs_num": -1}),
    ("return_logprob wrong type", {"text": "abc", "return_logprob": "yes"}),
    ("stream wrong type", {"text": "abc", "stream": "yes"}),
    ("batch param length mismatch", {"text": ["a", "b"], "sampling_params": [{}]}),
]


@pytest.mark.parametrize("name,payload", BAD_GENERATE, ids=[b[0] for b in BAD_GENERATE])
def test_generate_bad_input(server, name, payload):
    if isinstance(payload, bytes):
        r = requests.post(server.url + "/generate", data=payload, headers={"Content-Type": "application/json"},
                          timeout=30)
    else:
        r = post(server, "/generate", payload)
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"]


BAD_OPENAI = [
    ("/v1/completions", {"model": "tiny-llada"}),
    ("/v1/completions", {"model": "tiny-llada", "prompt": ""}),
    ("/v1/completions", {"model": "tiny-llada", "prompt": "a", "max_tokens": -1}),
    ("/v1/completions", {"model": "tiny-llada", "prompt": "a", "max_tokens": 10**9}),
    ("/v1/completions", {"model": "tiny-llada", "prompt": "a", "logprobs": 1000}),
    ("/v1/completions", {"model": "tiny-llada", "prompt": [1, [2]]}),
    ("/v1/completions", {"model": "tiny-llada", "prompt": "a", "temperature": "hot"}),
    ("/v1/chat/completions", {"model": "tiny-llada"}),
    ("/v1/chat/completions", {"model": "tiny-llada", "messages": []}),
    ("/v1/chat/completions", {"model": "tiny-llada", "messages": [{"role": "wizard", "content": "x"}]}),
    ("/v1/chat/completions", {"model": "tiny-llada", "messages": [{"role": "user", "content": 5}]}),
    ("/v1/chat/completions", {"model": "tiny-llada", "messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": 3}),
]


@pytest.mark.parametrize("path,payload", BAD_OPENAI)
def test_openai_bad_input(server, path, payload):
    r = post(server, path, payload)
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    assert r.json()["error"]["message"]


# a refused field with a value that asks for something: 400 naming the field, nothing generated
# (regex, json_schema, the penalties, min_p and logit_bias are implemented: tests/test_structured.py)
REFUSED_GENERATE = [
    ("ebnf", {"sampling_params": {"ebnf": "root ::= 'x'"}}),
    ("structural_tag", {"sampling_params": {"structural_tag": "{}"}}),
    ("stop_regex", {"sampling_params": {"stop_regex": ["\\d"]}}),
    ("custom_params", {"sampling_params": {"custom_params": {"x": 1}}}),
    ("no_stop_trim", {"sampling_params": {"no_stop_trim": True}}),
    ("temprature", {"sampling_params": {"temprature": 0.1}}),  # not a sampling parameter at all
    ("image_data", {"image_data": "cat.png"}),
    ("lora_path", {"lora_path": "my-adapter"}),
    ("return_hidden_states", {"return_hidden_states": True}),
    ("session_params", {"session_params": {"id": "s"}}),
]


@pytest.mark.parametrize("field,extra", REFUSED_GENERATE, ids=[f for f, _ in REFUSED_GENERATE])
def test_generate_refused_field_is_400_naming_it(server, field, extra):
    body = {"text": "refused", **extra}
    body["sampling_params"] = {"max_new_tokens": 4, **extra.get("sampling_params", {})}
    for stream in (False, True):
        r = post(server, "/generate", {**body, "stream": stream})
        assert r.status_code == 400, (field, r.status_code, r.text)
        assert r.json()["error"]["message"].startswith(field), r.text


def test_generate_accepts_exactly_what_the_sglang_frontend_sends(server):
    """The body the real frontend sends (recorded against a logging stub): its no-op defaults all pass."""
    body = {"text": "Q: capital of France?\nA:",
            "sampling_params": {"skip_special_tokens": True, "spaces_between_special_tokens": True,
                                "max_new_tokens": 16, "min_new_tokens": 0, "n": 1, "stop": ["\n", "Q:"],
                                "stop_token_ids": [], "stop_regex": [], "temperature": 0, "top_p": 1.0, "top_k": -1,
                                "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "ignore_eos": False,
                                "regex": None, "json_schema": None},
            "stream": False, "return_logprob": True, "logprob_start_len": 8, "top_logprobs_num": 5,
            "return_text_in_logprobs": True, "lora_path": None, "image_data": None, "sampling_seed": None,
            "return_routed_experts": False, "rid": "frontend-defaults"}
    out = gen(server, body)
    assert out["meta_info"]["id"] == "frontend-defaults" and out["meta_info"]["completion_tokens"] <= 16
    assert len(out["meta_info"]["output_top_logprobs"]) == out["meta_info"]["completion_tokens"]


def test_openai_unknown_model_404(server):
    r = post(server, "/v1/completions", {"model": "gpt-17", "prompt": "hi"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = post(server, "/v1/chat/completions", {"model": "gpt-17", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 404
    r = requests.get(server.url + "/v1/models/gpt-17", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_server_survives_bad_input(server):
    out = gen(server, {"text": "still alive", "sampling_params": {"max_new_tokens": 8}})
    assert out["meta_info"]["completion_tokens"] <= 8
    assert requests.get(server.url + "/health_generate", timeout=30).status_code == 200


# ------------------------------------------------------------------------------------------------
# the openai package
# ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def oai(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_openai_models(oai, server):
    models = oai.models.list().data
    assert [m.id for m in models] == ["tiny-llada"]
    assert oai.models.retrieve("tiny-llada").id == "tiny-llada"


def test_openai_completion(oai, tokenizer):
    prompt = "Once upon a time"
    r = oai.completions.create(model="tiny-llada", prompt=prompt, max_tokens=8, temperature=0, logprobs=2,
                               extra_body={"ignore_eos": True})
    c = r.choices[0]
    assert r.object == "text_completion" and c.finish_reason == "length"
    assert r.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert r.usage.completion_tokens == 8 == len(c.logprobs.tokens)
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8
    assert all(len(t) <= 2 for t in c.logprobs.top_logprobs)
    assert all(isinstance(t, str) for t in c.logprobs.tokens)  # byte tokens: no join check
    # list of prompts x n
    r = oai.completions.create(model="tiny-llada", prompt=["a", "bb"], max_tokens=4, n=2)
    assert len(r.choices) == 4 and sorted(ch.index for ch in r.choices) == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == len(tokenizer.encode("a")) + len(tokenizer.encode("bb"))


def test_openai_completion_echo_logprobs(oai, tokenizer):
    prompt = "echo this"
    r = oai.completions.create(model="tiny-llada", prompt=prompt, max_tokens=4, echo=True, logprobs=1)
    c = r.choices[0]
    assert c.text.startswith(prompt)
    assert c.logprobs.token_logprobs[0] is None
    assert len(c.logprobs.tokens) == len(tokenizer.encode(prompt)) + r.usage.completion_tokens


def test_openai_completion_stream(oai):
    stream = oai.completions.create(model="tiny-llada", prompt="Stream me", max_tokens=16, stream=True,
                                    stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    texts = [ch.choices[0].text for ch in chunks if ch.choices]
    reasons = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])
    assert len("".join(texts)) > 0


def test_openai_chat(oai, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    r = oai.chat.completions.create(model="tiny-llada", messages=messages, max_tokens=8, temperature=0,
                                    logprobs=True, top_logprobs=2)
    c = r.choices[0]
    assert r.object == "chat.completion" and c.message.role == "assistant"
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert r.usage.prompt_tokens == len(tokenizer.encode(rendered))
    assert r.usage.completion_tokens == len(c.logprobs.content)
    assert all(len(t.top_logprobs) == 2 for t in c.logprobs.content)
    r = oai.chat.completions.create(model="tiny-llada", messages=messages, max_tokens=4, n=2)
    assert len(r.choices) == 2


def test_min_new_tokens_past_the_budget_is_400_naming_it(server, tokenizer):
    """Native /generate: min_new_tokens over max_new_tokens is a 400 naming min_new_tokens
    (SGLang's rule), streaming or not; equal is served. A budget left to the default is judged
    as it runs, after it was shortened to the context: 4 positions left, min_new_tokens 10 is
    refused although the provisional default (128) would have allowed it."""
    for stream in (False, True):
        r = post(server, "/generate", {"text": "x", "sampling_params": {"max_new_tokens": 8, "min_new_tokens": 9},
                                       "stream": stream})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"].startswith("min_new_tokens must be in [0, max_new_tokens]"), r.text
    out = gen(server, {"text": "x", "sampling_params": {"max_new_tokens": 8, "min_new_tokens": 8, "temperature": 0}})
    assert out["meta_info"]["completion_tokens"] == 8
    ids = (tokenizer.encode("a long prompt that fills the context " * 60) * 2)[:CONTEXT - 4]
    r = post(server, "/generate", {"input_ids": ids, "sampling_params": {"min_new_tokens": 10}})
    assert r.status_code == 400 and "min_new_tokens 10 > max_new_tokens 4" in r.json()["error"]["message"], r.text
    out = gen(server, {"input_ids": ids, "sampling_params": {"min_new_tokens": 4, "temperature": 0}})
    assert out["meta_info"]["completion_tokens"] == 4


def test_openai_min_tokens_past_the_budget_is_400_naming_it(oai, tokenizer):
    """/v1: min_tokens over the budget actually used is a 400 whose param is min_tokens: an
    explicit max_tokens, the completions default (16), and a chat budget left to the default and
    shortened to the context (judged as it runs, not as the provisional default, 128)."""
    import openai

    long_text = tokenizer.decode(tokenizer.encode("a long message that fills most of the context " * 40)[:300])
    chat = {"messages": [{"role": "user", "content": long_text}], "temperature": 0}
    # the budget this chat runs with: every position generated (ignore_eos), fewer than the default
    budget = oai.chat.completions.create(model="tiny-llada", **chat,
                                         extra_body={"ignore_eos": True}).usage.completion_tokens
    assert 0 < budget < 128
    cases = [("chat", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                       "extra_body": {"min_tokens": 5}}, "5 > max_new_tokens 4"),
             ("completions", {"prompt": "hi", "extra_body": {"min_tokens": 17}}, "17 > max_new_tokens 16"),
             ("chat", {**chat, "extra_body": {"min_tokens": budget + 1}}, f"{budget + 1} > max_new_tokens {budget}")]
    for route, kwargs, needle in cases:
        with pytest.raises(openai.BadRequestError) as e:
            if route == "chat":
                oai.chat.completions.create(model="tiny-llada", **kwargs)
            else:
                oai.completions.create(model="tiny-llada", **kwargs)
        err = e.value.body
        assert e.value.status_code == 400 and err["param"] == "min_tokens" and needle in err["message"], err
    # within the budget actually used: served, with at least min_tokens tokens
    c = oai.chat.completions.create(model="tiny-llada", **chat, extra_body={"min_tokens": budget})
    assert c.usage.completion_tokens == budget
    c = oai.completions.create(model="tiny-llada", prompt="hi", temperature=0, extra_body={"min_tokens": 16})
    assert c.usage.completion_tokens == 16


OPENAI_REFUSED = [
    ("completions", "best_of", {"best_of": 2}),
    ("completions", "suffix", {"suffix": " the end"}),
    ("completions", "ebnf", {"extra_body": {"ebnf": "root ::= 'x'"}}),
    ("completions", "made_up_field", {"extra_body": {"made_up_field": 1}}),
    ("chat", "tools", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}),
    ("chat", "tool_choice", {"tool_choice": "required"}),
    ("chat", "functions", {"functions": [{"name": "f", "parameters": {}}]}),
    ("chat", "response_format", {"response_format": {"type": "xml"}}),
    ("chat", "reasoning_effort", {"reasoning_effort": "low"}),
    ("chat", "no_stop_trim", {"extra_body": {"no_stop_trim": True}}),
    ("chat", "stream_options.include_obfuscation",
     {"stream": True, "stream_options": {"include_usage": True, "include_obfuscation": True}}),
]


@pytest.mark.parametrize("route,field,kwargs", OPENAI_REFUSED, ids=[f"{r}-{f}" for r, f, _ in OPENAI_REFUSED])
def test_openai_refused_field_is_400_naming_it(oai, route, field, kwargs):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        if route == "chat":
            oai.chat.completions.create(model="tiny-llada", messages=[{"role": "user", "content": "hi"}],
                                        max_tokens=4, **kwargs)
        else:
            oai.completions.create(model="tiny-llada", prompt="hi", max_tokens=4, **kwargs)
    err = e.value.body
    assert e.value.status_code == 400 and err["param"] == field and err["message"].startswith(field), err


def test_openai_noop_values_and_metadata_accepted(oai):
    r = oai.chat.completions.create(model="tiny-llada", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                    frequency_penalty=0, presence_penalty=0.0, tools=[], tool_choice="none",
                                    response_format={"type": "text"}, user="u-1", metadata={"k": "v"},
                                    store=False, extra_body={"min_p": 0.0, "repetition_penalty": 1.0})
    assert r.choices[0].finish_reason in ("stop", "length")
    r = oai.completions.create(model="tiny-llada", prompt="hi", max_tokens=4, best_of=1, user="u-1",
                               frequency_penalty=0.0, extra_body={"regex": None})
    assert r.usage.completion_tokens <= 4


def test_openai_chat_stream(oai):
    stream = oai.chat.completions.create(model="tiny-llada", messages=[{"role": "user", "content": "Tell me"}],
                                         max_tokens=16, stream=True, stream_options={"include_usage": True},
                                         extra_body={"ignore_eos": True})
    chunks = list(stream)
    with_choices = [ch for ch in chunks if ch.choices]
    assert with_choices[0].choices[0].delta.role == "assistant"
    finishes = [ch for ch in with_choices if ch.choices[0].finish_reason is not None]
    assert len(finishes) == 1 and finishes[0] is with_choices[-1]
    assert finishes[0].choices[0].finish_reason == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 16
    content = "".join(ch.choices[0].delta.content or "" for ch in with_choices)
    assert isinstance(content, str)


# ------------------------------------------------------------------------------------------------
# the sglang frontend
# ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sgl(server):
    sgl = pytest.importorskip("sglang")
    sgl.set_default_backend(server.endpoint)
    yield sgl
    sgl.set_default_backend(None)


def test_sglang_gen_and_select_all_methods(sgl):
    from sglang.lang.choices import greedy_token_selection, token_length_normalized, unconditional_likelihood_normalized

    @sgl.function
    def program(s, method):
        s += "Q: Is the sky blue?\nA:"
        s += sgl.gen("reason", max_tokens=8, temperature=0)
        s += "\nVerdict: " + sgl.select("verdict", choices=["yes", "no", "maybe so"], choices_method=method)

    for method in (token_length_normalized, greedy_token_selection, unconditional_likelihood_normalized):
        state = program.run(method=method)
        assert state["verdict"] in ("yes", "no", "maybe so")
        meta = state.get_meta_info("verdict")
        assert len(meta["normalized_prompt_logprobs"]) == 3
        assert state.get_meta_info("reason")["completion_tokens"] <= 8


def test_sglang_frontend_penalties_and_constraints_are_served(sgl):
    """Penalties, dtype (which the frontend turns into a regex) and regex reach the server and are
    applied (they used to be refused; tests/test_structured.py covers them in depth)."""
    from sglang.lang.ir import REGEX_INT

    @sgl.function
    def program(s):
        s += "Q: 1+1?\nA:" + sgl.gen("pen", max_tokens=4, frequency_penalty=0.5, presence_penalty=0.5)
        s += "\nB:" + sgl.gen("typed", max_tokens=4, dtype=int)
        s += "\nC:" + sgl.gen("digits", max_tokens=4, regex="[0-9]+")

    state = program.run()
    state.sync()
    assert state.error() is None
    assert re.fullmatch(REGEX_INT, state["typed"]) and re.fullmatch("[0-9]+", state["digits"])


def test_sglang_join_concate_and_append(sgl, tokenizer):
    """join(mode="concate_and_append") calls /concate_and_append_request after the client appended the
    forks' text; the next gen then sees all of it (the route has nothing left to do)."""
    @sgl.function
    def tree(s):
        s += "Base. "
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += f"Branch {i}: "
            f += sgl.gen("idea", max_tokens=4)
        forks.join(mode="concate_and_append")
        s += " Then:" + sgl.gen("after", max_tokens=4)

    state = tree.run()
    state.sync()
    assert state.error() is None
    text = state.text()
    b0, b1 = text.find("Branch 0: "), text.find("Branch 1: ")
    assert text.startswith("Base. ") and 0 < b0 < b1 < text.find(" Then:")
    prompt = text[:text.find(" Then:")] + " Then:"
    assert state.get_meta_info("after")["prompt_tokens"] == len(tokenizer.encode(prompt))


def test_sglang_fork_join(sgl):
    @sgl.function
    def tree(s):
        s += "Shared context for all branches. "
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += f"Branch {i}: "
            f += sgl.gen("idea", max_tokens=8)
        forks.join()
        s += "Ideas: " + " | ".join(f["idea"] for f in forks)

    state = tree.run()
    assert state.text().startswith("Shared context for all branches. Ideas: ")
    assert state.text().count(" | ") >= 2


def test_sglang_run_batch_and_cached_prefix(sgl, server):
    post(server, "/flush_cache")

    @sgl.function
    def qa(s, question):
        s += "You are a careful assistant. Answer every question with a short phrase. " * 2
        s += "Question: " + question + "\nAnswer:"
        s += sgl.gen("answer", max_tokens=8, stop="\n")

    states = qa.run_batch([{"question": f"What is {i} + {i}?"} for i in range(6)], num_threads=4)
    assert len(states) == 6
    assert all(isinstance(st["answer"], str) for st in states)
    # run_batch sent the constant prefix first (cache_prefix): every request reports it cached
    cached = [st.get_meta_info("answer")["cached_tokens"] for st in states]
    assert min(cached) > 64


def test_sglang_streaming(sgl):
    @sgl.function
    def story(s):
        s += "A story: "
        s += sgl.gen("story", max_tokens=24, ignore_eos=True)

    state = story.run(stream=True)
    pieces = list(state.text_iter("story"))
    assert "".join(pieces) == state["story"]
    assert len(pieces) >= 2


def test_sglang_cache_prefix_then_cached_tokens(sgl, server):
    post(server, "/flush_cache")
    prefix = "This long document is shared by several calls and should come from the cache. " * 2
    server.endpoint.cache_prefix(prefix)

    @sgl.function
    def f(s):
        s += prefix + "Summary:"
        s += sgl.gen("out", max_tokens=8)

    state = f.run()
    assert state.get_meta_info("out")["cached_tokens"] >= len(prefix) - server.cache_slack


# ------------------------------------------------------------------------------------------------
# sglang.bench_serving
# ------------------------------------------------------------------------------------------------

def _bench(server, tmp_path, *extra):
    out = tmp_path / "bench.jsonl"
    env = dict(os.environ, HOME=str(tmp_path), TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    # the served model name is not a path here, so the tokenizer folder is passed explicitly
    cmd = [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang", "--base-url", server.url,
           "--tokenizer", server.model_path,
           "--output-file", str(out), "--seed", "1", "--disable-tqdm", *extra]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, check=False)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout, json.loads(out.read_text().splitlines()[-1])


def test_bench_serving_random_ids(server, tmp_path):
    pytest.importorskip("sglang")
    stdout, res = _bench(server, tmp_path, "--dataset-name", "random-ids", "--num-prompts", "8",
                         "--random-input-len", "48", "--random-output-len", "16", "--random-range-ratio", "0.5",
                         "--max-concurrency", "4")
    assert "Serving Benchmark Result" in stdout
    assert res["completed"] == 8 and res["total_output_tokens"] > 0


def test_bench_serving_generated_shared_prefix(server, tmp_path):
    pytest.importorskip("sglang")
    _stdout, res = _bench(server, tmp_path, "--dataset-name", "generated-shared-prefix", "--gsp-num-groups", "2",
                         "--gsp-prompts-per-group", "4", "--gsp-system-prompt-len", "96", "--gsp-question-len", "16",
                         "--gsp-output-len", "8", "--flush-cache")
    assert res["completed"] == 8
    info = requests.get(server.url + "/get_server_info", timeout=10).json()["internal_states"][0]
    assert info["cached_tokens_total"] > 0


def test_no_server_side_errors_logged(server):
    """Every case above, bad input and disconnects included, was answered without a server error."""
    log = server.log_text()
    assert "Traceback" not in log, log[-4000:]
    assert "unexpected error" not in log and " 500 " not in log


def test_tp_size_above_one_stops_the_launch(tmp_path):
    from bicache_sgl.runtime import Runtime

    with pytest.raises(RuntimeError, match="tensor parallelism is not implemented; use --tp-size 1"):
        Runtime(model_path=str(tmp_path / "never-loaded"), tp_size=2, timeout=60, log_path=str(tmp_path / "log"))


# ------------------------------------------------------------------------------------------------
# SGLang's contract, frame by frame (issue 20)
# ------------------------------------------------------------------------------------------------

def test_every_streamed_frame_carries_the_whole_meta_info(server):
    """SGLang puts every field in every frame: logprobs of everything so far, the cache fields."""
    r = post(server, "/generate", {"text": "frames", "stream": True, "return_logprob": True,
                                   "sampling_params": {"max_new_tokens": 24, "ignore_eos": True}}, stream=True)
    chunks = sse_events(r)[:-1]
    assert len(chunks) >= 3
    final = chunks[-1]["meta_info"]
    for c in chunks:
        m = c["meta_info"]
        for key in ("output_token_logprobs", "output_token_logprobs_length", "input_token_logprobs",
                    "bicache_depth", "cached_tokens", "prompt_tokens", "completion_tokens"):
            assert key in m, (key, m)
        n = len(c["output_ids"])
        assert m["output_token_logprobs_length"] == n == len(m["output_token_logprobs"])
        assert m["output_token_logprobs"] == final["output_token_logprobs"][:n]  # a prefix of the final reply's
        assert m["cached_tokens"] == final["cached_tokens"]


def test_incremental_streaming_slices_logprobs_with_the_text(tmp_path):
    """With --incremental-streaming-output each frame's logprobs are the new entries, as its ids."""
    from bicache_sgl.runtime import Runtime
    from bicache_sgl.testing import make_tiny_llada

    model = make_tiny_llada(tmp_path / "m")
    with Runtime(model_path=model, block_length=BLOCK, steps_per_block=2, threshold="none", num_threads=1,
                 incremental_streaming_output=True, skip_server_warmup=True, timeout=180) as rt:
        r = requests.post(rt.url + "/generate", json={"text": "inc", "stream": True, "return_logprob": True,
                                                      "sampling_params": {"max_new_tokens": 24, "ignore_eos": True}},
                          stream=True, timeout=120)
        chunks = sse_events(r)[:-1]
        assert sum(len(c["output_ids"]) for c in chunks) == 24
        for c in chunks:
            assert len(c["meta_info"]["output_token_logprobs"]) == len(c["output_ids"]), c["meta_info"]


def test_abort_all_ends_every_request_with_abort(server):
    import concurrent.futures

    def long_request(i):
        return gen(server, {"text": f"abort all {i}", "sampling_params": {"max_new_tokens": 256, "ignore_eos": True,
                                                                          "steps_per_block": 8}})
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futs = [pool.submit(long_request, i) for i in range(3)]
        deadline = time.time() + 60
        # all three in the engine before the abort (on a loaded machine a request that arrives
        # after it is not aborted, and rightly runs to its end)
        while _running(server) < 3 and time.time() < deadline:
            time.sleep(0.05)
        assert _running(server) == 3, "the three requests never ran together"
        r = post(server, "/abort_request", {"abort_all": True})
        assert r.status_code == 200, r.text
        outs = [f.result(timeout=120) for f in futs]
    assert all(o["meta_info"]["finish_reason"]["type"] == "abort" for o in outs), [o["meta_info"] for o in outs]
    assert post(server, "/abort_request", {"abort_all": "yes"}).status_code == 400
    assert post(server, "/abort_request", {}).status_code == 400  # neither rid nor abort_all


def test_empty_lora_path_means_no_adapter(server, oai):
    assert gen(server, {"text": "hi", "lora_path": "", "sampling_params": {"max_new_tokens": 4}})["text"] is not None
    assert gen(server, {"text": ["a", "b"], "lora_path": ["", None], "sampling_params": {"max_new_tokens": 4}})
    oai.completions.create(model="tiny-llada", prompt="hi", max_tokens=4, extra_body={"lora_path": ""})
    r = post(server, "/generate", {"text": "hi", "lora_path": "my-adapter", "sampling_params": {"max_new_tokens": 4}})
    assert r.status_code == 400 and "lora_path" in r.text


def test_stop_token_ids_outside_the_vocabulary_are_accepted(server, tokenizer):
    out = gen(server, {"text": "stop ids", "sampling_params": {"max_new_tokens": 8, "ignore_eos": True,
                                                                "stop_token_ids": [10**6]}})
    assert out["meta_info"]["completion_tokens"] == 8  # can never occur: no effect
    r = post(server, "/generate", {"text": "x", "sampling_params": {"max_new_tokens": 4, "stop_token_ids": ["a"]}})
    assert r.status_code == 400 and "stop_token_ids" in r.text  # malformed is still refused


def test_openai_chat_usage_and_deltas_have_sglang_keys(oai):
    r = oai.chat.completions.create(model="tiny-llada", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert r.usage.model_dump()["reasoning_tokens"] == 0
    stream = oai.chat.completions.create(model="tiny-llada", messages=[{"role": "user", "content": "hi"}],
                                         max_tokens=8, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    for ch in chunks:
        for c in ch.choices:
            assert c.delta.reasoning_content is None and c.delta.tool_calls is None
    assert chunks[-1].usage.model_dump()["reasoning_tokens"] == 0


def test_context_rule_is_prompt_plus_max_new_tokens(server):
    """A prompt that fits with max_new_tokens but not with the region rounded up to whole blocks is
    served (the last block cut short); past the context it is a 400."""
    ids = [5] * (CONTEXT - 4)
    out = gen(server, {"input_ids": ids, "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}})
    assert out["meta_info"]["completion_tokens"] == 4
    r = post(server, "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 5}})
    assert r.status_code == 400 and "context length" in r.text


@pytest.mark.parametrize("path,body,param,words", [
    ("/generate", {"input_ids": [1, 10**6]}, None, "outside the vocabulary"),
    ("/generate", {"input_ids": [5] * (CONTEXT - 4), "sampling_params": {"max_new_tokens": 5}}, None,
     "plus max_new_tokens (5) exceeds the context length"),
    ("/generate", {"input_ids": [5] * (CONTEXT + 1)}, None, "longer than the context length"),
    ("/v1/completions", {"model": "tiny-llada", "prompt": [1, 10**6], "max_tokens": 4}, "prompt",
     "outside the vocabulary"),
    ("/v1/completions", {"model": "tiny-llada", "prompt": [5] * (CONTEXT - 4), "max_tokens": 5}, "max_tokens",
     "exceeds the context length"),
])
def test_the_engines_vocabulary_and_context_refusals_are_400s_naming_the_field(server, path, body, param, words):
    """The vocabulary and context rules are the engine's (scheduler/validate.py), checked once at
    submit; the server answers its refusal with a 400 saying why (on /v1, ``param`` names the
    route's own field)."""
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert words in err["message"] and err.get("param") == param, err


def test_sglang_streamed_program_with_logprobs_matches_the_final_reply(sgl):
    """A frontend program with return_logprob=True and stream=True: every chunk parses (an
    intermediate frame without logprobs broke the client), and the final meta_info holds one
    logprob per generated token, the ids of the answer."""
    @sgl.function
    def prog(s):
        s += "Logprobs, streamed: "
        s += sgl.gen("answer", max_tokens=16, ignore_eos=True, temperature=0, return_logprob=True)

    state = prog.run(stream=True)
    pieces = list(state.text_iter("answer"))
    assert pieces and "".join(pieces) == state["answer"]
    streamed = state.get_meta_info("answer")
    lps = streamed["output_token_logprobs"]
    assert len(lps) == 16 and all(isinstance(lp, float) and lp <= 0 for lp, _, *_ in lps)
    assert streamed["completion_tokens"] == 16
