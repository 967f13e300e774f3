"""Faults against a real server: clients that hang up, /flush_cache under load, prefix pool
exhaustion and heavy eviction, requests whose processing raises, and SIGTERM with requests in
flight.

The fault server runs the ``naive`` prefix cache (every layer of a cached prefix is reused) with
a small pool, so cached state really flows into outputs. Outputs are compared in two ways:

* requests that pin ``bicache_depth: 0`` reuse nothing, so their greedy output must equal the
  output of the same request sent alone at any time;
* requests that reuse a prefix are compared with the same request run with the same cache
  state: ``/flush_cache``, then the prefix alone (``max_new_tokens: 0``), then the request.
"""

from __future__ import annotations

import http.client
import json
import signal
import socket
import threading
import time

import pytest
import requests

from reliability_support import (assert_pool_integrity, log_has_no_server_errors, port_is_free, serve,
                                 server_state, sse_frames, wait_idle)

POOL = 320
N_LAYERS = 4  # make_tiny_llada's default
# A chat template that, like many real ones, raises on input it cannot render: here a message
# that contains the model's mask token (it would corrupt a diffusion model's input).
TEMPLATE = ("{% for m in messages %}{% if '<|mask|>' in m['content'] %}"
            "{{ raise_exception('the mask token may not appear in a message') }}{% endif %}"
            "<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>{% endfor %}"
            "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serve(tmp_path_factory.mktemp("faults"), prefix_cache="naive", max_prefix_cache_tokens=POOL,
               max_running_requests=8, context_length=1536, chat_template=TEMPLATE, seed=2) as rt:
        yield rt


def post(rt, path: str, body=None, **kw) -> requests.Response:
    return requests.post(rt.url + path, json=body, timeout=120, **kw)


