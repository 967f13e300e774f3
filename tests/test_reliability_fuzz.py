"""Property-based fuzzing of /generate, /v1/completions and /v1/chat/completions against a real
server (hypothesis): a bounded run, zero 5xx answers, every error a JSON body with a message,
every 200 well-formed, and the server healthy (and its prefix pool intact) after each test's
own requests (checked at the end of every test, so each holds when run alone).

Bodies are mostly valid requests with up to two keys replaced by junk (wrong types, nulls, huge
or negative numbers, nested lists and objects, unicode, empty values), so the fuzzer reaches
deep into parsing, the engine and the output path instead of stopping at the first type check;
a share of the bodies is junk from the top. Raw byte bodies (invalid UTF-8, truncated or deeply
nested JSON, lone surrogates) and the other routes get a smaller run each.

The examples are derandomized (the same every run, so CI is reproducible); set
RELIABILITY_FUZZ_RANDOM=1 and RELIABILITY_FUZZ_EXAMPLES=2000 for a longer exploratory run.
"""

from __future__ import annotations

import json
import os
import re

import pytest
import requests
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from reliability_support import assert_pool_integrity, env_flag, serve, sse_frames, wait_idle

EXAMPLES = env_flag("RELIABILITY_FUZZ_EXAMPLES", 240)
CONTEXT = 256


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serve(tmp_path_factory.mktemp("fuzz"), prefix_cache="naive", max_prefix_cache_tokens=256,
               max_running_requests=8, context_length=CONTEXT, max_n=4, max_batch_size=8, seed=5) as rt:
        yield rt


def fuzz_settings(n: int):
    return settings(max_examples=n, deadline=None, database=None, derandomize=not os.environ.get(
        "RELIABILITY_FUZZ_RANDOM"), suppress_health_check=list(HealthCheck),
                    phases=[Phase.explicit, Phase.generate, Phase.shrink])


# -- strategies ------------------------------------------------------------------------------------

scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 300), st.integers(-(2**70), 2**70),
                    st.floats(allow_nan=False, allow_infinity=False), st.floats(0, 1), st.text(max_size=12),
                    st.sampled_from(["", "\x00", "\ud7ff\ue000", "\U0001f600" * 3, "<|mask|>", "<|endoftext|>",
                                     "-1", "1e400", "null"]))
junk = st.recursive(scalars, lambda c: st.one_of(st.lists(c, max_size=3),
                                                 st.dictionaries(st.text(max_size=6), c, max_size=3)),
                    max_leaves=8)
edge = st.one_of(scalars, junk, st.lists(st.integers(-(2**65), 2**65), max_size=3),
                 st.lists(st.integers(0, 400), max_size=3), st.lists(st.text(max_size=4), max_size=3))
prompt_text = st.text(min_size=1, max_size=30)

SAMPLING = {
    "max_new_tokens": st.integers(0, 24), "min_new_tokens": st.integers(0, 8), "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1), "top_k": st.integers(1, 300),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=3)),
    "stop_token_ids": st.lists(st.integers(0, 300), max_size=3), "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(), "n": st.integers(1, 3), "seed": st.integers(-(2**64), 2**64),
    "block_length": st.integers(1, 16), "steps": st.integers(1, 40), "steps_per_block": st.integers(1, 16),
    "threshold": st.floats(0, 1), "remasking": st.sampled_from(["low_confidence", "random"]),
    "cfg_scale": st.floats(0, 1e308), "cache_mode": st.sampled_from(["none", "prefix", "dual"]),
    "refresh_interval": st.integers(0, 5),
}
# Sampling fields SGLang has and this server refuses (400 naming the field) when set: junk may
# land on them, but they are not part of the mostly-valid bodies (which would then all be refused).
REFUSED_SAMPLING = ("regex", "json_schema", "ebnf", "frequency_penalty", "presence_penalty", "repetition_penalty",
                    "min_p", "logit_bias")


def mutated(optional: dict, required: dict, junk_keys: tuple[str, ...] = ()):
    """Mostly valid objects: the required keys, some optional ones, then (half the time) up to two
    keys (of these, ``junk_keys`` or an unknown one) overwritten by junk."""
    valid = st.fixed_dictionaries(required, optional={k: v for k, v in optional.items() if k not in required})
    keys = sorted(set(optional) | set(required) | set(junk_keys) | {"zzz"})
    return st.tuples(valid, st.dictionaries(st.sampled_from(keys), edge, max_size=2), st.booleans()).map(
        lambda t: {**t[0], **t[1]} if t[2] else t[0])


