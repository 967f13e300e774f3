"""LLaDA2.1's token editing chosen as SGLang chooses it: ``--dllm-algorithm JointThreshold`` (and
``LowConfidence``) with ``--dllm-algorithm-config FILE`` (YAML or JSON), on a tiny LLaDA2 folder.

- SGLang's LLaDA2.1 launch line parses unchanged, and the served engine decodes with editing:
  token-identical to the re-statement of the joint rule (testing/block_generate.py) with SGLang's
  JointThreshold defaults, with edits made, and different from LowConfidence;
- the config file's thresholds reach the decoding (reported, and the tokens follow them), with the
  precedence flag / config file > generation_config.json > the algorithm's defaults;
- refusals name the flag, the key or the field: algorithms a family does not run (either way),
  unknown keys, penalty_lambda, a block_size other than the model's, contradicting flags.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

from bicache_sgl.blockdiff.algorithm import choose_algorithm, read_algorithm_config
from bicache_sgl.blockdiff.client import BlockEngineClient
from bicache_sgl.blockdiff.engine import BlockEngine, BlockEngineOptions, BlockParams
from bicache_sgl.config import DecodeDefaults, EngineConfig, SamplingParams
from bicache_sgl.io_struct import GenerateRequest
from bicache_sgl.models.block_model import load_block_model
from bicache_sgl.models.families import family_named
from bicache_sgl.server.args import parse_args
from bicache_sgl.testing.block import make_tiny_llada2, make_tiny_sdar
from bicache_sgl.testing.block_generate import llada21_generate

B = 4
G = 10  # new tokens: three blocks, the last one cut
LLADA2 = family_named("llada2").decoding

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: one thread (tests/conftest.py)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_llada2(tmp_path_factory.mktemp("edit") / "llada21", block_length=B)


def _prompts() -> list[list[int]]:
    return [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 8, 11)]


def _serve(argv: list[str]) -> BlockEngineClient:
    """The engine the server builds for these flags (as launch_server does for a block folder)."""
    return BlockEngineClient(parse_args(argv + ["--num-threads", "1"]).engine_config())


def _answers(client: BlockEngineClient, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy answers of up to G tokens, cut at EOS as the published loops cut them (ignore_eos
    would ban EOS in the logits, which the re-statement does not do)."""
    out: list[list[int]] = []
    for ids in prompts:
        done, last = threading.Event(), []

        def cb(ev, last=last, done=done):
            if ev.finished:
                last.append(ev)
                done.set()
        client.submit(GenerateRequest(input_ids=ids, params=SamplingParams(max_new_tokens=G, temperature=0)), cb)
        assert done.wait(60)
        assert last[0].error is None, last[0].error
        out.append(list(last[0].output_ids))
    return out


def _restated(model, prompt: list[int], threshold: float, edit_threshold: float, post: int) -> tuple[list[int], int]:
    """The re-statement of the joint rule on the served model's own (dense, block-causal) forward,
    stopping at the block where EOS is final and cut there, as the engine does."""
    return llada21_generate(lambda ids: model.forward_dense(torch.tensor(ids)), prompt,
                            mask_id=model.cfg.mask_token_id, eos_id=model.cfg.eos_token_ids[0], gen_length=G,
                            block_length=B, threshold=threshold, edit_threshold=edit_threshold,
                            max_post_edit_steps=post)


def test_sglang_llada21_launch_line_decodes_with_token_editing(folder):
    argv = ["--model-path", folder, "--dllm-algorithm", "JointThreshold", "--trust-remote-code", "--tp-size", "1"]
    args = parse_args(argv)
    assert args.decode.dllm_algorithm == "joint_threshold" and args.ignored_args == ()
    prompts = _prompts()
    client = _serve(argv)
    try:
        assert client.get_stats()["decoding"] == {
            "algorithm": "joint_threshold", "sglang_name": "JointThreshold", "source": "--dllm-algorithm",
            "block_length": B, "threshold": 0.5, "edit_threshold": 0.0, "max_post_edit_steps": 16}
        edited = _answers(client, prompts)
        model = client.model
    finally:
        client.shutdown()
    edits = 0
    for ids, got in zip(prompts, edited):
        want, n = _restated(model, ids, 0.5, 0.0, 16)  # SGLang's JointThreshold defaults
        assert got == want
        edits += n
    assert edits > 0  # the joint rule really rewrote decoded tokens
    low = _serve(["--model-path", folder, "--dllm-algorithm", "lowconfidence"])
    try:
        assert low.get_stats()["decoding"]["algorithm"] == "low_confidence"
        plain = _answers(low, prompts)
    finally:
        low.shutdown()
    assert plain != edited