def gen(rt, text: str, params: dict, **extra) -> dict:
    r = post(rt, "/generate", {"text": text, "sampling_params": params, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def flush(rt) -> None:
    assert post(rt, "/flush_cache").status_code == 200


class Background:
    """Requests run on threads; ``results[name]`` is (status, parsed body or SSE frames)."""

    def __init__(self, rt):
        self.rt = rt
        self.results: dict[str, tuple[int, object]] = {}
        self.threads: list[threading.Thread] = []

    def start(self, name: str, path: str, body, stream: bool = False, raw: bytes | None = None) -> None:
        def run() -> None:
            try:
                if raw is not None:
                    r = requests.post(self.rt.url + path, data=raw, headers={"Content-Type": "application/json"},
                                      timeout=120)
                else:
                    r = requests.post(self.rt.url + path, json=body, stream=stream, timeout=120)
                if stream and r.status_code == 200:
                    self.results[name] = (r.status_code, sse_frames(r.iter_lines()))
                else:
                    try:
                        self.results[name] = (r.status_code, r.json())
                    except ValueError:
                        self.results[name] = (r.status_code, r.text)
            except Exception as e:  # noqa: BLE001 - recorded, asserted by the test
                self.results[name] = (-1, f"{type(e).__name__}: {e}")

        t = threading.Thread(target=run, daemon=True)
        t.start()
        self.threads.append(t)

    def join(self, timeout: float = 120) -> None:
        for t in self.threads:
            t.join(timeout)


def final_of(frames) -> dict:
    assert frames[-1] == "[DONE]", frames[-3:]
    return frames[-2]


# ------------------------------------------------------------------------------------------------
# a client disconnecting mid-request
# ------------------------------------------------------------------------------------------------

def test_disconnect_mid_request_leaves_batch_and_releases_locks(server):
    rt = server
    flush(rt)
    prefix = "A shared prefix for the long requests whose clients will hang up half way. "
    gen(rt, prefix, {"max_new_tokens": 0})  # cached, so the long requests lock it
    before = server_state(rt)
    long_params = {"max_new_tokens": 1400, "steps_per_block": 8, "ignore_eos": True, "temperature": 0}

    bystanders = Background(rt)
    by_params = {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True}
    for k in range(4):
        bystanders.start(f"b{k}", "/generate", {"text": f"bystander {k}: count slowly", "sampling_params": by_params,
                                                "bicache_depth": 0, "stream": k % 2 == 0}, stream=k % 2 == 0)
    streams = []
    for k in range(3):  # streaming: read the first frame, then hang up
        r = requests.post(rt.url + "/generate", json={"text": prefix + f"stream {k}", "stream": True,
                                                      "sampling_params": long_params}, stream=True, timeout=60)
        lines = r.iter_lines()  # kept: a dropped line iterator closes its response
        assert any(ln.startswith(b"data:") for ln in lines)
        streams.append((r, lines))
    sockets = []
    host, port = rt.url.split("//")[1].split(":")
    for k in range(3):  # non-streaming: a raw connection that sends the request and then goes away
        body = json.dumps({"text": prefix + f"plain {k}", "sampling_params": long_params}).encode()
        s = socket.create_connection((host, int(port)))
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
                  + str(len(body)).encode() + b"\r\n\r\n" + body)
        sockets.append(s)
    deadline = time.monotonic() + 20
    while True:
        st = server_state(rt)
        if st["num_running_reqs"] + st["num_waiting_reqs"] >= 6:
            break
        assert time.monotonic() < deadline, {k: v for k, v in st.items() if "req" in k}
        time.sleep(0.05)
    assert st["prefix_cache_protected_tokens"] > 0  # the running requests hold their prefix locks
    for r, _ in streams:
        r.close()
    for s in sockets:
        s.close()
    t_close = time.monotonic()
    idle = wait_idle(rt, timeout=20)
    left_after = time.monotonic() - t_close
    bystanders.join()

    # the six long requests left the batch early: far fewer tokens than 6 x 1400 were generated
    generated = idle["generated_tokens"] - before["generated_tokens"] - 4 * by_params["max_new_tokens"]
    print(f"\ndisconnect: 6 long requests left the batch {left_after:.2f} s after their clients hung up, "
          f"having generated {generated} of {6 * long_params['max_new_tokens']} tokens")
    assert generated < 6 * long_params["max_new_tokens"] // 2, generated
    assert left_after < 10, left_after
    assert_pool_integrity(idle)  # locks released, no slot in flight, nothing leaked
    # the bystanders were unaffected: complete, and equal to the same requests sent alone
    for k in range(4):
        status, body = bystanders.results[f"b{k}"]
        assert status == 200, body
        got = final_of(body) if k % 2 == 0 else body
        alone = gen(rt, f"bystander {k}: count slowly", by_params, bicache_depth=0)
        assert got["output_ids"] == alone["output_ids"] and got["text"] == alone["text"]
    assert requests.get(rt.url + "/health_generate", timeout=30).status_code == 200


# ------------------------------------------------------------------------------------------------
# /flush_cache while requests run
# ------------------------------------------------------------------------------------------------

def test_flush_cache_while_requests_run(server):
    rt = server
    docs = ["First cached document, about rivers and the towns along them, long enough to reuse. ",
            "Second cached document, about mountains and the roads across them, also reused. "]
    questions = ["Question: which river is longest?\nAnswer:", "Question: which pass is highest?\nAnswer:"]
    params = {"max_new_tokens": 320, "steps_per_block": 8, "ignore_eos": True, "temperature": 0}
    refs = []
    for doc, q in zip(docs, questions):  # the cache state each request will see: its document alone
        flush(rt)
        gen(rt, doc, {"max_new_tokens": 0})
        ref = gen(rt, doc + q, params)
        assert ref["meta_info"]["bicache_depth"] == N_LAYERS and ref["meta_info"]["reused_prefix_tokens"] > 0
        refs.append(ref)
    flush(rt)
    for doc in docs:
        gen(rt, doc, {"max_new_tokens": 0})
    streams = []
    for doc, q in zip(docs, questions):
        r = requests.post(rt.url + "/generate", json={"text": doc + q, "stream": True, "sampling_params": params},
                          stream=True, timeout=120)
        lines = r.iter_lines()
        first = next(ln for ln in lines if ln.startswith(b"data:"))  # admitted, first forward done
        streams.append((r, [first], lines))
    # flush (all three forms) while both run: only what they hold survives
    assert post(rt, "/flush_cache").status_code == 200
    st = server_state(rt)
    assert requests.get(rt.url + "/flush_cache", timeout=30).status_code == 200
    assert post(rt, "/flush_cache?timeout=5", {"empty_cache": True}).status_code == 200
    assert st["num_running_reqs"] == 2, "the requests finished before the flush; make them longer"
    assert st["prefix_cache_evictable_tokens"] == 0
    assert 0 < st["prefix_cache_used_tokens"] == st["prefix_cache_protected_tokens"]
    assert_pool_integrity(st, idle=False)
    for (r, head, lines), ref in zip(streams, refs):
        frames = sse_frames(head + list(lines))
        out = final_of(frames)
        assert out["output_ids"] == ref["output_ids"], "a flush changed a running request's output"
        assert out["meta_info"]["reused_prefix_tokens"] == ref["meta_info"]["reused_prefix_tokens"]
    idle = wait_idle(rt)
    assert_pool_integrity(idle)
    flush(rt)
    empty = server_state(rt)
    assert empty["prefix_cache_used_tokens"] == 0
    assert empty["prefix_cache_free_tokens"] == empty["prefix_cache_capacity_tokens"] == POOL


# ------------------------------------------------------------------------------------------------
# prefix pool exhaustion and heavy eviction
# ------------------------------------------------------------------------------------------------

def test_pool_exhaustion_and_heavy_eviction(server):
    rt = server
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    # distinct first characters: no document shares a cached prefix with another one (a shared
    # prefix would be reused from whichever prompt cached it first, which is a different state)
    pairs = [(f"{k} Document: " + "abcdefghij"[k:] * 8 + f" (version {k}). ", f"Summary of {k}:") for k in range(5)]
    refs = []
    for doc, q in pairs:  # reference: the document alone in a clean cache, then the request
        flush(rt)
        gen(rt, doc, {"max_new_tokens": 0})
        ref = gen(rt, doc + q, params)
        assert ref["meta_info"]["reused_prefix_tokens"] > 0
        refs.append(ref)
    before = server_state(rt)

    # 40 concurrent requests with distinct prompts want far more slots than the pool has; the
    # running ones hold theirs, so later ones find no room and run without caching
    churn = Background(rt)
    specs = {}
    for k in range(40):
        text = f"churn {k}: " + "".join(chr(0x61 + (k * 7 + j) % 26) for j in range(60 + 3 * k))
        pinned = k % 2 == 0
        specs[f"c{k}"] = (text, pinned)
        churn.start(f"c{k}", "/generate", {"text": text, "sampling_params": {**params, "max_new_tokens": 16},
                                           "stream": k % 3 == 0, **({"bicache_depth": 0} if pinned else {})},
                    stream=k % 3 == 0)
    peak_used, low_free = 0, POOL
    while any(t.is_alive() for t in churn.threads):
        st = server_state(rt)
        peak_used = max(peak_used, st["prefix_cache_used_tokens"])
        low_free = min(low_free, st["prefix_cache_free_tokens"])
        time.sleep(0.02)
    churn.join()
    idle = wait_idle(rt)
    assert_pool_integrity(idle)
    assert peak_used <= POOL and low_free < 64, (peak_used, low_free)
    assert idle["evicted_tokens"] - before["evicted_tokens"] > 2 * POOL, "no heavy eviction happened"
    for name, (text, pinned) in specs.items():
        status, body = churn.results[name]
        assert status == 200, (name, body)
        out = final_of(body) if isinstance(body, list) else body
        assert out["meta_info"]["completion_tokens"] == 16
        if pinned:
            alone = gen(rt, text, {**params, "max_new_tokens": 16}, bicache_depth=0)
            assert out["output_ids"] == alone["output_ids"], name

    # after the churn every slot has been recycled many times: cached state read back through
    # recycled slots must still be exactly what was written
    for k, ((doc, q), ref) in enumerate(zip(pairs, refs)):
        gen(rt, f"filler {k}: " + "zyxwvutsrq" * 12, {"max_new_tokens": 0})  # evicts older entries
        gen(rt, doc, {"max_new_tokens": 0})
        out = gen(rt, doc + q, params)
        assert out["meta_info"]["reused_prefix_tokens"] == ref["meta_info"]["reused_prefix_tokens"]
        assert out["output_ids"] == ref["output_ids"], f"pair {k}: reused state differs after eviction"
    assert_pool_integrity(wait_idle(rt))


# ------------------------------------------------------------------------------------------------
# an exception inside one request's processing
# ------------------------------------------------------------------------------------------------

BAD = [
    # (name, path, JSON body or raw bytes, text the error message must contain)
    ("invalid utf-8 body", "/generate", b'{"text": "caf\xe9 \xff\xfe", "sampling_params": {"max_new_tokens": 8}}',
     "UTF-8"),
    ("lone surrogate", "/generate", b'{"text": "half a pair: \\ud800", "sampling_params": {"max_new_tokens": 8}}',
     "surrogate"),
    ("chat template raises", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hello <|mask|> there"}], "max_tokens": 8},
     "the mask token may not appear in a message"),
    # out-of-vocabulary stop ids with min_new_tokens used to raise IndexError inside the engine step
    ("stop id past vocab (native)", "/generate",
     {"text": "x", "sampling_params": {"max_new_tokens": 8, "min_new_tokens": 2, "stop_token_ids": [100000]}},
     "stop_token_ids"),
    ("stop id past vocab (openai)", "/v1/completions",
     {"prompt": "x", "max_tokens": 8, "min_tokens": 2, "stop_token_ids": [100000]}, "stop_token_ids"),
    ("seed too large", "/generate", {"text": "x", "sampling_params": {"seed": 2**64}}, "seed"),
]


def test_failing_request_does_not_affect_others(server):
    rt = server
    params = {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True}
    bg = Background(rt)
    for k in range(6):
        bg.start(f"good{k}", "/generate", {"text": f"good request {k}", "sampling_params": params, "bicache_depth": 0,
                                           "stream": k % 2 == 1}, stream=k % 2 == 1)
    for name, path, body, _ in BAD:
        if isinstance(body, bytes):
            bg.start(name, path, None, raw=body)
        else:
            bg.start(name, path, body)
    bg.join()
    for name, path, body, needle in BAD:
        status, resp = bg.results[name]
        assert 400 <= status < 500, (name, status, resp)
        assert needle.lower() in resp["error"]["message"].lower(), (name, resp)
    for k in range(6):
        status, body = bg.results[f"good{k}"]
        assert status == 200, body
        out = final_of(body) if k % 2 == 1 else body
        alone = gen(rt, f"good request {k}", params, bicache_depth=0)
        assert out["output_ids"] == alone["output_ids"]
    assert requests.get(rt.url + "/health_generate", timeout=30).status_code == 200
    chat = post(rt, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 8})
    assert chat.status_code == 200
    assert_pool_integrity(wait_idle(rt))


