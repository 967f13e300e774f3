"""``python -m bicache_sgl.selftest``: the whole command on the CPU (exit 0, every row), and the
battery's checks reporting a mismatch when the runtime under them is broken (real engines and
forwards with a deliberately wrong attention backend, in-process)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from bicache_sgl import Engine
from bicache_sgl.attention.torch_backend import TorchAttention
from bicache_sgl.models.loader import default_model_path
from bicache_sgl.selftest.battery import (
    ENGINE_DECODE,
    LOGPROB_TOL,
    check_batched_equals_alone,
    check_depth0_equals_off,
    check_depth_forward,
    fewshot_workload,
)
from bicache_sgl.selftest.cli import guarded, parse_args
from bicache_sgl.selftest.report import FAIL, PASS, exit_status, format_table

CPU = torch.device("cpu")
EXACTNESS_ROWS = ("depth 0 == cache off", "batched == alone (mixed depths)",
                  "depth-d forward vs float64 (bundled LLaDA)", "depth-d forward vs float64 (random Dream, GQA)",
                  "depth-d forward vs float64 (random LLaDA-MoE, 8 experts top-2)",
                  "block-causal forward vs float64 (random LLaDA2, MoE)",
                  "block-causal forward vs float64 (random SDAR)",
                  "exact block reuse == cache off (random LLaDA2, MoE)")


def test_selftest_command_on_cpu_passes_and_prints_every_row():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "bicache_sgl.selftest", "--device", "cpu", "--probe-seconds", "2",
           "--num-threads", "1"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, check=False)
    out = r.stdout
    assert r.returncode == 0, f"{out}\n{r.stderr[-3000:]}"
    assert out.startswith("device: cpu")

    def row(check: str) -> str:
        found = [line for line in out.splitlines() if f"  {check}  " in line]
        assert len(found) == 1, (check, out)
        return found[0]
    for check in EXACTNESS_ROWS:
        assert f"  {PASS}  " in row(check), row(check)
    fi = row("flashinfer == torch backend")
    if importlib.util.find_spec("flashinfer") is None:
        assert "skipped: flashinfer not installed" in fi
    else:  # installed on a machine without CUDA: skipped for that reason, never a pass
        assert "skipped: flashinfer needs a CUDA device" in fi
    assert "prefix pool" in row("sizing: bundled model") and "request K/V" in row("sizing: bundled model")
    assert "full depth 32" in row("sizing: LLaDA-8B shape (no weights)")
    # K+V+h of one LLaDA-8B layer-token in float32 (the CPU's dtype): (2 * 4096 + 4096) * 4 bytes
    assert "49,152 B each" in row("sizing: LLaDA-8B shape (no weights)")
    # LLaDA-MoE-7B-A1B: K+V+h of one layer-token in float32: (2 * 2048 + 2048) * 4 bytes, and its
    # weights count all 64 experts of every layer (7.36B parameters, 28,064 MiB in float32)
    moe = row("sizing: LLaDA-MoE-7B-A1B shape (no weights)")
    assert "full depth 16" in moe and "24,576 B each" in moe and "weights 28,0" in moe
    for mode in ("cache off", "bicache"):
        assert "output tok/s" in row(mode)
    ratio = row("bicache / off").split("info", 1)[1].split()[0]
    assert ratio.endswith("x") and float(ratio[:-1]) > 0
    assert "K/V 81,920 B/token (20 layers)" in row("sizing: LLaDA2.0-mini shape (no weights)")
    assert "K/V 294,912 B/token (36 layers)" in row("sizing: SDAR-8B shape (no weights)")
    assert "selftest: OK: 8 passed, 0 failed, 1 skipped" in out


class StaleLayerAttention(TorchAttention):
    """An off-by-one-layer bug: every layer but the first attends to the previous layer's keys."""

    name = "stale-layer"

    def attend(self, q, k_store, v_store, layer, q_indptr, layout_key):
        return super().attend(q, k_store, v_store, max(0, layer - 1), q_indptr, layout_key)


class NeighbourLeakAttention(TorchAttention):
    """A batching bug: in a forward of several sequences each one also sees the first one's keys
    (a key mask that forgot a neighbour). Alone, it is exactly the torch backend."""

    name = "neighbour-leak"

    def begin_forward(self, kv_rows, flat=None):
        rows = list(kv_rows)
        # the caller's side-by-side rows describe the unleaked layout: dropped, rebuilt from these
        super().begin_forward([r if i == 0 else np.concatenate([r, rows[0]], axis=1) for i, r in enumerate(rows)])


