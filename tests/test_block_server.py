"""The HTTP server on a tiny LLaDA2 folder (real format, real tokenizer), with the engine in its
child process (the default layout): native /generate (its output equals the offline block
engine's), exact reuse reported in meta_info (whole blocks, full depth) for a repeated prompt and
for a second turn that repeats the first answer, streaming per block, stop strings, abort through
the process, the OpenAI client, an SGLang frontend program, and refusals that name the field.
Then: the engine in the server process (``--engine-in-process``), the K/V budget
(``--max-total-tokens``: admission waits, a request over it is a 400), a killed engine process
(/health 503, the server lives on), and ``--dp-size 2`` behind sglang-router."""

from __future__ import annotations

import json
import os
import signal
import threading
import urllib.error
import urllib.request

import pytest
from reliability_support import parent_pid, sse_frames, wait_until

from bicache_sgl.blockdiff.engine import BlockEngine, BlockEngineOptions, BlockParams
from bicache_sgl.models.block_model import load_block_model
from bicache_sgl.runtime import Runtime, http_json
from bicache_sgl.testing.block import make_tiny_llada2, make_tiny_sdar

requests = pytest.importorskip("requests")

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
    with urllib.request.urlopen(req, timeout=60) as resp:
        chunks = [f for f in sse_frames(resp) if f != "[DONE]"]
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


@pytest.mark.parametrize("params,field", [({"dllm_algorithm": "entropy"}, "dllm_algorithm"),
                                          ({"block_length": 10**6}, "block_length"), ({"steps": 16}, "steps"),
                                          ({"cfg_scale": 1.5}, "cfg_scale"), ({"cache_mode": "dual"}, "cache_mode"),
                                          ({"refresh_interval": 2}, "refresh_interval"),
                                          ({"logit_bias": {"999999": 1.0}}, "logit_bias")])
def test_unsupported_parameters_are_refused_by_name(server, params, field):
    rt, _ = server
    code, body = _post(f"{_url(rt)}/generate", {"text": "x", "sampling_params": {"max_new_tokens": 4, **params}})
    assert code == 400 and field in json.dumps(body)


def test_request_block_length_and_cache_mode_none(server):
    """block_length 8 on a checkpoint of block length 4 decodes as the offline engine with that
    block length, and a repeat reuses whole 8-blocks; cache_mode "none" reuses none (nor stores)
    and answers the same."""
    rt, folder = server
    url = _url(rt)
    ids = list(range(30, 49))
    sp = {"max_new_tokens": 9, "temperature": 0, "block_length": 8}
    first = http_json(f"{url}/generate", {"input_ids": ids, "sampling_params": sp})
    offline = BlockEngine(load_block_model(folder), BlockEngineOptions(prefix_cache=False)).run(
        [ids], BlockParams(max_new_tokens=9, block_length=8))[0]
    want = offline.tokens[:-1] if offline.meta["finish_reason"] == "stop" else offline.tokens
    assert first["output_ids"] == want and first["meta_info"]["block_length"] == 8
    again = http_json(f"{url}/generate", {"input_ids": ids, "sampling_params": sp})
    assert again["output_ids"] == want and again["meta_info"]["cached_tokens"] == 16
    none = http_json(f"{url}/generate", {"input_ids": ids, "sampling_params": {**sp, "cache_mode": "none"}})
    assert none["output_ids"] == want and none["meta_info"]["cached_tokens"] == 0


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
    from bicache_sgl.blockdiff.client import BlockEngineClient
    from bicache_sgl.config import EngineConfig, SamplingParams
    from bicache_sgl.engine.local import LocalEngine, build_local_engine
    from bicache_sgl.io_struct import GenerateRequest

    folder = make_tiny_sdar(tmp_path / "sdar", block_length=B)
    client = build_local_engine(EngineConfig(model_path=folder, num_threads=1))
    try:
        # what the engine process reports of it: the block engine validates its own submissions
        assert isinstance(client, BlockEngineClient) and isinstance(client, LocalEngine)
        assert client.accepts_valid_requests is False and client.kv_budget > 0
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


