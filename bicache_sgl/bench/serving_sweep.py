"""Serving sweep: bicache against the baselines, through real clients, one table + one plot per run.

Longer than ~450 lines on purpose: it is a benchmark (not the runtime), one run from flags to the
record (servers, workloads, client commands, counters, table, plot), and its pieces are shared
with examples/bench_serving_ab.py by import, so they stay in the one module both read.

For every configuration the script starts its own server (``bicache_sgl.runtime.Runtime``:
``python -m bicache_sgl.launch_server`` on a free loopback port, ready once ``/health_generate``
answers), runs every workload against it
at every concurrency, and stops it. Same model, same workloads, same decoding defaults otherwise:

  vanilla        --prefix-cache off     --cache-mode none --threshold 0    no caching, one token per step
  dual           --prefix-cache off     --cache-mode dual --threshold 0.9  Fast-dLLM (in-request cache)
  naive+dual     --prefix-cache naive   --cache-mode dual --threshold 0.9  shared prefix reused in all layers
  bicache+dual   --prefix-cache bicache --cache-mode dual --threshold 0.9  shared prefix reused in b(r) layers

Workloads:

- ``gsp r=X``: SGLang's own client, ``python -m sglang.bench_serving --backend sglang --dataset-name
  generated-shared-prefix`` (random-token system prompts shared by each group, random questions,
  ``ignore_eos``). For each shared fraction r in --ratios the lengths are chosen so that every request
  has the same sequence length N (--seq-len = system + separator + question + generation region) and
  ``r = system / N``. Each run starts from an empty prefix cache (``--flush-cache``; the first request of
  a group inserts its system prompt, the others of the group reuse it).
- ``fewshot``: ``bicache_sgl.bench.fewshot`` (examples/bench_fewshot.py; SGLang frontend program,
  ``run_batch``; the few-shot blocks are sent first as ``cache_prefix`` requests) on the bundled
  model's held-out key-lookup task, which has ground truth: the accuracy column.

Columns: request throughput, output tokens/s, mean / p99 end-to-end latency, cached prompt tokens
(server counter, share of prompt tokens), skipped layer-token fraction (server counters
skipped / (skipped + computed), differences over the run), accuracy; then speedups:
``xdual meas`` = output throughput / dual's output throughput on the same workload and concurrency,
``xdual ideal`` = dual's computed layer-tokens / this run's computed layer-tokens (counted work, from
the server), ``meas/ideal``, and the same two against vanilla; memory: prefix-pool bytes per cached
token (server stat) and the peak RSS of the server process (psutil, sampled every 0.1 s during the run).

Outputs in --out-dir (default bench_results/<timestamp>): table.md (the command, setup, table,
targets), sweep.png, results.json (every number, every bench_serving command), logs/ (server and client
output). The table is printed too.

    python examples/bench_serving_sweep.py                     # the default sweep (~15 min on 2 CPU cores)
    python examples/bench_serving_sweep.py --quick             # ~3 min
    python examples/bench_serving_sweep.py --configs dual,bicache+dual --ratios 0.9 --concurrency 16

bicache needs a profile: --bicache-profile FILE, else bicache_profile.json beside the model, else one
is calibrated on the spot (``python -m bicache_sgl.calibrate``, kv-cosine, on the few-shot task's
prompts, or on random prompts for other models) and written into the output folder.

Needs ``pip install "sglang==0.5.2" pybase64 matplotlib psutil`` (psutil optional: /proc is read
without it).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..config import DecodeDefaults, EngineConfig
from ..flags import add_flags
from ..runtime import Runtime, parse_server_args, server_flags
from .procmem import RSSSampler, proc_status_bytes

# the source checkout this module runs from (for the git revision in the report)
SOURCE_ROOT = Path(__file__).resolve().parents[2]

# server flags of each configuration, as bicache_sgl.runtime.Runtime keyword arguments
CONFIGS: dict[str, dict[str, str]] = {
    "vanilla": {"prefix_cache": "off", "cache_mode": "none", "threshold": "0"},
    "dual": {"prefix_cache": "off", "cache_mode": "dual", "threshold": "0.9"},
    "naive+dual": {"prefix_cache": "naive", "cache_mode": "dual", "threshold": "0.9"},
    "bicache+dual": {"prefix_cache": "bicache", "cache_mode": "dual", "threshold": "0.9"},
}

# The issue's targets (ratios in one run, r >= TARGET_R).
TARGET_R = 0.75
TARGET_X_DUAL = 2.0
TARGET_X_VANILLA = 10.0
TARGET_ACC_POINTS = 1.0
TARGET_IDEAL_TOL = 0.15

QUICK = {"ratios": "0.3,0.9", "concurrency": "1,16", "seq_len": 384, "gsp_groups": 2, "gsp_per_group": 8,
         "fewshot_questions": 48, "fewshot_shots": "8"}


# ---------------------------------------------------------------------------------------- arguments

def build_parser() -> argparse.ArgumentParser:
    """The flags (their dests and defaults are pinned in tests/test_config_flags.py)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_flags(ap, EngineConfig, only=("model_path", "bicache_profile"),
              helps={"model_path": "checkpoint folder (default: the bundled model)",
                     "bicache_profile": "profile for bicache+dual (default: bicache_profile.json beside the model, "
                                        "else calibrated on the spot into the output folder)"})
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, from {', '.join(CONFIGS)}")
    ap.add_argument("--concurrency", default="1,16", help="comma-separated max concurrencies")
    ap.add_argument("--ratios", default="0.3,0.5,0.75,0.9",
                    help="shared fractions r of the generated-shared-prefix workloads ('' for none)")
    ap.add_argument("--seq-len", type=int, default=512,
                    help="gsp: tokens per sequence N = system + separator + question + generation region")
    ap.add_argument("--output-len", type=int, default=32, help="gsp: max_new_tokens (ignore_eos)")
    ap.add_argument("--gsp-groups", type=int, default=4, help="gsp: distinct system prompts")
    ap.add_argument("--gsp-per-group", type=int, default=8, help="gsp: requests per system prompt")
    ap.add_argument("--fewshot-questions", type=int, default=96, help="few-shot questions (0: no few-shot workload)")
    ap.add_argument("--fewshot-shots", default="6,8",
                    help="comma-separated: one few-shot workload per count of examples in the prefix (the bundled "
                         "model is trained with up to 6; 6 shots give r ~ 0.73, 8 give r ~ 0.78)")
    ap.add_argument("--vanilla-min-r", type=float, default=TARGET_R,
                    help="vanilla runs only the gsp workloads with r >= this (and the few-shot ones): with no "
                         "caching its cost does not depend on r, and it is by far the slowest configuration")
    add_flags(ap, DecodeDefaults, only=("block_length",), helps={"block_length": "server --block-length"})
    add_flags(ap, EngineConfig, only=("num_threads",),
              helps={"num_threads": "server --num-threads (default: the server's own default, as a user runs it)"})
    ap.add_argument("--server-args", default="", help="extra flags for every server, e.g. '--dtype float32'")
    ap.add_argument("--seed", type=int, default=1, help="bench_serving --seed (same workload for every config)")
    ap.add_argument("--out-dir", default=None, help="default: bench_results/<timestamp>")
    ap.add_argument("--quick", action="store_true",
                    help="~3 minutes: " + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in QUICK.items())
                         + " (explicit flags win)")
    ap.add_argument("--server-timeout", type=float, default=300.0, help="seconds to wait for a server")
    ap.add_argument("--run-timeout", type=float, default=900.0, help="seconds per client run")
    ap.add_argument("--repeat", type=int, default=1,
                    help="rounds; each round starts fresh servers; the fastest run of each cell is reported "
                         "(all are kept in results.json)")
    ap.add_argument("--interleave", action="store_true",
                    help="keep every configuration's server up during a round and alternate the configurations "
                         "on each workload (robust to background load on a shared machine); default: one "
                         "server at a time")
    ap.add_argument("--no-plot", action="store_true")
    return ap


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.quick:
        given = {a.split("=", 1)[0] for a in (argv if argv is not None else sys.argv[1:]) if a.startswith("--")}
        for k, v in QUICK.items():
            if "--" + k.replace("_", "-") not in given:
                setattr(args, k, v)
    args.config_list = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in args.config_list if c not in CONFIGS]
    if bad or not args.config_list:
        ap.error(f"--configs: unknown {bad}; choose from {', '.join(CONFIGS)}")
    try:
        args.conc_list = sorted({int(c) for c in args.concurrency.split(",") if c.strip()})
        args.ratio_list = [float(r) for r in args.ratios.split(",") if r.strip()]
    except ValueError as e:
        ap.error(f"--concurrency / --ratios: {e}")
    if args.repeat < 1:
        ap.error("--repeat must be >= 1")
    if not args.conc_list or min(args.conc_list) < 1:
        ap.error("--concurrency needs integers >= 1")
    if any(not 0.0 < r < 1.0 for r in args.ratio_list):
        ap.error("--ratios must lie in (0, 1)")
    try:
        args.shots_list = [int(s) for s in str(args.fewshot_shots).split(",") if s.strip()]
    except ValueError as e:
        ap.error(f"--fewshot-shots: {e}")
    if any(s < 1 for s in args.shots_list):
        ap.error("--fewshot-shots: counts must be >= 1")
    if not args.shots_list:
        args.fewshot_questions = 0
    if not args.ratio_list and args.fewshot_questions <= 0:
        ap.error("nothing to run: no --ratios and --fewshot-questions 0")
    try:
        parse_server_args(args.server_args)
    except ValueError as e:
        ap.error(f"--server-args: {e}")
    return args


