"""What a newcomer's first hour sends: the README's first OpenAI calls on the bundled model, and
the fields OpenAI clients and load generators (guidellm, langchain) put in their requests.

One real server subprocess (the bundled model, context 1024) serves the module; the clients are
the real ``openai`` package and raw HTTP where a field is not in the SDK's signature.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from reliability_support import sse_frames

requests = pytest.importorskip("requests")
openai = pytest.importorskip("openai")

CONTEXT = 1024
# The bundled model's task (docs/default_model.md): the family's code is in its few-shot block,
# here in the system message; the chat template renders it as "Question: X\nAnswer:" turns.
SHOTS = "Question: K\nAnswer: 7\n\nQuestion: D\nAnswer: 7\n\nQuestion: M\nAnswer: 7"
PROMPT = SHOTS + "\n\nQuestion: D\nAnswer:"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from bicache_sgl.runtime import Runtime

    folder = tmp_path_factory.mktemp("openai_clients")
    rt = Runtime(num_threads=1, max_running_requests=8, context_length=CONTEXT, timeout=180,
                 log_path=str(folder / "server.log"))
    yield rt
    rt.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def post(server, path, payload):
    return requests.post(server.url + path, json=payload, timeout=120)


# ------------------------------------------------------------------------------------------------
# the bundled model answers chat, under its short name
# ------------------------------------------------------------------------------------------------

def test_first_chat_call_on_bundled_model_answers_with_the_family_code(client):
    """The README's first OpenAI chat call: non-empty text, the code from the few-shot block."""
    r = client.chat.completions.create(model="bicache-default", temperature=0, max_tokens=8,
                                       messages=[{"role": "system", "content": SHOTS},
                                                 {"role": "user", "content": "D"}])
    assert r.choices[0].message.content == " 7"
    assert r.choices[0].finish_reason == "stop" and r.model == "bicache-default"
    # the template rendered exactly the trained prompt: its token count is the prompt's characters
    assert r.usage.prompt_tokens == len(PROMPT)


def test_chat_turns_render_like_the_completion_prompt(client):
    """Earlier user/assistant turns are the few-shot block: same answer as /v1/completions."""
    msgs = [{"role": "user", "content": "K"}, {"role": "assistant", "content": " 7"},
            {"role": "user", "content": "D"}, {"role": "assistant", "content": "7"},
            {"role": "user", "content": "M"}, {"role": "assistant", "content": " 7"},
            {"role": "user", "content": "D"}]
    chat = client.chat.completions.create(model="bicache-default", messages=msgs, temperature=0, max_tokens=8)
    comp = client.completions.create(model="bicache-default", prompt=PROMPT, temperature=0, max_tokens=8)
    assert chat.choices[0].message.content == comp.choices[0].text == " 7"
    assert chat.usage.prompt_tokens == comp.usage.prompt_tokens == len(PROMPT)


def test_models_lists_the_short_name_and_path_or_name_both_work(server, client):
    cards = client.models.list().data
    assert [c.id for c in cards] == ["bicache-default"]
    info = requests.get(server.url + "/get_model_info", timeout=30).json()
    path = info["model_path"]
    assert path.endswith("default_model") and cards[0].model_extra["root"] == path
    for name in ("bicache-default", path, "default_model"):
        r = client.completions.create(model=name, prompt=PROMPT, temperature=0, max_tokens=4)
        assert r.choices[0].text == " 7" and r.model == "bicache-default"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4o", prompt=PROMPT, max_tokens=4)
    assert client.models.retrieve("bicache-default").id == "bicache-default"
    assert client.models.retrieve("default_model").id == "bicache-default"


def test_chat_template_refuses_roles_the_model_was_not_trained_on(server):
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "tool", "content": "x", "tool_call_id": "a"}]})
    assert r.status_code == 400 and "trained on" in r.json()["error"]["message"]


def test_served_model_name_flag_and_default_rule():
    """SGLang's rule for any model: --served-model-name, else the model path; bundled: short."""
    from bicache_sgl.models.loader import default_model_path
    from bicache_sgl.server.args import default_served_model_name

    assert default_served_model_name(default_model_path()) == "bicache-default"
    assert default_served_model_name(default_model_path().replace("default_model", "context_model")) == \
        "bicache-context"
    assert default_served_model_name("/data/LLaDA-8B-Instruct") == "/data/LLaDA-8B-Instruct"


