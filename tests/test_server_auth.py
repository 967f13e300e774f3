"""A second live server: --api-key with --admin-api-key (SGLang's three auth levels),
--incremental-streaming-output, --disable-radix-cache, --max-queued-requests, and
``bicache_sgl.Runtime`` as a context manager (start, endpoint for the sglang frontend, shutdown)."""

from __future__ import annotations

import json
import socket
import time

import pytest

requests = pytest.importorskip("requests")

KEY = "s3cret-key-for-tests"
AUTH = {"Authorization": f"Bearer {KEY}"}
ADMIN = "adm1n-key-for-tests"
ADMIN_AUTH = {"Authorization": f"Bearer {ADMIN}"}


@pytest.fixture(scope="module")
def rt(tmp_path_factory):
    from bicache_sgl.runtime import Runtime
    from bicache_sgl.testing import make_tiny_llada

    folder = tmp_path_factory.mktemp("auth_llada")
    model = make_tiny_llada(folder, seed=3)
    with Runtime(model_path=model, api_key=KEY, admin_api_key=ADMIN, incremental_streaming_output=True,
                 disable_radix_cache=True, block_length=8, steps_per_block=4, threshold="none", num_threads=1,
                 max_queued_requests=3, max_running_requests=1,
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
    assert info.status_code == 200 and KEY not in info.text and ADMIN not in info.text
    assert info.json()["admin_api_key"] == "<redacted>"
    assert info.json()["internal_states"][0]["prefix_cache"] == "off"
    assert KEY not in rt.log_text() and ADMIN not in rt.log_text()


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


# ------------------------------------------------------------------------------------------------
# --admin-api-key: SGLang's three levels (bicache_sgl/server/auth.py, docs/server.md)
# ------------------------------------------------------------------------------------------------

def test_auth_levels_decision_table():
    """Every (level, configured keys, key sent) case of SGLang's decide_request_auth."""
    from bicache_sgl.server.auth import AuthLevel, decide

    N, Opt, F = AuthLevel.NORMAL, AuthLevel.ADMIN_OPTIONAL, AuthLevel.ADMIN_FORCE
    u, a = b"U", b"A"
    cases = [
        # (level, api_key, admin_api_key, sent, expected: None = allowed)
        (N, None, None, b"", None), (Opt, None, None, b"", None), (F, None, None, a, 403),
        (N, "U", None, b"", 401), (N, "U", None, u, None), (Opt, "U", None, u, None), (Opt, "U", None, a, 401),
        (F, "U", None, u, 403),
        (N, None, "A", b"", None), (Opt, None, "A", b"", 401), (Opt, None, "A", a, None), (F, None, "A", a, None),
        (F, None, "A", u, 401),
        (N, "U", "A", u, None), (N, "U", "A", a, 401), (Opt, "U", "A", u, 401), (Opt, "U", "A", a, None),
        (Opt, "U", "A", b"", 401), (F, "U", "A", u, 401), (F, "U", "A", a, None),
    ]
    for level, api, admin, sent, want in cases:
        got = decide(level, path="/x", method="POST", given=sent, api_key=api, admin_api_key=admin)
        assert got == want, (level, api, admin, sent, got)
    for path in ("/health", "/health_generate", "/ready", "/metrics"):  # always open, even ADMIN_FORCE
        assert decide(F, path=path, method="GET", given=b"", api_key="U", admin_api_key="A") is None
    assert decide(Opt, path="/x", method="OPTIONS", given=b"", api_key="U", admin_api_key="A") is None


def test_route_levels_read_from_the_app():
    """The levels come from the handlers the app really serves: the control routes are
    ADMIN_OPTIONAL (as in SGLang), generation and info routes NORMAL."""
    from types import SimpleNamespace

    from bicache_sgl.server.app import create_app
    from bicache_sgl.server.args import ServerArgs
    from bicache_sgl.server.auth import AuthLevel, route_levels

    stub = SimpleNamespace(tokenizer=None, model_path="m", context_length=64, model_config=None,
                           submit_returns_at_once=False)
    levels = route_levels(create_app(stub, ServerArgs()).routes)
    admin = {p for p, lv in levels.items() if lv is AuthLevel.ADMIN_OPTIONAL}
    assert admin == {"/abort_request", "/flush_cache", "/start_profile", "/stop_profile"}
    assert not any(lv is AuthLevel.ADMIN_FORCE for lv in levels.values())
    for p in ("/generate", "/v1/completions", "/v1/chat/completions", "/get_server_info", "/v1/models"):
        assert levels[p] is AuthLevel.NORMAL


STREAM = {"text": "bystander", "sampling_params": {"max_new_tokens": 96, "temperature": 0, "ignore_eos": True},
          "stream": True}


def _open_stream(rt, headers=AUTH, max_new_tokens=None):
    """A bystander's stream, read up to its first chunk (so it is running on the server)."""
    body = STREAM if max_new_tokens is None else {
        **STREAM, "sampling_params": {**STREAM["sampling_params"], "max_new_tokens": max_new_tokens}}
    r = requests.post(rt.url + "/generate", json=body, headers=headers, stream=True, timeout=120)
    assert r.status_code == 200
    lines = r.iter_lines(decode_unicode=True)
    first = next(json.loads(ln[5:]) for ln in lines if ln.startswith("data:"))
    return r, lines, first


def _finish(lines, first):
    chunks = [first] + [json.loads(ln[5:]) for ln in lines if ln.startswith("data:") and ln[5:].strip() != "[DONE]"]
    ids = [t for c in chunks for t in c["output_ids"]]
    return ids, chunks[-1]["meta_info"]["finish_reason"]


def test_api_key_cannot_abort_or_flush_and_bystanders_are_unchanged(rt):
    reference = requests.post(rt.url + "/generate", json={**STREAM, "stream": False}, headers=AUTH,
                              timeout=120).json()
    assert reference["meta_info"]["finish_reason"]["type"] == "length"
    r, lines, first = _open_stream(rt)
    try:
        # a client holding only the API key (or nothing, or a wrong key) is refused on the admin routes
        for headers in (AUTH, {"X-API-Key": KEY}, {}, {"Authorization": "Bearer nope"}):
            for path, body in (("/abort_request", {"abort_all": True}), ("/abort_request", {"rid": "someone-else"}),
                               ("/flush_cache", None), ("/start_profile", None)):
                got = requests.post(rt.url + path, json=body, headers=headers, timeout=30)
                assert got.status_code == 401 and got.json() == {"error": "Unauthorized"}, (path, headers)
        ids, reason = _finish(lines, first)
    finally:
        r.close()
    # the bystander was not touched: its answer is the one it gets alone
    assert reason["type"] == "length" and ids == reference["output_ids"]
    # the admin key is not an API key: generation routes still want the API key
    assert requests.post(rt.url + "/generate", json={"text": "x"}, headers=ADMIN_AUTH, timeout=30).status_code == 401


def test_admin_key_aborts_all_and_flushes(rt):
    r, lines, first = _open_stream(rt)
    try:
        got = requests.post(rt.url + "/abort_request", json={"abort_all": True}, headers=ADMIN_AUTH, timeout=30)
        assert got.status_code == 200
        ids, reason = _finish(lines, first)
    finally:
        r.close()
    assert reason["type"] == "abort" and len(ids) < STREAM["sampling_params"]["max_new_tokens"]
    got = requests.post(rt.url + "/flush_cache?timeout=30", headers={"X-API-Key": ADMIN}, timeout=60)
    assert got.status_code == 200 and "Cache flushed" in got.text
    assert rt.flush_cache(timeout=30) is not None  # Runtime sends the admin key to the admin route
    got = requests.post(rt.url + "/abort_request", json={"rid": "no-such-request"}, headers=ADMIN_AUTH, timeout=30)
    assert got.status_code == 200


def test_hang_up_aborts_own_request_without_admin_key(rt):
    """A client cancels its own request by closing the connection: no route, no key needed. The
    request is cut short: fewer tokens are generated in all than it asked for (one forward can
    finish at most a block)."""
    before = rt.internal_state()
    long = {**STREAM, "rid": "hang-up-own", "sampling_params": {**STREAM["sampling_params"], "max_new_tokens": 400}}
    r = requests.post(rt.url + "/generate", json=long, headers=AUTH, stream=True, timeout=120)
    assert r.status_code == 200
    assert any(ln.startswith(b"data:") for ln in r.iter_lines())
    r.close()
    deadline = time.monotonic() + 60
    while (st := rt.internal_state())["num_running_reqs"] or st["num_waiting_reqs"]:
        assert time.monotonic() < deadline, "the hung-up request kept running"
        time.sleep(0.05)
    assert st["generated_tokens"] - before["generated_tokens"] < 400
    # its rid is free again (the engine let go of it)
    again = requests.post(rt.url + "/generate", json={"text": "x", "rid": "hang-up-own", "sampling_params": {
        "max_new_tokens": 1}}, headers=AUTH, timeout=60)
    assert again.status_code == 200


# ------------------------------------------------------------------------------------------------
# /v1/completions with max_tokens 0, echo and logprobs: lm-eval's scoring call
# ------------------------------------------------------------------------------------------------

def test_echo_with_zero_tokens_scores_the_prompt(rt):
    """OpenAI's meaning: the prompt's own logprobs, left to right (entry i = log p(token i |
    tokens before it), the first null), nothing generated. Each entry equals the native input
    logprob of that position scored alone (logprob_start_len = i). The prompt is three tokens: its
    two scoring requests fit this server's queue of three (--max-queued-requests)."""
    prompt = "Que"
    r = requests.post(rt.url + "/v1/completions", headers=AUTH, timeout=60,
                      json={"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1})
    assert r.status_code == 200, r.text
    out = r.json()
    choice = out["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 0 and out["usage"]["prompt_tokens"] == len(lp["tokens"])
    assert "".join(lp["tokens"]) == prompt and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    ids = requests.post(rt.url + "/generate", headers=AUTH, timeout=60, json={
        "text": prompt, "sampling_params": {"max_new_tokens": 0}}).json()["meta_info"]["prompt_tokens"]
    assert ids == len(lp["tokens"])
    for i in range(1, len(lp["tokens"])):
        native = requests.post(rt.url + "/generate", headers=AUTH, timeout=60, json={
            "text": prompt, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
            "logprob_start_len": i}).json()["meta_info"]["input_token_logprobs"][0][0]
        assert lp["token_logprobs"][i] == pytest.approx(native, abs=1e-5), i
        assert len(lp["top_logprobs"][i]) == 1


@pytest.mark.parametrize("stream", [False, True])
def test_echo_scoring_aborted_by_the_admin_is_an_abort_not_a_500(rt, stream):
    """The scoring requests of an echo call wait behind a running request (one slot); the admin's
    abort_all ends them before their forward. The answer is the abort as the OpenAI routes give it
    (a 503 ServiceUnavailableError saying the request was aborted: "abort" is not one of OpenAI's
    finish reasons, docs/server.md), with no made-up logprobs, not a 500 (it was an IndexError)."""
    import threading

    r, lines, first = _open_stream(rt, max_new_tokens=2000)  # holds the only running slot until aborted
    got: dict = {}

    def echo() -> None:
        got["r"] = requests.post(rt.url + "/v1/completions", headers=AUTH, timeout=120, json={
            "prompt": "Que", "max_tokens": 0, "echo": True, "logprobs": 1, "stream": stream})

    th = threading.Thread(target=echo)
    th.start()
    try:
        deadline = time.monotonic() + 30
        while rt.internal_state()["num_waiting_reqs"] == 0:
            assert time.monotonic() < deadline, "the scoring requests never queued"
            time.sleep(0.02)
        assert requests.post(rt.url + "/abort_request", json={"abort_all": True}, headers=ADMIN_AUTH,
                             timeout=30).status_code == 200
        th.join(60)
        _finish(lines, first)
    finally:
        r.close()
    resp = got["r"]
    if resp.status_code == 200:  # a stream already under way ends with an error frame
        assert stream, resp.text[:500]
        frames = [json.loads(ln[5:]) for ln in resp.text.splitlines()
                  if ln.startswith("data:") and ln[5:].strip() != "[DONE]"]
        assert all(c.get("logprobs") is None for f in frames for c in f.get("choices", []))
        error = frames[-1]["error"]
    else:
        assert resp.status_code == 503, resp.text[:500]
        error = resp.json()["error"]
    assert error["code"] == 503 and error["type"] == "ServiceUnavailableError", error
    assert "abort" in error["message"], error


@pytest.mark.parametrize("size", [100_000, 900_000])
def test_large_body_to_an_admin_route_with_a_user_key_gets_its_401(rt, size):
    """A client with only the API key posting a large body to an admin-only route reads its 401,
    even when it reads the answer only after sending everything. The server reads the body before
    answering and closing: a socket closed with unread bytes is reset by the kernel, and a reset
    drops the answer the client had not read yet (ConnectionResetError under hostile load)."""
    host, port = rt.url.split("//")[1].rsplit(":", 1)
    body = json.dumps({"abort_all": True, "pad": "x" * size}).encode()
    head = (f"POST /abort_request HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    for _ in range(3):
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(head + body)
            time.sleep(0.3)  # the answer (and, before the fix, the reset) arrives before we read
            got = b""
            while chunk := sock.recv(65536):
                got += chunk
        status, _, rest = got.partition(b"\r\n")
        assert status.startswith(b"HTTP/1.1 401"), got[:200]
        assert json.loads(rest.split(b"\r\n\r\n", 1)[1]) == {"error": "Unauthorized"}
    # the server still serves
    assert requests.get(rt.url + "/health", timeout=30).status_code == 200