def test_depth_forward_check_reports_a_broken_backend(tiny_llada):
    good = check_depth_forward(tiny_llada, "tiny", CPU, TorchAttention())
    bad = check_depth_forward(tiny_llada, "tiny", CPU, StaleLayerAttention())
    assert good.status == PASS, good
    assert bad.status == FAIL and "forwards beyond the bound" in bad.detail, bad
    assert exit_status([good]) == 0 and exit_status([good, bad]) == 1
    assert "FAIL" in format_table([good, bad]).splitlines()[-1]


def test_batched_equals_alone_reports_a_batch_that_leaks():
    """Real engines on the bundled model; the leaking backend is swapped into each engine's
    runner. Alone requests are unaffected (depth 0 == off still passes); batched ones differ."""
    work = fewshot_workload()

    def make(mode: str) -> Engine:
        eng = Engine(default_model_path(), prefix_cache=mode, device="cpu", num_threads=1, **ENGINE_DECODE)
        eng.runner.attn = NeighbourLeakAttention()
        return eng
    assert check_depth0_equals_off(make, work).status == PASS
    row = check_batched_equals_alone(make, work, n_layers=8)
    # the model is so sure of its answers that the tokens survive; the top-5 logprobs do not
    assert row.status == FAIL, row
    diff = float(row.detail.split("logprobs within ")[1].split(";")[0])
    assert diff > 100 * LOGPROB_TOL, row


def test_a_check_that_raises_is_a_failed_row_not_a_crash():
    def broken_kernel():
        raise RuntimeError("CUDA error: no kernel image is available")
    rows = guarded("exactness", "flashinfer == torch backend", broken_kernel)
    assert [r.status for r in rows] == [FAIL] and "RuntimeError: CUDA error" in rows[0].detail
    assert exit_status(rows) == 1


def test_bad_arguments_exit_2_naming_the_flag(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--attention-backend", "nope"])
    assert e.value.code == 2 and "--attention-backend" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        parse_args(["--probe-seconds", "-1"])
    assert e.value.code == 2 and "--probe-seconds" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit) as e:
            parse_args(["--device", "cuda"])
        assert e.value.code == 2 and "--device" in capsys.readouterr().err
        with pytest.raises(SystemExit) as e:
            parse_args(["--device", "cpu", "--attention-backend", "flashinfer"])
        assert e.value.code == 2 and "--attention-backend flashinfer" in capsys.readouterr().err


def test_sizing_rows_are_the_engines_own_plan():
    """The memory rows call plan_memory as the engine does: an engine on the bundled model ends up
    with exactly the plan the self-test prints for it (and the LLaDA-8B shape is 8.0B parameters)."""
    from bicache_sgl.models.config import parse_model_config
    from bicache_sgl.selftest.sizing import (
        LLADA_8B_CONFIG,
        LLADA_MOE_7B_CONFIG,
        engine_plan,
        memory_rows,
        weight_bytes,
    )
    eng = Engine(default_model_path(), device="cpu", num_threads=1)
    try:
        dtype, plan = engine_plan(eng.model_config, CPU, eng.policy.max_node_depth)
        assert plan == eng.memory and dtype == next(eng.model.parameters()).dtype
    finally:
        eng.shutdown()
    bundled = memory_rows(default_model_path(), CPU)[0]
    assert f"{plan.pool_rows:,} layer-tokens" in bundled.detail and f"{plan.request_tokens:,} tokens" in bundled.detail
    cfg = parse_model_config(LLADA_8B_CONFIG)
    assert (cfg.n_layers, cfg.hidden_size, cfg.n_heads, cfg.n_kv_heads, cfg.vocab_size) == (32, 4096, 32, 32, 126464)
    assert round(weight_bytes(cfg, torch.bfloat16) / 2 / 1e9, 2) == 8.02
    # LLaDA-MoE-7B-A1B: every expert's weights are resident (7.36B parameters; about 1.4B active per token)
    moe = parse_model_config(LLADA_MOE_7B_CONFIG)
    assert moe.arch == "llada_moe" and (moe.moe.n_experts, moe.moe.top_k) == (64, 8)
    assert round(weight_bytes(moe, torch.bfloat16) / 2 / 1e9, 2) == 7.36
    # on an H200 with the weights loaded: the pools fit what is left
    free = (139 << 30) - weight_bytes(cfg, torch.bfloat16)
    dtype, h200 = engine_plan(cfg, torch.device("cuda"), 32, free_bytes=free)
    assert dtype == torch.bfloat16 and 0 < h200.pool_bytes + h200.request_bytes <= free
