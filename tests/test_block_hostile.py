"""Hostile traffic and fuzzing against a server on a tiny LLaDA2 folder (the block-diffusion engine
in its child process, the default layout).

The bidirectional suites' generators are reused, not copied: every kind of
tests/test_reliability_hostile.py (``hostile`` / ``send``: malformed JSON, wrong types, bad numbers,
long prompts, out-of-vocabulary ids, batches and ``n``, pathological regexes and schemas,
logit_bias junk, penalties, logprobs, clients that hang up, aborts, operator flushes, the API key on
admin routes, OpenAI junk, lm-eval's scoring call), and tests/test_reliability_fuzz.py's body
strategy and answer check. Added, block-specific kinds (``block_hostile``): max_new_tokens over
the K/V budget (the server runs with ``--max-total-tokens`` below its context) and over the
context, a prompt of exactly the context length, max_new_tokens 0 with and without logprobs,
logprob_start_len at its edges, a regex no output of the budget fits, JSON schemas with features
the compiler refuses, an abort in the middle of a block (one token per step, aborted after the
first streamed block), a disconnect mid-stream, n over --max-n, logit_bias with bad ids, and
operator flushes while requests run (the generic ``flush`` kind).

Asserted: no 5xx (clients and /metrics), no dropped connection, no hang (every client has a
timeout; the server is idle after), every refusal of a block kind a 4xx whose message names its
field, bystanders (plain, logprobs, regex, n=2, streaming: greedy; sampled with a seed) equal to the quiet server's
answers before the storm, the engine child process the same one and alive, the K/V accounting
back to the cache alone when idle, and after the storm a repeated prompt reuses whole blocks and
equals the offline engine with the cache off. ``RELIABILITY_BLOCK_HOSTILE_REQUESTS`` and
``RELIABILITY_BLOCK_FUZZ_EXAMPLES`` scale it (docs/reliability.md, "Block diffusion").
"""

from __future__ import annotations

import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import test_reliability_fuzz as fuzz
import test_reliability_hostile as hostile
from reliability_support import env_flag, mib, parent_pid, rss_bytes, sse_frames, wait_idle, wait_until

from bicache_sgl.blockdiff.engine import BlockEngine, BlockEngineOptions, BlockParams
from bicache_sgl.models.block_model import load_block_model
from bicache_sgl.runtime import Runtime
from bicache_sgl.testing.block import make_tiny_llada2

N_REQUESTS = env_flag("RELIABILITY_BLOCK_HOSTILE_REQUESTS", 120)
FUZZ_EXAMPLES = env_flag("RELIABILITY_BLOCK_FUZZ_EXAMPLES", 60)
CONCURRENCY = 12
B = 4
CONTEXT = hostile.CONTEXT  # 384: the generic "long" kind's lengths are about it
KV_BUDGET = 320  # below the context: the budget, not the context, binds a long request
MAX_N = 4
TIMEOUT = 120
USER, ADMIN = hostile.USER, hostile.ADMIN
RSS_GROWTH_BOUND = 160 << 20
# one token per step (threshold 1.0, steps = B): a request runs long enough to be aborted mid-block
SLOW = {"temperature": 0, "threshold": 1.0, "steps_per_block": B, "ignore_eos": True}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_llada2(tmp_path_factory.mktemp("blockhostile") / "llada2", block_length=B)


@pytest.fixture(scope="module")
def server(folder, tmp_path_factory):
    log = tmp_path_factory.mktemp("blockhostile-log") / "server.log"
    with Runtime(model_path=folder, num_threads=1, timeout=180, context_length=CONTEXT, max_total_tokens=KV_BUDGET,
                 max_running_requests=8, max_queued_requests=64, max_n=MAX_N, api_key=hostile.API_KEY,
                 admin_api_key=hostile.ADMIN_KEY, log_path=str(log)) as rt:
        yield rt


def _state(rt) -> dict:
    return requests.get(rt.url + "/get_server_info", headers=USER, timeout=30).json()["internal_states"][0]