# the tiny random model's top probabilities are 0.01 - 0.03: thresholds inside that range decide
# something (at SGLang's defaults every step unmasks one position and any disagreement is an edit)
JOINT = (0.018, 0.02, 2)


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_the_algorithm_config_file_sets_the_thresholds(folder, tmp_path, suffix):
    """JointThreshold's keys from a YAML or JSON file: reported by /get_server_info's engine
    state, and the tokens are the re-statement's with those thresholds (not with the defaults)."""
    thr, edit, post = JOINT
    keys = {"threshold": thr, "edit_threshold": edit, "max_post_edit_steps": post, "penalty_lambda": 0,
            "block_size": B}
    f = tmp_path / f"algo{suffix}"
    f.write_text(json.dumps(keys) if suffix == ".json" else "".join(f"{k}: {v}\n" for k, v in keys.items()))
    client = _serve(["--model-path", folder, "--dllm-algorithm", "JointThreshold", "--dllm-algorithm-config", str(f)])
    try:
        d = client.get_stats()["decoding"]
        assert (d["threshold"], d["edit_threshold"], d["max_post_edit_steps"]) == JOINT
        assert d["source"] == "--dllm-algorithm + --dllm-algorithm-config"
        prompts = _prompts()
        got = _answers(client, prompts)
        model = client.model
    finally:
        client.shutdown()
    want = [_restated(model, ids, *JOINT) for ids in prompts]
    assert got == [w for w, _ in want] and sum(n for _, n in want) > 0
    assert got != [_restated(model, ids, 0.5, 0.0, 16)[0] for ids in prompts]


def test_the_http_server_reports_and_runs_the_chosen_algorithm(folder, tmp_path):
    """SGLang's launch line as a real server process: /get_server_info shows the flags and the
    decoding the model runs; /generate answers with it."""
    from bicache_sgl.runtime import Runtime, http_json
    f = tmp_path / "algo.yaml"
    f.write_text("".join(f"{k}: {v}\n" for k, v in zip(("threshold", "edit_threshold", "max_post_edit_steps"), JOINT)))
    prompt = _prompts()[0]
    with Runtime(model_path=folder, dllm_algorithm="JointThreshold", dllm_algorithm_config=str(f),
                 trust_remote_code=True, tp_size=1, num_threads=1, timeout=120) as rt:
        info = rt.get_server_info()
        out = http_json(f"{rt.url}/generate", {"input_ids": prompt, "sampling_params": {
            "max_new_tokens": G, "temperature": 0}})
    assert (info["dllm_algorithm"], info["dllm_algorithm_config"]) == ("joint_threshold", str(f))
    assert info["internal_states"][0]["decoding"] == {
        "algorithm": "joint_threshold", "sglang_name": "JointThreshold",
        "source": "--dllm-algorithm + --dllm-algorithm-config", "block_length": B, "threshold": JOINT[0],
        "edit_threshold": JOINT[1], "max_post_edit_steps": JOINT[2]}
    assert out["output_ids"] == _restated(load_block_model(folder), prompt, *JOINT)[0]


def test_a_low_confidence_config_file_sets_its_threshold(folder, tmp_path):
    f = tmp_path / "lc.yaml"
    f.write_text("threshold: 0.015\nblock_size: 4\n")
    client = _serve(["--model-path", folder, "--dllm-algorithm-config", str(f)])  # SGLang's default: LowConfidence
    try:
        d = client.get_stats()["decoding"]
        assert (d["algorithm"], d["threshold"]) == ("low_confidence", 0.015) and "edit_threshold" not in d
        prompts = _prompts()
        got = _answers(client, prompts)
    finally:
        client.shutdown()
    offline = BlockEngine(load_block_model(folder), BlockEngineOptions(prefix_cache=False))
    assert got == [r.tokens for r in offline.run(prompts, BlockParams(max_new_tokens=G, threshold=0.015))]
    assert got != [r.tokens for r in offline.run(prompts, BlockParams(max_new_tokens=G))]  # 0.95


