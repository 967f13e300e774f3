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

import contextlib
import http.client
import json
import signal
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import requests
from reliability_support import assert_pool_integrity, port_is_free, serve, server_state, sse_frames, wait_idle

from bicache_sgl.config import SamplingParams

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
            except Exception as e:
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


def wait_state(rt, cond, what: str, timeout: float = 30) -> dict:
    """Poll /get_server_info until ``cond(state)`` holds (fails the test after ``timeout`` s)."""
    deadline = time.monotonic() + timeout
    while True:
        st = server_state(rt)
        if cond(st):
            return st
        assert time.monotonic() < deadline, (f"waiting for {what}", {k: v for k, v in st.items() if "req" in k})
        time.sleep(0.02)


class LogWindow:
    """The part of the server log written since this object was made: each test checks the
    server errors of its own requests, whatever ran before it (or did not)."""

    def __init__(self, rt):
        self.rt = rt
        self.start = len(rt.log_text())

    def text(self) -> str:
        return self.rt.log_text()[self.start:]

    def assert_no_server_errors(self) -> None:
        new = self.text()
        for needle in ("Traceback", "unexpected error", "engine step failed", "failed while planning"):
            assert needle not in new, new[-4000:]


# ------------------------------------------------------------------------------------------------
# a client disconnecting mid-request
# ------------------------------------------------------------------------------------------------

def test_disconnect_mid_request_leaves_batch_and_releases_locks(server):
    """Ten long requests whose clients hang up: eight running (four streams after their first
    frame, four plain requests on raw sockets) and two streams still queued behind them. The
    queued ones leave the queue, the running ones leave the batch early, every cache lock and rid
    is released, and four requests queued behind them all are then served as if alone.

    "Early" is proven with the engine's forward counter, not a clock: a long request needs
    LONG forwards to finish by itself (one token per forward), so if the engine runs fewer than
    LONG forwards in total until it is idle again, none of them can have run to its end: each
    was cut short, and nothing but its client going away ends it."""
    rt = server
    log = LogWindow(rt)
    flush(rt)
    prefix = "A shared prefix for the long requests whose clients will hang up half way. "
    gen(rt, prefix, {"max_new_tokens": 0})  # cached, so the long requests lock it
    long_tokens = 1400  # LONG
    long_params = {"max_new_tokens": long_tokens, "steps_per_block": 8, "ignore_eos": True, "temperature": 0}
    before = wait_idle(rt)

    def open_stream(rid: str):
        r = requests.post(rt.url + "/generate", json={"text": prefix + rid, "stream": True, "rid": rid,
                                                      "sampling_params": long_params}, stream=True, timeout=60)
        assert r.status_code == 200, r.text
        return r, r.iter_lines()  # the line iterator is kept: dropping it closes its response

    running = [f"hangup-stream-{k}" for k in range(4)] + [f"hangup-plain-{k}" for k in range(4)]
    queued = [f"hangup-queued-{k}" for k in range(2)]
    streams = [open_stream(rid) for rid in running[:4]]
    sockets = []
    host, port = rt.url.split("//")[1].split(":")
    for rid in running[4:]:  # non-streaming: a raw connection that sends the request and then goes away
        body = json.dumps({"text": prefix + rid, "rid": rid, "sampling_params": long_params}).encode()
        s = socket.create_connection((host, int(port)))
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
                  + str(len(body)).encode() + b"\r\n\r\n" + body)
        sockets.append(s)
    wait_state(rt, lambda st: st["num_running_reqs"] == 8, "eight long requests in the eight slots")
    for _, lines in streams:  # the streams hang up after their first frame
        assert any(ln.startswith(b"data:") for ln in lines)
    queued_streams = [open_stream(rid) for rid in queued]
    wait_state(rt, lambda st: st["num_waiting_reqs"] == 2, "two long requests queued")
    # the engine holds each of them: a new request with the same rid is refused
    for rid in running + queued:
        r = post(rt, "/generate", {"text": "probe", "rid": rid, "sampling_params": {"max_new_tokens": 0}})
        assert r.status_code == 400 and "already in use" in r.text, (rid, r.status_code, r.text)

    bystanders = Background(rt)
    by_params = {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True}
    for k in range(4):
        bystanders.start(f"b{k}", "/generate", {"text": f"bystander {k}: count slowly", "sampling_params": by_params,
                                                "bicache_depth": 0, "stream": k % 2 == 0}, stream=k % 2 == 0)
    st = wait_state(rt, lambda st: st["num_waiting_reqs"] == 6, "the bystanders queued")
    assert st["num_running_reqs"] == 8 and st["prefix_cache_protected_tokens"] > 0  # the running hold their locks
    for r, _ in queued_streams:  # first the queued ones: they leave the queue (no slot frees meanwhile)
        r.close()
    wait_state(rt, lambda st: st["num_waiting_reqs"] == 4, "the queued hang-ups to leave the queue")
    for r, _ in streams:
        r.close()
    for s in sockets:
        s.close()
    idle = wait_idle(rt, timeout=60)  # a guard only: the proof is the forward count below
    bystanders.join()

    forwards = idle["num_forward_passes"] - before["num_forward_passes"]
    generated = idle["generated_tokens"] - before["generated_tokens"] - 4 * by_params["max_new_tokens"]
    print(f"\ndisconnect: the engine ran {forwards} forwards in all (a long request needs {long_tokens}); "
          f"the hung-up requests generated {generated} of {10 * long_tokens} tokens")
    assert forwards < long_tokens, f"{forwards} forwards: a long request may have run to its end"
    assert_pool_integrity(idle)  # locks released, no slot in flight, nothing leaked
    # the engine let go of every rid (running or queued when its client left): each can be used again
    for rid in running + queued:
        r = post(rt, "/generate", {"text": "probe", "rid": rid, "sampling_params": {"max_new_tokens": 0}})
        assert r.status_code == 200, f"the engine still holds {rid}: {r.text}"
    # the bystanders were unaffected: complete, and equal to the same requests sent alone
    for k in range(4):
        status, body = bystanders.results[f"b{k}"]
        assert status == 200, body
        got = final_of(body) if k % 2 == 0 else body
        assert got["meta_info"]["finish_reason"] == {"type": "length", "length": by_params["max_new_tokens"]}
        alone = gen(rt, f"bystander {k}: count slowly", by_params, bicache_depth=0)
        assert got["output_ids"] == alone["output_ids"] and got["text"] == alone["text"]
    assert requests.get(rt.url + "/health_generate", timeout=30).status_code == 200
    log.assert_no_server_errors()


