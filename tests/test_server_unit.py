"""Server pieces that need no running server: flags, request parsing, which fields are refused,
streaming text hold-back, Prometheus rendering, chat rendering, the app's wiring (routes on a stub
engine, no import circle), Runtime's flag mapping."""

from __future__ import annotations

import ast
import logging
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest

from bicache_sgl.config import SamplingParams
from bicache_sgl.server.args import parse_args, parse_context_length
from bicache_sgl.server.protocol import APIError, parse_generate, parse_json_body


def tok(text: str) -> list[int]:
    return [ord(c) % 250 for c in text]


def parse(body, **kw):
    kw.setdefault("context_length", 64)
    return parse_generate(body, tok, **kw)


# -- flags ------------------------------------------------------------------------------------

def test_flags_map_to_engine_config(caplog):
    with caplog.at_level(logging.WARNING):
        a = parse_args(["--model-path", "/m", "--port", "1234", "--block-length", "16", "--steps-per-block", "4",
                        "--threshold", "none", "--remasking", "random", "--cache-mode", "prefix",
                        "--prefix-cache", "fixed:3", "--max-prefix-cache-tokens", "4096", "--max-queued-requests", "7",
                        "--max-running-requests", "5", "--context-length", "2k", "--attention-backend", "triton",
                        "--max-total-tokens", "9000",
                        "--cuda-graph-bs", "4", "--disable-cuda-graph", "--grammar-backend", "none"])
    cfg = a.engine_config()
    assert (cfg.model_path, cfg.max_running_requests, cfg.max_queued_requests, cfg.context_length) == ("/m", 5, 7, 2000)
    assert (cfg.prefix_cache, cfg.max_prefix_cache_tokens, cfg.attention_backend) == ("fixed:3", 4096, "torch")
    assert cfg.max_total_tokens == 9000
    d = cfg.decode
    assert (d.block_length, d.steps_per_block, d.threshold, d.dllm_algorithm, d.cache_mode) == (16, 4, None, "random",
                                                                                              "prefix")
    assert a.port == 1234 and a.url == "http://127.0.0.1:1234"
    assert a.ignored_args == ("--cuda-graph-bs", "4", "--disable-cuda-graph", "--grammar-backend", "none")
    assert "ignoring unsupported SGLang flags" in caplog.text


def test_flags_defaults_and_radix_switch():
    a = parse_args([])
    assert a.model_path is None and a.host == "127.0.0.1" and a.port == 30000
    assert a.engine_config().prefix_cache == "bicache"
    assert parse_args(["--disable-radix-cache"]).engine_config().prefix_cache == "off"
    assert parse_args(["--model", "/x"]).model_path == "/x"
    assert parse_args(["--steps", "64"]).default_sampling_params() == {"steps": 64}
    assert parse_args([]).engine_config().decode.step_rows == "block"
    assert parse_args(["--step-rows", "active"]).engine_config().decode.step_rows == "active"


@pytest.mark.parametrize("argv", [["--prefix-cache", "sometimes"], ["--threshold", "2"], ["--block-length", "0"],
                                  ["--remasking", "nope"], ["--chat-template", "no-such-template"],
                                  ["--context-length", "lots"], ["--step-rows", "some"],
                                  ["--step-rows", "active", "--cache-mode", "prefix"]])
def test_bad_flags_exit(argv):
    with pytest.raises(SystemExit):
        parse_args(argv)


@pytest.mark.parametrize("argv,message", [
    (["--tp-size", "2"], "tensor parallelism is not implemented; use --tp-size 1"),
    (["--tensor-parallel-size", "4"], "tensor parallelism is not implemented; use --tp-size 1"),
    (["--dp-size", "0"], "--dp-size must be >= 1"),
    (["--dllm-algorithm", "Speculative"], "--dllm-algorithm Speculative is not implemented")])