# ---- the process layout, the K/V budget, data parallelism ----------------------------------------


def _state(url: str) -> dict:
    return requests.get(f"{url}/get_server_info", timeout=30).json()["internal_states"][0]


# threshold 1.0 with steps_per_block = B: one token per step, so a long request runs long enough
# to be seen running on any machine
SLOW = {"temperature": 0, "threshold": 1.0, "steps_per_block": B, "ignore_eos": True}


def test_the_block_engine_runs_in_a_child_process(server):
    rt, _ = server
    pid = _state(rt.url)["engine_pid"]
    assert pid != rt.proc.pid and parent_pid(pid) == rt.proc.pid
    assert "engine process pid" in rt.log_text()


def test_abort_through_the_engine_process(server):
    """A streaming request aborted by its rid (/abort_request) ends with finish_reason abort after
    its first blocks; the engine process is idle again."""
    rt, _ = server
    body = {"text": PROMPT, "rid": "block-abort-1", "stream": True, "sampling_params": {"max_new_tokens": 2000, **SLOW}}
    r = requests.post(f"{rt.url}/generate", json=body, stream=True, timeout=60)
    assert r.status_code == 200, r.text
    lines = r.iter_lines()
    frames: list = []
    for line in lines:
        frames += sse_frames([line])
        if frames:
            break
    assert frames[0]["meta_info"]["finish_reason"] is None
    assert requests.post(f"{rt.url}/abort_request", json={"rid": "block-abort-1"}, timeout=30).status_code == 200
    frames += sse_frames(lines)
    assert frames[-1] == "[DONE]" and frames[-2]["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(frames[-2]["output_ids"]) < 2000
    assert wait_until(lambda: _state(rt.url)["num_running_reqs"] == 0, 30, 0.1)


def test_abort_all_through_the_engine_process(server):
    """/abort_request {"abort_all": true} ends every running block request with finish_reason abort."""
    rt, _ = server
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 2000, **SLOW}}
    answers: list = []
    threads = [threading.Thread(target=lambda: answers.append(requests.post(f"{rt.url}/generate", json=body,
                                                                             timeout=60))) for _ in range(2)]
    for t in threads:
        t.start()
    assert wait_until(lambda: _state(rt.url)["num_running_reqs"] == 2, 30, 0.02)
    assert requests.post(f"{rt.url}/abort_request", json={"abort_all": True}, timeout=30).status_code == 200
    for t in threads:
        t.join(60)
    assert len(answers) == 2
    for r in answers:
        meta = r.json()["meta_info"]
        assert meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] < 2000, r.text


def test_engine_in_process_serves_the_same_answers(server, tmp_path):
    rt, folder = server
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 9, "temperature": 0}}
    want = http_json(f"{rt.url}/generate", body)["output_ids"]
    with Runtime(model_path=folder, num_threads=1, engine_in_process=True, timeout=120,
                 log_path=str(tmp_path / "server.log")) as local:
        assert http_json(f"{local.url}/generate", body)["output_ids"] == want
        assert "engine_pid" not in _state(local.url)
        assert "block-diffusion engine in the server process" in local.log_text()


@pytest.fixture(scope="module")
def small_budget(tmp_path_factory, server):
    """A server (engine child process) whose K/V budget holds one long request's window and
    little else: 230 positions."""
    _, folder = server
    log = tmp_path_factory.mktemp("budget") / "server.log"
    with Runtime(model_path=folder, num_threads=1, max_total_tokens=230, timeout=120, log_path=str(log)) as rt:
        yield rt