# ------------------------------------------------------------------------------------------------
# /flush_cache while requests run
# ------------------------------------------------------------------------------------------------

def stream_first_tokens(rt, body: dict, k: int, lines=None, head=None) -> dict:
    """Read a native stream (cumulative frames) until it has ``k`` output tokens, abort the
    request by its rid (/abort_request), read on to [DONE]; returns the last frame. The request
    asks for far more than ``k`` tokens, so it cannot end by itself first on any machine."""
    if lines is None:
        r = requests.post(rt.url + "/generate", json={**body, "stream": True}, stream=True, timeout=120)
        assert r.status_code == 200, r.text
        lines = r.iter_lines()
    frames = list(head or [])
    for ln in lines:
        frames += sse_frames([ln])
        if frames and isinstance(frames[-1], dict) and len(frames[-1]["output_ids"]) >= k:
            break
    assert frames and frames[-1] != "[DONE]" and frames[-1]["meta_info"]["finish_reason"] is None, frames[-2:]
    assert post(rt, "/abort_request", {"rid": body["rid"]}).status_code == 200
    last = final_of(frames + sse_frames(lines))
    assert last["meta_info"]["finish_reason"]["type"] == "abort", last["meta_info"]
    assert len(last["output_ids"]) >= k
    return last


def test_flush_cache_while_requests_run(server):
    """Two requests that reuse cached documents are running when /flush_cache comes (POST, GET,
    with a body and ?timeout): only the prefixes they hold survive, and their outputs, also the
    blocks generated after the flush, equal their outputs without the flush."""
    rt = server
    log = LogWindow(rt)
    docs = ["First cached document, about rivers and the towns along them, long enough to reuse. ",
            "Second cached document, about mountains and the roads across them, also reused. "]
    questions = ["Question: which river is longest?\nAnswer:", "Question: which pass is highest?\nAnswer:"]
    # 640 tokens, 4 a forward: 160 forwards, far more than the few that pass between a request's
    # first block and the flush, so both still run at the flush on any machine; the first 128
    # tokens (32 forwards, most of them after the flush) are compared, then each is aborted
    params = {"max_new_tokens": 640, "ignore_eos": True, "temperature": 0}
    k = 128
    refs = []
    for n, (doc, q) in enumerate(zip(docs, questions)):  # the cache state each request will see: its document
        flush(rt)
        gen(rt, doc, {"max_new_tokens": 0})
        ref = stream_first_tokens(rt, {"text": doc + q, "sampling_params": params, "rid": f"flush-ref-{n}"}, k)
        assert ref["meta_info"]["bicache_depth"] == N_LAYERS and ref["meta_info"]["reused_prefix_tokens"] > 0
        refs.append(ref)
    wait_idle(rt)
    flush(rt)
    for doc in docs:
        gen(rt, doc, {"max_new_tokens": 0})
    streams = []
    for n, (doc, q) in enumerate(zip(docs, questions)):
        body = {"text": doc + q, "stream": True, "sampling_params": params, "rid": f"flush-run-{n}"}
        r = requests.post(rt.url + "/generate", json=body, stream=True, timeout=120)
        lines = r.iter_lines()
        first = next(ln for ln in lines if ln.startswith(b"data:"))  # admitted, first block done
        streams.append((body, sse_frames([first]), lines))
    # flush (all three forms) while both run: only what they hold survives
    assert post(rt, "/flush_cache").status_code == 200
    st = server_state(rt)
    assert requests.get(rt.url + "/flush_cache", timeout=30).status_code == 200
    assert post(rt, "/flush_cache?timeout=5", {"empty_cache": True}).status_code == 200
    assert st["num_running_reqs"] == 2, st["num_running_reqs"]
    assert st["prefix_cache_evictable_tokens"] == 0
    assert 0 < st["prefix_cache_used_tokens"] == st["prefix_cache_protected_tokens"]
    assert_pool_integrity(st, idle=False)
    for (body, head, lines), ref in zip(streams, refs):
        out = stream_first_tokens(rt, body, k, lines=lines, head=head)
        assert out["output_ids"][:k] == ref["output_ids"][:k], "a flush changed a running request's output"
        assert out["meta_info"]["reused_prefix_tokens"] == ref["meta_info"]["reused_prefix_tokens"]
    idle = wait_idle(rt)
    assert_pool_integrity(idle)
    flush(rt)
    empty = server_state(rt)
    assert empty["prefix_cache_used_tokens"] == empty["prefix_cache_stored_layer_tokens"] == 0
    assert empty["prefix_cache_free_tokens"] == empty["prefix_cache_capacity_tokens"]
    # --max-prefix-cache-tokens counts tokens at full depth: POOL x N_LAYERS layer-tokens
    assert empty["prefix_cache_free_layer_tokens"] == empty["prefix_cache_capacity_layer_tokens"] == POOL * N_LAYERS
    log.assert_no_server_errors()