sampling = mutated(SAMPLING, {"max_new_tokens": st.integers(0, 16)}, REFUSED_SAMPLING)
native_text = mutated(
    {"stream": st.booleans(), "return_logprob": st.booleans(), "logprob_start_len": st.integers(-1, 5),
     "top_logprobs_num": st.integers(0, 5), "return_text_in_logprobs": st.booleans(),
     "bicache_depth": st.integers(0, 4), "rid": st.text(min_size=1, max_size=8)},
    {"text": st.one_of(prompt_text, st.lists(prompt_text, min_size=1, max_size=3)), "sampling_params": sampling})
native_ids = mutated(
    {"stream": st.booleans(), "return_logprob": st.booleans(), "top_logprobs_num": st.integers(0, 3)},
    {"input_ids": st.one_of(st.lists(st.integers(0, 260), min_size=1, max_size=20),
                            st.lists(st.lists(st.integers(0, 260), min_size=1, max_size=8), min_size=1, max_size=3)),
     "sampling_params": sampling})
OPENAI = {
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "n": st.integers(1, 3), "stop": st.text(max_size=3),
    "seed": st.integers(-(2**64), 2**64), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}), "min_tokens": st.integers(0, 4),
    "stop_token_ids": st.lists(st.integers(0, 300), max_size=2), "ignore_eos": st.booleans(),
    "model": st.sampled_from(["", "default", "tiny"]), "block_length": st.integers(1, 16),
    "cache_mode": st.sampled_from(["none", "prefix", "dual"]), "user": st.text(max_size=5),
}
completions = mutated(
    {**OPENAI, "echo": st.booleans(), "logprobs": st.integers(0, 5), "suffix": st.none()},
    {"prompt": st.one_of(prompt_text, st.lists(prompt_text, min_size=1, max_size=2),
                         st.lists(st.integers(0, 260), min_size=1, max_size=10)),
     "max_tokens": st.integers(0, 16)})
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant"]),
     "content": st.one_of(st.text(max_size=20), st.lists(st.fixed_dictionaries(
         {"type": st.just("text"), "text": st.text(max_size=5)}), max_size=2))})
chat = mutated(
    {**OPENAI, "logprobs": st.booleans(), "top_logprobs": st.integers(0, 5), "continue_final_message": st.booleans(),
     "chat_template_kwargs": st.dictionaries(st.text(max_size=5), scalars, max_size=2),
     "max_completion_tokens": st.integers(0, 16)},
    {"messages": st.lists(message, min_size=1, max_size=3), "max_tokens": st.integers(0, 16)})

ROUTES = ["/generate", "/generate", "/v1/completions", "/v1/chat/completions"]
bodies = st.one_of(
    st.tuples(st.just("/generate"), native_text), st.tuples(st.just("/generate"), native_ids),
    st.tuples(st.just("/v1/completions"), completions), st.tuples(st.just("/v1/chat/completions"), chat),
    st.tuples(st.sampled_from(ROUTES), junk),  # junk from the top: lists, strings, numbers, null
)


# -- checks ----------------------------------------------------------------------------------------

class Tally:
    def __init__(self) -> None:
        self.by_status: dict[int, int] = {}

    def note(self, status: int) -> None:
        self.by_status[status] = self.by_status.get(status, 0) + 1


def check_answer(path: str, body, r: requests.Response) -> None:
    where = f"{path} {json.dumps(body)[:400] if not isinstance(body, bytes) else body[:200]!r}"
    assert r.status_code < 500, f"{r.status_code} for {where}: {r.text[:500]}"
    if r.status_code >= 400:
        err = r.json()["error"]
        assert isinstance(err, dict) and isinstance(err["message"], str) and err["message"], (where, r.text)
        return
    assert r.status_code == 200, (where, r.status_code, r.text[:300])
    if r.headers["content-type"].startswith("text/event-stream"):
        frames = sse_frames(r.iter_lines())
        assert frames and frames[-1] == "[DONE]", (where, frames[-2:])
        for f in frames[:-1]:
            assert "error" not in f, (where, f)
        return
    out = r.json()
    if path == "/generate":
        for o in out if isinstance(out, list) else [out]:
            assert isinstance(o["text"], str) and isinstance(o["output_ids"], list), where
            assert o["meta_info"]["finish_reason"]["type"] in ("length", "stop"), (where, o["meta_info"])
    else:
        assert out["choices"] and all(c["finish_reason"] in ("length", "stop") for c in out["choices"]), where


def five_xx(rt) -> dict[str, float]:
    """5xx answers so far by /metrics line (health routes excluded: they answer 503 while the
    server warms up, and Runtime polls them at start)."""
    metrics = requests.get(rt.url + "/metrics", timeout=30).text
    out = {}
    for ln in metrics.splitlines():
        if ln.startswith("sglang:http_requests_total") and re.search(r'status="5\d\d"', ln) \
                and 'route="/health' not in ln:
            name, _, value = ln.rpartition(" ")
            out[name] = float(value)
    return out