def sse(resp) -> list:
    return sse_frames(resp.iter_lines(decode_unicode=False))


# ------------------------------------------------------------------------------------------------
# what load generators send: stream_options.continuous_usage_stats (guidellm, on every request)
# ------------------------------------------------------------------------------------------------

GUIDELLM_STREAM = {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats_puts_usage_on_every_chunk(server, route):
    """A guidellm-shaped request (fixed output length via ignore_eos): every chunk with a choice
    carries that choice's usage so far, completion tokens never go down and end at the final
    usage; the last chunk is the whole request's usage."""
    body = {"model": "bicache-default", "max_tokens": 40, "ignore_eos": True, "temperature": 0,
            **GUIDELLM_STREAM}
    if route == "/v1/completions":
        body["prompt"] = PROMPT
    else:
        body["messages"] = [{"role": "system", "content": SHOTS}, {"role": "user", "content": "D"}]
    with requests.post(server.url + route, json=body, stream=True, timeout=120) as r:
        assert r.status_code == 200, r.text
        frames = sse(r)
    assert frames[-1] == "[DONE]"
    chunks = frames[:-1]
    with_choice = [c for c in chunks if c["choices"]]
    assert len(with_choice) >= 2
    seen = []
    for c in with_choice:
        u = c["usage"]
        assert u["prompt_tokens"] == len(PROMPT) and u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
        seen.append(u["completion_tokens"])
    assert seen == sorted(seen) and seen[-1] == 40
    final = chunks[-1]
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 40
    assert with_choice[-1]["choices"][0]["finish_reason"] == "length"


def test_continuous_usage_stats_off_and_bad_values(server):
    body = {"prompt": PROMPT, "max_tokens": 8, "stream": True, "stream_options": {"include_usage": True}}
    with requests.post(server.url + "/v1/completions", json=body, stream=True, timeout=120) as r:
        chunks = sse(r)[:-1]
    assert all(c["usage"] is None for c in chunks if c["choices"]) and chunks[-1]["usage"]["completion_tokens"] >= 1
    bad = post(server, "/v1/completions", {**body, "stream_options": {"continuous_usage_stats": "yes"}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "stream_options.continuous_usage_stats"


@pytest.mark.parametrize(("route", "field", "value", "why"), [
    ("/v1/chat/completions", "guided_json", {"type": "object"}, "response_format"),
    ("/v1/completions", "guided_regex", "[0-9]", "regex"),
    ("/v1/completions", "include_stop_str_in_output", True, "trimmed"),
    ("/v1/chat/completions", "use_beam_search", True, "beam search"),
    ("/v1/completions", "cache_salt", "tenant-a", "one prefix cache"),
    ("/v1/chat/completions", "priority", 5, "priority scheduling"),
    ("/v1/chat/completions", "chat_template", "{{ messages }}", "--chat-template"),
    ("/v1/completions", "return_token_ids", True, "/generate"),
    ("/v1/chat/completions", "echo", True, "/v1/completions"),
])
def test_vllm_and_newer_sglang_fields_are_refused_with_the_reason(server, route, field, value, why):
    body = {"prompt": PROMPT} if route == "/v1/completions" else {"messages": TOOL_MSGS}
    r = post(server, route, {**body, "max_tokens": 4, field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["message"].startswith(f"{field} is not supported (") and why in err["message"]


def test_vllm_style_defaults_ask_for_nothing_and_are_accepted(server):
    """What vLLM-style clients send by default (no-op values) is accepted, not refused."""
    defaults = {"include_stop_str_in_output": False, "use_beam_search": False, "length_penalty": 1.0,
                "priority": 0, "return_token_ids": False, "stop_regex": [], "custom_params": {},
                "skip_special_tokens": True, "ignore_eos": False}
    r = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, **defaults})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == " 7"
    r = post(server, "/v1/chat/completions", {"messages": TOOL_MSGS, "max_tokens": 4, "temperature": 0,
                                              "echo": False, "add_generation_prompt": True, **defaults})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == " 7"


# ------------------------------------------------------------------------------------------------
# finish_reason is always one of OpenAI's values; structured output cut short is "length"
# ------------------------------------------------------------------------------------------------

def test_openai_parse_answers_and_a_cut_off_answer_raises_length_error(client):
    from pydantic import BaseModel

    class Code(BaseModel):
        code: int

    msgs = [{"role": "system", "content": SHOTS}, {"role": "user", "content": "D"}]
    ok = client.chat.completions.parse(model="bicache-default", messages=msgs, response_format=Code, max_tokens=48,
                                       temperature=0)
    assert isinstance(ok.choices[0].message.parsed, Code) and ok.choices[0].finish_reason == "stop"
    with pytest.raises(openai.LengthFinishReasonError):
        client.chat.completions.parse(model="bicache-default", messages=msgs, response_format=Code, max_tokens=3,
                                      temperature=0)


def test_structured_output_cut_short_streams_length_not_abort(server):
    body = {"messages": [{"role": "user", "content": "D"}], "max_tokens": 3, "stream": True,
            "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": {
                "type": "object", "properties": {"code": {"type": "integer"}}, "required": ["code"]}}}}
    with requests.post(server.url + "/v1/chat/completions", json=body, stream=True, timeout=120) as r:
        chunks = sse(r)[:-1]
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert reasons == ["length"]


# ------------------------------------------------------------------------------------------------
# field errors on /v1 name the field
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("field", "value"), [
    ("temperature", -1), ("top_p", 2), ("n", 0), ("stop", 5), ("top_k", 0), ("min_p", 3), ("seed", "x"),
    ("frequency_penalty", 9), ("logit_bias", {"x": 1}), ("max_tokens", -2), ("min_tokens", -1),
    ("stop_token_ids", "a"), ("repetition_penalty", 0),
])
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_field_errors_name_the_field(server, route, field, value):
    body = {"prompt": PROMPT} if route == "/v1/completions" else {"messages": [{"role": "user", "content": "D"}]}
    r = post(server, route, {**body, "max_tokens": 4, field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field, r.json()


# ------------------------------------------------------------------------------------------------
# a long prompt with max_tokens left out: the answer that fits, or a 400 that says why
# ------------------------------------------------------------------------------------------------

def long_shots(total: int) -> str:
    """A system message of the family's shots (code 7) that renders, with the user's "D", into a
    prompt of ``total`` characters (= tokens): spaces after the first "Question:" fill the rest."""
    shot = "Question: K\nAnswer: 7"
    tail = len("\n\nQuestion: D\nAnswer:")  # the blank line after the system message, then the question
    k = (total - tail + 2) // (len(shot) + 2)
    block = "\n\n".join([shot] * k)
    pad = total - tail - len(block)
    return "Question: " + " " * pad + block[len("Question: "):]


def test_implicit_budget_fits_a_1000_token_prompt_in_a_1024_context(client):
    block = long_shots(1000)
    msgs = [{"role": "system", "content": block}, {"role": "user", "content": "D"}]
    r = client.chat.completions.create(model="bicache-default", messages=msgs, temperature=0)
    # the 24 tokens left: the same answer as asking for them (before: 0 tokens, empty text). (The
    # toy model itself answers prompts this long poorly; that is the model, not the budget.)
    explicit = client.chat.completions.create(model="bicache-default", messages=msgs, temperature=0, max_tokens=24)
    assert r.usage.prompt_tokens == 1000 and r.usage.completion_tokens >= 1
    assert r.choices[0].message.content == explicit.choices[0].message.content
    assert r.usage.completion_tokens == explicit.usage.completion_tokens <= CONTEXT - 1000


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_budget_past_the_context_names_the_budget_field(server, field):
    r = post(server, "/v1/chat/completions", {"messages": TOOL_MSGS, field: CONTEXT})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_prompt_filling_the_context_without_max_tokens_is_a_400_saying_why(server):
    block = long_shots(CONTEXT)
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "system", "content": block},
                                                           {"role": "user", "content": "D"}]})
    assert r.status_code == 400, r.text
    assert "no room is left to generate" in r.json()["error"]["message"] and r.json()["error"]["param"] == "prompt"


