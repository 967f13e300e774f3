"""The general server suites and the SGLang frontend programs, run unchanged against a server on a
tiny LLaDA2 folder (block-diffusion engine in its child process, the default layout).

Nothing is copied: tests of tests/test_server_live.py (all but the two that launch servers of
their own) and tests/test_openai_clients.py (those that neither assert the bundled model's answers
nor address it by its served name) are bound into this module, so pytest runs them again with this
module's ``server`` (a LLaDA2 server configured like test_server_live's: block 8, context 384, the
same served name and SGLang harness flags); its frontend program file runs through its own
helpers. The tiny model is random, so what is checked here beyond them is protocol, shape,
constraints and equality: the frontend program's batch answers (run_batch, 4 threads, prefix
cached first) equal the same prompts sent alone through /generate after a flush (exact block
reuse, batched == alone); tool calls and response_format under bounded schemas; completions' stop
== /generate's; the block engine's refusals named on /v1; chat roles, dtype=float, choices;
images refused; and the two frontend examples run against a LLaDA2 server.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import test_openai_clients as clients
import test_server_live as live
import test_sglang_frontends as frontends

requests = pytest.importorskip("requests")

# Their fixtures, resolved here against this module's ``server``.
tokenizer, oai, sgl = live.tokenizer, live.oai, live.sgl
items_file, sglang_newest = frontends.items_file, frontends.sglang_newest

# tests/test_server_live.py: every case but the LLaDA-only and launch ones
# (test_incremental_streaming_slices_logprobs_with_the_text starts its own bidirectional server,
# test_tp_size_above_one_stops_the_launch launches nothing), in that file's order
LIVE = [
    "launch_log_ready_line_and_unknown_flags", "health_and_ready", "model_info_both_routes",
    "server_info_internal_states", "metrics_prometheus_text", "flush_cache_variants_empty_the_cache",
    "concate_and_append_route_answers_what_it_does", "profiling_is_501", "generate_single",
    "generate_batch_input_ids_and_n", "generate_prefill_only", "generate_logprobs",
    "generate_stop_string_and_token", "generate_stream_cumulative", "generate_stream_batch_has_index",
    "client_disconnect_aborts_request", "prefix_cache_reports_cached_tokens", "generate_bad_input",
    "openai_bad_input", "generate_refused_field_is_400_naming_it",
    "generate_accepts_exactly_what_the_sglang_frontend_sends", "openai_unknown_model_404",
    "server_survives_bad_input", "openai_models", "openai_completion", "openai_completion_echo_logprobs",
    "openai_completion_stream", "openai_chat", "openai_refused_field_is_400_naming_it",
    "openai_noop_values_and_metadata_accepted", "openai_chat_stream", "sglang_gen_and_select_all_methods",
    "sglang_frontend_penalties_and_constraints_are_served", "sglang_join_concate_and_append", "sglang_fork_join",
    "sglang_run_batch_and_cached_prefix", "sglang_streaming", "sglang_cache_prefix_then_cached_tokens",
    "bench_serving_random_ids", "bench_serving_generated_shared_prefix",
    "every_streamed_frame_carries_the_whole_meta_info", "abort_all_ends_every_request_with_abort",
    "empty_lora_path_means_no_adapter", "stop_token_ids_outside_the_vocabulary_are_accepted",
    "openai_chat_usage_and_deltas_have_sglang_keys", "context_rule_is_prompt_plus_max_new_tokens",
    "sglang_streamed_program_with_logprobs_matches_the_final_reply",
]
# tests/test_openai_clients.py: its protocol-level cases (the rest assert the bundled model's
# answers or address it by its served name; tool calls and response_format are checked below)
CLIENTS = [
    "continuous_usage_stats_off_and_bad_values", "vllm_and_newer_sglang_fields_are_refused_with_the_reason",
    "field_errors_name_the_field", "budget_past_the_context_names_the_budget_field",
    "tool_requests_that_cannot_be_served_are_400_naming_the_field",
]
# bound here, pytest collects them in this module: their ``server`` is this module's
globals().update({f"test_{n}": getattr(live, f"test_{n}") for n in LIVE})
globals().update({f"test_{n}": getattr(clients, f"test_{n}") for n in CLIENTS})

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 8  # test_server_live's block length and context, so its length rules hold as written
CONTEXT = 384


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One LLaDA2 server for the module, configured as test_server_live's (same served name, the
    same unknown SGLang harness flags, which are accepted with a warning)."""
    from bicache_sgl.runtime import Runtime
    from bicache_sgl.testing.block import make_tiny_llada2

    folder = tmp_path_factory.mktemp("block_suites")
    model = make_tiny_llada2(folder / "llada2", block_length=BLOCK)
    rt = Runtime(model_path=model, context_length=CONTEXT, max_running_requests=8, num_threads=1,
                 served_model_name="tiny-llada", timeout=180, log_path=str(folder / "server.log"),
                 disable_cuda_graph=True, cuda_graph_bs=4, grammar_backend="none")
    rt.model_path = model
    # exact reuse is whole blocks: a cached prompt leaves up to BLOCK - 1 tokens to compute
    rt.cache_slack = BLOCK - 1
    yield rt
    rt.shutdown()


