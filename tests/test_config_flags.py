"""Configuration declared once: each setting is a dataclass field (default + help) and every CLI
flag is built from it (bicache_sgl/flags.py). The snapshots below are the flags, dests, defaults
and choices the CLIs had before the flags were generated; they must not drift (tests, docs and
SGLang launch lines use them)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bicache_sgl import cli
from bicache_sgl.config import DecodeDefaults, EngineConfig
from bicache_sgl.flags import add_flags, flag_fields, flag_values, option
from bicache_sgl.server.args import ServerArgs, build_parser, parse_args

ROOT = Path(__file__).resolve().parents[1]

# option strings -> (dest, default, choices), as `python -m bicache_sgl.launch_server --help` had them
SERVER_FLAGS: dict[str, tuple] = {
    "--api-key": ("api_key", None, None),
    "--admin-api-key": ("admin_api_key", None, None),
    "--attention-backend": ("attention_backend", "torch", None),
    "--bicache-audit-min-agreement": ("bicache_audit_min_agreement", 0.9, None),
    "--bicache-audit-probation": ("bicache_audit_probation", None, None),
    "--bicache-audit-probe-rate": ("bicache_audit_probe_rate", None, None),
    "--bicache-audit-raise-bound": ("bicache_audit_raise_bound", 0.05, None),
    "--bicache-audit-rate": ("bicache_audit_rate", 0.02, None),
    "--bicache-profile": ("bicache_profile", None, None),
    "--bicache-tolerance": ("bicache_tolerance", 0.0, None),
    "--bicache-span-cut": ("bicache_span_cut", "segment", ("segment", "none")),
    "--block-length": ("block_length", 32, None),
    "--cache-mode": ("cache_mode", "dual", ("none", "prefix", "dual")),
    "--cache-output": ("cache_output", False, None),
    "--calibration-budget-s": ("calibration_budget_s", 40.0, None),
    "--calibration-data": ("calibration_data", None, None),
    "--chat-template": ("chat_template", None, None),
    "--context-length": ("context_length", None, None),
    "--device": ("device", "auto", None),
    "--disable-radix-cache": ("disable_radix_cache", False, None),
    "--dllm-alg-temp": ("dllm_alg_temp", None, None),
    "--dllm-algorithm": ("dllm_algorithm", None, None),
    "--dllm-algorithm-config": ("dllm_algorithm_config", None, None),
    "--dllm-eps": ("dllm_eps", None, None),
    "--dp-max-restarts": ("dp_max_restarts", 3, None),
    "--dp-size/--data-parallel-size": ("dp_size", 1, None),
    "--dtype": ("dtype", "auto", ("auto", "float32", "float", "bfloat16", "float16", "half")),
    "--enable-metrics": ("enable_metrics", False, None),
    "--engine-in-process": ("engine_in_process", False, None),
    "--graceful-shutdown-timeout": ("graceful_shutdown_timeout", 5.0, None),
    "--host": ("host", "127.0.0.1", None),
    "--incremental-streaming-output": ("incremental_streaming_output", False, None),
    "--log-level": ("log_level", "info", ("debug", "info", "warning", "error", "critical")),
    "--max-batch-size": ("max_batch_size", 1024, None),
    "--max-n": ("max_n", 256, None),
    "--max-prefix-cache-tokens": ("max_prefix_cache_tokens", None, None),
    "--max-queued-requests": ("max_queued_requests", None, None),
    "--max-request-bytes": ("max_request_bytes", 33554432, None),
    "--max-running-requests": ("max_running_requests", 16, None),
    "--max-total-tokens": ("max_total_tokens", None, None),
    "--mem-fraction-static": ("mem_fraction_static", None, None),
    "--model-path/--model": ("model_path", None, None),
    "--num-threads": ("num_threads", None, None),
    "--port": ("port", 30000, None),
    "--prefix-cache": ("prefix_cache", "bicache", None),
    "--random-seed": ("random_seed", None, None),
    "--refresh-interval": ("refresh_interval", 0, None),
    "--remasking": ("remasking", None, ("low_confidence", "random")),
    "--router-policy": ("router_policy", "cache_aware",
                        ("cache_aware", "round_robin", "random", "power_of_two", "manual")),
    "--served-model-name": ("served_model_name", None, None),
    "--skip-server-warmup": ("skip_server_warmup", False, None),
    "--step-rows": ("step_rows", "block", ("block", "active")),
    "--steps": ("steps", None, None),
    "--steps-per-block": ("steps_per_block", None, None),
    "--threshold": ("threshold", 0.9, None),
    "--tokenizer-path": ("tokenizer_path", None, None),
    "--tp-size/--tensor-parallel-size": ("tp_size", 1, None),
    "--trust-remote-code": ("trust_remote_code", False, None),
}
# `python -m bicache_sgl`
CLI_FLAGS: dict[str, tuple] = {
    "--attention-backend": ("attention_backend", "torch", None),
    "--block-length": ("block_length", 32, None),
    "--cache-mode": ("cache_mode", "dual", ("none", "prefix", "dual")),
    "--cfg-scale": ("cfg_scale", 0.0, None),
    "--chat": ("chat", False, None),
    "--device": ("device", "auto", None),
    "--dtype": ("dtype", "auto", None),
    "--json": ("json", False, None),
    "--max-new-tokens": ("max_new_tokens", 64, None),
    "--model-path/--model": ("model_path", None, None),  # the server's flag, alias included
    "--prompt": ("prompt", None, None),
    "--remasking": ("remasking", "low_confidence", ("low_confidence", "random")),
    "--steps": ("steps", None, None),
    "--temperature": ("temperature", 0.0, None),
    "--threshold": ("threshold", 0.9, None),
}

# the benchmark, training and example CLIs that share flags: option strings -> (dest, default)
SHARED_FLAG_CLIS: dict[str, dict[str, tuple]] = {
    "bicache_sgl/training/evaluate.py": {
        "--bicache-profile": ("bicache_profile", None),
        "--cached-context": ("cached_context", "first_request"),
        "--control": ("control", "none,remove,shuffle"),
        "--device": ("device", "auto"),
        "--gen-length": ("gen_length", "8"),
        "--ignore-eos": ("ignore_eos", False),
        "--kind": ("kind", "code"),
        "--max-running-requests": ("max_running_requests", 64),
        "--model": ("model", None),
        "--num-questions": ("num_questions", 500),
        "--num-shots": ("num_shots", "5"),
        "--prefix-cache": ("prefix_cache", None),
        "--seed": ("seed", 0),
        "--threads": ("threads", 1),
    },
    "bicache_sgl/bench/fidelity.py": {
        "--device": ("device", "cpu"),
        "--fixed": ("fixed", "1,2,4"),
        "--model": ("model", None),
        "--num-questions": ("num_questions", 45),
        "--out": ("out", None),
        "--plot": ("plot", None),
        "--r": ("r", "0.2,0.4,0.6,0.8"),
        "--rows": ("rows", None),
        "--steps": ("steps", 8),
        "--threads": ("threads", 1),
    },
    "bicache_sgl/bench/serving_sweep.py": {
        "--bicache-profile": ("bicache_profile", None),
        "--block-length": ("block_length", 32),
        "--concurrency": ("concurrency", "1,16"),
        "--configs": ("configs", "vanilla,dual,naive+dual,bicache+dual"),
        "--fewshot-questions": ("fewshot_questions", 96),
        "--fewshot-shots": ("fewshot_shots", "6,8"),
        "--gsp-groups": ("gsp_groups", 4),
        "--gsp-per-group": ("gsp_per_group", 8),
        "--interleave": ("interleave", False),
        "--model-path/--model": ("model_path", None),
        "--no-plot": ("no_plot", False),
        "--num-threads": ("num_threads", None),
        "--out-dir": ("out_dir", None),
        "--output-len": ("output_len", 32),
        "--quick": ("quick", False),
        "--ratios": ("ratios", "0.3,0.5,0.75,0.9"),
        "--repeat": ("repeat", 1),
        "--run-timeout": ("run_timeout", 900.0),
        "--seed": ("seed", 1),
        "--seq-len": ("seq_len", 512),
        "--server-args": ("server_args", ""),
        "--server-timeout": ("server_timeout", 300.0),
        "--vanilla-min-r": ("vanilla_min_r", 0.75),
    },
    "examples/bench_decode.py": {
        "--batch": ("batch", 8),
        "--batch-gen-len": ("batch_gen_len", 64),
        "--block-length": ("block_length", 32),
        "--gen-len": ("gen_len", 256),
        "--heads": ("heads", 8),
        "--hidden": ("hidden", 512),
        "--layers": ("layers", 8),
        "--mlp": ("mlp", 1536),
        "--prompt-len": ("prompt_len", 512),
        "--steps": ("steps", 64),
        "--threads": ("threads", None),
    },
    "examples/bench_prefix.py": {
        "--audit-rate": ("audit_rate", None),
        "--block-length": ("block_length", 32),
        "--cache-mode": ("cache_mode", "dual"),
        "--cache-prefix": ("cache_prefix", False),
        "--calib-threshold": ("calib_threshold", 0.97),
        "--device": ("device", "auto"),
        "--dtype": ("dtype", "auto"),
        "--groups": ("groups", None),
        "--max-new-tokens": ("max_new_tokens", 32),
        "--max-running-requests": ("max_running_requests", 16),
        "--model-path": ("model_path", None),
        "--modes": ("modes", "off,bicache,naive"),
        "--per-group": ("per_group", None),
        "--prefix-len": ("prefix_len", 320),
        "--profile": ("profile", None),
        "--question-len": ("question_len", 48),
        "--random-heads": ("random_heads", 4),
        "--random-hidden": ("random_hidden", 256),
        "--random-layers": ("random_layers", 8),
        "--repeat": ("repeat", 2),
        "--seed": ("seed", 0),
        "--shots": ("shots", 6),
        "--task": ("task", "auto"),
        "--threads": ("threads", None),
        "--threshold": ("threshold", 0.9),
    },
    "examples/bench_step_rows.py": {
        "--block-length": ("block_length", 32),
        "--gen-len": ("gen_len", 96),
        "--max-running": ("max_running", 8),
        "--model-path": ("model_path", None),
        "--prefix-cache": ("prefix_cache", "off"),
        "--prompt-len": ("prompt_len", 384),
        "--requests": ("requests", 32),
        "--runs": ("runs", 2),
        "--seed": ("seed", 0),
        "--threads": ("threads", 1),
        "--threshold": ("threshold", 0.9),
    },
}


def flag_table(parser: argparse.ArgumentParser) -> dict[str, tuple]:
    return {"/".join(a.option_strings): (a.dest, a.default, tuple(a.choices) if a.choices else None)
            for a in parser._actions if not isinstance(a, argparse._HelpAction)}


def test_server_flags_and_defaults_unchanged():
    assert flag_table(build_parser()) == SERVER_FLAGS


def test_cli_flags_and_defaults_unchanged():
    table = flag_table(cli.build_parser())
    assert {k: v[:2] for k, v in table.items()} == {k: v[:2] for k, v in CLI_FLAGS.items()}
    # the shared flags bring the config's validation: --dtype is checked when parsed now
    assert table["--dtype"][2] == EngineConfig.__dataclass_fields__["dtype"].metadata["choices"]
    assert {k: v for k, v in table.items() if k != "--dtype"} == {k: v for k, v in CLI_FLAGS.items() if k != "--dtype"}


def load_cli(path: str):
    """A CLI module by its file (examples/ is not a package)."""
    if path.startswith("bicache_sgl/"):
        return importlib.import_module(path.removesuffix(".py").replace("/", "."))
    spec = importlib.util.spec_from_file_location("cli_" + Path(path).stem, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("path", sorted(SHARED_FLAG_CLIS))
def test_shared_flag_clis_unchanged(path):
    parser = load_cli(path).build_parser()
    assert {k: v[:2] for k, v in flag_table(parser).items()} == SHARED_FLAG_CLIS[path]
    for a in parser._actions:
        assert a.help != argparse.SUPPRESS
    ns = parser.parse_args([])
    assert {v[0]: v[1] for v in SHARED_FLAG_CLIS[path].values()} == vars(ns)


def test_every_server_field_is_a_flag_and_the_parsed_defaults_are_the_dataclass_defaults():
    dests = {a.dest for a in build_parser()._actions}
    names = [f.name for f in flag_fields(ServerArgs)]
    assert set(names) <= dests
    assert {"block_length", "dllm_algorithm", "host", "max_n", "model_path"} <= set(names)  # nested decode too
    no_flag = {f.name for f in dataclasses.fields(ServerArgs) if not f.metadata.get("cli", True)}
    assert no_flag == {"enable_metrics", "router_extra_args", "ignored_args"}
    assert parse_args([]) == ServerArgs()
    assert parse_args([]).engine_config() == EngineConfig()


def test_each_field_declared_once_with_help():
    for cls in (EngineConfig, DecodeDefaults, ServerArgs):
        for f in dataclasses.fields(cls):
            if f.name != "decode":
                assert f.metadata.get("help"), f"{cls.__name__}.{f.name} has no help string"
    # ServerArgs inherits EngineConfig's fields instead of retyping them
    own = set(ServerArgs.__annotations__)
    assert not own & {f.name for f in dataclasses.fields(EngineConfig)}


def test_help_explains_every_flag():
    for a in build_parser()._actions:
        assert a.help and a.help != argparse.SUPPRESS, a.option_strings
    for a in cli.build_parser()._actions:
        assert a.help and a.help != argparse.SUPPRESS, a.option_strings
    out = subprocess.run([sys.executable, "-m", "bicache_sgl.launch_server", "--help"], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 0, out.stderr
    for flags in SERVER_FLAGS:
        for flag in flags.split("/"):
            assert flag in out.stdout
    assert "(default: 0.02)" in out.stdout and "flashinfer" in out.stdout  # defaults and registry names shown


@pytest.mark.parametrize("argv,message", [
    (["--max-n", "0"], "--max-n must be >= 1"),
    (["--max-running-requests", "0"], "--max-running-requests must be an integer >= 1"),
    (["--bicache-audit-rate", "2"], "--bicache-audit-rate must be in [0, 1]"),
    (["--bicache-tolerance", "1"], "--bicache-tolerance must be in [0, 1)"),
    (["--graceful-shutdown-timeout", "inf"], "--graceful-shutdown-timeout must be a number of seconds >= 0"),
    (["--threshold", "2"], "threshold must be in [0, 1]"),
    (["--context-length", "lots"], "invalid context length 'lots'"),
    (["--prefix-cache", "sometimes"], "prefix_cache must be one of off, naive, bicache, fixed:N"),
    (["--dllm-eps", "2"], "--dllm-eps must be in (0, 1)"),
])
def test_bad_values_name_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


def test_remasking_and_dllm_algorithm_are_one_setting():
    assert parse_args(["--remasking", "random"]).decode.dllm_algorithm == "random"
    assert parse_args(["--remasking", "random", "--dllm-algorithm", "Entropy"]).decode.dllm_algorithm == "entropy"
    assert parse_args([]).decode.dllm_algorithm is None  # the checkpoint's generation_config decides
    assert "remasking" not in {f.name for f in dataclasses.fields(DecodeDefaults)}


def test_engine_keywords_are_the_config_names():
    from bicache_sgl.engine.engine import build_config

    cfg = build_config(dllm_algorithm="entropy", dllm_eps=0.01, block_length=8, prefix_cache="off")
    assert (cfg.decode.dllm_algorithm, cfg.decode.dllm_eps, cfg.decode.block_length) == ("entropy", 0.01, 8)
    assert cfg.prefix_cache == "off"
    for old in ("algorithm", "remasking", "eps"):  # no second spelling
        with pytest.raises(TypeError, match=old):
            build_config(**{old: "x"})


def test_server_args_public_dict_is_flat():
    d = parse_args(["--block-length", "16", "--api-key", "k"]).public_dict()
    assert d["block_length"] == 16 and "decode" not in d and d["api_key"] == "<redacted>"


def test_request_remasking_is_translated_at_the_protocol_edge():
    from bicache_sgl.config import SamplingParams

    assert SamplingParams.from_dict({"remasking": "random"}).dllm_algorithm == "random"
    both = SamplingParams.from_dict({"remasking": "random", "dllm_algorithm": "Entropy"})
    assert both.dllm_algorithm == "entropy"
    assert SamplingParams.from_dict({"remasking": "random", "dllm_algorithm": None}).dllm_algorithm == "random"
    with pytest.raises(ValueError, match="remasking must be one of"):
        SamplingParams.from_dict({"remasking": "bogus", "dllm_algorithm": "entropy"})
    assert "remasking" not in {f.name for f in dataclasses.fields(SamplingParams)}


# a small hierarchy for the helper itself (module level: the annotations are resolved by name)
def _non_negative(v: str) -> int:
    if int(v) < 0:
        raise ValueError(f"count must be >= 0, got {v}")
    return int(v)


@dataclasses.dataclass(frozen=True)
class Inner:
    rate: float = option(0.5, "a rate")


@dataclasses.dataclass(frozen=True)
class Outer:
    name: str = option("x", "a name", flags=("--name", "-n"), choices=("x", "y"))
    count: int | None = option(None, "a count", parse=_non_negative)
    on: bool = option(False, "a switch")
    inner: Inner = dataclasses.field(default_factory=Inner)
    derived: int = option(3, "not a flag", cli=False)


@dataclasses.dataclass(frozen=True)
class OnByDefault:
    on: bool = option(True, "a switch that cannot be turned off")


def test_flags_helper_on_a_small_hierarchy(capsys):
    p = argparse.ArgumentParser()
    add_flags(p, Outer, defaults={"rate": 0.25})
    assert Outer(**flag_values(p.parse_args([]), Outer)) == Outer(inner=Inner(rate=0.25))
    got = Outer(**flag_values(p.parse_args(["-n", "y", "--count", "4", "--on", "--rate", "1"]), Outer, derived=7))
    assert got == Outer(name="y", count=4, on=True, inner=Inner(rate=1.0), derived=7)
    assert "(default: 0.25)" in p.format_help() and "--derived" not in p.format_help()
    with pytest.raises(SystemExit):
        p.parse_args(["--count", "-1"])
    assert "count must be >= 0, got -1" in capsys.readouterr().err
    with pytest.raises(ValueError, match="help"):
        option(1, "")
    with pytest.raises(TypeError, match="default to False"):
        add_flags(argparse.ArgumentParser(), OnByDefault)


def test_calibrate_engine_flags_are_the_declaration():
    """The calibrate CLI's engine settings are the config's fields: same defaults, choices and
    parsing as the server's flags, checked by the same validator (no restated literals)."""
    from bicache_sgl import calibrate

    parser = calibrate.build_parser()
    table = {a.dest: a for a in parser._actions}
    server = {a.dest: a for a in build_parser()._actions}
    for name in calibrate.ENGINE_FLAGS:
        dest = "decode_threshold" if name == "threshold" else name
        mine, theirs = table[dest], server[name]
        kind = [getattr(a.type, "__name__", None) for a in (mine, theirs)]  # a parse= wrapper is per parser
        assert (mine.default, mine.choices, kind[0]) == (theirs.default, theirs.choices, kind[1]), name
    ns = parser.parse_args(["--data", "d", "--out", "o", "--decode-threshold", "none", "--threshold", "0.5"])
    assert (ns.decode_threshold, ns.threshold) == (None, 0.5)  # the decoding one parses as the server's
    with pytest.raises(SystemExit):
        calibrate.main(["--data", "d", "--out", "o", "--steps-per-block", "0"])
