"""A second live server: --api-key, --incremental-streaming-output, --disable-radix-cache,
--max-queued-requests, and
``bicache_sgl.Runtime`` as a context manager (start, endpoint for the sglang frontend, shutdown)."""

from __future__ import annotations

import json
import socket

import pytest

requests = pytest.importorskip("requests")

KEY = "s3cret-key-for-tests"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def rt(tmp_path_factory):
    from bicache_sgl.runtime import Runtime
    from bicache_sgl.testing import make_tiny_llada

    folder = tmp_path_factory.mktemp("auth_llada")
    model = make_tiny_llada(folder, seed=3)
    with Runtime(model_path=model, api_key=KEY, incremental_streaming_output=True, disable_radix_cache=True,
                 block_length=8, steps_per_block=4, threshold="none", num_threads=1, max_queued_requests=3,
                 timeout=180, log_path=str(folder / "server.log")) as runtime:
        yield runtime
    assert runtime.proc is None
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", runtime.port), timeout=2).close()


def test_open_routes_need_no_key(rt):
    for path in ("/health", "/health_generate", "/metrics", "/ready"):
        assert requests.get(rt.url + path, timeout=30).status_code == 200, path


@pytest.mark.parametrize("method,path", [("POST", "/generate"), ("GET", "/get_model_info"), ("GET", "/model_info"),
                                         ("GET", "/get_server_info"), ("POST", "/flush_cache"),
                                         ("GET", "/v1/models"), ("POST", "/v1/completions"),
                                         ("POST", "/v1/chat/completions"), ("POST", "/concate_and_append_request")])
def test_key_required(rt, method, path):
    body = {"text": "x", "prompt": "x", "messages": [{"role": "user", "content": "x"}]}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = requests.request(method, rt.url + path, json=body, headers=headers, timeout=30)
        assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}


def test_key_accepted_and_never_shown(rt):
    r = requests.post(rt.url + "/generate", json={"text": "hello", "sampling_params": {"max_new_tokens": 8}},
                      headers=AUTH, timeout=60)
    assert r.status_code == 200
    info = requests.get(rt.url + "/get_server_info", headers=AUTH, timeout=10)
    assert info.status_code == 200 and KEY not in info.text
    assert info.json()["internal_states"][0]["prefix_cache"] == "off"
    assert KEY not in rt.log_text()


def test_openai_package_with_key(rt):
    openai = pytest.importorskip("openai")
    bad = openai.OpenAI(base_url=rt.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    good = openai.OpenAI(base_url=rt.url + "/v1", api_key=KEY, max_retries=0)
    model = good.models.list().data[0].id
    r = good.completions.create(model=model, prompt="abc", max_tokens=8)
    assert r.usage.completion_tokens <= 8


def _stream(rt, payload):
    r = requests.post(rt.url + "/generate", json={**payload, "stream": True}, headers=AUTH, stream=True, timeout=60)
    assert r.status_code == 200
    frames = [ln[5:].strip() for ln in r.iter_lines(decode_unicode=True) if ln.startswith("data:")]
    assert frames[-1] == "[DONE]"
    return [json.loads(f) for f in frames[:-1]]


def test_incremental_streaming_matches_non_streaming(rt):
    payload = {"text": "incremental", "sampling_params": {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True},
               "return_logprob": True, "top_logprobs_num": 2}
    chunks = _stream(rt, payload)
    assert len(chunks) >= 2
    full = requests.post(rt.url + "/generate", json=payload, headers=AUTH, timeout=60).json()
    # prefix cache off + temperature 0: the same request gives the same tokens
    assert [t for c in chunks for t in c["output_ids"]] == full["output_ids"]
    assert "".join(c["text"] for c in chunks) == full["text"]
    lps = [e for c in chunks for e in c["meta_info"].get("output_token_logprobs", [])]
    assert [e[1] for e in lps] == full["output_ids"]
    assert chunks[-1]["meta_info"]["completion_tokens"] == 32
    assert chunks[-1]["meta_info"]["cached_tokens"] == 0


def test_queue_full_is_503(rt):
    # a batch is queued atomically: 4 requests do not fit a queue of 3
    r = requests.post(rt.url + "/generate",
                      json={"text": ["a", "b", "c", "d"], "sampling_params": {"max_new_tokens": 8}},
                      headers=AUTH, timeout=60)
    assert r.status_code == 503 and "queue is full" in r.json()["error"]["message"]
    r = requests.post(rt.url + "/generate", json={"text": ["a", "b"], "sampling_params": {"max_new_tokens": 8}},
                      headers=AUTH, timeout=60)
    assert r.status_code == 200 and len(r.json()) == 2


def test_runtime_endpoint_with_sglang_frontend(rt):
    sgl = pytest.importorskip("sglang")

    @sgl.function
    def qa(s):
        s += "Q: pick one.\nA:" + sgl.select("pick", choices=["red", "green"])
        s += " because" + sgl.gen("why", max_tokens=8)

    state = qa.run(backend=rt.endpoint)
    assert state["pick"] in ("red", "green")
    assert state.get_meta_info("why")["completion_tokens"] <= 8
    assert rt.get_model_info()["model_path"]