# ---------------------------------------------------------------------------------------- workloads

def gen_region(output_len: int, block_length: int) -> int:
    """Generation positions of a request: max_new_tokens rounded up to whole blocks."""
    return -(-output_len // block_length) * block_length


def gsp_lengths(r: float, seq_len: int, output_len: int, block_length: int, sep_len: int = 2) -> dict:
    """System-prompt and question lengths so that system / N = r for N = seq_len tokens
    (system + separator + question + generation region). Raises ValueError if it does not fit."""
    g = gen_region(output_len, block_length)
    room = seq_len - g - sep_len
    sys_len = round(r * seq_len)
    q_len = room - sys_len
    if sys_len < 1 or q_len < 1:
        raise ValueError(f"r={r}: N={seq_len} leaves {room} prompt tokens after the {g}-token generation "
                         f"region; a system prompt of {sys_len} and a question of >= 1 do not fit "
                         "(raise --seq-len)")
    return {"system_prompt_len": sys_len, "question_len": q_len, "output_len": output_len,
            "r": sys_len / (sys_len + sep_len + q_len + g), "seq_len": sys_len + sep_len + q_len + g}


class Workload:
    def __init__(self, name: str, kind: str, r: float, params: dict | None = None) -> None:
        self.name, self.kind, self.r = name, kind, r  # kind: "gsp" | "fewshot"
        self.params = dict(params or {})


def build_workloads(args, tokenizer) -> list[Workload]:
    out = []
    sep_len = len(tokenizer.encode("\n\n", add_special_tokens=False)) if tokenizer is not None else 2
    for r in args.ratio_list:
        try:
            p = gsp_lengths(r, args.seq_len, args.output_len, args.block_length, sep_len)
        except ValueError as e:
            raise SystemExit(f"--ratios/--seq-len: {e}") from None
        p.update(num_groups=args.gsp_groups, prompts_per_group=args.gsp_per_group)
        out.append(Workload(f"gsp r={r:g}", "gsp", p["r"], p))
    for shots in (args.shots_list if args.fewshot_questions > 0 else []):
        r = fewshot_fraction(tokenizer, shots, args.fewshot_questions, args.block_length)
        if r is not None:
            out.append(Workload(f"fewshot {shots}-shot", "fewshot", r,
                                {"num_questions": args.fewshot_questions, "num_shots": shots}))
    return out


def runs_for(cfg: str, workloads: list, args) -> list:
    """The workloads a configuration runs (vanilla skips the gsp ones below --vanilla-min-r)."""
    if cfg != "vanilla":
        return list(workloads)
    return [w for w in workloads if w.kind != "gsp" or w.r >= args.vanilla_min_r - 1e-9]


def fewshot_fraction(tokenizer, shots: int, questions: int, block_length: int) -> float | None:
    """Mean shared fraction of the few-shot workload (prefix tokens / (prompt + generation region)),
    or None when the bundled task is unavailable."""
    try:
        from bicache_sgl.training import task
    except ImportError:
        return None
    items = task.heldout_items(questions, shots, seed=0)
    g = gen_region(32, block_length)
    rs = []
    for it in items:
        prefix = it["prefix"] + task.EXAMPLE_SEP
        n_pre = len(tokenizer.encode(prefix, add_special_tokens=False))
        n_all = len(tokenizer.encode(it["prompt"]))
        rs.append(n_pre / (n_all + g))
    return sum(rs) / len(rs)


# ---------------------------------------------------------------------------------------- server

def vm_hwm(pid: int) -> int | None:
    """The kernel's lifetime peak RSS of ``pid`` (VmHWM), bytes."""
    return proc_status_bytes(pid, "VmHWM")


# ---------------------------------------------------------------------------------------- clients

# the prefix pool as /get_server_info reports it, kept with every run
POOL_STATS = ("prefix_cache_bytes", "prefix_cache_stored_bytes", "prefix_cache_bytes_per_layer_token",
              "prefix_cache_capacity_tokens", "prefix_cache_used_tokens", "prefix_cache_max_depth")

COUNTERS = ("computed_layer_tokens", "skipped_layer_tokens", "cached_tokens_total", "prompt_tokens_total",
            "generation_tokens_total", "num_forward_passes", "num_requests_total")


def counter_delta(before: dict, after: dict) -> dict:
    return {k: after.get(k, 0) - before.get(k, 0) for k in COUNTERS if k in after}


def bench_serving_cmd(url: str, tokenizer_path: str, wl: Workload, conc: int, seed: int, out_file: Path) -> list[str]:
    p = wl.params
    return [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang", "--base-url", url,
            "--tokenizer", tokenizer_path, "--dataset-name", "generated-shared-prefix",
            "--gsp-num-groups", str(p["num_groups"]), "--gsp-prompts-per-group", str(p["prompts_per_group"]),
            "--gsp-system-prompt-len", str(p["system_prompt_len"]), "--gsp-question-len", str(p["question_len"]),
            "--gsp-output-len", str(p["output_len"]), "--max-concurrency", str(conc), "--request-rate", "inf",
            "--flush-cache", "--warmup-requests", "0", "--seed", str(seed), "--disable-tqdm",
            "--output-file", str(out_file)]


def fewshot_cmd(url: str, wl: Workload, conc: int, result_file: Path, raw_file: Path) -> list[str]:
    port = url.rsplit(":", 1)[1]
    return [sys.executable, "-m", "bicache_sgl.bench.fewshot", "--host", "127.0.0.1", "--port", port,
            "--num-questions", str(wl.params["num_questions"]), "--num-shots", str(wl.params["num_shots"]),
            "--parallel", str(conc), "--result-file", str(result_file), "--raw-result-file", str(raw_file)]


def client_env(home: Path) -> dict:
    # bench_serving caches its generated dataset under ~/.cache/sglang/benchmark keyed by the lengths and
    # the tokenizer *class*: a private HOME keeps other models' data out and gives every configuration
    # of this run the same prompts (the first run writes them, the others load them).
    return dict(os.environ, HOME=str(home), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")


def run_client(cmd: list[str], env: dict, log_path: Path, timeout: float) -> tuple[int, float]:
    t0 = time.perf_counter()
    with open(log_path, "ab") as log:
        log.write(("$ " + shlex.join(cmd) + "\n").encode())
        log.flush()
        try:
            p = subprocess.run(cmd, check=False, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout)
            rc = p.returncode
        except subprocess.TimeoutExpired:
            rc = 124
    return rc, time.perf_counter() - t0


def warm_up(server: Runtime, tokenizer, seq_len: int, output_len: int, block_length: int) -> None:
    """A couple of untimed requests of the sweep's sizes (first-call costs), then an empty cache."""
    import random

    rng = random.Random(12345)
    vocab = sorted(set(tokenizer.get_vocab().values()))
    n = max(8, min(seq_len - gen_region(output_len, block_length), 256))
    ids = [rng.choice(vocab) for _ in range(n)]
    for _ in range(2):
        server.generate(input_ids=ids, sampling_params={"max_new_tokens": output_len, "temperature": 0,
                                                        "ignore_eos": True}, timeout=600)
    server.flush_cache(timeout=30)


def run_one(server: Runtime, cfg: str, wl: Workload, conc: int, args, tok_path: str, home: Path,
            out_dir: Path, sampler: RSSSampler) -> dict:
    tag = f"{cfg}_{wl.name.replace(' ', '_').replace('=', '')}_c{conc}".replace("+", "-")
    log_path = out_dir / "logs" / f"{tag}.log"
    res: dict[str, Any] = {"config": cfg, "workload": wl.name, "kind": wl.kind, "r": wl.r, "concurrency": conc}
    try:
        server.flush_cache(timeout=30)
        before = server.internal_state()
    except (OSError, ValueError) as e:
        res["error"] = f"server not answering before the run: {e} (log: {server.log_path})"
        return res
    sampler.reset()
    if wl.kind == "gsp":
        out_file = out_dir / "logs" / f"{tag}.jsonl"
        cmd = bench_serving_cmd(server.url, tok_path, wl, conc, args.seed, out_file)
        rc, wall = run_client(cmd, client_env(home), log_path, args.run_timeout)
        res["command"] = shlex.join(cmd)
        if rc == 0 and out_file.exists():
            b = json.loads(out_file.read_text().splitlines()[-1])
            res.update(completed=b["completed"], duration=b["duration"],
                       request_throughput=b["request_throughput"], output_throughput=b["output_throughput"],
                       mean_latency=b["mean_e2e_latency_ms"] / 1e3, p99_latency=b["p99_e2e_latency_ms"] / 1e3,
                       output_tokens=b["total_output_tokens"], accept_length=b.get("accept_length"),
                       accuracy=None)
        else:
            res["error"] = f"bench_serving exited with {rc} (log: {log_path})"
    else:
        result_file = out_dir / "logs" / f"{tag}.result.jsonl"
        raw_file = out_dir / "logs" / f"{tag}.raw.jsonl"
        result_file.unlink(missing_ok=True)
        cmd = fewshot_cmd(server.url, wl, conc, result_file, raw_file)
        rc, wall = run_client(cmd, client_env(home), log_path, args.run_timeout)
        res["command"] = shlex.join(cmd)
        if rc == 0 and result_file.exists():
            b = json.loads(result_file.read_text().splitlines()[-1])
            o = b.get("other", {})
            lat = b["latency"]
            res.update(completed=b["num_requests"] - o.get("failed_requests", 0), duration=lat,
                       request_throughput=b["num_requests"] / lat, output_throughput=o.get("output_throughput"),
                       mean_latency=None, p99_latency=None, output_tokens=o.get("completion_tokens"),
                       accuracy=b["accuracy"], invalid=o.get("invalid"))
            try:
                res["outputs"] = [json.loads(ln)["output"] for ln in raw_file.read_text().splitlines()]
            except (OSError, ValueError, KeyError):
                pass
        else:
            res["error"] = f"bench_fewshot exited with {rc} (log: {log_path})"
    try:
        after = server.internal_state()
    except (OSError, ValueError) as e:
        res["error"] = f"server not answering after the run: {e} (log: {server.log_path})"
        return res
    res["peak_rss"] = sampler.peak
    res["client_wall"] = wall
    d = counter_delta(before, after)
    res.update(d)
    tot = d.get("computed_layer_tokens", 0) + d.get("skipped_layer_tokens", 0)
    res["skipped_fraction"] = d.get("skipped_layer_tokens", 0) / tot if tot else None
    res["cache_hit"] = (d.get("cached_tokens_total", 0) / d["prompt_tokens_total"]) \
        if d.get("prompt_tokens_total") else None
    for k in POOL_STATS:
        res[k] = after.get(k)
    return res


# ---------------------------------------------------------------------------------------- profile

def ensure_profile(args, model_path: str, n_layers: int, out_dir: Path) -> tuple[str | None, str]:
    """(profile path, how it was obtained)."""
    if args.bicache_profile:
        return args.bicache_profile, f"--bicache-profile {args.bicache_profile}"
    beside = Path(model_path) / "bicache_profile.json"
    if beside.exists():
        return str(beside), f"shipped: {beside}"
    if "bicache+dual" not in args.config_list:
        return None, "none (bicache+dual not run)"
    data = out_dir / "calibration_prompts.jsonl"
    prof = out_dir / "bicache_profile.json"
    rows = []
    try:
        from bicache_sgl.training import task
        bundled = Path(model_path).resolve() == Path(default_model_path()).resolve()
    except ImportError:
        bundled = False
    if bundled:
        shots = max(args.shots_list or [6])
        for it in task.heldout_items(48, shots, seed=7):
            rows.append({"prompt": it["prompt"]})
        what = f"the few-shot task's prompts ({shots}-shot, 48 held-out items, seed 7)"
    else:
        import random

        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(model_path)
        vocab = sorted(set(tok.get_vocab().values()))
        rng = random.Random(7)
        for _ in range(16):
            rows.append({"prompt": tok.decode(rng.choices(vocab, k=args.seq_len - args.output_len))})
        what = "16 random-token prompts"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cmd = [sys.executable, "-m", "bicache_sgl.calibrate", "--model-path", model_path, "--data", str(data),
           "--out", str(prof), "--plot", "none", "--gen-length", str(args.output_len),
           "--block-length", str(args.block_length), "--no-progress",
           *(["--num-threads", str(args.num_threads)] if args.num_threads else [])]
    print("no bicache profile: calibrating one: " + shlex.join(cmd), file=sys.stderr, flush=True)
    p = subprocess.run(cmd, check=False, capture_output=True, text=True)
    (out_dir / "logs" / "calibrate.log").write_text(p.stdout + p.stderr)
    if p.returncode != 0:
        raise SystemExit(f"calibration failed:\n{p.stdout[-2000:]}{p.stderr[-2000:]}")
    return str(prof), f"calibrated on the spot (kv-cosine, threshold 0.97, resume rule) on {what}: {prof}"


def default_model_path() -> str:
    from bicache_sgl.models.loader import default_model_path as d
    return d()


# ---------------------------------------------------------------------------------------- analysis

def add_speedups(results: list[dict]) -> None:
    """Speedups against dual and vanilla on the same workload and concurrency (in place)."""
    by = {(r["workload"], r["concurrency"], r["config"]): r for r in results if "error" not in r}
    for r in results:
        if "error" in r:
            continue
        for ref_name, key in (("dual", "dual"), ("vanilla", "vanilla")):
            ref = by.get((r["workload"], r["concurrency"], ref_name))
            meas = ideal = None
            if ref is not None:
                if r.get("output_throughput") and ref.get("output_throughput"):
                    meas = r["output_throughput"] / ref["output_throughput"]
                if r.get("computed_layer_tokens") and ref.get("computed_layer_tokens"):
                    ideal = ref["computed_layer_tokens"] / r["computed_layer_tokens"]
            r[f"x_{key}_measured"], r[f"x_{key}_ideal"] = meas, ideal
        m, i = r.get("x_dual_measured"), r.get("x_dual_ideal")
        r["measured_over_ideal"] = m / i if m is not None and i else None


def check_targets(results: list[dict]) -> list[dict]:
    """One entry per (workload with r >= TARGET_R, concurrency) where bicache+dual ran."""
    by = {(r["workload"], r["concurrency"], r["config"]): r for r in results if "error" not in r}
    out = []
    for (wl, conc, cfg), b in sorted(by.items(), key=lambda kv: (kv[1]["r"], kv[0][0], kv[0][1])):
        if cfg != "bicache+dual" or b["r"] < TARGET_R:
            continue
        d, v = by.get((wl, conc, "dual")), by.get((wl, conc, "vanilla"))
        e: dict[str, Any] = {"workload": wl, "r": b["r"], "concurrency": conc}
        xd = b.get("x_dual_measured")
        acc_ok, acc_diff = None, None
        if d is not None and b.get("accuracy") is not None and d.get("accuracy") is not None:
            acc_diff = 100.0 * (b["accuracy"] - d["accuracy"])
            acc_ok = acc_diff >= -TARGET_ACC_POINTS
        e["x_dual"] = xd
        e["acc_diff_points"] = acc_diff
        e["x_dual_met"] = None if xd is None else (xd >= TARGET_X_DUAL and acc_ok is not False)
        e["x_vanilla"] = b.get("x_vanilla_measured") if v is not None else None
        e["x_vanilla_met"] = None if e["x_vanilla"] is None else e["x_vanilla"] >= TARGET_X_VANILLA
        moi = b.get("measured_over_ideal")
        e["x_dual_ideal"] = b.get("x_dual_ideal")
        e["measured_over_ideal"] = moi
        e["ideal_met"] = None if moi is None else abs(moi - 1.0) <= TARGET_IDEAL_TOL
        out.append(e)
    return out


def _f(v: Any, spec: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    return format(v, spec)


def _mib(nbytes: Any) -> str:
    return _f(nbytes / 2**20 if nbytes else None, ".0f")


TABLE_HEAD = ("| workload | r | conc | config | req/s | out tok/s | mean lat (s) | p99 lat (s) | cached tokens "
              "(of prompt) | skipped layer-tokens | accuracy | x dual meas | x dual ideal | meas/ideal "
              "| x vanilla meas | x vanilla ideal | pool (MiB) | peak RSS (MiB) |")


def format_table(results: list[dict]) -> str:
    lines = [TABLE_HEAD, "|" + "---|" * TABLE_HEAD.count(" | ") + "---|"]
    for r in results:
        head = f"| {r['workload']} | {r['r']:.2f} | {r['concurrency']} | {r['config']} "
        if "error" in r:
            lines.append(head + f"| {r['error']} |" + " |" * 13)
            continue
        hit = "n/a" if r.get("cache_hit") is None else f"{r.get('cached_tokens_total', 0)} ({r['cache_hit']:.0%})"
        lines.append(
            head + f"| {_f(r.get('request_throughput'), '.2f')} | {_f(r.get('output_throughput'), '.1f')} "
            f"| {_f(r.get('mean_latency'), '.2f')} | {_f(r.get('p99_latency'), '.2f')} | {hit} "
            f"| {_f(r.get('skipped_fraction'), '.1%')} | {_f(r.get('accuracy'), '.3f')} "
            f"| {_f(r.get('x_dual_measured'), '.2f')} | {_f(r.get('x_dual_ideal'), '.2f')} "
            f"| {_f(r.get('measured_over_ideal'), '.2f')} | {_f(r.get('x_vanilla_measured'), '.2f')} "
            f"| {_f(r.get('x_vanilla_ideal'), '.2f')} | {_mib(r.get('prefix_cache_bytes'))} "
            f"| {_mib(r.get('peak_rss'))} |")
    return "\n".join(lines)


def format_memory(results: list[dict], servers: dict) -> str:
    """Per configuration: the prefix pool (allocated at startup), the most of it in use after any run,
    and the server's peak RSS."""
    out = []
    for cfg, info in servers.items():
        rows = [r for r in results if r["config"] == cfg and "error" not in r]
        if not rows:
            continue
        last = rows[-1]
        cap = last.get("prefix_cache_capacity_tokens") or 0
        used = max((r.get("prefix_cache_used_tokens") or 0) for r in rows)
        stored = max((r.get("prefix_cache_stored_bytes") or 0) for r in rows)
        peak = max((r.get("peak_rss") or 0) for r in rows)
        hwm = info.get("vm_hwm")
        pool = "no prefix pool" if not last.get("prefix_cache_bytes") else (
            f"pool {_mib(last['prefix_cache_bytes'])} MiB for {cap} tokens "
            f"({last.get('prefix_cache_bytes_per_layer_token')} B per layer-token, nodes up to depth "
            f"{last.get('prefix_cache_max_depth')}), at most {used} tokens ({_mib(stored)} MiB) cached after a "
            f"run ({'within' if used <= cap else 'OVER'} budget)")
        out.append(f"- {cfg}: {pool}; peak RSS {peak / 2**20:.0f} MiB sampled during the runs"
                   + (f", {hwm / 2**20:.0f} MiB lifetime (VmHWM)" if hwm else ""))
    return "\n".join(out)


def format_targets(targets: list[dict]) -> str:
    if not targets:
        return f"No workload with r >= {TARGET_R} ran with bicache+dual: the targets were not evaluated."

    def mark(ok):
        return "n/a" if ok is None else ("met" if ok else "NOT met")

    out = []
    for t in targets:
        acc = "" if t["acc_diff_points"] is None else f", accuracy {t['acc_diff_points']:+.1f} points"
        out.append(
            f"- {t['workload']} (r = {t['r']:.2f}), concurrency {t['concurrency']}: "
            f"bicache+dual = {_f(t['x_dual'], '.2f')}x dual{acc} (target >= {TARGET_X_DUAL}x, within "
            f"{TARGET_ACC_POINTS:g} point: {mark(t['x_dual_met'])}); {_f(t['x_vanilla'], '.2f')}x vanilla "
            f"(target >= {TARGET_X_VANILLA:g}x: {mark(t['x_vanilla_met'])}); measured/ideal "
            f"{_f(t['measured_over_ideal'], '.2f')} (ideal {_f(t['x_dual_ideal'], '.2f')}x; target within "
            f"{TARGET_IDEAL_TOL:.0%}: {mark(t['ideal_met'])})")
    return "\n".join(out)


def make_plot(results: list[dict], path: Path, title: str) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    ok = [r for r in results if "error" not in r and r.get("output_throughput")]
    if not ok:
        return None
    concs = sorted({r["concurrency"] for r in ok})
    styles = ["-", "--", ":", "-."]
    colors = {"vanilla": "tab:gray", "dual": "tab:blue", "naive+dual": "tab:orange", "bicache+dual": "tab:green"}
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 5))
    for cfg in CONFIGS:
        for ci, c in enumerate(concs):
            pts = sorted((r["r"], r["output_throughput"]) for r in ok
                         if r["config"] == cfg and r["concurrency"] == c and r["kind"] == "gsp")
            if pts:
                a1.plot(*zip(*pts), styles[ci % 4], marker="o", color=colors.get(cfg), label=f"{cfg}, conc {c}")
            fs = [(r["r"], r["output_throughput"]) for r in ok
                  if r["config"] == cfg and r["concurrency"] == c and r["kind"] == "fewshot"]
            if fs:
                a1.plot(*zip(*fs), marker="*", markersize=12, linestyle="none", color=colors.get(cfg),
                        markeredgecolor="black" if ci else colors.get(cfg))
    a1.set_yscale("log")
    a1.set_xlabel("shared prefix fraction r")
    a1.set_ylabel("output tokens/s (log)")
    a1.set_title("throughput (lines: generated-shared-prefix; stars: few-shot, black edge = batched)")
    a1.grid(True, which="both", alpha=0.3)
    a1.legend(fontsize=7)
    b = [r for r in ok if r["config"] == "bicache+dual" and r.get("x_dual_measured")]
    for ci, c in enumerate(concs):
        for kind, mk in (("gsp", "o"), ("fewshot", "*")):
            pts = sorted((r["r"], r["x_dual_measured"], r.get("x_dual_ideal") or float("nan")) for r in b
                         if r["concurrency"] == c and r["kind"] == kind)
            if not pts:
                continue
            xs, ms, ids = zip(*pts)
            ls = styles[ci % 4] if kind == "gsp" else "none"
            lab = "" if kind == "gsp" else " (few-shot)"
            a2.plot(xs, ms, linestyle=ls, marker=mk, color="tab:green", markersize=10 if mk == "*" else 6,
                    label=f"measured, conc {c}{lab}")
            a2.plot(xs, ids, linestyle=ls, marker=mk, color="tab:purple", markersize=10 if mk == "*" else 6,
                    markerfacecolor="none", label=f"ideal (counted work), conc {c}{lab}")
    a2.axhline(TARGET_X_DUAL, color="red", linewidth=0.8, linestyle=":", label=f"target {TARGET_X_DUAL}x")
    a2.axhline(1.0, color="black", linewidth=0.5)
    a2.axvline(TARGET_R, color="gray", linewidth=0.5, linestyle=":")
    a2.set_xlabel("shared prefix fraction r")
    a2.set_ylabel("bicache+dual speedup over dual")
    a2.set_title("bicache+dual / dual: measured (output tok/s) vs ideal")
    a2.grid(True, alpha=0.3)
    a2.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


# ---------------------------------------------------------------------------------------- main

def file_digest(folder: str) -> str | None:
    p = Path(folder)
    files = sorted(p.glob("*.safetensors"))
    if not files:
        return None
    h = hashlib.sha256()
    for f in files:
        h.update(f.read_bytes())
    return h.hexdigest()[:12]


def git_rev() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], check=False, capture_output=True, text=True,
                             cwd=SOURCE_ROOT).stdout
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], check=False,
                               capture_output=True, text=True, cwd=SOURCE_ROOT).stdout.strip()
        return rev.strip() + (" (uncommitted changes)" if dirty else "")
    except OSError:
        return "unknown"