def _decode(folder: str, algorithm: str | None, config: str | None = None):
    choice = choose_algorithm(LLADA2, algorithm, config)
    model = load_block_model(folder, decode_defaults=choice.defaults, decode_overrides=choice.overrides)
    return choice.describe(model.cfg.decode)


def test_precedence_flags_over_generation_config_over_algorithm_defaults(tmp_path):
    """A LLaDA2.1 folder whose generation_config.json turns editing on (diffusers' names)."""
    folder = make_tiny_llada2(tmp_path / "gen", block_length=B)
    gen = Path(folder) / "generation_config.json"
    gen.write_text(json.dumps({"block_length": B, "threshold": 0.7, "editing_threshold": 0.6, "max_post_steps": 3}))
    # no flag: the checkpoint decides
    d = _decode(folder, None)
    assert (d["algorithm"], d["threshold"], d["edit_threshold"], d["max_post_edit_steps"], d["source"]) == \
        ("joint_threshold", 0.7, 0.6, 3, "checkpoint")
    # JointThreshold: generation_config.json's keys over SGLang's defaults (0.5 / 0.0 / 16)
    d = _decode(folder, "joint_threshold")
    assert (d["threshold"], d["edit_threshold"], d["max_post_edit_steps"]) == (0.7, 0.6, 3)
    # the config file over generation_config.json
    f = tmp_path / "a.yaml"
    f.write_text("edit_threshold: 0.2\n")
    d = _decode(folder, "joint_threshold", str(f))
    assert (d["threshold"], d["edit_threshold"], d["max_post_edit_steps"]) == (0.7, 0.2, 3)
    # LowConfidence named: no editing, whatever generation_config.json says; its threshold stays
    d = _decode(folder, "low_confidence")
    assert (d["algorithm"], d["threshold"]) == ("low_confidence", 0.7) and "edit_threshold" not in d
    # without generation_config.json keys: SGLang's JointThreshold defaults
    gen.write_text(json.dumps({"block_length": B}))
    d = _decode(folder, "joint_threshold")
    assert (d["threshold"], d["edit_threshold"], d["max_post_edit_steps"]) == (0.5, 0.0, 16)


@pytest.mark.parametrize("argv,message", [
    (["--dllm-algorithm", "Speculative"], "--dllm-algorithm Speculative is not implemented; valid: .*joint_threshold"),
])
def test_unknown_algorithms_stop_the_launch(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    import re
    assert re.search(message, capsys.readouterr().err)


def test_algorithms_a_family_does_not_run_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match=r"--dllm-algorithm JointThreshold: the sdar family does not run "
                                         r"joint_threshold; valid: low_confidence \(LowConfidence\)$"):
        BlockEngineClient(EngineConfig(model_path=make_tiny_sdar(tmp_path / "sdar", block_length=B),
                                       decode=DecodeDefaults(dllm_algorithm="joint_threshold")))
    with pytest.raises(ValueError, match=r"--dllm-algorithm entropy: the llada2 family does not run entropy; valid: "
                                         r"low_confidence \(LowConfidence\), joint_threshold \(JointThreshold\)"):
        choose_algorithm(LLADA2, "entropy", None)
    # the bidirectional families: JointThreshold and the algorithm config are block-diffusion only
    from bicache_sgl.engine.engine import Engine
    from bicache_sgl.testing import make_tiny_llada
    llada = make_tiny_llada(tmp_path / "llada", n_layers=2)
    with pytest.raises(ValueError, match=r"--dllm-algorithm JointThreshold: the llada family does not run "
                                         r"joint_threshold; valid: low_confidence \(LowConfidence\), random, origin"):
        Engine(config=EngineConfig(model_path=llada, prefix_cache="off", num_threads=1,
                                   decode=DecodeDefaults(dllm_algorithm="joint_threshold")))
    with pytest.raises(ValueError, match="--dllm-algorithm-config applies to the block-diffusion families"):
        family_named("dream").decoding.check_flags(None, "algo.yaml")