# ---- bystanders: one of each kind of careful request, greedy or seeded ------------------------------------

def bystander(i: int) -> dict:
    text = f"Bystander {i}: the block engine answers this."
    sp = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    kind = i % 6
    if kind == 5:  # sampled with its own seed: its answer is fixed too
        return {"text": text, "sampling_params": {**sp, "temperature": 0.8, "top_p": 0.9, "seed": 7 + i}}
    if kind == 1:
        return {"text": text, "sampling_params": sp, "return_logprob": True, "top_logprobs_num": 2,
                "logprob_start_len": 0}
    if kind == 2:
        return {"text": text, "sampling_params": {"max_new_tokens": 12, "temperature": 0, "regex": "[a-z ]{2,12}"}}
    if kind == 3:
        return {"text": text, "sampling_params": {**sp, "n": 2}}
    if kind == 4:
        return {"text": text, "sampling_params": sp, "stream": True}
    return {"text": text, "sampling_params": sp}


def answer_of(body: dict, r: requests.Response) -> object:
    """What must not change: ids, text, finish reason and logprobs of every output (compared by
    :func:`same_answer`)."""
    if body.get("stream"):
        frames = sse_frames(r.iter_lines())
        assert frames[-1] == "[DONE]", frames[-2:]
        r_json = frames[-2]
    else:
        r_json = r.json()
    outs = r_json if isinstance(r_json, list) else [r_json]
    got = []
    for o in outs:
        m = o["meta_info"]
        lp = [(v, t) for v, t, *_ in m.get("output_token_logprobs") or []]
        got.append((o["output_ids"], o["text"], m["finish_reason"], lp))
    return got


def same_answer(a: object, b: object) -> bool:
    """Equal ids, text and finish reason; logprobs within 1e-4 (a batched forward may differ from
    an alone one in the last float bits; the tokens may not)."""
    if not (isinstance(a, list) and isinstance(b, list) and len(a) == len(b)):
        return False
    for (ids, text, fr, lp), (ids2, text2, fr2, lp2) in zip(a, b):
        if (ids, text, fr, [t for _, t in lp]) != (ids2, text2, fr2, [t for _, t in lp2]):
            return False
        if any(abs(v - w) > 1e-4 for (v, _), (w, _) in zip(lp, lp2)):
            return False
    return True


# ---- block-specific hostile kinds ---------------------------------------------------------------

# kind -> the field its 4xx must name (every refusal of these kinds is checked)
BLOCK_FIELDS = {"kv_huge": "max-total-tokens", "ctx_huge": "max_new_tokens", "ctx_exact": "prompt",
                "ctx_exact0": "max-total-tokens", "mnt0": "", "lp_start": "logprob_start_len",
                "regex_nofit": "regex", "schema_unsupported": "json_schema", "n_large": "n",
                "bias_bad": "logit_bias", "abort_mid_block": "", "disconnect_mid_stream": ""}
UNSUPPORTED_SCHEMAS = [
    {"type": "string", "format": "date-time"}, {"type": "object", "patternProperties": {"^a": {"type": "integer"}}},
    {"allOf": [{"type": "integer"}, {"minimum": 3}]}, {"type": "string", "pattern": "(?=a)b"},
    {"not": {"type": "string"}}, {"type": "object", "dependentRequired": {"a": ["b"]}},
]


