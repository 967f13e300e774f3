"""Hostile load with constraints: attackers and careful users at once against one real server.

Kinds of traffic (each request drawn at random, deterministically): malformed JSON, wrong types,
bad numbers, prompts at and past the context limit, out-of-vocabulary ids, batches and ``n``,
invalid and pathological regexes, hostile JSON schemas (1000 properties, deep nesting, ``$ref``
cycles, 5000-item enums, contradictory bounds), logit_bias junk, penalties and stops, logprobs,
streaming and non-streaming clients that hang up, aborts by rid and ``abort_all``-free aborts,
``/flush_cache`` during load, info routes, OpenAI junk and lm-eval's scoring call (``max_tokens:
0`` with ``echo`` and ``logprobs``), and clients holding only the API key trying the admin routes
(``abort_all``, an abort of someone else's rid, ``/flush_cache``); mixed in, greedy *bystanders*
whose answers were recorded alone beforehand (they pin ``bicache_depth: 0``, so their answer may
not depend on the cache; everything else reuses prefixes at the profile's depth). The server runs
with ``--api-key`` and ``--admin-api-key``: the operator's aborts and flushes use the admin key.

Asserted: no 5xx seen by any client and none counted by the server's own /metrics, no connection
dropped by the server, every bystander equal to its reference, every admin route refused (401) to
the API key, /get_server_info answering throughout, healthy and idle after, the pool's accounting
intact, resident memory growth after the first tenth under a bound. Printed: resident memory per
process (server, engine, build workers) at the start, after each tenth and after a flush.
``RELIABILITY_HOSTILE_REQUESTS`` scales it (the default fits CI; docs/reliability.md has a
20,000-request run).
"""

from __future__ import annotations

import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from reliability_support import (
    assert_pool_integrity,
    env_flag,
    mib,
    rss_by_process,
    rss_bytes,
    serve,
    sse_frames,
    wait_idle,
)

N_REQUESTS = env_flag("RELIABILITY_HOSTILE_REQUESTS", 360)
CONCURRENCY = 16
CONTEXT = 384
RSS_GROWTH_BOUND = 160 << 20  # measured: see docs/reliability.md
SYSTEM = "System: you are a careful assistant; answer briefly. "
TIMEOUT = 120
API_KEY = "hostile-user-key"  # every client holds it
ADMIN_KEY = "hostile-admin-key"  # the operator's: aborts and flushes
USER = {"Authorization": f"Bearer {API_KEY}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
ADMIN_ONLY_KINDS = ("abort_all_user", "abort_user", "flush_user")  # the API key is refused there: 401


def _schemas() -> list:
    deep: dict = {"type": "integer"}
    for _ in range(40):
        deep = {"type": "object", "properties": {"a": deep}, "required": ["a"]}
    return [
        {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(1000)}},
        deep,
        {"$ref": "#/definitions/a",
         "definitions": {"a": {"$ref": "#/definitions/b"}, "b": {"$ref": "#/definitions/a"}}},
        {"enum": [f"value-{i}" for i in range(5000)]},
        {"type": "integer", "minimum": 10, "maximum": 1},
        {"type": "string", "minLength": 5, "maxLength": 2},
        {"type": "object", "properties": {"x": {"type": "string", "maxLength": 3}}, "required": ["x"]},
        {"type": "object", "properties": {f"q{i}": {"type": "boolean"} for i in range(101)}},  # max_schema_properties
    ]


REGEXES = ["(a|a)*b", "((a+)+)+c", "|".join(f"w{i}" for i in range(3000)), "(" * 300 + "a" + ")" * 300,
           "[0-9]{2,3}", "(c|q)*c(c|q){8}", "[", "a{5,2}", "(?P<x>a)", "\\p{L}+",
           "(a|b)*a(a|b){25}", "(x|y)*x(x|y){19}"]  # 2^26 and 2^20 states: refused up front