@pytest.fixture(scope="module")
def wide_server(server, tmp_path_factory):
    """The same folder with the checkpoint's own context (the examples' prompts are longer than
    the 384 tokens test_server_live's length rules need)."""
    from bicache_sgl.runtime import Runtime

    log = tmp_path_factory.mktemp("block_examples") / "server.log"
    with Runtime(model_path=server.model_path, max_running_requests=8, num_threads=1, timeout=180,
                 log_path=str(log)) as rt:
        yield rt


def test_the_suites_ran_on_the_block_engine(server):
    st = requests.get(server.url + "/get_server_info", timeout=30).json()["internal_states"][0]
    assert st["prefix_reuse_rule"] == "exact-block" and st["block_length"] == BLOCK
    assert requests.get(server.url + "/get_model_info", timeout=30).json()["model_type"] == "llada2"


# ------------------------------------------------------------------------------------------------
# what the imported suites do not cover, or cover with the bundled model's content
# ------------------------------------------------------------------------------------------------

# a tool whose arguments are bounded (the random model would fill an unbounded integer or string
# up to max_tokens, and a call cut short is rightly "length", as test_openai_clients checks)
PICK = {"type": "function", "function": {"name": "pick", "parameters": {
    "type": "object", "properties": {"hard": {"type": "boolean"}, "level": {"type": "integer", "minimum": 0,
                                                                             "maximum": 9}},
    "required": ["hard", "level"]}}}
MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Pick a level."}]


@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "pick"}}, "required"])
def test_openai_tool_calls_on_llada2(oai, choice):
    """Named and required tool_choice: one call valid under the function's schema (constrained
    decoding within blocks), streamed == not streamed."""
    kw = {"model": "tiny-llada", "messages": MSGS, "tools": [PICK], "tool_choice": choice, "max_tokens": 64,
          "temperature": 0}
    ch = oai.chat.completions.create(**kw).choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None and len(ch.message.tool_calls) == 1
    name, args = clients.check_call(ch.message.tool_calls[0], tools=(PICK,))
    assert name == "pick"
    chunks = list(oai.chat.completions.create(stream=True, **kw))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    assert len(deltas) == 1 and json.loads(deltas[0].function.arguments) == args