# ------------------------------------------------------------------------------------------------
# tool calls through constrained decoding
# ------------------------------------------------------------------------------------------------

LOOKUP = {"type": "function", "function": {
    "name": "lookup_code", "description": "The code of a family's key",
    "parameters": {"type": "object", "properties": {"key": {"type": "string", "maxLength": 3},
                                                    "code": {"type": "integer"}},
                   "required": ["key", "code"]}}}
RESET = {"type": "function", "function": {"name": "reset", "parameters": {
    "type": "object", "properties": {"hard": {"type": "boolean"}}, "required": ["hard"]}}}
TOOL_MSGS = [{"role": "system", "content": SHOTS}, {"role": "user", "content": "D"}]


def check_call(call, tools=(LOOKUP, RESET)):
    """An OpenAI tool call: an id, a known function, arguments a JSON string valid under its schema."""
    import jsonschema

    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert call.id.startswith("call_") and call.type == "function" and call.function.name in schemas
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, schemas[call.function.name])
    return call.function.name, args


def test_named_tool_choice_returns_a_call_valid_under_the_function_schema(client):
    r = client.chat.completions.create(model="bicache-default", messages=TOOL_MSGS, tools=[LOOKUP, RESET],
                                       tool_choice={"type": "function", "function": {"name": "lookup_code"}},
                                       max_tokens=64, temperature=0)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None and len(ch.message.tool_calls) == 1
    assert check_call(ch.message.tool_calls[0])[0] == "lookup_code"