def block_hostile(rng: random.Random, i: int) -> tuple[str, str, object, dict]:
    """(kind, path, body, options) for block-specific request ``i`` (module docstring)."""
    text = f"block request {i} " + rng.choice(["alpha", "beta", "gamma"])
    sp = {"max_new_tokens": rng.choice([4, 8]), "temperature": rng.choice([0, 0.7])}
    k = rng.choice(list(BLOCK_FIELDS))
    if k == "kv_huge":  # under the context, over the K/V budget: could never be admitted
        return k, "/generate", {"text": text, "sampling_params": {"max_new_tokens": rng.choice([KV_BUDGET, 360])}}, {}
    if k == "ctx_huge":
        return k, "/generate", {"text": text, "sampling_params": {"max_new_tokens": rng.choice([CONTEXT, 10**6])}}, {}
    if k in ("ctx_exact", "ctx_exact0"):  # the prompt fills the context; with 0 it fits the context, not the budget
        ids = [rng.randrange(5, 200) for _ in range(CONTEXT)]
        return k, "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 0 if k == "ctx_exact0" else 4},
                                "return_logprob": rng.random() < 0.5}, {}
    if k == "mnt0":
        body = {"text": text, "sampling_params": {"max_new_tokens": 0}}
        if rng.random() < 0.5:
            body.update(return_logprob=True, top_logprobs_num=rng.choice([0, 3]))
        return k, "/generate", body, {}
    if k == "lp_start":
        ids = [rng.randrange(5, 200) for _ in range(9)]
        return k, "/generate", {"input_ids": ids, "sampling_params": {**sp, "max_new_tokens": rng.choice([0, 4])},
                                "return_logprob": True, "logprob_start_len": rng.choice([-1, 0, 8, 9, 10, 10**6])}, {}
    if k == "regex_nofit":  # longer than max_new_tokens allows, or tokens the vocabulary cannot spell
        rx = rng.choice(["a{40}", "[0-9]{30}x", "\U0001f600{20}", "(abc){20}"])
        return k, "/generate", {"text": text, "sampling_params": {**sp, "regex": rx}}, {}
    if k == "schema_unsupported":
        return k, "/generate", {"text": text, "sampling_params": {**sp, "json_schema": json.dumps(
            rng.choice(UNSUPPORTED_SCHEMAS))}}, {}
    if k == "n_large":
        return k, "/generate", {"text": text, "sampling_params": {**sp, "n": rng.choice([MAX_N + 1, 1000, 10**9])}}, {}
    if k == "bias_bad":
        return k, "/generate", {"text": text, "sampling_params": {**sp, "logit_bias": rng.choice(
            [{"-1": 1.0}, {"100000": 1.0}, {"1.5": 1.0}, {"7": -1e300}, {"7": "x"}])}}, {}
    return k, "/generate", {"text": text, "rid": f"block-{k}-{i}", "stream": True,
                            "sampling_params": {"max_new_tokens": 64, **SLOW}}, {}


def send_block(url: str, kind: str, path: str, body: dict, opt: dict) -> tuple[str, int | str, str]:
    """One block-kind request: (kind, status or a connection error's name, the answer's text).
    The mid-block abort and the mid-stream disconnect read the first streamed block first."""
    data = json.dumps(body).encode()  # NaN / inf go as JSON's NaN / Infinity
    headers = {"Content-Type": "application/json", **USER}
    try:
        if kind in ("abort_mid_block", "disconnect_mid_stream"):
            with requests.post(url + path, data=data, headers=headers, timeout=TIMEOUT, stream=True) as r:
                lines = r.iter_lines()
                first = sse_frames([next(lines, b"")])
                if kind == "disconnect_mid_stream":
                    return kind, r.status_code, ""  # the with block closes the connection mid-stream
                requests.post(url + "/abort_request", json={"rid": body["rid"]}, headers=ADMIN, timeout=TIMEOUT)
                frames = first + sse_frames(lines)
                reason = frames[-2]["meta_info"]["finish_reason"] if len(frames) >= 2 else None
                # aborted; or, under load, finished in full before the abort arrived
                done = frames[-1:] == ["[DONE]"] and reason is not None and (
                    reason["type"] == "abort" or reason == {"type": "length", "length": body["sampling_params"][
                        "max_new_tokens"]})
                if opt.get("must_abort") and reason is not None and reason["type"] != "abort":
                    done = False
                return kind, r.status_code if done else f"not aborted: {frames[-2:]}", ""
        r = requests.post(url + path, data=data, headers=headers, timeout=TIMEOUT)
        return kind, r.status_code, r.text
    except requests.exceptions.RequestException as e:
        return kind, type(e).__name__, ""


