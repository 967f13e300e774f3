"""Security limits of a real server: the API key on every route (enumerated from the app itself),
the key never logged, and request size limits (body bytes, prompt tokens, batch size, n) answered
with a clear 4xx JSON error.
"""

from __future__ import annotations

import http.client
import json
from types import SimpleNamespace

import pytest
import requests
from reliability_support import serve

KEY = "rel-Sup3r-s3cret-k3y-0123456789"
HF_TOKEN = "hf_n0t-a-real-token-but-secret"  # an unknown flag's value: must not be logged either
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_BYTES, MAX_BATCH, MAX_N, CONTEXT = 64 * 1024, 8, 4, 256


@pytest.fixture(scope="module")
def rt(tmp_path_factory):
    # debug logging (access log on) gives the key the most chances to leak into the log
    with serve(tmp_path_factory.mktemp("security"), api_key=KEY, log_level="debug", prefix_cache="off",
               max_request_bytes=MAX_BYTES, max_batch_size=MAX_BATCH, max_n=MAX_N, context_length=CONTEXT,
               hf_token=HF_TOKEN, seed=6) as server:
        yield server


def app_routes() -> list[tuple[str, str]]:
    """(method, path) for every route the server's app serves, read from the app itself."""
    from bicache_sgl.server.app import create_app
    from bicache_sgl.server.args import ServerArgs

    stub = SimpleNamespace(tokenizer=None, model_path="m", context_length=CONTEXT, model_config=None,
                           submit_returns_at_once=False)
    app = create_app(stub, ServerArgs())
    out = set()
    for r in app.routes:
        for m in getattr(r, "methods", None) or ():
            if m != "HEAD":
                out.add((m, r.path.replace("{model_id:path}", "some-model")))
    return sorted(out)