class StillHealthy:
    """Made before a test's requests; ``check()`` after them: the server answers /health_generate,
    serves a request in full, is idle with its prefix pool intact, counted no 5xx answer in
    between and logged no server-side error in between. ``integrity``: the idle state's check
    (the prefix pool's accounting by default; the block-diffusion suite passes its K/V one)."""

    def __init__(self, rt, integrity=assert_pool_integrity) -> None:
        self.rt = rt
        self.integrity = integrity
        self.five_xx = five_xx(rt)
        self.log_start = len(rt.log_text())

    def check(self) -> None:
        rt = self.rt
        assert requests.get(rt.url + "/health_generate", timeout=30).status_code == 200
        out = requests.post(rt.url + "/generate", timeout=60, json={
            "text": "still fine?", "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}})
        assert out.status_code == 200, out.text
        assert out.json()["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
        self.integrity(wait_idle(rt))
        assert five_xx(rt) == self.five_xx, (self.five_xx, five_xx(rt))
        log = rt.log_text()[self.log_start:]
        for needle in ("Traceback", "unexpected error", "engine step failed"):
            assert needle not in log, log[-4000:]


def test_fuzz_json_bodies(server):
    rt = server
    healthy = StillHealthy(rt)
    session = requests.Session()
    tally = Tally()

    @fuzz_settings(EXAMPLES)
    @given(bodies)
    def run(case):
        path, body = case
        r = session.post(rt.url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"},
                         timeout=60, stream=True)
        tally.note(r.status_code)
        check_answer(path, body, r)

    run()
    print(f"\nfuzz: {EXAMPLES} JSON bodies, status counts {dict(sorted(tally.by_status.items()))}")
    # the run reached past validation: a good share were served, a good share refused
    assert tally.by_status.get(200, 0) >= EXAMPLES // 5
    assert sum(v for k, v in tally.by_status.items() if 400 <= k < 500) >= EXAMPLES // 10
    healthy.check()


RAW = [
    b"", b" ", b"{", b"}", b"[", b'{"text": "abc", ', b'{"text": "abc"}}', b"null", b"0", b'"text"', b"[]", b"[{}]",
    b'{"text": "caf\xe9"}', b"\xff\xfe\xfd", b'{"text": "\\ud800"}', b'{"text": "\\udc00\\ud800"}',
    b'{"text": "a\\u0000b", "sampling_params": {"max_new_tokens": 4}}', b"[" * 5000 + b"]" * 5000,
    b'{"a":' * 2000 + b"1" + b"}" * 2000, b'{"text": "x", "sampling_params": {"max_new_tokens": 1e999}}',
    b'{"text": "x", "sampling_params": {"max_new_tokens": NaN}}',
    b'{"text": "x", "sampling_params": {"temperature": -0.0}}',
    b'{"input_ids": [1e308]}', b'{"input_ids": [99999999999999999999999999999]}', b'{"text": "x", "text": 5}',
    b'\xef\xbb\xbf{"text": "bom"}', b'{"text": "x"}' + b" " * 10000, b"\x00" * 100,
]


@pytest.mark.parametrize("path", ["/generate", "/v1/completions", "/v1/chat/completions"])
def test_fuzz_raw_bytes(server, path):
    healthy = StillHealthy(server)
    session = requests.Session()
    for body in RAW:
        r = session.post(server.url + path, data=body, headers={"Content-Type": "application/json"}, timeout=60)
        check_answer(path, body, r)
    healthy.check()


other_routes = st.one_of(
    st.tuples(st.just("POST"), st.just("/abort_request"), junk),
    st.tuples(st.just("POST"), st.just("/concate_and_append_request"), junk),
    st.tuples(st.sampled_from(["GET", "POST"]), st.just("/flush_cache"), junk),
    st.tuples(st.just("GET"), st.text(max_size=20).map(lambda s: "/v1/models/" + s), st.none()),
    st.tuples(st.sampled_from(["GET", "PUT", "DELETE", "PATCH"]),
              st.sampled_from(["/generate", "/v1/completions", "/get_server_info", "/nope"]), st.none()),
)


def test_fuzz_other_routes(server):
    rt = server
    healthy = StillHealthy(rt)
    session = requests.Session()

    @fuzz_settings(60)
    @given(other_routes, st.one_of(st.none(), st.text(max_size=8)))
    def run(case, query):
        method, path, body = case
        params = {"timeout": query} if query is not None and path == "/flush_cache" else None
        data = None if body is None else json.dumps(body).encode()
        r = session.request(method, rt.url + path, data=data, params=params, timeout=60)
        assert r.status_code < 500, (method, path, body, query, r.status_code, r.text[:300])

    run()
    healthy.check()