def best_run(rows: list[dict]) -> dict | None:
    """The fastest successful run of a cell (all runs' throughputs kept under "runs"), else the last error."""
    if not rows:
        return None
    ok = [r for r in rows if "error" not in r]
    if not ok:
        return rows[-1]
    best = dict(max(ok, key=lambda r: r.get("output_throughput") or r.get("request_throughput") or 0.0))
    best["runs"] = [r.get("output_throughput") for r in ok]
    return best


def start_server(cfg: str, base_flags: dict[str, Any], profile_path: str | None, out_dir: Path, rnd: int,
                 args, tokenizer, servers: dict) -> tuple | None:
    flags = {**base_flags, **CONFIGS[cfg]}
    if cfg == "bicache+dual" and profile_path:
        flags["bicache_profile"] = profile_path
    log_path = out_dir / "logs" / f"server_{cfg.replace('+', '-')}" f"{'' if rnd == 0 else f'_round{rnd + 1}'}.log"
    t0 = time.perf_counter()
    try:
        server = Runtime(timeout=args.server_timeout, log_path=str(log_path),
                         env={"TOKENIZERS_PARALLELISM": "false"}, **flags)
    except (RuntimeError, TimeoutError) as e:
        print(f"[{cfg}] server failed: {e}", file=sys.stderr, flush=True)
        return None
    sampler = RSSSampler(server.proc.pid).start()
    info = servers.setdefault(cfg, {"command": shlex.join(server.cmd), "startup_s": [], "vm_hwm": 0})
    info["startup_s"].append(round(time.perf_counter() - t0, 2))
    try:
        warm_up(server, tokenizer, args.seq_len, args.output_len, args.block_length)
    except Exception as e:
        print(f"[{cfg}] warm-up failed: {e}", file=sys.stderr, flush=True)
        sampler.stop()
        server.shutdown()
        return None
    return server, sampler