def raw(rt, method: str, path: str, headers: dict | None = None, body: bytes | None = None) -> tuple[int, bytes]:
    """An HTTP request with the path sent exactly as given (no client-side normalisation)."""
    host, port = rt.url.split("//")[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


OPEN = ("/health", "/health_generate", "/ready", "/metrics")
BODY = json.dumps({"text": "x", "prompt": "x", "messages": [{"role": "user", "content": "x"}], "rid": "x"}).encode()


def test_every_route_but_health_and_metrics_needs_the_key(rt):
    routes = app_routes()
    paths = {p for _, p in routes}
    assert {"/generate", "/v1/completions", "/v1/chat/completions", "/get_server_info", "/flush_cache",
            "/abort_request", "/v1/models"} <= paths and len(routes) >= 20
    checked = 0
    for method, path in routes:
        if path in OPEN:
            status, _ = raw(rt, method, path)
            assert status != 401, (method, path)
            continue
        for headers in ({}, {"Authorization": "Bearer wrong-key"}, {"Authorization": KEY},
                        {"Authorization": f"Basic {KEY}"}, {"Authorization": f"Bearer {KEY}x"},
                        {"X-API-Key": "wrong"}, {"Authorization": "Bearer "}):
            status, body = raw(rt, method, path, {**headers, "Content-Type": "application/json"}, BODY)
            assert status == 401, (method, path, headers, status, body[:200])
            assert json.loads(body) == {"error": "Unauthorized"}
            checked += 1
        # the right key (either header) gets past the check
        for good in (AUTH, {"X-API-Key": KEY}):
            status, body = raw(rt, method, path, {**good, "Content-Type": "application/json"}, BODY)
            assert status != 401, (method, path, good)
    assert checked >= 7 * 15


@pytest.mark.parametrize("path", ["/health/../generate", "/metrics/../get_server_info", "//generate", "/generate/",
                                  "/GENERATE", "/health%2F..%2Fgenerate", "/v1/models/../../generate",
                                  "/health_generate/../v1/completions", "/ready/..%2Fflush_cache", "/nonexistent"])
def test_path_tricks_do_not_bypass_the_key(rt, path):
    for method in ("GET", "POST"):
        status, body = raw(rt, method, path, {"Content-Type": "application/json"}, BODY)
        assert status in (401, 404, 405, 307), (method, path, status, body[:200])
        assert b"output_ids" not in body and b"internal_states" not in body and b"Cache flushed" not in body


def test_key_never_logged_or_returned(rt):
    r = requests.post(rt.url + "/generate", json={"text": "hello", "sampling_params": {"max_new_tokens": 8}},
                      headers=AUTH, timeout=60)
    assert r.status_code == 200
    info = requests.get(rt.url + "/get_server_info", headers=AUTH, timeout=30)
    assert info.status_code == 200 and info.json()["api_key"] == "<redacted>"
    for text in (info.text, requests.get(rt.url + "/metrics", timeout=30).text,
                 requests.get(rt.url + "/get_model_info", headers=AUTH, timeout=30).text):
        assert KEY not in text and HF_TOKEN not in text
    log = rt.log_text()
    assert "GET /get_server_info" in log  # the access log is on: the most the server ever logs
    assert KEY not in log and HF_TOKEN not in log
    assert "--hf-token <redacted>" in log


# ------------------------------------------------------------------------------------------------
# request size limits
# ------------------------------------------------------------------------------------------------

def error_of(r: requests.Response) -> str:
    err = r.json()["error"]
    return err["message"] if isinstance(err, dict) else err


@pytest.mark.parametrize("path", ["/generate", "/v1/completions", "/v1/chat/completions", "/abort_request",
                                  "/flush_cache"])
def test_body_over_limit_is_413(rt, path):
    big = json.dumps({"text": "a" * MAX_BYTES, "prompt": "x", "messages": [{"role": "user", "content": "x"}]})
    r = requests.post(rt.url + path, data=big, headers={**AUTH, "Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 413, (r.status_code, r.text[:200])
    msg = error_of(r)
    assert str(MAX_BYTES) in msg and "--max-request-bytes" in msg


def test_chunked_body_over_limit_is_413(rt):
    def chunks(total: int):
        yield b'{"text": "'
        for _ in range(total // 4096):
            yield b"a" * 4096
        yield b'", "sampling_params": {"max_new_tokens": 4}}'

    r = requests.post(rt.url + "/generate", data=chunks(MAX_BYTES + 8192),
                      headers={**AUTH, "Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 413 and "--max-request-bytes" in error_of(r)
    # a chunked body under the limit is served (the context limit answers, not the size limit)
    r = requests.post(rt.url + "/generate", data=chunks(8192), headers={**AUTH, "Content-Type": "application/json"},
                      timeout=60)
    assert r.status_code == 400 and "context length" in error_of(r)


def test_body_at_the_limit_is_accepted(rt):
    body = json.dumps({"text": "hi", "sampling_params": {"max_new_tokens": 4}}).encode()
    body += b" " * (MAX_BYTES - len(body))  # trailing whitespace is valid JSON
    assert len(body) == MAX_BYTES
    r = requests.post(rt.url + "/generate", data=body, headers={**AUTH, "Content-Type": "application/json"},
                      timeout=60)
    assert r.status_code == 200, r.text[:200]


LIMIT_CASES = [
    # prompt tokens (bounded by the context length)
    ("/generate", {"text": "x" * (CONTEXT + 1)}, "context length"),
    ("/generate", {"input_ids": [65] * (CONTEXT + 1)}, "context length"),
    ("/v1/completions", {"prompt": [[65] * (CONTEXT + 1)]}, "context length"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * CONTEXT}]}, "context length"),
    # batch size (prompts x n)
    ("/generate", {"text": ["a"] * (MAX_BATCH + 1), "sampling_params": {"max_new_tokens": 1}}, "--max-batch-size"),
    ("/generate", {"input_ids": [[65]] * (MAX_BATCH + 1), "sampling_params": {"max_new_tokens": 1}},
     "--max-batch-size"),
    ("/generate", {"text": ["a", "b", "c"], "sampling_params": {"max_new_tokens": 1, "n": 3}}, "--max-batch-size"),
    ("/v1/completions", {"prompt": ["a"] * (MAX_BATCH + 1), "max_tokens": 1}, "--max-batch-size"),
    ("/v1/completions", {"prompt": [[65]] * (MAX_BATCH + 1), "max_tokens": 1}, "--max-batch-size"),
    ("/v1/completions", {"prompt": ["a", "b", "c"], "max_tokens": 1, "n": 3}, "--max-batch-size"),
    # n
    ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": 1, "n": MAX_N + 1}}, "--max-n"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 1, "n": MAX_N + 1}, "--max-n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "max_tokens": 1, "n": MAX_N + 1},
     "--max-n"),
]


@pytest.mark.parametrize("path,body,needle", LIMIT_CASES, ids=[f"{p} {n}" for p, _, n in LIMIT_CASES])
def test_size_limits_are_clear_400s(rt, path, body, needle):
    r = requests.post(rt.url + path, json=body, headers=AUTH, timeout=60)
    assert r.status_code == 400, (r.status_code, r.text[:300])
    assert needle in error_of(r), error_of(r)


def test_requests_at_the_limits_are_served(rt):
    r = requests.post(rt.url + "/generate", json={"text": ["a", "b"], "sampling_params": {"max_new_tokens": 2, "n": 4}},
                      headers=AUTH, timeout=60)
    assert r.status_code == 200 and len(r.json()) == MAX_BATCH
    r = requests.post(rt.url + "/v1/chat/completions", headers=AUTH, timeout=60,
                      json={"messages": [{"role": "user", "content": "a"}], "max_tokens": 2, "n": MAX_N})
    assert r.status_code == 200 and len(r.json()["choices"]) == MAX_N
    r = requests.post(rt.url + "/generate", json={"input_ids": [65] * (CONTEXT - 8), "sampling_params": {
        "max_new_tokens": 8}}, headers=AUTH, timeout=60)
    assert r.status_code == 200


def test_server_healthy_and_quiet_after_limit_violations(rt):
    """Every limit violation above, sent again here (so this holds when run alone), then: each
    was refused, the server still serves, and its log shows no server-side error for them."""
    log_start = len(rt.log_text())
    big = json.dumps({"text": "a" * MAX_BYTES})
    r = requests.post(rt.url + "/generate", data=big, headers={**AUTH, "Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 413
    for path, body, _ in LIMIT_CASES:
        assert requests.post(rt.url + path, json=body, headers=AUTH, timeout=60).status_code == 400, (path, body)
    assert requests.get(rt.url + "/health_generate", timeout=30).status_code == 200
    r = requests.post(rt.url + "/generate", json={"text": "ok", "sampling_params": {"max_new_tokens": 4,
                                                                                    "ignore_eos": True}},
                      headers=AUTH, timeout=60)
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 4
    log = rt.log_text()[log_start:]
    assert "/generate" in log  # the access log is on: the window holds these requests
    for needle in ("Traceback", "unexpected error", "engine step failed"):
        assert needle not in log, log[-4000:]


@pytest.mark.parametrize("argv", [["--max-request-bytes", "0"], ["--max-batch-size", "0"], ["--max-n", "-1"],
                                  ["--graceful-shutdown-timeout", "-1"], ["--graceful-shutdown-timeout", "nan"],
                                  ["--graceful-shutdown-timeout", "inf"]])
def test_limit_flags_reject_bad_values(argv):
    from bicache_sgl.server.args import parse_args

    with pytest.raises(SystemExit):
        parse_args(argv)


def test_limit_flags_defaults():
    from bicache_sgl.server.args import parse_args

    a = parse_args([])
    assert (a.max_request_bytes, a.max_batch_size, a.max_n, a.graceful_shutdown_timeout) == (32 << 20, 1024, 256, 5.0)
    b = parse_args(["--max-request-bytes", "1000", "--max-batch-size", "2", "--max-n", "3",
                    "--graceful-shutdown-timeout", "0"])
    assert (b.max_request_bytes, b.max_batch_size, b.max_n, b.graceful_shutdown_timeout) == (1000, 2, 3, 0.0)
    assert b.public_dict()["max_n"] == 3