def test_kv_budget_admission_waits_and_answers_are_unchanged(server, small_budget):
    """A 212-position request runs; a 24-position one waits for it (212 + 24 > 230) and then
    answers what the unbounded server answers; one of 252 positions is a 400 naming the flag."""
    rt, _ = server
    url = small_budget.url
    ids = list(range(40, 50))  # 10 tokens
    short = {"input_ids": ids, "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
    want = http_json(f"{rt.url}/generate", short)["output_ids"]
    answers: dict = {}

    def post(key: str, body: dict) -> None:
        answers[key] = requests.post(f"{url}/generate", json=body, timeout=120)

    long = threading.Thread(target=post, args=("long", {"input_ids": ids, "sampling_params": {
        "max_new_tokens": 200, **SLOW}}))
    long.start()
    assert wait_until(lambda: _state(url)["num_running_reqs"] == 1, 30, 0.02)
    waiting = threading.Thread(target=post, args=("short", short))
    waiting.start()
    st: dict = {}

    def seen_waiting() -> bool:
        st.update(_state(url))
        return st["num_running_reqs"] == 1 and st["num_waiting_reqs"] == 1
    assert wait_until(seen_waiting, 30, 0.02)
    assert st["kv_budget_tokens"] == 230 and 212 <= st["kv_used_tokens"] <= 230
    code, body = _post(f"{url}/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 240}})
    assert code == 400 and "--max-total-tokens" in json.dumps(body) and "252" in json.dumps(body)
    long.join(120)
    waiting.join(120)
    assert answers["long"].status_code == 200 and len(answers["long"].json()["output_ids"]) == 200
    assert answers["short"].status_code == 200 and answers["short"].json()["output_ids"] == want


def test_killed_engine_process_gives_503_and_the_server_lives_on(small_budget):
    """SIGKILL the block engine's process: /health answers 503 (so a router drops the worker),
    /generate answers 503 naming the engine, the server itself still answers."""
    rt = small_budget
    pid = _state(rt.url)["engine_pid"]
    os.kill(pid, signal.SIGKILL)
    assert wait_until(lambda: requests.get(f"{rt.url}/health", timeout=30).status_code == 503, 30, 0.1)
    r = requests.post(f"{rt.url}/generate", json={"text": "after", "sampling_params": {"max_new_tokens": 4}},
                      timeout=30)
    assert r.status_code == 503 and "engine" in r.json()["error"]["message"]
    assert requests.get(f"{rt.url}/health", timeout=30).status_code == 503  # still answering
    assert requests.get(f"{rt.url}/get_server_info", timeout=30).status_code == 200
    assert rt.proc.poll() is None and "exited unexpectedly" in rt.log_text()


def test_dp_size_2_serves_the_block_model_through_the_router(server, tmp_path):
    """``launch_server --dp-size 2`` on the LLaDA2 folder: two workers (each with its engine
    process) behind sglang-router on one port; answers through it equal the single server's."""
    pytest.importorskip("sglang_router")
    from bicache_sgl.scaleout.stats import cluster_stats

    rt, folder = server
    prompts = [f"Worker question {i}." for i in range(4)]
    want = [http_json(f"{rt.url}/generate", {"text": t, "sampling_params": {"max_new_tokens": 6, "temperature": 0}})
            ["output_ids"] for t in prompts]
    with Runtime(model_path=folder, dp_size=2, num_threads=1, graceful_shutdown_timeout=1, timeout=180,
                 log_path=str(tmp_path / "dp.log")) as dp:
        got = [requests.post(f"{dp.url}/generate", json={"text": t, "sampling_params": {
            "max_new_tokens": 6, "temperature": 0}}, timeout=60) for t in prompts]
        assert [r.status_code for r in got] == [200] * 4, [r.text for r in got]
        assert [r.json()["output_ids"] for r in got] == want
        workers = cluster_stats(dp.url)["workers"]
        assert len(workers) == 2 and all(w["healthy"] and "error" not in w for w in workers), workers
        assert sum(w["prompt_tokens_total"] for w in workers) > 0
