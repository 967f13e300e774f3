"""The server with the engine in its own process (the default layout, ``engine/process.py``):
the real server on loopback, the bundled model, default flags; the child is killed and the server
is sent SIGTERM for real. Every wait is bounded."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from reliability_support import parent_pid, sse_frames, wait_until

requests = pytest.importorskip("requests")

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads process parents from /proc")

TIMEOUT = 60  # every HTTP call; long generations use threshold 0 (the fixed schedule: one token per step)


def info(rt) -> dict:
    return requests.get(rt.url + "/get_server_info", timeout=TIMEOUT).json()["internal_states"][0]


def post(rt, payload, **kw):
    return requests.post(rt.url + "/generate", json=payload, timeout=TIMEOUT, **kw)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from bicache_sgl.runtime import Runtime

    log = tmp_path_factory.mktemp("engine_process") / "server.log"
    rt = Runtime(timeout=180, log_path=str(log))  # default flags, bundled model
    yield rt
    rt.shutdown()


@pytest.fixture(scope="module")
def tokenizer(server):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(server.get_model_info()["model_path"])


# -- unit --------------------------------------------------------------------------------------------------

def test_thread_defaults(monkeypatch):
    import torch

    from bicache_sgl.engine.process import default_engine_threads
    from bicache_sgl.server.args import parse_args

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert default_engine_threads(1) == 1 and default_engine_threads(2) == 1
    assert default_engine_threads(64) == min(63, torch.get_num_threads())
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert default_engine_threads(8) is None  # the user's setting wins
    assert parse_args([]).engine_in_process is False and parse_args(["--engine-in-process"]).engine_in_process


# -- the default layout ------------------------------------------------------------------------------------

def test_engine_runs_in_a_child_process(server):
    pid = info(server)["engine_pid"]
    assert pid != server.proc.pid and parent_pid(pid) == server.proc.pid
    assert "engine process pid" in server.log_text()


def test_generate_with_logprob_texts_decoded_in_the_server(server, tokenizer):
    out = post(server, {"text": "The capital city of France is", "sampling_params": {"max_new_tokens": 8,
               "temperature": 0}, "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2,
               "return_text_in_logprobs": True})
    assert out.status_code == 200, out.text
    m = out.json()["meta_info"]
    assert m["completion_tokens"] == len(out.json()["output_ids"]) and m["finish_reason"]["type"] in ("stop", "length")
    for _lp, tid, text in m["input_token_logprobs"] + m["output_token_logprobs"]:
        assert text == tokenizer.decode([tid])
    for tops in m["output_top_logprobs"]:
        assert len(tops) == 2 and all(t[2] == tokenizer.decode([t[1]]) for t in tops)
    plain = post(server, {"text": "Hi", "sampling_params": {"max_new_tokens": 4}, "return_logprob": True}).json()
    assert all(e[2] is None for e in plain["meta_info"]["output_token_logprobs"])


def test_stream_and_batch(server):
    r = post(server, {"text": "stream me", "stream": True, "sampling_params": {"max_new_tokens": 40,
                                                                             "ignore_eos": True}}, stream=True)
    frames = sse_frames(r.iter_lines())
    assert frames[-1] == "[DONE]" and len(frames) >= 3  # a chunk per block, then [DONE]
    assert frames[-2]["meta_info"]["completion_tokens"] == 40
    assert all(frames[-2]["text"].startswith(f["text"]) for f in frames[:-1])
    out = post(server, {"text": ["one", "two", "three"], "sampling_params": {"max_new_tokens": 8}})
    assert out.status_code == 200 and len(out.json()) == 3


def test_bad_requests_are_400(server):
    r = post(server, {"input_ids": [10**6], "sampling_params": {"max_new_tokens": 4}})
    assert r.status_code == 400 and "[0, 100)" in r.json()["error"]["message"]
    # rules only the engine knows, checked in the server process before anything is sent
    r = post(server, {"text": ["a", "b"], "rid": ["same", "same"], "sampling_params": {"max_new_tokens": 4}})
    assert r.status_code == 400 and "already in use" in r.json()["error"]["message"]
    r = post(server, {"text": "ab", "bicache_depth": 1000, "sampling_params": {"max_new_tokens": 4}})
    assert r.status_code == 400 and "bicache_depth must be in" in r.json()["error"]["message"]
    r = post(server, {"text": "ab", "return_logprob": True, "logprob_start_len": 50})
    assert r.status_code == 400 and "logprob_start_len" in r.json()["error"]["message"]


def test_client_disconnect_aborts(server):
    before = info(server)["generated_tokens"]
    payload = {"text": "disconnect me", "stream": True,
               "sampling_params": {"max_new_tokens": 768, "ignore_eos": True, "threshold": 0}}
    with requests.post(server.url + "/generate", json=payload, stream=True, timeout=TIMEOUT) as r:
        assert r.status_code == 200, r.text
        for line in r.iter_lines():
            if line.startswith(b"data:"):
                break
    assert wait_until(lambda: info(server)["num_running_reqs"] == 0, 20)
    assert info(server)["generated_tokens"] - before < 768  # stopped early: aborted, not finished


def test_flush_cache_and_server_info(server):
    r = requests.post(server.url + "/flush_cache", timeout=TIMEOUT)
    assert r.status_code == 200 and r.text.startswith("Cache flushed.")
    st = info(server)
    assert st["prefix_cache"] == "bicache" and st["num_finished_reqs"] > 0 and st["num_running_reqs"] == 0
    assert requests.get(server.url + "/health", timeout=TIMEOUT).status_code == 200


def test_sigterm_stops_the_engine_process(server):  # last: it stops the module's server
    pid = info(server)["engine_pid"]
    server.proc.send_signal(signal.SIGTERM)  # the server only, as `kill PID` does
    server.proc.wait(30)
    assert wait_until(lambda: parent_pid(pid) is None, 10), "the engine process outlived the server"


# -- failures --------------------------------------------------------------------------------------------

def test_full_queue_dead_engine_and_shutdown(tmp_path):
    from bicache_sgl.runtime import Runtime

    rt = Runtime(max_queued_requests=1, max_total_tokens=1100, timeout=180, log_path=str(tmp_path / "server.log"))
    try:
        # K/V budget (an engine rule, checked in the server process): 1016 positions + a 600-token probe
        r = post(rt, {"text": "x" * 600, "sampling_params": {"max_new_tokens": 400}, "return_logprob": True,
                      "logprob_start_len": 0})
        assert r.status_code == 400 and "--max-total-tokens" in r.json()["error"]["message"]
        r = post(rt, {"text": ["a", "b"], "sampling_params": {"max_new_tokens": 4}})
        assert r.status_code == 503 and "queue is full" in r.json()["error"]["message"]
        assert post(rt, {"text": "a", "sampling_params": {"max_new_tokens": 4}}).status_code == 200
        pid = info(rt)["engine_pid"]

        long = {"text": "a long one", "sampling_params": {"max_new_tokens": 512, "ignore_eos": True,
                                                          "threshold": 0}}
        answers: list = []
        t = threading.Thread(target=lambda: answers.append(post(rt, long)), daemon=True)
        t.start()
        assert wait_until(lambda: info(rt)["num_running_reqs"] == 1, 20, 0.02)
        stream = post(rt, {**long, "stream": True}, stream=True)
        assert stream.status_code == 200, stream.text
        lines = stream.iter_lines()
        assert any(line.startswith(b"data:") for line in lines)  # the stream is running
        os.kill(pid, signal.SIGKILL)
        rest = sse_frames(lines)  # ends (bounded by TIMEOUT) with an error frame and [DONE]
        assert rest[-1] == "[DONE]" and "engine process" in rest[-2]["error"]["message"]
        t.join(TIMEOUT)
        assert answers and answers[0].status_code == 500
        assert "exited unexpectedly (killed by SIGKILL)" in answers[0].json()["error"]["message"]
        assert requests.get(rt.url + "/health", timeout=TIMEOUT).status_code == 503
        assert requests.get(rt.url + "/health_generate", timeout=TIMEOUT).status_code == 503
        r = post(rt, {"text": "after", "sampling_params": {"max_new_tokens": 4}})
        assert r.status_code == 503 and "engine" in r.json()["error"]["message"]
        assert requests.get(rt.url + "/get_server_info", timeout=TIMEOUT).status_code == 200  # still answers
        assert "exited unexpectedly" in rt.log_text()
    finally:
        t0 = time.monotonic()
        rt.shutdown(timeout=20)
    assert time.monotonic() - t0 < 20


def test_engine_in_process_still_serves(tmp_path):
    from bicache_sgl.runtime import Runtime

    with Runtime(engine_in_process=True, timeout=180, log_path=str(tmp_path / "server.log")) as rt:
        out = post(rt, {"text": "hello", "sampling_params": {"max_new_tokens": 8}})
        assert out.status_code == 200 and out.json()["meta_info"]["completion_tokens"] <= 8
        assert "engine_pid" not in info(rt) and "engine in the server process" in rt.log_text()

