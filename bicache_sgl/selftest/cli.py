"""``python -m bicache_sgl.selftest``: arguments, the run, the table, the exit status."""

from __future__ import annotations

import argparse
import logging
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ..attention import ALIASES, available_backends, create_backend
from ..config import EngineConfig
from ..engine.engine import Engine
from ..engine.model_runner import pick_device
from ..flags import add_flags
from ..models.loader import default_model_path, load_model_config
from ..testing import make_tiny_dream, make_tiny_llada_moe
from ..testing.block import make_tiny_llada2, make_tiny_sdar
from .battery import (
    ENGINE_DECODE,
    SECTION,
    EngineFactory,
    check_batched_equals_alone,
    check_depth0_equals_off,
    check_depth_forward,
    check_flashinfer,
    fewshot_workload,
)
from .block_checks import check_block_forward, check_block_reuse
from .probe import throughput_rows
from .report import FAIL, Row, exit_status, format_table, summary
from .sizing import memory_rows

log = logging.getLogger("bicache_sgl.selftest")

DESCRIPTION = """\
Self-test of bicache-sgl on the device present (default: cuda if available, else cpu).

(a) exactness: depth 0 == cache off, a batch of mixed bicache depths == each request alone, the
    packed depth-d forward vs an independent float64 reference (the bundled LLaDA model, a
    random Dream with GQA, a random LLaDA-MoE), FlashInfer == the torch backend (skipped, and
    said so, where FlashInfer is not installed or there is no CUDA device);
(b) memory: the prefix-pool and request K/V sizing an engine would use on this device, for the
    bundled model and for LLaDA-8B- and LLaDA-MoE-7B-A1B-shaped configs (built in memory, no
    weights);
(c) throughput: cache off vs bicache on the bundled model, few-shot shared-prefix workload,
    output tokens/s and the ratio (--probe-seconds in all, 0 to skip).

Prints one table; exits 1 when any check reports a mismatch (FAIL), 0 otherwise, 2 on bad
arguments. Rows marked info are measurements; skipped rows say why and never count as a pass."""


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bicache_sgl.selftest", description=DESCRIPTION,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    # the engine settings: the server's flags (EngineConfig's declaration), with this tool's help
    add_flags(ap, EngineConfig, only=("device", "attention_backend"), helps={
        "device": "where to run: auto | cpu | cuda | cuda:N (auto: cuda when available, else cpu)",
        "attention_backend": f"attention backend of the engines and forwards checked "
                             f"({', '.join(available_backends())}; a kernel that does not support the model's dtype / "
                             "head_dim falls back to torch, and the depth-d row names the backend that ran)"})
    ap.add_argument("--probe-seconds", type=float, default=30.0,
                    help="total timed seconds of the throughput probe, both modes together (0: skip it)")
    add_flags(ap, EngineConfig, only=("num_threads",), helps={"num_threads": "torch CPU threads of the engines"})
    return ap


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Arguments, validated: a bad value exits 2 with a message naming the flag."""
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        args.device = pick_device(args.device)
    except (ValueError, RuntimeError) as e:  # torch's device parser raises RuntimeError
        ap.error(f"--device: {e}")
    name = ALIASES.get(args.attention_backend, args.attention_backend)
    if name not in available_backends():
        ap.error(f"--attention-backend: unknown backend {args.attention_backend!r}; "
                 f"choose one of {available_backends()}")
    try:
        create_backend(name, args.device)
    except (RuntimeError, ImportError) as e:
        ap.error(f"--attention-backend {name}: {e}")
    args.attention_backend = name
    if args.probe_seconds < 0:
        ap.error(f"--probe-seconds must be >= 0, got {args.probe_seconds}")
    if args.num_threads is not None and args.num_threads < 1:
        ap.error(f"--num-threads must be >= 1, got {args.num_threads}")
    return args


def engine_factory(device: torch.device, attention_backend: str, num_threads: int | None,
                   **decode: Any) -> EngineFactory:
    """prefix-cache mode -> a fresh Engine on the bundled model with these flags."""
    def make(mode: str) -> Engine:
        return Engine(default_model_path(), prefix_cache=mode, device=device.type, attention_backend=attention_backend,
                      num_threads=num_threads, **decode)
    return make


def device_line(device: torch.device) -> str:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        what = f"{props.name}, {props.total_memory / (1 << 30):.1f} GiB"
    else:
        what = f"{platform.machine()} CPU, {torch.get_num_threads()} torch threads"
    return f"device: {device.type} ({what}); torch {torch.__version__}"


def guarded(section: str, check: str, fn: Callable[[], Row | list[Row]]) -> list[Row]:
    """The rows of ``fn``; an exception (a kernel that fails on this device, say) is a FAIL row
    naming it, so one broken check does not hide the others."""
    try:
        out = fn()
    except Exception as e:  # every failure of a check is a result to report
        log.exception("%s: %s raised", section, check)
        return [Row(section, check, FAIL, f"raised {type(e).__name__}: {e}")]
    return out if isinstance(out, list) else [out]


def run(args: argparse.Namespace) -> list[Row]:
    """Every row of the self-test, in table order: exactness, memory, throughput."""
    dev, bundled = args.device, default_model_path()
    n_layers = load_model_config(bundled).n_layers
    exact = engine_factory(dev, args.attention_backend, args.num_threads, **ENGINE_DECODE)
    work = fewshot_workload()

    def depth_row(folder: str, label: str) -> Row:
        attn = create_backend(args.attention_backend, dev, torch.float32, load_model_config(folder).head_dim)
        return check_depth_forward(folder, label, dev, attn)

    # memory first: nothing of ours holds device memory yet
    memory = guarded("memory", "sizing", lambda: memory_rows(bundled, dev))
    rows = guarded(SECTION, "depth 0 == cache off", lambda: check_depth0_equals_off(exact, work))
    rows += guarded(SECTION, "batched == alone (mixed depths)",
                    lambda: check_batched_equals_alone(exact, work, n_layers))
    with tempfile.TemporaryDirectory(prefix="bicache-selftest-") as tmp:
        dream = make_tiny_dream(Path(tmp) / "dream", n_layers=4, hidden_size=64, n_heads=4, n_kv_heads=2)
        moe = make_tiny_llada_moe(Path(tmp) / "moe", n_layers=4, n_experts=8, top_k=2)
        for folder, label in ((bundled, "bundled LLaDA"), (dream, "random Dream, GQA"),
                              (moe, "random LLaDA-MoE, 8 experts top-2")):
            rows += guarded(SECTION, f"depth-d forward vs float64 ({label})",
                            lambda f=folder, la=label: depth_row(f, la))
        llada2 = make_tiny_llada2(f"{tmp}/llada2", block_length=4)
        sdar = make_tiny_sdar(f"{tmp}/sdar", block_length=4)
        for folder, label in ((llada2, "random LLaDA2, MoE"), (sdar, "random SDAR")):
            rows += guarded(SECTION, f"block-causal forward vs float64 ({label})",
                            lambda f=folder, la=label: check_block_forward(f, la, dev))
        rows += guarded(SECTION, "exact block reuse == cache off",
                        lambda: check_block_reuse(llada2, "random LLaDA2, MoE", dev))
    rows += guarded(SECTION, "flashinfer == torch backend", lambda: check_flashinfer(dev))
    rows += memory
    serving = engine_factory(dev, args.attention_backend, args.num_threads)
    rows += guarded("throughput", "bicache / off", lambda: throughput_rows(serving, args.probe_seconds))
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    print(device_line(args.device), flush=True)
    t0 = time.perf_counter()
    rows = run(args)
    print(format_table(rows))
    print(f"{summary(rows)} ({time.perf_counter() - t0:.1f} s)")
    return exit_status(rows)


if __name__ == "__main__":
    sys.exit(main())