def stop_server(cfg: str, server: Runtime, sampler: RSSSampler, servers: dict) -> None:
    try:
        servers[cfg]["vm_hwm"] = max(servers[cfg]["vm_hwm"] or 0, vm_hwm(server.proc.pid) or 0)
    finally:
        sampler.stop()
        server.shutdown()


def run_round(order: list[str], workloads: list, args, base_flags, profile_path, tokenizer, model_path: str,
              home: Path, out_dir: Path, servers: dict, runs: dict, rnd: int) -> None:
    """One round over every configuration. Sequential (default): one server at a time, all its workloads,
    then it is stopped. --interleave: every configuration's server is up for the round and the
    configurations take turns on each (workload, concurrency), so slow changes in background load hit
    them alike; the servers are stopped at the end of the round."""
    def record(cfg, wl, c, res):
        runs.setdefault((cfg, wl.name, c), []).append(res)
        msg = res.get("error") or (f"{res['output_throughput']:.1f} out tok/s, {res['request_throughput']:.2f} req/s"
                                   + (f", acc {res['accuracy']:.3f}" if res.get("accuracy") is not None else ""))
        tag = f" (round {rnd + 1})" if args.repeat > 1 else ""
        print(f"[{cfg}] {wl.name} conc {c}: {msg} ({res.get('client_wall', 0):.0f} s){tag}", file=sys.stderr,
              flush=True)

    def failed(cfg, wl, c, why):
        return {"config": cfg, "workload": wl.name, "kind": wl.kind, "r": wl.r, "concurrency": c, "error": why}

    if not args.interleave:
        for cfg in order:
            started = start_server(cfg, base_flags, profile_path, out_dir, rnd, args, tokenizer, servers)
            for wl in runs_for(cfg, workloads, args):
                for c in args.conc_list:
                    if started is None:
                        record(cfg, wl, c, failed(cfg, wl, c, "server failed to start (see logs/)"))
                    else:
                        record(cfg, wl, c, run_one(started[0], cfg, wl, c, args, model_path, home, out_dir,
                                                   started[1]))
            if started is not None:
                stop_server(cfg, *started, servers)
        return
    live: dict[str, tuple] = {}
    try:
        for cfg in order:
            started = start_server(cfg, base_flags, profile_path, out_dir, rnd, args, tokenizer, servers)
            if started is not None:
                live[cfg] = started
        for wl in workloads:
            for c in args.conc_list:
                for cfg in order:
                    if wl not in runs_for(cfg, workloads, args):
                        continue
                    if cfg not in live:
                        record(cfg, wl, c, failed(cfg, wl, c, "server failed to start (see logs/)"))
                        continue
                    record(cfg, wl, c, run_one(live[cfg][0], cfg, wl, c, args, model_path, home, out_dir,
                                               live[cfg][1]))
    finally:
        for cfg, (server, sampler) in live.items():
            stop_server(cfg, server, sampler, servers)


