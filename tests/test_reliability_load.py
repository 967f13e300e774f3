"""Load and soak: many concurrent clients against one real server, then the same prompts one at a
time.

The server runs the ``naive`` prefix cache (every layer of a cached prefix is reused) with a
small pool (``--max-prefix-cache-tokens``), so the shared-prefix groups below keep evicting each
other, and ``--max-running-requests 16`` under 64 clients. That requests really shared the
engine's forwards is read from counters, not from samples: the sum of the requests' own forward
counts divided by the engine's forward count is the mean batch size. (Queueing behind the
slots is proven by ``test_queue_waits_then_runs_and_overflow_is_503``, deterministically.)

Greedy outputs of a diffusion LM with prefix reuse depend on what is cached when a request is
admitted (the reused K/V were computed in another request's context). The equality check
therefore uses requests that pin ``bicache_depth: 0``: they still match, lock and insert
prefixes like every other request (so they take part in the cache churn), but they reuse no
layer, so their output cannot depend on the cache state and must equal the output of the same
request sent alone, after ``/flush_cache``, to the same server (same flags). The other half of
the requests reuse cached prefixes at full depth; for them the test checks the response shape,
the lengths and the bookkeeping.

Figures (requests, concurrency, errors, resident memory) are printed with ``-s`` and recorded
in docs/reliability.md.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time

import httpx
import pytest
import requests
from reliability_support import (
    assert_pool_integrity,
    env_flag,
    log_has_no_server_errors,
    rss_bytes,
    serve,
    server_state,
    sse_frames,
    wait_idle,
)

CLIENTS = 64
ROUNDS = env_flag("RELIABILITY_LOAD_ROUNDS", 4)  # measured rounds after the warm-up round
PER_ROUND = env_flag("RELIABILITY_LOAD_PER_ROUND", 64)
WARMUP = 48
POOL_TOKENS = 640  # --max-prefix-cache-tokens: tokens at full depth
N_LAYERS = 4  # make_tiny_llada's default
MAX_RUNNING = 16
# Resident memory may grow by at most this much from the end of the first measured round to the
# end of the last one. Measured: under 5 MiB (allocator noise). Leaking each request's private
# K/V buffers alone (~300 KB for these prompts) would add ~75 MiB over the 256 measured requests.
RSS_GROWTH_BOUND = 48 << 20

SYSTEMS = [
    "You are a careful assistant. Answer in one short sentence. ",
    "System: the following is a conversation about the weather in several cities of Europe. ",
    "Context: a long shared document that many users ask questions about, repeated for caching. " * 2,
    "Instructions: translate the user's text into French, keeping the tone and the punctuation. ",
    "Rules of the game: each player draws two cards; the highest total wins the round. ",
    "Persona: a pirate who speaks in riddles and never gives a straight answer to anything. ",
    "Background: unicode text \u00e9\u00e8\u00ea \u4e2d\u6587 \u0440\u0443\u0441\u0441\u043a\u0438\u0439 "
    "\U0001f600 mixed in. ",
    "Notes: ",
]


def make_requests(n: int, offset: int) -> list[dict]:
    """Request specs: shared-prefix groups x questions, streaming or not, short or long, native or
    OpenAI, depth pinned to 0 (equality-checked) or full reuse."""
    out = []
    for k in range(n):
        i = offset + k
        system = SYSTEMS[i % len(SYSTEMS)]
        prompt = f"{system}Question {i // len(SYSTEMS)}: what about item {i * 7 % 13}?\nAnswer:"
        long = i % 4 == 0
        params = {"max_new_tokens": 40 if long else 8, "temperature": 0}
        if long:
            params["ignore_eos"] = True
        spec = {"i": i, "prompt": prompt, "params": params, "stream": i % 3 == 0,
                "api": "openai" if i % 10 == 9 else "native", "pinned": i % 2 == 0}
        out.append(spec)
    return out


def native_body(spec: dict) -> dict:
    body = {"text": spec["prompt"], "sampling_params": spec["params"], "stream": spec["stream"]}
    if spec["pinned"]:
        body["bicache_depth"] = 0
    return body


def check_native_result(spec: dict, out: dict) -> None:
    assert set(out) >= {"text", "output_ids", "meta_info"}, out
    m = out["meta_info"]
    assert m["completion_tokens"] == len(out["output_ids"]) <= spec["params"]["max_new_tokens"]
    assert m["finish_reason"]["type"] in ("length", "stop"), m["finish_reason"]
    if spec["params"].get("ignore_eos"):
        assert m["completion_tokens"] == spec["params"]["max_new_tokens"]
    assert m["prompt_tokens"] > 0 and 0 <= m["cached_tokens"] < m["prompt_tokens"]
    if spec["pinned"]:
        assert m["bicache_depth"] == 0 and m["reused_prefix_tokens"] == 0
    assert isinstance(out["text"], str)


async def run_one(client: httpx.AsyncClient, url: str, spec: dict) -> dict:
    if spec["api"] == "openai":
        body = {"model": "default", "prompt": spec["prompt"], "max_tokens": spec["params"]["max_new_tokens"],
                "temperature": 0, "stream": spec["stream"], "ignore_eos": bool(spec["params"].get("ignore_eos"))}
        if spec["stream"]:
            async with client.stream("POST", url + "/v1/completions", json=body) as r:
                assert r.status_code == 200, await r.aread()
                frames = sse_frames([ln async for ln in r.aiter_lines()])
            assert frames[-1] == "[DONE]"
            chunks = frames[:-1]
            assert chunks and all(c["object"] == "text_completion" for c in chunks)
            reasons = [c["choices"][0]["finish_reason"] for c in chunks]
            assert reasons[-1] in ("stop", "length") and all(x is None for x in reasons[:-1])
            return {"text": "".join(c["choices"][0]["text"] for c in chunks)}
        r = await client.post(url + "/v1/completions", json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        c = out["choices"][0]
        assert c["finish_reason"] in ("stop", "length") and isinstance(c["text"], str)
        assert out["usage"]["completion_tokens"] <= body["max_tokens"]
        return {"text": c["text"]}
    body = native_body(spec)
    if spec["stream"]:
        async with client.stream("POST", url + "/generate", json=body) as r:
            assert r.status_code == 200, await r.aread()
            assert r.headers["content-type"].startswith("text/event-stream")
            frames = sse_frames([ln async for ln in r.aiter_lines()])
        assert frames[-1] == "[DONE]" and len(frames) >= 2
        chunks = frames[:-1]
        for a, b in itertools.pairwise(chunks):  # cumulative frames: text and ids only grow
            assert b["text"].startswith(a["text"]) and b["output_ids"][:len(a["output_ids"])] == a["output_ids"]
        assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
        out = chunks[-1]
    else:
        r = await client.post(url + "/generate", json=body)
        assert r.status_code == 200, r.text
        out = r.json()
    check_native_result(spec, out)
    return out


async def load_round(url: str, specs: list[dict], clients: int, sampler) -> tuple[dict[int, dict], list[str]]:
    """Run ``specs`` with ``clients`` concurrent workers. Returns results by index and the
    failures."""
    queue: asyncio.Queue = asyncio.Queue()
    for s in specs:
        queue.put_nowait(s)
    results: dict[int, dict] = {}
    failures: list[str] = []
    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        async def worker() -> None:
            while True:
                try:
                    spec = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                try:
                    results[spec["i"]] = await run_one(client, url, spec)
                except Exception as e:  # collected, asserted below
                    failures.append(f"request {spec['i']} ({spec['api']}, stream={spec['stream']}): "
                                    f"{type(e).__name__}: {e}")

        stop = asyncio.Event()
        sampling = asyncio.create_task(sampler(stop))
        await asyncio.gather(*(worker() for _ in range(clients)))
        stop.set()
        await sampling
    return results, failures


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serve(tmp_path_factory.mktemp("load"), prefix_cache="naive", max_prefix_cache_tokens=POOL_TOKENS,
               max_running_requests=MAX_RUNNING, context_length=384) as rt:
        yield rt


def test_load_soak_outputs_pool_and_memory(server):
    rt = server
    pid = rt.proc.pid
    samples: list[dict] = []

    async def sampler(stop: asyncio.Event) -> None:
        async with httpx.AsyncClient(timeout=30) as c:
            while not stop.is_set():
                st = (await c.get(rt.url + "/get_server_info")).json()["internal_states"][0]
                samples.append(st)
                try:
                    await asyncio.wait_for(stop.wait(), 0.25)
                except asyncio.TimeoutError:
                    pass

    t0 = time.perf_counter()
    all_specs: list[dict] = []
    results: dict[int, dict] = {}
    failures: list[str] = []
    rss: list[int] = []
    offset = 0
    start = wait_idle(rt)
    for rnd in range(ROUNDS + 1):
        n = WARMUP if rnd == 0 else PER_ROUND
        specs = make_requests(n, offset)
        offset += n
        all_specs += specs
        res, fails = asyncio.run(load_round(rt.url, specs, CLIENTS, sampler))
        results.update(res)
        failures += fails
        wait_idle(rt)
        rss.append(rss_bytes(pid))
    load_s = time.perf_counter() - t0

    assert not failures, "\n".join(failures[:10])
    assert len(results) == len(all_specs)

    # the pool stayed within its budget in every sample, and it was under pressure
    assert samples, "no server state was sampled during the load"
    idle = wait_idle(rt)
    samples.append(idle)
    cap = idle["prefix_cache_capacity_layer_tokens"]
    assert cap == POOL_TOKENS * N_LAYERS
    for st in samples:
        assert st["prefix_cache_stored_layer_tokens"] <= cap
        assert st["prefix_cache_used_tokens"] <= st["prefix_cache_capacity_tokens"]
        assert st["num_running_reqs"] <= MAX_RUNNING
    # the requests shared the engine's forwards: (sum of each request's forwards) / (engine
    # forwards) is the mean number of requests per forward, at most the running-request cap
    finished = idle["num_requests_total"] - start["num_requests_total"]
    engine_fwd = idle["num_forward_passes"] - start["num_forward_passes"]
    mean_batch = (idle["forward_passes_total"] - start["forward_passes_total"]) / engine_fwd
    assert finished == len(all_specs), (finished, len(all_specs))
    assert 2 <= mean_batch <= MAX_RUNNING, f"mean batch {mean_batch:.2f}: {CLIENTS} clients were not served together"
    assert idle["evicted_tokens"] > 0, "the small pool never evicted: the load did not stress it"
    assert idle["prefix_cache_bytes"] == cap * idle["prefix_cache_bytes_per_layer_token"]
    assert_pool_integrity(idle)

    # greedy outputs of the pinned (no-reuse) requests == the same requests one at a time
    pinned = [s for s in all_specs if s["pinned"] and s["api"] == "native"]
    assert requests_post(rt, "/flush_cache").status_code == 200
    mismatches = []
    t1 = time.perf_counter()
    for s in pinned:
        ref = requests_post(rt, "/generate", {**native_body(s), "stream": False}).json()
        got = results[s["i"]]
        if (got["output_ids"], got["text"]) != (ref["output_ids"], ref["text"]):
            mismatches.append((s["i"], got["output_ids"], ref["output_ids"]))
    seq_s = time.perf_counter() - t1
    assert not mismatches, f"{len(mismatches)} of {len(pinned)} outputs differ under load: {mismatches[:3]}"
    assert_pool_integrity(wait_idle(rt))

    # resident memory: after the warm-up round it stops growing
    growth = rss[-1] - rss[1]
    print(f"\nload: {len(all_specs)} requests, {CLIENTS} clients, {mean_batch:.1f} requests per forward on "
          f"average, peak waiting sampled {max(s['num_waiting_reqs'] for s in samples)}, 0 errors, {load_s:.1f} s "
          f"({len(all_specs) / load_s:.1f} req/s); {len(pinned)} outputs equal sequential ({seq_s:.1f} s); "
          f"evicted {idle['evicted_tokens']} tokens; RSS MiB per round "
          f"{[round(x / 2**20, 1) for x in rss]}, growth after warm-up {growth / 2**20:.1f} MiB")
    assert growth < RSS_GROWTH_BOUND, f"RSS grew {growth / 2**20:.1f} MiB after warm-up: {rss}"
    log_has_no_server_errors(rt)


def requests_post(rt, path: str, body: dict | None = None):
    return requests.post(rt.url + path, data=None if body is None else json.dumps(body),
                         headers={"Content-Type": "application/json"}, timeout=120)


# ------------------------------------------------------------------------------------------------
# queueing beyond --max-running-requests, and --max-queued-requests
# ------------------------------------------------------------------------------------------------

QUEUE_RUNNING, QUEUE_LIMIT = 2, 4


@pytest.fixture(scope="module")
def queue_server(tmp_path_factory):
    with serve(tmp_path_factory.mktemp("queue"), prefix_cache="off", max_running_requests=QUEUE_RUNNING,
               max_queued_requests=QUEUE_LIMIT, context_length=1152, seed=1) as rt:
        yield rt


def test_queue_waits_then_runs_and_overflow_is_503(queue_server):
    """2 running slots and a queue of 4: two long requests take the slots, four more wait (and
    stay waiting: nothing of theirs comes back while the slots are taken); six more sent while
    the queue is full get 503 with a clear message; then the long ones are aborted
    (/abort_request) and the four queued ones run, each with the output it has when sent alone;
    the server keeps serving.

    The long requests need 1024 forwards each, and they are ended by the abort, not by a clock:
    the queue stays full for as long as the test needs, on any machine."""
    rt = queue_server
    long_params = {"max_new_tokens": 1024, "block_length": 32, "steps_per_block": 32, "ignore_eos": True}
    short_params = {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True}
    results: dict[str, requests.Response] = {}

    def send(name: str, body: dict) -> threading.Thread:
        def run() -> None:
            results[name] = requests.post(rt.url + "/generate", json=body, timeout=120)
        t = threading.Thread(target=run)
        t.start()
        return t

    def wait_for(running: int, waiting: int) -> dict:
        deadline = time.monotonic() + 30
        while True:
            st = server_state(rt)
            if st["num_running_reqs"] == running and st["num_waiting_reqs"] == waiting:
                return st
            assert time.monotonic() < deadline, f"expected {running} running, {waiting} waiting: {st}"
            time.sleep(0.01)

    threads = [send(f"long{k}", {"text": f"long request {k}", "rid": f"queue-long-{k}", "sampling_params": long_params})
               for k in range(QUEUE_RUNNING)]
    wait_for(QUEUE_RUNNING, 0)
    queued = [{"text": f"queued request {k}", "sampling_params": short_params} for k in range(QUEUE_LIMIT)]
    threads += [send(f"queued{k}", body) for k, body in enumerate(queued)]
    wait_for(QUEUE_RUNNING, QUEUE_LIMIT)
    extra = [requests.post(rt.url + "/generate", json={"text": f"extra {k}", "sampling_params": {"max_new_tokens": 8}},
                           timeout=30) for k in range(3)]
    extra += [requests.post(rt.url + "/v1/completions", json={"prompt": f"extra {k}", "max_tokens": 8}, timeout=30)
              for k in range(3)]
    for r in extra:
        assert r.status_code == 503, (r.status_code, r.text)
        assert "queue is full" in r.json()["error"]["message"]
    # the queued ones are still waiting: no answer yet, and the server still counts them queued
    wait_for(QUEUE_RUNNING, QUEUE_LIMIT)
    assert not results, sorted(results)
    for k in range(QUEUE_RUNNING):
        assert requests.post(rt.url + "/abort_request", json={"rid": f"queue-long-{k}"}, timeout=30).status_code == 200
    for t in threads:
        t.join(120)
    for k in range(QUEUE_RUNNING):
        r = results[f"long{k}"]
        assert r.status_code == 200, r.text
        meta = r.json()["meta_info"]
        assert meta["finish_reason"]["type"] == "abort", meta
        assert meta["completion_tokens"] < long_params["max_new_tokens"]
    # every queued request then ran to the end, as if alone
    for k, body in enumerate(queued):
        r = results[f"queued{k}"]
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": short_params["max_new_tokens"]}
        alone = requests.post(rt.url + "/generate", json=body, timeout=120).json()
        assert out["output_ids"] == alone["output_ids"]
    assert requests.get(rt.url + "/health_generate", timeout=30).status_code == 200
    wait_idle(rt)
    log_has_no_server_errors(rt)