def bystander_body(i: int) -> dict:
    return {"text": SYSTEM + f"Bystander question {i}: what comes next?",
            "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}, "bicache_depth": 0}


def hostile(rng: random.Random, i: int) -> tuple[str, str, object, dict]:
    """(kind, path, body (dict, or bytes sent raw), options) for request ``i``."""
    sp = {"max_new_tokens": rng.choice([4, 8, 16]), "temperature": rng.choice([0, 0.7])}
    text = rng.choice([SYSTEM, "", "Shared head: "]) + f"request {i} " + rng.choice(["alpha", "beta", "gamma"])
    kinds = ["malformed", "types", "numbers", "long", "oov", "batch", "regex", "schema", "logit_bias",
             "penalties", "logprobs", "stream_hangup", "hangup", "abort", "flush", "info", "openai", "good",
             "echo0", *ADMIN_ONLY_KINDS]
    k = rng.choice(kinds)
    if k == "malformed":
        return k, "/generate", rng.choice([b"{", b"[1, 2", b"\xff\xfe", b'{"text": "x", }', b"null"]), {}
    if k == "types":
        return k, "/generate", rng.choice([{"text": 5}, {"text": "x", "sampling_params": []},
                                           {"text": "x", "sampling_params": {"max_new_tokens": "8"}},
                                           {"input_ids": "abc"}, {"text": ["a", 3]}]), {}
    if k == "numbers":
        return k, "/generate", {"text": text, "sampling_params": rng.choice([
            {"max_new_tokens": -1}, {"max_new_tokens": 10**9}, {"temperature": float("nan")},
            {"top_p": 3}, {"top_k": -5}, {"seed": 2**70}, {"block_length": 0}])}, {}
    if k == "long":
        n = rng.choice([CONTEXT - 4, CONTEXT, CONTEXT + 50, 20000])
        return k, "/generate", {"input_ids": [rng.randrange(5, 200) for _ in range(n)],
                                "sampling_params": {"max_new_tokens": 4}}, {}
    if k == "oov":
        return k, "/generate", {"input_ids": [1, 2, 10**9], "sampling_params": {"max_new_tokens": 4}}, {}
    if k == "batch":
        return k, "/generate", rng.choice([{"text": [text, text + "!"], "sampling_params": sp},
                                           {"text": text, "sampling_params": {**sp, "n": 3}},
                                           {"text": [text] * 300, "sampling_params": sp}]), {}
    if k == "regex":
        return k, "/generate", {"text": text, "sampling_params": {**sp, "regex": rng.choice(REGEXES)}}, {}
    if k == "schema":
        return k, "/generate", {"text": text, "sampling_params": {**sp, "json_schema": json.dumps(
            rng.choice(_schemas()))}}, {}
    if k == "logit_bias":
        return k, "/generate", {"text": text, "sampling_params": {**sp, "logit_bias": rng.choice(
            [{"x": 1}, {"999999999": 5}, {"5": "big"}, [1, 2], {"7": 1e300}])}}, {}
    if k == "penalties":
        return k, "/generate", {"text": text, "sampling_params": {**sp, "frequency_penalty": rng.uniform(-2, 2),
                                                                   "presence_penalty": rng.uniform(-2, 2),
                                                                   "stop": rng.choice([["x"], "request", ["", "a"]]),
                                                                   "stop_token_ids": [5, 10**7]}}, {}
    if k == "logprobs":
        return k, "/generate", {"text": text, "sampling_params": sp, "return_logprob": True,
                                "top_logprobs_num": rng.choice([0, 5, 10**6]),
                                "logprob_start_len": rng.choice([-1, 0, 3, 10**6])}, {}
    if k in ("stream_hangup", "hangup"):
        return k, "/generate", {"text": text, "sampling_params": {**sp, "max_new_tokens": 64, "ignore_eos": True},
                                "stream": k == "stream_hangup"}, {"hangup": True}
    if k == "abort":
        return k, "/generate", {"text": text, "rid": f"hostile-{i}",
                                "sampling_params": {**sp, "max_new_tokens": 64, "ignore_eos": True}}, {"abort": True}
    if k == "flush":
        return k, "/flush_cache", None, {}
    if k == "abort_all_user":  # a client holding the API key tries to abort every request
        return k, "/abort_request", {"abort_all": True}, {"user_only": True}
    if k == "abort_user":  # ... or someone else's, by its rid
        return k, "/abort_request", {"rid": f"hostile-{i - 1}"}, {"user_only": True}
    if k == "flush_user":
        return k, "/flush_cache", None, {"user_only": True}
    if k == "echo0":  # lm-eval's loglikelihood call: the prompt's logprobs, nothing generated
        return k, "/v1/completions", {"prompt": rng.choice(["Question", "Question: 2+2?", "A"]), "max_tokens": 0,
                                      "echo": True, "logprobs": rng.choice([0, 1, 5])}, {}
    if k == "info":
        return k, rng.choice(["/get_server_info", "/get_model_info", "/metrics", "/health"]), None, {"get": True}
    if k == "openai":
        return k, "/v1/chat/completions", rng.choice([
            {"model": "x-unknown", "messages": [{"role": "user", "content": "hi"}]},
            {"messages": "not a list"},
            {"messages": [{"role": "user", "content": text}], "max_tokens": 8, "response_format": {"type": "bogus"}},
            {"messages": [{"role": "user", "content": text}], "max_tokens": 8, "lora_path": ""}]), {}
    return k, "/generate", {"text": text, "sampling_params": sp}, {}


def send(url: str, kind: str, path: str, body, opt: dict) -> tuple[str, int | str]:
    """One request; returns (kind, status or the name of a connection error)."""
    try:
        if opt.get("get"):
            r = requests.get(url + path, headers=USER, timeout=TIMEOUT)
            return kind, r.status_code
        if kind == "flush":  # the operator
            return kind, requests.post(url + path, headers=ADMIN, timeout=TIMEOUT).status_code
        if opt.get("user_only"):
            return kind, requests.post(url + path, json=body, headers=USER, timeout=TIMEOUT).status_code
        data = body if isinstance(body, bytes) else json.dumps(body).encode()  # NaN goes as NaN
        headers = {"Content-Type": "application/json", **USER}
        if opt.get("hangup"):  # a client that goes away after the first bytes (or before any)
            with requests.post(url + path, data=data, headers=headers, timeout=(5, 0.3), stream=True) as r:
                try:
                    next(r.iter_lines(), None)
                except requests.exceptions.RequestException:
                    pass
                return kind, r.status_code
        if opt.get("abort"):
            def later() -> None:
                time.sleep(0.05)
                requests.post(url + "/abort_request", json={"rid": body["rid"]}, headers=ADMIN, timeout=TIMEOUT)
            threading.Thread(target=later, daemon=True).start()
        streaming = isinstance(body, dict) and bool(body.get("stream"))
        r = requests.post(url + path, data=data, headers=headers, timeout=TIMEOUT, stream=streaming)
        if streaming and r.status_code == 200:
            sse_frames(r.iter_lines())
        return kind, r.status_code
    except requests.exceptions.ReadTimeout:
        return kind, "hangup" if opt.get("hangup") else "ReadTimeout"
    except requests.exceptions.ConnectionError as e:
        return kind, f"ConnectionError: {e}"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hostile")
    profile = folder / "profile.json"
    profile.write_text(json.dumps({"n_layers": 4, "table": [[0, 0], [10, 2], [40, 4]]}))
    with serve(folder, bicache_profile=str(profile), max_prefix_cache_tokens=600, max_running_requests=8,
               max_queued_requests=64, context_length=CONTEXT, api_key=API_KEY, admin_api_key=ADMIN_KEY) as rt:
        yield rt


def test_hostile_load_with_constraints_harms_no_bystander(server):
    rt = server
    url, pid = rt.url, rt.proc.pid
    n_bystanders = max(8, N_REQUESTS // 12)
    refs = {}
    for i in range(n_bystanders):  # the reference answers, alone
        r = requests.post(url + "/generate", json=bystander_body(i), headers=USER, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        refs[i] = r.json()["output_ids"]
    wait_idle(rt)
    rss_start = rss_bytes(pid, children=True)
    rss_rows = [("start", rss_by_process(pid))]
    rng = random.Random(0)
    jobs = [("bystander", i) for i in range(n_bystanders)] + [("hostile", i) for i in range(N_REQUESTS)]
    rng.shuffle(jobs)
    got: dict[int, list[int]] = {}
    statuses: list[tuple[str, int | str]] = []
    info_latency: list[float] = []
    stop = threading.Event()

    info_errors: list[str] = []

    def poll_info() -> None:
        while not stop.is_set():
            t = time.perf_counter()
            try:
                r = requests.get(url + "/get_server_info", headers=USER, timeout=TIMEOUT)
                if r.status_code != 200:
                    info_errors.append(f"status {r.status_code}")
            except requests.RequestException as e:
                info_errors.append(repr(e))
            info_latency.append(time.perf_counter() - t)
            stop.wait(0.5)

    latency: dict[str, list[float]] = {}

    def run(job) -> None:
        what, i = job
        t = time.perf_counter()
        if what == "bystander":
            r = requests.post(url + "/generate", json=bystander_body(i), headers=USER, timeout=TIMEOUT)
            statuses.append(("bystander", r.status_code))
            if r.status_code == 200:
                got[i] = r.json()["output_ids"]
            latency.setdefault("bystander", []).append(time.perf_counter() - t)
            return
        kind, status = send(url, *hostile(random.Random(i), i))
        statuses.append((kind, status))
        latency.setdefault(kind, []).append(time.perf_counter() - t)

    poller = threading.Thread(target=poll_info, daemon=True)
    poller.start()
    # ten tenths; the first warms up (build workers start, caches fill); RSS per process after each
    bounds = [len(jobs) * k // 10 for k in range(11)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        for k in range(10):
            list(pool.map(run, jobs[bounds[k]:bounds[k + 1]]))
            rss_rows.append((f"tenth {k + 1}", rss_by_process(pid)))
            if k == 0:
                rss0 = rss_bytes(pid, children=True)  # the server, its engine process and the build workers
    elapsed = time.perf_counter() - t0
    stop.set()
    poller.join(TIMEOUT)

    assert not info_errors, info_errors[:5]
    server_errors = [s for s in statuses if isinstance(s[1], int) and s[1] >= 500 and s[1] != 503]
    dropped = [s for s in statuses if isinstance(s[1], str) and s[1] != "hangup"]
    assert not server_errors, server_errors[:10]
    assert not dropped, dropped[:10]
    wrong = [i for i in refs if got.get(i) != refs[i]]
    assert not wrong, f"{len(wrong)} of {len(refs)} bystanders answered differently (or not at all): {wrong[:5]}"
    not_refused = [s for s in statuses if s[0] in ADMIN_ONLY_KINDS and s[1] != 401]
    assert not not_refused, not_refused[:10]  # the API key never aborts or flushes anything
    # the scoring call is answered (503 "overloaded" when its per-position requests do not fit the queue)
    echo = [s[1] for s in statuses if s[0] == "echo0"]
    assert all(s in (200, 503) for s in echo) and (not echo or 200 in echo), sorted(set(map(str, echo)))
    idle = wait_idle(rt, timeout=60)
    assert_pool_integrity(idle)
    assert requests.get(url + "/health", timeout=30).status_code == 200
    metrics = requests.get(url + "/metrics", timeout=30).text
    counted_5xx = [ln for ln in metrics.splitlines() if ln.startswith("sglang:http_requests_total")
                   and 'status="5' in ln and 'status="503"' not in ln]
    assert not counted_5xx, counted_5xx
    growth = rss_bytes(pid, children=True) - rss0
    flushed = requests.post(url + "/flush_cache?timeout=30", headers=ADMIN, timeout=TIMEOUT)
    assert flushed.status_code == 200, flushed.text
    assert wait_idle(rt)["prefix_cache_used_tokens"] == 0
    rss_rows.append(("after a flush", rss_by_process(pid)))
    roles = ("server", "engine", "build workers")
    table = "\n".join(f"  {name:>13}: " + ", ".join(f"{r} {mib(v[r])}" for r in roles)
                      + f"; total {mib(sum(v.values()))}" for name, v in rss_rows)
    by_kind: dict[str, dict] = {}
    for k, s in statuses:
        by_kind.setdefault(k, {}).setdefault(str(s), 0)
        by_kind[k][str(s)] += 1
    lat = {k: f"{sorted(v)[len(v) // 2]:.2f}/{max(v):.2f}" for k, v in sorted(latency.items())}
    print(f"\nhostile: {len(jobs)} requests ({n_bystanders} bystanders) in {elapsed:.1f} s, concurrency "
          f"{CONCURRENCY}; 0 5xx, 0 dropped; /get_server_info max {max(info_latency):.2f} s; RSS (server + engine "
          f"+ build workers) {rss_start / 2**20:.0f} MiB before, {rss0 / 2**20:.0f} MiB after warm-up, "
          f"{(rss0 + growth) / 2**20:.0f} MiB at the end (growth {growth / 2**20:.1f} MiB); statuses by kind "
          f"{json.dumps(by_kind, sort_keys=True)}; latency p50/max s by kind {json.dumps(lat)}\nRSS MiB by process:\n"
          f"{table}")
    assert max(info_latency) < 10.0, max(info_latency)
    assert growth < RSS_GROWTH_BOUND, f"RSS grew {growth / 2**20:.1f} MiB"


def test_heavy_constraint_builds_hold_no_other_request(server):
    """Six fresh, slow regex builds at once (each a second or more: 2^16-state automata, under the
    200,000-state limit, so the up-front estimate lets them through to the build workers): plain
    requests, aborts and /get_server_info are answered meanwhile in well under a build's time."""
    url = server.url
    heavy = [f"({a}|{b})*{a}({a}|{b}){{15}}" for a, b in ("cq", "dr", "fs", "gt", "hu", "jv")]
    results: dict[str, float] = {}

    def build(rx: str) -> None:
        t = time.perf_counter()
        r = requests.post(url + "/generate", json={"text": "heavy", "sampling_params": {"max_new_tokens": 4,
                                                                                         "regex": rx}},
                          headers=USER, timeout=300)
        assert r.status_code in (200, 400), r.text
        results[rx] = time.perf_counter() - t

    threads = [threading.Thread(target=build, args=(rx,)) for rx in heavy]
    for th in threads:
        th.start()
    time.sleep(0.5)  # the builds are running
    t = time.perf_counter()
    r = requests.post(url + "/generate", json={"text": "plain", "sampling_params": {"max_new_tokens": 4}}, headers=USER,
                      timeout=60)
    plain_s = time.perf_counter() - t
    assert r.status_code == 200, r.text
    t = time.perf_counter()
    assert requests.get(url + "/get_server_info", headers=USER, timeout=60).status_code == 200
    info_s = time.perf_counter() - t
    t = time.perf_counter()
    assert requests.post(url + "/abort_request", json={"rid": "nobody"}, headers=ADMIN, timeout=60).status_code == 200
    abort_s = time.perf_counter() - t
    for th in threads:
        th.join(300)
    slowest = max(results.values())
    print(f"\nheavy builds: slowest {slowest:.1f} s; meanwhile a plain request {plain_s:.2f} s, /get_server_info "
          f"{info_s:.2f} s, /abort_request {abort_s:.2f} s")
    assert len(results) == len(heavy)
    assert plain_s < max(2.0, slowest / 3), (plain_s, slowest)
    assert info_s < 3.0 and abort_s < 2.0, (info_s, abort_s)