def main(argv: Sequence[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    command = "python examples/bench_serving_sweep.py" + ("" if not argv else " " + shlex.join(argv))
    from transformers import AutoTokenizer

    from bicache_sgl.models.loader import load_model_config, resolve_model_path

    model_path = resolve_model_path(args.model_path)
    mc = load_model_config(model_path)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_dir = Path(args.out_dir or Path("bench_results") / stamp)
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    home = out_dir / "logs" / "client_home"
    home.mkdir(exist_ok=True)
    if args.fewshot_questions > 0 and Path(model_path).resolve() != Path(default_model_path()).resolve():
        print("note: the few-shot workload is the bundled model's task; with another model its accuracy is "
              "not meaningful", file=sys.stderr)
    workloads = build_workloads(args, tokenizer)
    profile_path, profile_note = ensure_profile(args, model_path, mc.n_layers, out_dir)
    profile_table = None
    if profile_path:
        prof_json = json.loads(Path(profile_path).read_text())
        # per generation mode where the profile has a table each (the runtime serves each request by its mode's)
        profile_table = prof_json.get("table_by_mode") or prof_json.get("table")
    digest0 = file_digest(model_path)
    base_flags = {"model_path": model_path, "num_threads": args.num_threads, "block_length": args.block_length,
                  "max_running_requests": max(args.conc_list), "random_seed": 0, **parse_server_args(args.server_args)}
    print(f"command: {command}\nmodel: {model_path} ({mc.n_layers} layers, weights {digest0})\n"
          f"bicache profile: {profile_note}: {profile_table}\nworkloads: "
          + "; ".join(f"{w.name} (r={w.r:.2f})" for w in workloads) + f"\nout: {out_dir}", flush=True)

    servers: dict[str, dict] = {}
    runs: dict[tuple, list] = {}  # (config, workload, concurrency) -> every run's row
    t_start = time.perf_counter()
    for rnd in range(args.repeat):
        # rotate the order each round so no configuration always runs first / last
        order = args.config_list[rnd % len(args.config_list):] + args.config_list[:rnd % len(args.config_list)]
        run_round(order, workloads, args, base_flags, profile_path, tokenizer, model_path, home, out_dir,
                  servers, runs, rnd)
    total_s = time.perf_counter() - t_start
    shutil.rmtree(home, ignore_errors=True)  # bench_serving's dataset cache
    results = []
    for cfg in args.config_list:
        for wl in runs_for(cfg, workloads, args):
            for c in args.conc_list:
                results.append(best_run(runs.get((cfg, wl.name, c), [])) or {
                    "config": cfg, "workload": wl.name, "kind": wl.kind, "r": wl.r, "concurrency": c,
                    "error": "not run"})
    total_s = time.perf_counter() - t_start
    digest1 = file_digest(model_path)

    add_speedups(results)
    targets = check_targets(results)
    table = format_table(results)
    title = (f"{Path(model_path).name} ({mc.n_layers} layers, weights {digest0}), N={args.seq_len}, "
             f"out {args.output_len}, block {args.block_length}, {args.gsp_groups}x{args.gsp_per_group} gsp "
             f"requests, threads {args.num_threads or 'server default'}")
    plot = None if args.no_plot else make_plot(results, out_dir / "sweep.png", title)
    setup = [
        f"- model: `{model_path}` ({mc.n_layers} layers, weights sha256 {digest0}"
        + ("" if digest1 == digest0 else f", CHANGED during the run to {digest1}: results are not comparable")
        + ")",
        f"- bicache profile: {profile_note}; table (r % -> depth): {profile_table}",
        f"- server flags (all configs): `{shlex.join(server_flags(base_flags))}` + the config's flags",
        "- workloads: " + "; ".join(
            (f"{w.name}: " + (f"system {w.params['system_prompt_len']} + question {w.params['question_len']} + "
                             f"gen {gen_region(w.params['output_len'], args.block_length)} = N "
                             f"{w.params['seq_len']}, {w.params['num_groups']}x{w.params['prompts_per_group']} "
                             "requests" if w.kind == "gsp" else
                             f"{w.params['num_questions']} questions, {w.params['num_shots']} shots, r {w.r:.2f}"))
            for w in workloads),
        (f"- vanilla ran the gsp workloads with r >= {args.vanilla_min_r:g} only (--vanilla-min-r; without "
         "caching its cost does not depend on r) and every few-shot workload"),
        f"- {'interleaved' if args.interleave else 'sequential'} servers, {args.repeat} round(s)"
        + (" (each cell: the fastest of its runs; all runs in results.json)" if args.repeat > 1 else ""),
        f"- git {git_rev()}, {os.cpu_count()} CPUs, total {total_s / 60:.1f} min",
    ]
    md = "\n".join([f"command: `{command}`", "", *setup, "", table, "",
                    ("x dual / x vanilla meas = output tok/s ratio; ideal = ratio of computed layer-tokens "
                     "(server counters); meas/ideal = x dual meas / x dual ideal. Few-shot latency columns are "
                     "n/a (bench_fewshot reports the batch latency only)."), "",
                    "Memory:", format_memory(results, servers), "",
                    f"Targets (r >= {TARGET_R}):", format_targets(targets), "",
                    f"plot: {plot or 'none'}"]) + "\n"
    (out_dir / "table.md").write_text(md)
    summary = {"command": command, "model_path": model_path, "weights": digest0, "weights_after": digest1,
               "profile": profile_path, "profile_note": profile_note, "profile_table": profile_table,
               "workloads": [w.__dict__ for w in workloads], "servers": servers, "results": results,
               "targets": targets, "plot": plot, "table": str(out_dir / "table.md"), "total_s": total_s}
    (out_dir / "results.json").write_text(json.dumps(summary, indent=1, default=str))
    print("\n" + md, flush=True)
    return summary


if __name__ == "__main__":
    main()