def test_unimplemented_flags_stop_the_launch(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


def test_sglang_flags_with_their_single_device_values_are_accepted():
    a = parse_args(["--tp-size", "1", "--dp-size", "1", "--dllm-algorithm", "LowConfidence", "--remasking", "random",
                    "--trust-remote-code", "--enable-metrics"])
    assert a.decode.dllm_algorithm == "low_confidence" and a.ignored_args == ()
    # LLaDA2.1's (the family at startup decides whether the model runs it: tests/test_block_editing.py)
    a = parse_args(["--dllm-algorithm", "JointThreshold", "--dllm-algorithm-config", "algo.yaml"])
    assert (a.decode.dllm_algorithm, a.decode.dllm_algorithm_config) == ("joint_threshold", "algo.yaml")
    assert a.public_dict()["dllm_algorithm_config"] == "algo.yaml"


def test_context_length_units():
    assert [parse_context_length(v) for v in ("4096", "32k", "1Ki", "2M")] == [4096, 32000, 1024, 2_000_000]


def test_api_key_redacted(caplog):
    a = parse_args(["--api-key", "topsecret"])
    assert "topsecret" not in repr(a.public_dict())
    with caplog.at_level(logging.WARNING):
        a = parse_args(["--api_key", "topsecret", "--hf-token=abc", "--cuda-graph-bs", "4"])
    assert a.ignored_args == ("--api_key", "<redacted>", "--hf-token=<redacted>", "--cuda-graph-bs", "4")
    assert "topsecret" not in caplog.text and "abc" not in caplog.text


# -- /generate parsing ----------------------------------------------------------------------------

def test_single_and_batch_shapes():
    g = parse({"text": "abc"})
    assert not g.batch and len(g.items) == 1 and g.items[0].input_ids == tok("abc")
    g = parse({"text": ["a", "bb"], "sampling_params": {"n": 3, "max_new_tokens": 4}})
    assert g.batch and [(i.prompt_index, i.sample_index) for i in g.items] == [(p, s) for p in range(2)
                                                                               for s in range(3)]
    assert all(i.params.n == 1 for i in g.items)
    g = parse({"input_ids": [[1, 2], [3]], "rid": ["x", "y"]})
    assert [i.rid for i in g.items] == ["x", "y"]
    assert parse({"text": "a", "sampling_params": {"n": 2}}).batch  # n > 1 answers with a list


# what SGLang's frontend sends on every gen() call (recorded from the real client)
FRONTEND_SAMPLING = {"skip_special_tokens": True, "spaces_between_special_tokens": True, "max_new_tokens": 16,
                     "min_new_tokens": 0, "n": 1, "stop": ["\n", "Q:"], "stop_token_ids": [], "stop_regex": [],
                     "temperature": 0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0,
                     "presence_penalty": 0.0, "ignore_eos": False, "regex": None, "json_schema": None}


def test_nulls_and_noop_defaults_accepted_unknown_top_level_keys_ignored():
    g = parse({"text": "abc", "sampling_params": {"max_new_tokens": None, "temperature": None, "regex": None,
                                                    "json_schema": None, "stop": "x", "logit_bias": {},
                                                    "repetition_penalty": 1.0, "custom_params": None,
                                                    "no_stop_trim": False, "some_future_key": None},
               "return_logprob": None, "logprob_start_len": None, "top_logprobs_num": None, "lora_path": None,
               "image_data": None, "return_hidden_states": False, "sampling_seed": None, "stream": None,
               "conversation_id": "c1", "whatever": 1})
    p = g.items[0].params
    assert p.temperature == SamplingParams().temperature and p.stop == ("x",)
    assert g.items[0].req.logprob_start_len == -1
    p = parse({"text": "abc", "sampling_params": FRONTEND_SAMPLING}).items[0].params
    assert (p.temperature, p.max_new_tokens, p.stop, p.top_k) == (0.0, 16, ("\n", "Q:"), -1)


# (regex, json_schema, the penalties, min_p and logit_bias are implemented: tests/test_structured.py)
REFUSED_SAMPLING = [("ebnf", "root ::= 'a'"), ("structural_tag", "{}"), ("stop_regex", ["a+"]),
                    ("custom_params", {"k": 1}), ("no_stop_trim", True),
                    ("spaces_between_special_tokens", False), ("stream_interval", 4),
                    # a number is not the boolean true (Python would say 1 == True)
                    ("spaces_between_special_tokens", 1)]


@pytest.mark.parametrize("key,value", REFUSED_SAMPLING, ids=[f"{k}={v!r}" for k, v in REFUSED_SAMPLING])
def test_refused_sampling_params_name_the_field(key, value):
    with pytest.raises(ValueError, match=f"^{key} is not supported yet .*: remove the field or set it to null"):
        SamplingParams.from_dict({key: value})
    with pytest.raises(APIError) as e:
        parse({"text": "abc", "sampling_params": {"max_new_tokens": 4, key: value}})
    assert e.value.status == 400 and e.value.message.startswith(key)


def test_every_refused_sampling_key_accepts_its_noop_values():
    for key, (noops, _) in SamplingParams.UNSUPPORTED.items():
        for v in (None, *noops):
            assert SamplingParams.from_dict({key: v}) == SamplingParams(), (key, v)
    assert {k for k, _ in REFUSED_SAMPLING} == set(SamplingParams.UNSUPPORTED)  # the test covers the table


def test_unknown_sampling_key_is_refused_by_name():
    with pytest.raises(APIError, match="^temprature is not a sampling parameter"):
        parse({"text": "abc", "sampling_params": {"temprature": 0.5}})
    assert SamplingParams.from_dict({"sampling_seed": 7, "max_tokens": 3}).seed == 7  # aliases are known


REFUSED_TOP_LEVEL = [("image_data", "http://x/cat.png"), ("audio_data", ["a.wav"]), ("modalities", ["image"]),
                     ("lora_path", "adapter"), ("lora_path", [None, "adapter"]), ("return_hidden_states", True),
                     ("session_params", {"id": "s"}), ("custom_logit_processor", "x"), ("token_ids_logprob", [1]),
                     ("bootstrap_host", "h"), ("data_parallel_rank", 1), ("priority", 1), ("sampling_seed", 3),
                     ("input_embeds", [[0.1]]), ("background", True)]


@pytest.mark.parametrize("key,value", REFUSED_TOP_LEVEL, ids=[f"{k}={v!r}" for k, v in REFUSED_TOP_LEVEL])
def test_refused_generate_fields_name_the_field(key, value):
    with pytest.raises(APIError) as e:
        parse({"text": "abc", key: value})
    assert e.value.status == 400 and e.value.param == key and e.value.message.startswith(f"{key} is not supported")


def test_log_metrics_false_is_carried_to_the_item():
    assert parse({"text": "a"}).items[0].log_metrics is True
    assert parse({"text": "a", "log_metrics": False}).items[0].log_metrics is False
    with pytest.raises(APIError):
        parse({"text": "a", "log_metrics": "no"})


# -- OpenAI request fields ------------------------------------------------------------------------------

def openai_check(route: str, body: dict) -> None:
    from bicache_sgl.server.fields import check_chat_body, check_completion_body

    (check_chat_body if route == "chat" else check_completion_body)(body)


# tools / tool_choice are implemented (checked by the chat route: openai_tools.plan_tools)
OPENAI_REFUSED = [("chat", "functions", [{"name": "f"}]), ("chat", "function_call", {"name": "f"}),
                  ("chat", "ebnf", "root ::= 'a'"), ("chat", "audio", {"voice": "x"}),
                  ("chat", "modalities", ["text", "audio"]), ("chat", "reasoning_effort", "low"),
                  ("chat", "prediction", {"type": "content"}), ("chat", "store", True),
                  ("chat", "service_tier", "flex"), ("chat", "structural_tag", "{}"),
                  ("chat", "no_stop_trim", True), ("chat", "rid", "r1"),
                  ("completions", "best_of", 3), ("completions", "suffix", "end"),
                  ("completions", "ebnf", "root ::= 'a'"), ("completions", "lora_path", "a"),
                  ("completions", "tools", [])]  # not a completions field at all


@pytest.mark.parametrize("route,key,value", OPENAI_REFUSED, ids=[f"{r}-{k}" for r, k, _ in OPENAI_REFUSED])
def test_openai_refused_fields_name_the_field(route, key, value):
    from bicache_sgl.server.fields import FieldError

    with pytest.raises(FieldError) as e:
        openai_check(route, {"model": "m", key: value})
    assert e.value.param == key and str(e.value).startswith(key)


def test_openai_noop_and_metadata_fields_accepted():
    openai_check("chat", {"model": "m", "messages": [], "tools": [], "tool_choice": "auto", "functions": None,
                          "function_call": "none", "parallel_tool_calls": True, "response_format": {"type": "text"},
                          "user": "u", "metadata": {"k": "v"}, "store": False, "service_tier": "auto",
                          "frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": None, "n": 1,
                          "separate_reasoning": True, "modalities": ["text"], "seed": 1})
    openai_check("completions", {"model": "m", "prompt": "p", "best_of": 1, "suffix": None, "user": "u",
                                 "echo": False, "min_p": 0.0, "regex": None})
    from bicache_sgl.server.openai_tools import plan_tools

    # "auto" asks for nothing without tools; with tools it needs a template that declares a
    # tool-call format (here none): a 400 naming tools
    assert plan_tools({"tool_choice": "auto", "tools": []}, "{{ messages }}") is None
    with pytest.raises(APIError, match="^tools") as e:
        plan_tools({"tool_choice": "auto", "tools": [{"type": "function", "function": {"name": "f"}}]},
                   "{{ messages }}")
    assert e.value.param == "tools"


def test_openai_unknown_field_and_stream_option_refused():
    from bicache_sgl.server.fields import FieldError, check_stream_options

    with pytest.raises(FieldError) as e:
        openai_check("completions", {"prompt": "p", "max_new_token": 3})
    assert e.value.param == "max_new_token"
    check_stream_options({"include_usage": True, "include_obfuscation": False, "continuous_usage_stats": True})
    with pytest.raises(FieldError) as e:
        check_stream_options({"include_obfuscation": True})
    assert e.value.param == "stream_options.include_obfuscation"


def test_implicit_max_new_tokens_shrinks_to_context():
    g = parse({"input_ids": list(range(40))}, context_length=64, block_length=8)
    assert g.items[0].params.max_new_tokens == 24  # 64 - 40 rounded down to whole blocks
    # less than a block left: what is left (the engine cuts the last block short), not 0
    g = parse({"input_ids": list(range(60))}, context_length=64, block_length=8)
    assert g.items[0].params.max_new_tokens == 4
    # a budget the client gave, and a prompt with no room left, are the engine's to refuse
    # (tests/test_validate.py::test_the_context_and_vocabulary_rules_name_the_field)
    g = parse({"input_ids": list(range(40)), "sampling_params": {"max_new_tokens": 32}}, context_length=64)
    assert g.items[0].params.max_new_tokens == 32
    assert parse({"input_ids": list(range(64))}, context_length=64).items[0].params.max_new_tokens == 128
    # min_new_tokens is left as sent (never lowered to the fitted budget): the engine judges it
    # against that budget (scheduler/validate.py check_min_new_tokens: 24 < 30 is a 400)
    g = parse({"input_ids": list(range(40)), "sampling_params": {"min_new_tokens": 30}}, context_length=64,
              block_length=8)
    assert (g.items[0].params.max_new_tokens, g.items[0].params.min_new_tokens) == (24, 30)


def test_prefill_likelihood_defaults_to_all_positions():
    g = parse({"input_ids": [[1, 2, 3]], "sampling_params": {"max_new_tokens": 0}, "return_logprob": True})
    assert g.items[0].req.logprob_start_len == 0
    g = parse({"text": "abc", "return_logprob": True})
    assert g.items[0].req.logprob_start_len == -1


@pytest.mark.parametrize("body", [{"text": 1}, {"text": ""}, {"input_ids": [1.5]}, {"input_ids": [True]},
                                  {"text": "a", "sampling_params": {"top_k": 0}},
                                  {"text": "a", "sampling_params": {"max_new_tokens": 2.5}},
                                  {"text": "a", "sampling_params": {"n": 1000}},
                                  {"text": ["a"], "rid": [1]}, {"text": "a", "bicache_depth": -1},
                                  {"text": "a", "input_embeds": [[0.1]]}])
def test_bad_bodies(body):
    with pytest.raises(APIError) as e:
        parse(body)
    assert 400 <= e.value.status < 500


def test_json_body_errors():
    with pytest.raises(APIError, match="UTF-8"):
        parse_json_body(b'{"text": "\xff"}')
    with pytest.raises(APIError, match="malformed"):
        parse_json_body(b"{")
    assert parse_json_body(b"", allow_empty=True) is None


# -- streaming hold-back -----------------------------------------------------------------------------

def test_stream_text_holds_back_stop_prefix_and_partial_chars():
    from bicache_sgl.io_struct import GenerateRequest
    from bicache_sgl.server.protocol import Item
    from bicache_sgl.server.responses import stream_text

    item = Item(GenerateRequest([1], SamplingParams(stop=("END", "\n\n"))))
    ev = SimpleNamespace(text="hello EN", finished=False)
    assert stream_text(item, ev) == "hello "
    assert stream_text(item, SimpleNamespace(text="line\n", finished=False)) == "line"
    assert stream_text(item, SimpleNamespace(text="caf\ufffd", finished=False)) == "caf"
    assert stream_text(item, SimpleNamespace(text="hello EN", finished=True)) == "hello EN"


# -- metrics -------------------------------------------------------------------------------------------

def test_prometheus_rendering():
    from bicache_sgl.server.metrics import Metrics

    m = Metrics('model "q"')
    m.on_finish(10, {"completion_tokens": 8, "cached_tokens": 4, "forward_passes": 2,
                     "finish_reason": {"type": "length"}}, 0.3, 0.1)
    text = m.render({"num_running_reqs": 1, "cache_hit_rate": 0.5, "prefix_cache_mode": "bicache",
                     "nested": {"a": 2}})
    assert 'sglang:prompt_tokens_total{model_name="model \\"q\\""} 10' in text
    assert "sglang:num_running_reqs{" in text and "bicache_sgl:cache_hit_rate{" in text
    assert "bicache_sgl:nested_a{" in text and "prefix_cache_mode" not in text
    assert 'sglang:e2e_request_latency_seconds_bucket{model_name="model \\"q\\"",le="0.5"} 1' in text
    assert m.avg_tokens_per_forward == 4.0
    for line in text.splitlines():
        assert line.startswith("#") or len(line.rsplit(" ", 1)) == 2


# -- chat -------------------------------------------------------------------------------------------------

def test_chat_rendering(tmp_path):
    from transformers import AutoTokenizer

    from bicache_sgl.server.chat import load_chat_template, normalize_messages, render_chat
    from bicache_sgl.testing import make_tiny_llada

    tk = AutoTokenizer.from_pretrained(make_tiny_llada(tmp_path / "m"))
    msgs = normalize_messages([{"role": "system", "content": "S"},
                               {"role": "user", "content": [{"type": "text", "text": "Hi"}]}])
    out = render_chat(tk, msgs, None)
    assert out == tk.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    tk.chat_template = None  # a tokenizer without a template gets the plain one
    assert render_chat(tk, msgs, None) == "SYSTEM: S\nUSER: Hi\nASSISTANT:"
    assert render_chat(tk, msgs + [{"role": "assistant", "content": "Hel"}], None,
                       continue_final_message=True).endswith("ASSISTANT: Hel")
    assert "<|im_start|>user\nHi<|im_end|>" in render_chat(tk, msgs, load_chat_template("chatml"))
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert render_chat(tk, msgs, load_chat_template(str(f))) == "[S][Hi]"
    with pytest.raises(APIError):
        normalize_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


# -- Runtime ---------------------------------------------------------------------------------------------

def test_runtime_flag_mapping():
    from bicache_sgl.runtime import find_free_port, server_flags

    assert server_flags({"block_length": 8, "disable_radix_cache": True, "api_key": None, "skip_server_warmup": False,
                         "threshold": "none"}) == ["--block-length", "8", "--disable-radix-cache", "--threshold",
                                                   "none"]
    port = find_free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # the port it returns can really be served
        s.bind(("127.0.0.1", port))
        s.listen()
        assert s.getsockname()[1] == port


def test_runtime_reports_a_failed_start(tmp_path):
    from bicache_sgl.runtime import Runtime

    with pytest.raises(RuntimeError, match="could not start the engine"):
        Runtime(model_path=str(tmp_path / "missing"), timeout=60, log_path=str(tmp_path / "log.txt"))


# -- the app's wiring ----------------------------------------------------------------------------------

SERVER_DIR = Path(__file__).resolve().parents[1] / "bicache_sgl" / "server"


def server_imports() -> dict[str, set[str]]:
    """module -> the bicache_sgl.server modules it imports (at any depth in the file)."""
    graph: dict[str, set[str]] = {}
    for f in SERVER_DIR.glob("*.py"):
        deps = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                deps |= {n.rsplit(".", 1)[-1] for n in names if n.startswith("bicache_sgl.server.")}
        graph[f.stem] = deps & {g.stem for g in SERVER_DIR.glob("*.py")} - {f.stem}
    return graph


def test_server_modules_have_no_import_circle():
    graph = server_imports()
    assert "app" not in graph["openai_api"] and "app" not in graph["native_api"]
    done: set[str] = set()

    def visit(m: str, path: tuple[str, ...]) -> None:
        assert m not in path, f"import circle: {' -> '.join(path + (m,))}"
        if m in done:
            return
        for d in graph.get(m, ()):
            if d != "__init__":  # the package __init__ only re-exports (lazily for the app)
                visit(d, path + (m,))
        done.add(m)

    for m in graph:
        visit(m, ())


def test_no_engine_probing_in_the_server():
    """The server uses the typed EngineClient interface: never getattr on the engine, never a test
    of the engine's class (what differs between engines is in the protocol)."""
    for f in [*SERVER_DIR.glob("*.py"), SERVER_DIR.parent / "launch_server.py"]:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr", "isinstance"):
                target = ast.unparse(node.args[0])
                assert "engine" not in target and target != "ev", (f.name, ast.unparse(node))


def test_every_engine_client_has_what_the_server_uses():
    """The in-process engine, the engine-process client and the block-diffusion client all carry
    the members the server reads from the EngineClient protocol."""
    from bicache_sgl.blockdiff.client import BlockEngineClient
    from bicache_sgl.engine.engine import Engine
    from bicache_sgl.engine.interface import EngineClient
    from bicache_sgl.engine.process import EngineProcessClient

    members = [n for n in dir(EngineClient) if not n.startswith("_")] + list(EngineClient.__annotations__)
    for cls in (Engine, EngineProcessClient, BlockEngineClient):
        for name in ("in_process", "submit_returns_at_once", "attach_loop", "watch", "describe", "submit_many",
                     "abort", "abort_all", "flush_cache", "get_stats", "shutdown"):
            assert name in members, name
            assert hasattr(cls, name), (cls.__name__, name)


class StubEngine:
    """Just enough of EngineClient to build the app and answer the routes that need no model."""

    model_path = "stub-model"
    submit_returns_at_once = False
    context_length = 64
    tokenizer = None
    model_config = None

    def flush_cache(self, timeout: float = 30.0) -> bool:
        return True

    def get_stats(self) -> dict:
        return {"num_running_reqs": 0, "num_waiting_reqs": 0}

    def shutdown(self, timeout: float = 10.0) -> None:
        pass


@pytest.fixture
def client():
    from fastapi.testclient import TestClient

    from bicache_sgl.server.app import create_app
    from bicache_sgl.server.args import ServerArgs

    return TestClient(create_app(StubEngine(), ServerArgs(served_model_name="stub")))  # no lifespan: no warmup


@pytest.mark.parametrize("method", ["GET", "POST"])
@pytest.mark.parametrize("path", ["/start_profile", "/stop_profile"])
def test_profile_routes_are_501(client, method, path):
    r = client.request(method, path)
    assert r.status_code == 501
    err = r.json()["error"]
    assert err["type"] == "NotImplementedError" and f"{path} is not implemented" in err["message"]


def test_concate_and_append_checks_its_body(client):
    r = client.post("/concate_and_append_request", json={"src_rids": ["a", "b"], "dst_rid": "c"})
    assert r.status_code == 200 and r.json()["success"] is True and "nothing to splice" in r.json()["message"]
    for bad in ({"src_rids": "a", "dst_rid": "c"}, {"src_rids": ["a"]}, {"src_rids": [1], "dst_rid": "c"}):
        r = client.post("/concate_and_append_request", json=bad)
        assert r.status_code == 400, bad


def test_state_reached_through_the_app(client):
    info = client.get("/get_server_info").json()
    assert info["served_model_name"] == "stub" and info["model_path"] == "stub-model"
    st = info["internal_states"][0]
    assert st["avg_tokens_per_forward"] == st["avg_spec_accept_length"] == 1.0  # no forward yet
    assert st["num_running_reqs"] == 0  # the engine's stats are merged in
    assert client.get("/v1/models").json()["data"][0]["id"] == "stub"
    assert client.get("/health").status_code == 503  # not warmed up: the lifespan did not run
    assert client.post("/flush_cache").text.startswith("Cache flushed.")