# ------------------------------------------------------------------------------------------------
# prefix pool exhaustion and heavy eviction
# ------------------------------------------------------------------------------------------------

def test_pool_exhaustion_and_heavy_eviction(server):
    rt = server
    log = LogWindow(rt)
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
    samples = []  # as many as the machine's speed allows (maybe none): bounds only, checked on each
    while any(t.is_alive() for t in churn.threads):
        samples.append(server_state(rt))
        time.sleep(0.02)
    churn.join()
    idle = wait_idle(rt)
    samples.append(idle)
    assert_pool_integrity(idle)
    for st in samples:  # never over budget (--max-prefix-cache-tokens: tokens at full depth)
        assert st["prefix_cache_stored_layer_tokens"] <= st["prefix_cache_capacity_layer_tokens"] == POOL * N_LAYERS
    # the pool ran out of room again and again: it evicts only to make room (no flush meanwhile),
    # and it evicted more than twice its size
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
    log.assert_no_server_errors()


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
    ("seed too large", "/generate", {"text": "x", "sampling_params": {"seed": 2**64}}, "seed"),
]


def test_stop_ids_past_the_vocabulary_are_served_as_sglang_does(server):
    """Out-of-vocabulary stop ids with min_new_tokens once raised IndexError inside the engine step;
    SGLang accepts them (they can never be generated), so they are dropped and the request served."""
    for path, body in (("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 8, "min_new_tokens": 2,
                                                                         "ignore_eos": True,
                                                                         "stop_token_ids": [100000]}}),
                       ("/v1/completions", {"prompt": "x", "max_tokens": 8, "min_tokens": 2, "ignore_eos": True,
                                            "stop_token_ids": [100000]})):
        r = requests.post(server.url + path, json=body, timeout=60)
        assert r.status_code == 200, (path, r.text)
        usage = r.json().get("usage") or {}
        meta = r.json().get("meta_info") or {}
        assert (usage.get("completion_tokens") or meta.get("completion_tokens")) == 8


