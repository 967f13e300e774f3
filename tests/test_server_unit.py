"""Server pieces that need no running server: flags, request parsing, streaming text hold-back,
Prometheus rendering, chat rendering, Runtime's flag mapping."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from bicache_sgl.config import SamplingParams
from bicache_sgl.server.args import parse_args, parse_context_length
from bicache_sgl.server.protocol import APIError, parse_generate, parse_json_body


def tok(text: str) -> list[int]:
    return [ord(c) % 250 for c in text]


def parse(body, **kw):
    kw.setdefault("vocab_size", 256)
    kw.setdefault("context_length", 64)
    return parse_generate(body, tok, **kw)


# -- flags ------------------------------------------------------------------------------------

def test_flags_map_to_engine_config(caplog):
    with caplog.at_level(logging.WARNING):
        a = parse_args(["--model-path", "/m", "--port", "1234", "--block-length", "16", "--steps-per-block", "4",
                        "--threshold", "none", "--remasking", "random", "--cache-mode", "prefix",
                        "--prefix-cache", "fixed:3", "--max-prefix-cache-tokens", "4096", "--max-queued-requests", "7",
                        "--max-running-requests", "5", "--context-length", "2k", "--attention-backend", "triton",
                        "--cuda-graph-bs", "4", "--disable-cuda-graph", "--grammar-backend", "none"])
    cfg = a.engine_config()
    assert (cfg.model_path, cfg.max_running_requests, cfg.max_queued_requests, cfg.context_length) == ("/m", 5, 7, 2000)
    assert (cfg.prefix_cache, cfg.max_prefix_cache_tokens, cfg.attention_backend) == ("fixed:3", 4096, "torch")
    d = cfg.decode
    assert (d.block_length, d.steps_per_block, d.threshold, d.remasking, d.cache_mode) == (16, 4, None, "random",
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


@pytest.mark.parametrize("argv", [["--prefix-cache", "sometimes"], ["--threshold", "2"], ["--block-length", "0"],
                                  ["--remasking", "nope"], ["--chat-template", "no-such-template"],
                                  ["--context-length", "lots"]])
def test_bad_flags_exit(argv):
    with pytest.raises(SystemExit):
        parse_args(argv)


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


def test_nulls_mean_default_and_unknown_keys_ignored():
    g = parse({"text": "abc", "sampling_params": {"max_new_tokens": None, "temperature": None, "regex": None,
                                                    "json_schema": None, "stop": "x", "logit_bias": {"1": 2}},
               "return_logprob": None, "logprob_start_len": None, "top_logprobs_num": None, "lora_path": None,
               "stream": None, "whatever": 1})
    p = g.items[0].params
    assert p.temperature == SamplingParams().temperature and p.stop == ("x",)
    assert g.items[0].logprob.logprob_start_len == -1


def test_implicit_max_new_tokens_shrinks_to_context():
    g = parse({"input_ids": list(range(40))}, context_length=64, block_length=8)
    assert g.items[0].params.max_new_tokens == 24  # 64 - 40 rounded down to whole blocks
    with pytest.raises(APIError):
        parse({"input_ids": list(range(40)), "sampling_params": {"max_new_tokens": 32}}, context_length=64)


def test_prefill_likelihood_defaults_to_all_positions():
    g = parse({"input_ids": [[1, 2, 3]], "sampling_params": {"max_new_tokens": 0}, "return_logprob": True})
    assert g.items[0].logprob.logprob_start_len == 0
    g = parse({"text": "abc", "return_logprob": True})
    assert g.items[0].logprob.logprob_start_len == -1


@pytest.mark.parametrize("body", [{"text": 1}, {"text": ""}, {"input_ids": [1.5]}, {"input_ids": [True]},
                                  {"input_ids": [300]}, {"text": "a", "sampling_params": {"top_k": 0}},
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
    from bicache_sgl.server.app import stream_text
    from bicache_sgl.server.protocol import Item, LogprobOptions

    item = Item(input_ids=[1], params=SamplingParams(stop=("END", "\n\n")), logprob=LogprobOptions())
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
                         "threshold": "none"}) == ["--block-length", "8", "--disable-radix-cache", "--threshold", "none"]
    assert 0 < find_free_port() < 65536


def test_runtime_reports_a_failed_start(tmp_path):
    from bicache_sgl.runtime import Runtime

    with pytest.raises(RuntimeError, match="could not start the engine"):
        Runtime(model_path=str(tmp_path / "missing"), timeout=60, log_path=str(tmp_path / "log.txt"))