@pytest.mark.parametrize("parallel", [False, None])
def test_required_tool_choice_picks_a_tool_under_an_any_of_schema(client, parallel):
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    r = client.chat.completions.create(model="bicache-default", messages=TOOL_MSGS, tools=[LOOKUP, RESET],
                                       tool_choice="required", max_tokens=96, temperature=0, **extra)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.tool_calls
    for call in ch.message.tool_calls:
        check_call(call)
    if parallel is False:
        assert len(ch.message.tool_calls) == 1
    assert len({c.id for c in ch.message.tool_calls}) == len(ch.message.tool_calls)


def test_streamed_tool_call_matches_the_non_streamed_one(client):
    kw = {"model": "bicache-default", "messages": TOOL_MSGS, "tools": [LOOKUP], "max_tokens": 64, "temperature": 0,
          "tool_choice": {"type": "function", "function": {"name": "lookup_code"}}}
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls[0]
    chunks = list(client.chat.completions.create(stream=True, **kw))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == ["tool_calls"] and len(deltas) == 1
    d = deltas[0]
    assert d.index == 0 and d.id.startswith("call_") and d.function.name == "lookup_code"
    assert json.loads(d.function.arguments) == json.loads(whole.function.arguments)
    assert all(not (c.choices and c.choices[0].delta.content) for c in chunks)


def test_tool_choice_none_ignores_the_tools(client):
    r = client.chat.completions.create(model="bicache-default", messages=TOOL_MSGS, tools=[LOOKUP], tool_choice="none",
                                       max_tokens=8, temperature=0)
    assert r.choices[0].message.content == " 7" and r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason == "stop"