def test_failing_request_does_not_affect_others(server):
    """Requests that fail in parsing, in the chat template and in engine validation, sent beside
    six good ones: each gets a 4xx naming its cause, the good ones their output alone, and the
    server log shows no server-side error for any of them."""
    rt = server
    log = LogWindow(rt)
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
    for name, _, _, needle in BAD:
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
    log.assert_no_server_errors()  # each failure was answered, none escaped as a server error


# ------------------------------------------------------------------------------------------------
# a request failing at admission (fault injection on the real pool)
# ------------------------------------------------------------------------------------------------

FAULT = "injected pool fault"
GOOD_PARAMS = {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True}


def fault_engine(model: str):
    from bicache_sgl import Engine

    return Engine(model, prefix_cache="naive", max_prefix_cache_tokens=POOL, block_length=8, steps_per_block=2,
                  threshold=None, num_threads=1)


def fail_allocation(monkeypatch, pool, call: int) -> list[int]:
    """The pool's ``call``-th request allocation from now (1: the next) raises, once; the others
    are the pool's own. Returns the lengths asked for so far (the test checks the fault fired)."""
    real, calls = pool.alloc_request, []

    def alloc_request(n: int):
        calls.append(n)
        if len(calls) == call:
            raise RuntimeError(FAULT)
        return real(n)

    monkeypatch.setattr(pool, "alloc_request", alloc_request)
    return calls


def assert_engine_idle_and_empty(eng) -> None:
    """Nothing runs, every request row is back in the pool, no prefix slot in flight or locked."""
    eng.check_integrity()  # asserts request rows all free when idle
    st = eng.get_stats()
    assert st["num_running_reqs"] == 0 and st["num_waiting_reqs"] == 0
    assert st["request_kv_used_tokens"] == 0
    assert st["prefix_cache_in_flight_tokens"] == 0 and st["prefix_cache_protected_tokens"] == 0


def test_admission_failure_answers_its_client_in_the_same_step_offline(tiny_llada, monkeypatch):
    """A request whose admission raises (its second K/V buffer, after the first was taken) gets
    its final event, an abort naming the internal error, within the step that admitted it (before
    any forward: nothing else has finished), not when its client gives up; the three requests
    admitted beside it answer as in a run without the fault; afterwards the pool and the cache
    hold nothing (the first buffer went back too)."""
    from bicache_sgl.io_struct import GenerateRequest

    eng = fault_engine(tiny_llada)
    try:
        goods = [eng.encode(f"good request {k} beside a failing one") for k in range(3)]
        good_params = SamplingParams.from_dict(GOOD_PARAMS)

        def good_reqs() -> list:
            return [GenerateRequest(list(ids), good_params, bicache_depth=0) for ids in goods]

        alone = [ev.output_ids for ev in eng.run_sync(good_reqs())]
        # the victim first in arrival order (an empty cache and distinct prompts: admitted in that
        # order), with two buffers (input logprobs): the fault hits the second one
        eng.flush()
        victim = GenerateRequest(eng.encode("the request whose admission fails"), good_params, return_logprob=True,
                                 logprob_start_len=0)
        calls = fail_allocation(monkeypatch, eng.pool, call=2)
        events: dict[int, list] = {i: [] for i in range(4)}
        eng.submit_many([victim, *good_reqs()], [events[i].append for i in range(4)], start=False)
        assert eng.step()  # one step: admission (the fault) and the others' first forward
        assert len(calls) >= 2, "the fault did not fire"
        assert len(events[0]) == 1 and events[0][0].finished, events[0]
        ev = events[0][0]
        assert ev.finish_reason["type"] == "abort" and FAULT in ev.finish_reason["message"]
        assert ev.error and ev.error.startswith("internal error") and FAULT in ev.error
        assert not any(e.finished for i in (1, 2, 3) for e in events[i])  # it did not wait for them
        while eng.has_work():
            eng.step()
        assert [events[i][-1].output_ids for i in (1, 2, 3)] == alone
        assert all(events[i][-1].error is None for i in (1, 2, 3))
        assert len(events[0]) == 1  # one final event, no other
        assert_engine_idle_and_empty(eng)
        assert eng.get_stats()["finished_reqs_by_reason"]["abort"] == 1
    finally:
        eng.shutdown()