def test_hostile_block_traffic_harms_no_bystander_and_keeps_the_cache_exact(server, folder):
    rt, url = server, server.url
    engine_pid = _state(rt)["engine_pid"]
    n_bystanders = max(10, N_REQUESTS // 8)
    assert requests.post(url + "/flush_cache", headers=ADMIN, timeout=30).status_code == 200
    refs = {}
    for i in range(n_bystanders):  # the quiet server's answers, one at a time
        body = bystander(i)
        r = requests.post(url + "/generate", json=body, headers=USER, timeout=TIMEOUT, stream=True)
        assert r.status_code == 200, r.text
        refs[i] = answer_of(body, r)
    wait_idle(rt)
    rss0 = rss_bytes(rt.proc.pid, children=True)
    jobs = ([("bystander", i) for i in range(n_bystanders)] + [("generic", i) for i in range(N_REQUESTS // 2)]
            + [("block", i) for i in range(N_REQUESTS - N_REQUESTS // 2)])
    random.Random(0).shuffle(jobs)
    got: dict[int, object] = {}
    statuses: list[tuple[str, int | str]] = []
    unnamed: list[tuple[str, int, str]] = []

    def run(job) -> None:
        what, i = job
        if what == "bystander":
            body = bystander(i)
            try:
                r = requests.post(url + "/generate", json=body, headers=USER, timeout=TIMEOUT, stream=True)
                statuses.append(("bystander", r.status_code))
                got[i] = answer_of(body, r) if r.status_code == 200 else r.status_code
            except requests.exceptions.RequestException as e:
                statuses.append(("bystander", type(e).__name__))
            return
        if what == "generic":
            statuses.append(hostile.send(url, *hostile.hostile(random.Random(i), i)))
            return
        kind, status, text = send_block(url, *block_hostile(random.Random(10_000 + i), i))
        statuses.append((kind, status))
        field = BLOCK_FIELDS[kind]
        if isinstance(status, int) and 400 <= status < 500 and (not field or field not in text):
            unnamed.append((kind, status, text[:300]))

    t0 = time.perf_counter()
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        list(pool.map(run, jobs))
    elapsed = time.perf_counter() - t0

    server_errors = [s for s in statuses if isinstance(s[1], int) and s[1] >= 500 and s[1] != 503]
    dropped = [s for s in statuses if isinstance(s[1], str) and s[1] != "hangup"]
    assert not server_errors, server_errors[:10]
    assert not dropped, dropped[:10]
    assert not unnamed, unnamed[:10]  # every refusal of a block kind names its field
    wrong = {i: (refs[i], got.get(i)) for i in refs if not same_answer(refs[i], got.get(i))}
    assert not wrong, f"{len(wrong)} of {len(refs)} bystanders differ: {list(wrong.items())[:2]}"
    idle = wait_idle(rt, timeout=60)  # no hang: everything ends
    counted = {k: v for k, v in fuzz.five_xx(rt).items() if 'status="503"' not in k}  # 503: the queue was full
    assert not counted, counted
    # the engine child is the same process, alive, and its K/V accounting is back to the cache alone
    assert idle["engine_pid"] == engine_pid and parent_pid(engine_pid) == rt.proc.pid
    assert requests.get(url + "/health", timeout=30).status_code == 200
    assert idle["kv_used_tokens"] == idle["prefix_cache_used_tokens"] <= idle["prefix_cache_capacity_tokens"]
    assert idle["kv_budget_tokens"] == KV_BUDGET
    log = rt.log_text()
    for needle in ("Traceback", "engine step failed", "event callback failed"):
        assert needle not in log, log[-4000:]
    # the exact block cache: a repeated prompt reuses whole blocks and equals the engine with the cache off
    ids = list(range(40, 58))
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}
    first = requests.post(url + "/generate", json=body, headers=USER, timeout=TIMEOUT).json()
    again = requests.post(url + "/generate", json=body, headers=USER, timeout=TIMEOUT).json()
    off = BlockEngine(load_block_model(folder), BlockEngineOptions(prefix_cache=False)).run(
        [ids], BlockParams(max_new_tokens=8))[0]
    assert first["output_ids"] == again["output_ids"] == off.tokens
    assert again["meta_info"]["cached_tokens"] >= (len(ids) // B) * B and again["meta_info"]["cached_tokens"] % B == 0
    growth = rss_bytes(rt.proc.pid, children=True) - rss0
    by_kind: dict[str, dict] = {}
    for k, s in statuses:
        by_kind.setdefault(k, {}).setdefault(str(s), 0)
        by_kind[k][str(s)] += 1
    print(f"\nblock hostile: {len(jobs)} requests ({n_bystanders} bystanders) in {elapsed:.1f} s, concurrency "
          f"{CONCURRENCY}; 0 5xx, 0 dropped; RSS (server + engine) {mib(rss0)} MiB after the references, growth "
          f"{growth / 2**20:.1f} MiB; statuses by kind {json.dumps(by_kind, sort_keys=True)}")
    assert growth < RSS_GROWTH_BOUND, f"RSS grew {growth / 2**20:.1f} MiB"


def test_heavy_regex_is_answered_without_a_5xx_while_bystanders_run(server):
    """A regex whose automaton takes longer to build than a submission's round trip to the engine
    process may wait (10 s; here up to the build's 30 s limit): the server builds it before it
    submits, as for the bidirectional engine, so the answer is a 200 or a 400 naming the regex,
    never the 500 "the engine process did not answer submitting the request"; a plain request
    sent meanwhile is answered."""
    url = server.url
    heavy: dict = {}

    def send() -> None:
        body = {"text": "heavy", "sampling_params": {"max_new_tokens": 4, "regex": "o.{3605}"}}
        r = requests.post(url + "/generate", json=body, headers=USER, timeout=TIMEOUT)
        heavy.update(status=r.status_code, text=r.text)

    th = threading.Thread(target=send)
    th.start()
    time.sleep(0.5)  # the build is running
    r = requests.post(url + "/generate", json=bystander(1), headers=USER, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    th.join(TIMEOUT)
    assert heavy["status"] in (200, 400), heavy
    if heavy["status"] == 400:
        assert "regex" in heavy["text"], heavy
    assert requests.get(url + "/health", timeout=30).status_code == 200


def test_abort_mid_block_ends_with_abort_and_leaves_no_window(server):
    """A streaming request aborted after its first block (one token per step, so mid-block): its
    stream ends with an abort frame, and its K/V window is given back (idle: the cache alone)."""
    rt = server
    body = {"text": "abort me", "rid": "mid-block", "stream": True, "sampling_params": {"max_new_tokens": 200, **SLOW}}
    status = send_block(rt.url, "abort_mid_block", "/generate", body, {"must_abort": True})[1]
    assert status == 200, status
    idle = wait_idle(rt, timeout=30)
    assert idle["kv_used_tokens"] == idle["prefix_cache_used_tokens"]


def test_disconnect_mid_stream_aborts_the_request(server):
    """A client that goes away after the first streamed block: the server aborts its request in
    the engine process (it does not decode 300 tokens for nobody) and gives its window back."""
    rt = server
    before = _state(rt)["finished_reqs_by_reason"].get("abort", 0)
    body = {"text": "nobody listens", "rid": "gone", "stream": True, "sampling_params": {"max_new_tokens": 300, **SLOW}}
    status = send_block(rt.url, "disconnect_mid_stream", "/generate", body, {})[1]
    assert status == 200
    assert wait_until(lambda: _state(rt)["finished_reqs_by_reason"].get("abort", 0) == before + 1, 30)
    idle = wait_idle(rt, timeout=10)
    assert idle["kv_used_tokens"] == idle["prefix_cache_used_tokens"]


@pytest.mark.parametrize("constraint", [{"regex": "abc"}, {"json_schema": '{"type": "integer"}'}])
@pytest.mark.parametrize("logprobs", [False, True])
def test_prefill_only_with_a_constraint_ends_with_length_0(server, constraint, logprobs):
    """max_new_tokens 0 generates nothing, so a constraint has no output to check: the answer is
    finish_reason length 0 (the bidirectional engine's), never an abort (which /v1 turns into a
    503); with return_logprob the prompt's logprobs come back."""
    rt = server
    body = {"text": "score this prompt", "sampling_params": {"max_new_tokens": 0, **constraint},
            "return_logprob": logprobs}
    r = requests.post(rt.url + "/generate", json=body, headers=USER, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    m = r.json()["meta_info"]
    assert m["finish_reason"] == {"type": "length", "length": 0} and r.json()["output_ids"] == []
    assert len(m.get("input_token_logprobs") or []) == (m["prompt_tokens"] if logprobs else 0)
    v1 = requests.post(rt.url + "/v1/completions", headers=USER, timeout=TIMEOUT, json={
        "prompt": "score this prompt", "max_tokens": 0, **constraint})
    assert v1.status_code == 200 and v1.json()["choices"][0]["finish_reason"] == "length", v1.text


def test_end_ids_before_min_new_tokens_do_not_end_the_answer(server, folder):
    """Every id a stop id and min_new_tokens 4: the sampler bans all of them on the first four
    positions, so one lands there anyway; it must not end the answer early (the bidirectional
    engine answers 4 tokens, finish_reason length)."""
    rt = server
    model = load_block_model(folder)
    V = model.cfg.vocab_size
    off = BlockEngine(model, BlockEngineOptions(prefix_cache=False)).run(
        [list(range(40, 46))], BlockParams(max_new_tokens=8, min_new_tokens=4, stop_ids=tuple(range(V))))[0]
    assert len(off.tokens) == 5 and off.meta["finish_reason"] == "stop"  # the first end id from position 4 on
    r = requests.post(rt.url + "/generate", headers=USER, timeout=TIMEOUT, json={
        "text": "x", "sampling_params": {"max_new_tokens": 4, "min_new_tokens": 4, "stop_token_ids": list(range(V))}})
    assert r.status_code == 200, r.text
    assert len(r.json()["output_ids"]) == 4 and r.json()["meta_info"]["finish_reason"] == {"type": "length",
                                                                                            "length": 4}


def test_flush_while_requests_run_changes_no_answer(server):
    """Operator flushes racing running requests: every answer equals the quiet one; the cache is
    empty after the last flush once idle, and refills exactly."""
    rt, url = server, server.url
    bodies = [{"text": f"flush race {i} " * 3, "sampling_params": {"max_new_tokens": 12, "temperature": 0,
                                                                    "ignore_eos": True}} for i in range(6)]
    want = [requests.post(url + "/generate", json=b, headers=USER, timeout=TIMEOUT).json()["output_ids"]
            for b in bodies]
    got: dict[int, list] = {}
    stop = threading.Event()

    def flusher() -> None:
        while not stop.is_set():
            assert requests.post(url + "/flush_cache", headers=ADMIN, timeout=30).status_code == 200
            time.sleep(0.01)

    th = threading.Thread(target=flusher, daemon=True)
    th.start()
    with ThreadPoolExecutor(6) as pool:
        for i, r in enumerate(pool.map(lambda b: requests.post(url + "/generate", json=b, headers=USER,
                                                                timeout=TIMEOUT), bodies * 3)):
            got.setdefault(i % 6, []).append(r.json()["output_ids"] if r.status_code == 200 else r.status_code)
    stop.set()
    th.join(30)
    assert all(v == [want[i]] * 3 for i, v in got.items()), got
    assert requests.post(url + "/flush_cache", headers=ADMIN, timeout=30).status_code == 200
    assert wait_until(lambda: _state(rt)["prefix_cache_used_tokens"] == 0, 10)
    refill = requests.post(url + "/generate", json=bodies[0], headers=USER, timeout=TIMEOUT)
    assert refill.json()["output_ids"] == want[0]


def _block_integrity(st: dict) -> None:
    """The block engine's K/V accounting when idle: the running windows are gone, the cache is
    within its cap and the budget."""
    assert st["kv_used_tokens"] == st["prefix_cache_used_tokens"] <= st["prefix_cache_capacity_tokens"]
    assert st["kv_used_tokens"] <= st["kv_budget_tokens"]


@pytest.fixture(scope="module")
def fuzz_server(folder, tmp_path_factory):
    """No API key (the fuzz bodies go out bare), the fuzz suite's context."""
    log = tmp_path_factory.mktemp("blockfuzz") / "server.log"
    with Runtime(model_path=folder, num_threads=1, timeout=180, context_length=fuzz.CONTEXT, max_running_requests=8,
                 max_n=4, max_batch_size=8, log_path=str(log)) as rt:
        yield rt


def test_fuzz_json_bodies_on_the_block_server(fuzz_server):
    """tests/test_reliability_fuzz.py's body strategy and answer check, on the LLaDA2 server."""
    rt = fuzz_server
    healthy = fuzz.StillHealthy(rt, integrity=_block_integrity)
    session = requests.Session()
    tally = fuzz.Tally()

    @fuzz.fuzz_settings(FUZZ_EXAMPLES)
    @fuzz.given(fuzz.bodies)
    def run(case):
        path, body = case
        r = session.post(rt.url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"},
                         timeout=60, stream=True)
        tally.note(r.status_code)
        fuzz.check_answer(path, body, r)

    run()
    print(f"\nblock fuzz: {FUZZ_EXAMPLES} JSON bodies, status counts {dict(sorted(tally.by_status.items()))}")
    assert tally.by_status.get(200, 0) >= FUZZ_EXAMPLES // 6
    healthy.check()


def test_fuzz_raw_bytes_on_the_block_server(fuzz_server):
    healthy = fuzz.StillHealthy(fuzz_server, integrity=_block_integrity)
    session = requests.Session()
    for path in ("/generate", "/v1/completions"):
        for body in fuzz.RAW:
            r = session.post(fuzz_server.url + path, data=body, headers={"Content-Type": "application/json"},
                             timeout=60)
            fuzz.check_answer(path, body, r)
    healthy.check()


def test_steps_per_block_under_joint_threshold_is_refused_by_name(folder, tmp_path):
    """Under JointThreshold (LLaDA2.1's token editing) steps_per_block has no meaning: every such
    request is a 400 naming it, while a bystander streams its answer unchanged."""
    with Runtime(model_path=folder, num_threads=1, timeout=180, dllm_algorithm="JointThreshold",
                 log_path=str(tmp_path / "server.log")) as rt:
        body = {"text": "joint bystander", "stream": True, "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
        want = answer_of(body, requests.post(rt.url + "/generate", json=body, timeout=TIMEOUT, stream=True))
        bad = [{"text": f"joint {i}", "sampling_params": {"max_new_tokens": 4, "steps_per_block": s}}
               for i, s in enumerate([1, 2, B, 0, -1, 10**6])]
        with ThreadPoolExecutor(4) as pool:
            side = pool.submit(lambda: answer_of(body, requests.post(rt.url + "/generate", json=body, timeout=TIMEOUT,
                                                                     stream=True)))
            answers = list(pool.map(lambda b: requests.post(rt.url + "/generate", json=b, timeout=TIMEOUT), bad))
            assert same_answer(side.result(), want)
        assert all(r.status_code == 400 and "steps_per_block" in r.text for r in answers), \
            [(r.status_code, r.text[:200]) for r in answers]
        assert requests.get(rt.url + "/health", timeout=30).status_code == 200