def test_a_request_naming_joint_threshold_on_a_bidirectional_model_is_refused(tmp_path):
    from bicache_sgl.models.families import parse_model_config
    from bicache_sgl.models.loader import read_config
    from bicache_sgl.scheduler.validate import RequestLimits, validate_request
    from bicache_sgl.testing import make_tiny_llada
    llada = make_tiny_llada(tmp_path / "llada", n_layers=2)
    limits = RequestLimits.of(parse_model_config(read_config(llada)), DecodeDefaults(block_length=8), 256)
    params = SamplingParams.from_dict({"max_new_tokens": 8, "dllm_algorithm": "JointThreshold"}).resolved()
    with pytest.raises(ValueError, match=r"dllm_algorithm: 'joint_threshold' is not an algorithm .*\(llada\)"):
        validate_request(GenerateRequest(input_ids=[1, 2], params=params), limits)


@pytest.mark.parametrize("algorithm,text,message", [
    ("joint_threshold", "threshold: 0.5\nedit_treshold: 0.1\n", r"unknown key\(s\) edit_treshold for JointThreshold; "
                                                                r"it takes threshold, edit_threshold"),
    ("low_confidence", "edit_threshold: 0.1\n", r"unknown key\(s\) edit_threshold for LowConfidence"),
    ("joint_threshold", "penalty_lambda: 0.5\n", "penalty_lambda 0.5 .* is not implemented"),
    ("joint_threshold", "edit_threshold: -1\n", r"edit_threshold must be in \[0, 1\]"),
    ("joint_threshold", "threshold: high\n", "threshold must be a number, got 'high'"),
    ("joint_threshold", "max_post_edit_steps: 2.5\n", "max_post_edit_steps must be an integer"),
    ("low_confidence", "- 0.5\n", "must hold a mapping"),
    ("low_confidence", "threshold: [0.5\n", "not valid YAML"),
])
def test_bad_algorithm_config_files_are_refused_by_key(tmp_path, algorithm, text, message):
    f = tmp_path / "algo.yaml"
    f.write_text(text)
    with pytest.raises(ValueError, match=f"--dllm-algorithm-config {f}: .*{message}"):
        read_algorithm_config(str(f), algorithm)


def test_settings_the_model_contradicts_are_refused_at_startup(folder, tmp_path):
    f = tmp_path / "algo.yaml"
    f.write_text("block_size: 32\nthreshold: 0.6\n")
    with pytest.raises(ValueError, match="block_size 32 is not the block length 4 llada2 decodes in"):
        _serve(["--model-path", folder, "--dllm-algorithm-config", str(f)])
    f.write_text("threshold: 0.6\n")
    with pytest.raises(ValueError, match="--threshold 0.7 and --dllm-algorithm-config's threshold 0.6 disagree"):
        _serve(["--model-path", folder, "--dllm-algorithm-config", str(f), "--threshold", "0.7"])
    with pytest.raises(ValueError, match="--steps-per-block does not apply to joint_threshold"):
        _serve(["--model-path", folder, "--dllm-algorithm", "JointThreshold", "--steps-per-block", "2"])
    with pytest.raises(ValueError, match="--dllm-algorithm-config .*missing.yaml: cannot read it"):
        _serve(["--model-path", folder, "--dllm-algorithm-config", str(tmp_path / "missing.yaml")])


def test_a_request_step_schedule_is_refused_under_token_editing(folder):
    client = _serve(["--model-path", folder, "--dllm-algorithm", "JointThreshold"])
    try:
        with pytest.raises(ValueError, match="steps_per_block: this server decodes with joint_threshold"):
            client.submit(GenerateRequest(input_ids=[1, 2, 3], params=SamplingParams(max_new_tokens=4,
                                                                                    steps_per_block=2)))
    finally:
        client.shutdown()