def test_openai_response_format_json_schema_and_json_object(oai):
    import jsonschema

    schema = PICK["function"]["parameters"]
    r = oai.chat.completions.create(model="tiny-llada", messages=MSGS, max_tokens=48, temperature=0, response_format={
        "type": "json_schema", "json_schema": {"name": "pick", "schema": schema}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    # json_object: any JSON object (unbounded keys: the random model may use the whole budget)
    r = oai.chat.completions.create(model="tiny-llada", messages=MSGS, max_tokens=24, temperature=0,
                                    response_format={"type": "json_object"})
    text = r.choices[0].message.content
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_openai_completion_stop_equals_generate(oai, server):
    """/v1/completions with n = 2, stop: each choice is /generate's text cut at the stop string."""
    base = oai.completions.create(model="tiny-llada", prompt="Stop here", max_tokens=16, temperature=0,
                                  extra_body={"ignore_eos": True}).choices[0].text
    stop = base[4:6]
    r = oai.completions.create(model="tiny-llada", prompt="Stop here", max_tokens=16, temperature=0, stop=[stop], n=2,
                               extra_body={"ignore_eos": True})
    assert [c.text for c in r.choices] == [base[:base.index(stop)]] * 2
    assert [c.finish_reason for c in r.choices] == ["stop"] * 2
    native = requests.post(server.url + "/generate", json={"text": "Stop here", "sampling_params": {
        "max_new_tokens": 16, "temperature": 0, "ignore_eos": True, "stop": [stop]}}, timeout=60).json()
    assert native["text"] == r.choices[0].text


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("field,value", [("steps", 16), ("cfg_scale", 1.5), ("dllm_algorithm", "entropy"),
                                         ("block_length", 10**6), ("cache_mode", "dual"), ("eps", 1e-3)])
def test_openai_fields_without_meaning_for_block_models_are_400_naming_them(server, route, field, value):
    """The block engine's refusals reach /v1 as the server's own do: a 400 whose ``param`` is the field."""
    body = {"prompt": "x"} if route == "/v1/completions" else {"messages": MSGS}
    r = requests.post(server.url + route, json={**body, "max_tokens": 4, field: value}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["message"].startswith(field), err


def test_sglang_chat_roles_float_choices(sgl):
    """sgl.system / user / assistant (the frontend's chat template), gen(dtype=float) and
    gen(choices=...) on the block model."""
    from sglang.lang.ir import REGEX_FLOAT

    @sgl.function
    def chat(s):
        s += sgl.system("Be brief.")
        s += sgl.user("Hi")
        s += sgl.assistant(sgl.gen("hello", max_tokens=8, temperature=0))
        s += sgl.user("A number?")
        s += sgl.assistant(sgl.gen("number", max_tokens=8, dtype=float, temperature=0))
        s += sgl.user("A colour?")
        s += sgl.assistant(sgl.gen("colour", choices=["red", "green", "blue"]))

    st = chat.run()
    assert st.error() is None, st.error()
    assert re.fullmatch(REGEX_FLOAT, st["number"]) and st["colour"] in ("red", "green", "blue")
    msgs = st.messages()
    assert [m["role"] for m in msgs] == ["system", "user", "assistant"] * 1 + ["user", "assistant"] * 2
    assert msgs[2]["content"] == st["hello"]


def test_images_are_refused_naming_the_field(sgl, oai, server, tmp_path):
    """A text-only model: sgl.image in a program ends it with the server's 400 naming image_data;
    an OpenAI image part is a 400; the server answers on."""
    import openai

    img = tmp_path / "pixel.png"
    img.write_bytes(b"\x89PNG\r\n\x1a\n")

    @sgl.function
    def look(s):
        s += sgl.user(sgl.image(str(img)) + "What is this?")
        s += sgl.assistant(sgl.gen("answer", max_tokens=4))

    st = look.run()
    assert st.error() is not None and "image_data" in str(st.error())
    with pytest.raises(openai.BadRequestError, match="image"):
        oai.chat.completions.create(model="tiny-llada", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "text", "text": "hi"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}])
    assert requests.get(server.url + "/health", timeout=30).status_code == 200


# ------------------------------------------------------------------------------------------------
# the SGLang frontend programs (tests/sglang_frontend_program.py), pinned and newest frontends
# ------------------------------------------------------------------------------------------------

def alone_answers(server, items: Path) -> list[str]:
    """The program's ``qa`` prompts sent one at a time through /generate, after a flush, with the
    sampling parameters the frontend sends (what run_batch's answers must equal)."""
    requests.post(server.url + "/flush_cache", timeout=30)
    out = []
    for it in json.loads(items.read_text()):
        body = {"text": it["prefix"] + "\n\nQuestion: " + it["question"] + "\nAnswer:",
                "sampling_params": {"max_new_tokens": 32, "stop": ["\n", "Question"], "temperature": 0}}
        r = requests.post(server.url + "/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        out.append(r.json()["text"].strip())
    return out


@pytest.mark.parametrize("frontend", ["pinned", "newest"])
def test_frontend_program_on_llada2(server, items_file, frontend, request):
    pytest.importorskip("sglang")
    path = request.getfixturevalue("sglang_newest") if frontend == "newest" else None
    res = frontends.run_program(server.url, items_file, path)
    frontends.check_protocol(res)
    # batched (4 threads, prefix cached first, exact block reuse) == each prompt alone, cache flushed
    assert res["batch"] == alone_answers(server, items_file)


# ------------------------------------------------------------------------------------------------
# the examples, against this server
# ------------------------------------------------------------------------------------------------

def run_example(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, TMPDIR=str(tmp_path), TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=240, env=env,
                          check=False)


def test_frontend_agent_example_on_llada2(wide_server, tmp_path):
    """examples/frontend_agent.py --url: run_batch of two tasks, fork/join of three approaches
    (temperature 0.7), every call reports whole-block reuse at full depth."""
    pytest.importorskip("sglang")
    p = run_example([str(ROOT / "examples" / "frontend_agent.py"), "--url", wide_server.url], tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    table = p.stdout.split("latency\n", 1)[1].split("\n\n", 1)[0]  # the rows under the table's header
    rows = [ln.split() for ln in table.splitlines()]
    assert len(rows) == 2 * 6  # two tasks x (plan, 3 forks, best, answer)
    cached, depth = [int(r[-4]) for r in rows], [int(r[-3]) for r in rows]
    assert all(c > 0 and c % BLOCK == 0 for c in cached), cached  # the shared system prompt's blocks
    assert set(depth) == {3}  # full depth (3 layers): exact reuse is never partial


def test_frontend_structured_example_on_llada2(wide_server, tmp_path):
    """examples/frontend_structured.py (its demo) against this server: the regex, int and choice
    fields are well formed and the JSON record is complete and valid under its schema (a bounded
    one: the constraint finishes it within its 96 tokens), which the example checks itself."""
    pytest.importorskip("sglang")
    port = wide_server.url.rsplit(":", 1)[1]
    p = run_example([str(ROOT / "examples" / "frontend_structured.py"), "--port", port], tmp_path)
    out = p.stdout
    assert p.returncode == 0 and "all fields well formed" in out, out + p.stderr[-3000:]
    fields = dict(re.findall(r"^(order_id|boxes|shipping):\s+'(.*)'$", out, re.M))
    assert re.fullmatch(r" [0-9]{4}", fields["order_id"]) and fields["shipping"] in (" standard", " express"), out


# run last: everything above (bad input, disconnects, aborts included) left no server error
test_no_server_side_errors_logged = live.test_no_server_side_errors_logged