def test_tool_call_cut_short_by_max_tokens_is_length(client):
    r = client.chat.completions.create(model="bicache-default", messages=TOOL_MSGS, tools=[LOOKUP], max_tokens=4,
                                       tool_choice={"type": "function", "function": {"name": "lookup_code"}})
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.tool_calls is None


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"tools": [LOOKUP]}, "tools", "tool-call format"),  # "auto", the default: this template declares none
    ({"tools": [LOOKUP], "tool_choice": "auto"}, "tools", "tool-call format"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [LOOKUP], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not in tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}], "tool_choice": "required"}, "tools",
     "letters"),
    ({"tools": [LOOKUP], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "response_format"),
    ({"tools": [LOOKUP], "tool_choice": "required", "logprobs": True}, "logprobs", "tool calls"),
    ({"tools": [LOOKUP], "tool_choice": "required", "parallel_tool_calls": "yes"}, "parallel_tool_calls",
     "boolean"),
])
def test_tool_requests_that_cannot_be_served_are_400_naming_the_field(server, body, param, words):
    r = post(server, "/v1/chat/completions", {"messages": TOOL_MSGS, "max_tokens": 8, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_openai_pydantic_function_tool_parses_the_arguments(client):
    from pydantic import BaseModel

    class LookupCode(BaseModel):
        key: str
        code: int

    r = client.chat.completions.parse(model="bicache-default", messages=TOOL_MSGS, max_tokens=64, temperature=0,
                                      tools=[openai.pydantic_function_tool(LookupCode)],
                                      tool_choice={"type": "function", "function": {"name": "LookupCode"}})
    call = r.choices[0].message.tool_calls[0]
    assert isinstance(call.function.parsed_arguments, LookupCode)


def test_auto_parses_hermes_tool_call_blocks():
    """"auto" where the template declares Hermes/Qwen <tool_call> blocks: the blocks naming a known
    tool become calls, the rest stays content; a template without them is refused."""
    from bicache_sgl.server.openai_tools import plan_tools
    from bicache_sgl.server.protocol import APIError

    hermes = "{% for m in messages %}{{ m.content }}{% endfor %}<tool_call>{{ tools | tojson }}</tool_call>"
    plan = plan_tools({"tools": [LOOKUP, RESET]}, hermes)
    assert plan.mode == "auto" and plan.template_tools == [LOOKUP, RESET]
    text = ('Let me look. <tool_call>\n{"name": "lookup_code", "arguments": {"key": "D", "code": 7}}\n</tool_call>'
            '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>')
    content, calls = plan.auto_split(text)
    assert content == "Let me look." and [c["function"]["name"] for c in calls] == ["lookup_code"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"key": "D", "code": 7}
    assert plan.auto_split("just text") == ("just text", [])
    with pytest.raises(APIError):
        plan_tools({"tools": [LOOKUP]}, "{{ messages }}")
    assert plan_tools({"tools": [LOOKUP], "tool_choice": "none"}, "{{ messages }}").template_tools is None


def test_langchain_bind_tools_and_structured_output_via_function_calling(server):
    """langchain-openai's tool-calling paths, unchanged, against this server."""
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class LookupCode(BaseModel):
        """The code of a family's key."""

        key: str = Field(max_length=3)
        code: int

    llm = ChatOpenAI(base_url=server.url + "/v1", api_key="none", model="bicache-default", temperature=0,
                     max_tokens=64, max_retries=0)
    msgs = [("system", SHOTS), ("human", "D")]
    ai = llm.bind_tools([LookupCode], tool_choice="LookupCode").invoke(msgs)
    assert [c["name"] for c in ai.tool_calls] == ["LookupCode"] and ai.tool_calls[0]["id"].startswith("call_")
    LookupCode.model_validate(ai.tool_calls[0]["args"])
    out = llm.with_structured_output(LookupCode, method="function_calling").invoke(msgs)
    assert isinstance(out, LookupCode)
    streamed = list(llm.bind_tools([LookupCode], tool_choice="any").stream(msgs))
    merged = streamed[0]
    for c in streamed[1:]:
        merged = merged + c
    assert [c["name"] for c in merged.tool_calls] == ["LookupCode"]


# ------------------------------------------------------------------------------------------------
# the README's examples run and print what the README says they print
# ------------------------------------------------------------------------------------------------

README = Path(__file__).resolve().parents[1] / "README.md"
# (a line the block contains, the stdout the README's comments promise)
README_BLOCKS = [
    ("client.chat.completions.create(", ["' 7'", "' 7' 88"]),
    ("sgl.set_default_backend(", ["' 3' 148 8", "' 3' 148 8"]),
    ("engine = Engine()", ["' 5'"]),
]


def readme_python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


@pytest.mark.parametrize(("marker", "expected"), README_BLOCKS, ids=["openai", "sglang-frontend", "engine"])
def test_readme_example_prints_what_the_readme_says(server, marker, expected):
    blocks = [b for b in readme_python_blocks() if marker in b]
    assert len(blocks) == 1, f"the README has no single python block with {marker!r}"
    block = blocks[0]
    for line in expected:  # the README's own comments promise this output
        assert f"# {line}" in block, (line, block)
    code = block.replace("http://127.0.0.1:30000", server.url)
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=env, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.splitlines() == expected, p.stdout


def test_launch_server_help_starts_with_start_here_flags_that_exist():
    from bicache_sgl.server.args import START_HERE, build_parser

    parser = build_parser()
    text = parser.format_help()
    assert text.index("start here") < text.index("examples:") < text.index("options:")
    known = {s for a in parser._actions for s in a.option_strings}
    listed = set(re.findall(r"(--[a-z][a-z-]+)", START_HERE.split("examples:")[0]))
    assert len(listed) >= 10 and listed <= known, listed - known