def test_no_server_side_errors_logged(server):
    """Everything above was answered without an unexpected server error."""
    log_has_no_server_errors(server)


# ------------------------------------------------------------------------------------------------
# SIGTERM with requests in flight
# ------------------------------------------------------------------------------------------------

GRACE = 3.0


def test_sigterm_drains_then_exits_and_releases_port(tmp_path):
    """SIGTERM with 9 requests in flight: the one that can finish within --graceful-shutdown-timeout
    finishes; the others (running or queued) are answered with an error (503, or a stream that
    ends with finish_reason abort and [DONE]); new requests are refused; the process exits and
    its port can be bound again."""
    with serve(tmp_path, prefix_cache="off", max_running_requests=6, context_length=4096,
               graceful_shutdown_timeout=GRACE, seed=4) as rt:
        proc, port = rt.proc, rt.port
        bg = Background(rt)
        # ~1500 forwards each (~20 s here, far past the grace period); 32-token blocks refreshed once
        # per block keep each forward cheap, so the short request below advances quickly beside them
        long_params = {"max_new_tokens": 1536, "block_length": 32, "steps_per_block": 32, "ignore_eos": True}

        def start_long(k: int) -> None:
            bg.start(f"long{k}", "/generate", {"text": f"long {k}", "stream": k % 2 == 0,
                                               "sampling_params": long_params}, stream=k % 2 == 0)

        def wait_for(running: int, waiting: int) -> None:
            deadline = time.monotonic() + 20
            while True:
                st = server_state(rt)
                if st["num_running_reqs"] >= running and st["num_waiting_reqs"] >= waiting:
                    return
                assert time.monotonic() < deadline, st
                time.sleep(0.02)

        for k in range(5):
            start_long(k)
        wait_for(5, 0)
        # takes the sixth slot; can finish within the grace period
        short = requests.post(rt.url + "/generate", json={"text": "short", "stream": True, "sampling_params": {
            "max_new_tokens": 96, "steps_per_block": 4, "ignore_eos": True}}, stream=True, timeout=60)
        short_lines = short.iter_lines()
        head = [next(ln for ln in short_lines if ln.startswith(b"data:"))]
        for k in range(5, 8):  # no slot left: these wait in the queue
            start_long(k)
        wait_for(6, 2)  # the short one still runs (else a queued one took its slot and 3 wait)
        host, _ = rt.url.split("//")[1].split(":")
        keep_alive = http.client.HTTPConnection(host, port, timeout=30)  # open before the signal
        keep_alive.request("GET", "/health")
        assert keep_alive.getresponse().read() == b""
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        # during the drain: a new connection is refused, a request on an open one gets 503
        with pytest.raises(requests.ConnectionError):
            requests.post(rt.url + "/generate", json={"text": "late"}, timeout=10)
        keep_alive.request("POST", "/generate", body=b'{"text": "late"}', headers={"Content-Type": "application/json"})
        late = keep_alive.getresponse()
        assert late.status == 503 and b"shutting down" in late.read()
        keep_alive.close()
        short_frames = sse_frames(head + list(short_lines))
        rc = proc.wait(GRACE + 15)
        exit_s = time.monotonic() - t0
        bg.join(30)
        log = rt.log_text()

    print(f"\nsigterm: exit code {rc}, {exit_s:.1f} s after the signal (grace {GRACE} s)")
    assert rc in (0, -signal.SIGTERM), rc
    assert exit_s < GRACE + 10, exit_s
    # the short request finished normally during the grace period
    out = final_of(short_frames)
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 96}, out["meta_info"]
    # the long ones (5 running, 3 queued) were answered with an error, never cut off
    for k in range(8):
        status, body = bg.results[f"long{k}"]
        if k % 2 == 0:
            assert status == 200, body  # a stream: it had started
            last = final_of(body)
            assert last["meta_info"]["finish_reason"]["type"] == "abort", last["meta_info"]
            assert "shutting down" in last["meta_info"]["finish_reason"]["message"]
        else:
            assert status == 503, body
            assert "shutting down" in body["error"]["message"]
    assert "aborting 8 request(s) still running" in log
    assert "Traceback" not in log
    assert port_is_free(port), f"port {port} still in use after the server exited"