@contextlib.contextmanager
def serve_engine(engine) -> Iterator[str]:
    """A real HTTP server (uvicorn on a free loopback port, on a thread of this process) in front
    of ``engine``: a fault injected into the engine's own pool reaches requests sent over HTTP."""
    import uvicorn

    from bicache_sgl.runtime import find_free_port
    from bicache_sgl.server.app import create_app
    from bicache_sgl.server.args import ServerArgs

    port = find_free_port()
    app = create_app(engine, ServerArgs(port=port, skip_server_warmup=True))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="fault-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not app.state.server.ready:
        assert thread.is_alive() and time.monotonic() < deadline, "the in-process server did not come up"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


def test_admission_failure_answers_its_http_client_at_once(tiny_llada, monkeypatch):
    """Over HTTP: three long requests running, then one whose admission raises. Its client gets
    the error (a 500 naming the internal error) while the three still run, not at its timeout;
    the three answer as when sent alone; the engine ends idle with nothing held."""
    eng = fault_engine(tiny_llada)
    with serve_engine(eng) as url:
        params = {**GOOD_PARAMS, "max_new_tokens": 256}  # long enough to still run when the victim fails
        bodies = [{"text": f"good request {k} beside a failing one", "sampling_params": params, "bicache_depth": 0}
                  for k in range(3)]
        results: dict[int, requests.Response] = {}

        def send(k: int) -> None:
            results[k] = requests.post(url + "/generate", json=bodies[k], timeout=120)

        threads = [threading.Thread(target=send, args=(k,), daemon=True) for k in range(3)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while eng.get_stats()["num_running_reqs"] < 3:
            assert time.monotonic() < deadline, "the good requests did not start"
            time.sleep(0.01)
        calls = fail_allocation(monkeypatch, eng.pool, call=1)  # the victim's is the next allocation
        r = requests.post(url + "/generate", json={"text": "the request whose admission fails",
                                                   "sampling_params": GOOD_PARAMS}, timeout=30)
        still_running = eng.get_stats()["num_running_reqs"]
        assert calls, "the fault did not fire"
        assert r.status_code == 500, r.text
        msg = r.json()["error"]["message"]
        assert "internal error" in msg and FAULT in msg, msg
        assert still_running == 3, "the failed request was answered only after the others finished"
        for t in threads:
            t.join(120)
        monkeypatch.undo()
        for k in range(3):
            assert results[k].status_code == 200, results[k].text
            alone = requests.post(url + "/generate", json=bodies[k], timeout=120)
            assert results[k].json()["output_ids"] == alone.json()["output_ids"]
        deadline = time.monotonic() + 30
        while eng.has_work():  # output captures, if any
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert_engine_idle_and_empty(eng)


# ------------------------------------------------------------------------------------------------
# SIGTERM with requests in flight
# ------------------------------------------------------------------------------------------------

GRACE = 4.0  # --graceful-shutdown-timeout: the product promise this test checks


def metric_values(text: str) -> dict[str, float]:
    """A /metrics exposition as {metric name: value} (labels dropped: for the unlabelled gauges
    read here there is one sample per name)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name.split("{")[0]] = float(value)
    return out


def test_sigterm_drains_then_exits_and_releases_port(tmp_path):
    """SIGTERM with 9 requests in flight: the one that can finish within --graceful-shutdown-timeout
    finishes after the signal; the others (running or queued) are answered with an error (503, or
    a stream that ends with finish_reason abort and [DONE]) once the grace period is over; new
    requests are refused; the process exits and its port can be bound again.

    Which request can finish is set by forward counts: the short one needs 48 forwards, a long
    one (one token per forward) 2560, and the grace period lies between the two on anything
    from a loaded 2-core CPU (40 to 60 ms a forward with these requests) to a GPU (expected a few
    ms). That the short one finished after the signal is checked, not assumed: /metrics, read
    after the signal, shows all nine requests in the engine."""
    with serve(tmp_path, prefix_cache="off", max_running_requests=6, context_length=4096,
               graceful_shutdown_timeout=GRACE, seed=4) as rt:
        proc, port = rt.proc, rt.port
        bg = Background(rt)
        # 64-token blocks refreshed once per block keep each forward cheap, so the short request
        # below advances quickly beside them
        long_params = {"max_new_tokens": 2560, "block_length": 64, "steps_per_block": 64, "ignore_eos": True}

        def start_long(k: int) -> None:
            bg.start(f"long{k}", "/generate", {"text": f"long {k}", "stream": k % 2 == 0,
                                               "sampling_params": long_params}, stream=k % 2 == 0)

        for k in range(5):
            start_long(k)
        wait_state(rt, lambda st: st["num_running_reqs"] == 5, "five long requests running")
        # takes the sixth slot; can finish within the grace period (12 blocks of 4 forwards)
        short = requests.post(rt.url + "/generate", json={"text": "short", "stream": True, "sampling_params": {
            "max_new_tokens": 96, "steps_per_block": 4, "ignore_eos": True}}, stream=True, timeout=60)
        short_lines = short.iter_lines()
        head = [next(ln for ln in short_lines if ln.startswith(b"data:"))]
        for k in range(5, 8):  # no slot left: these wait in the queue
            start_long(k)
        wait_state(rt, lambda st: (st["num_running_reqs"], st["num_waiting_reqs"]) == (6, 3), "three queued")
        host, _ = rt.url.split("//")[1].split(":")
        keep_alive = http.client.HTTPConnection(host, port, timeout=30)  # open before the signal

        def on_keep_alive(method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
            keep_alive.request(method, path, body=body, headers={"Content-Type": "application/json"})
            resp = keep_alive.getresponse()
            return resp.status, resp.read()

        assert on_keep_alive("GET", "/health") == (200, b"")
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        m = metric_values(on_keep_alive("GET", "/metrics")[1].decode())  # open also while draining
        in_engine = (m["sglang:num_running_reqs"], m["sglang:num_queue_reqs"])
        # the drain has begun once /health answers 503 (an event, not a sleep); by then the
        # listening socket is closed
        while on_keep_alive("GET", "/health")[0] == 200:
            assert time.monotonic() - t0 < 10, "the server did not start draining"
            time.sleep(0.01)
        # during the drain: a new connection is refused, a request on an open one gets 503
        with pytest.raises(requests.ConnectionError):
            requests.post(rt.url + "/generate", json={"text": "late"}, timeout=10)
        status, late = on_keep_alive("POST", "/generate", b'{"text": "late"}')
        assert status == 503 and b"shutting down" in late, (status, late)
        keep_alive.close()
        short_frames = sse_frames(head + list(short_lines))
        rc = proc.wait(GRACE + 15)
        exit_s = time.monotonic() - t0
        bg.join(30)
        log = rt.log_text()

    print(f"\nsigterm: exit code {rc}, {exit_s:.1f} s after the signal (grace {GRACE} s)")
    assert rc in (0, -signal.SIGTERM), rc
    # the server waited out the grace period (long requests were still running), then exited promptly
    assert GRACE <= exit_s < GRACE + 10, exit_s
    # the short request was still running after the signal (all nine in the engine) ...
    assert in_engine == (6, 3), f"running, queued after the signal: {in_engine}"
    # ... and finished normally during the grace period
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
