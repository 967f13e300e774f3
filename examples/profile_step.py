"""Where the engine's time goes: the serving workloads run through the offline Engine on this
thread (``Engine.run_sync``: no HTTP, no client, no engine thread), timed per prefix-cache mode,
with the top operators of torch.profiler for the last run of each mode.

Workloads (the ones of issue 13's headline and of the serving sweep):
  gsp      --groups x --per-group random-token requests, a --system-len shared prefix per group,
           --question-len own tokens, --output-len new tokens (ignore_eos); all submitted at once,
           at most --max-running at a time (bench_serving's --max-concurrency)
  fewshot  --questions held-out questions of the bundled model's few-shot task, --shots examples

    python examples/profile_step.py                          # gsp, off vs bicache, 4 timed runs each
    python examples/profile_step.py --workload fewshot --max-running 16
    python examples/profile_step.py --ops 0                  # timings only
    python examples/profile_step.py --max-running 1          # the per-forward floor (one request a step)

Per forward it also prints the median step time (schedule + forward + postprocess) and the model
forward alone (``ModelRunner.forward``), over all steps and over the steps computing at most
--step-rows rows (the block steps), with the step's CPU time on this thread (less sensitive to
other load on the machine than the wall time), and the aten operators per forward counted by torch.profiler
(top-level: called from Python, not from inside another aten op; all: every aten op). Operator
counts do not depend on the machine's load, the times do.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None, help="checkpoint folder (default: the bundled model)")
    ap.add_argument("--workload", choices=("gsp", "fewshot"), default="gsp")
    ap.add_argument("--modes", default="off,bicache", help="comma-separated --prefix-cache modes")
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--per-group", type=int, default=8)
    ap.add_argument("--system-len", type=int, default=512)
    ap.add_argument("--question-len", type=int, default=48)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--questions", type=int, default=96, help="fewshot: questions")
    ap.add_argument("--shots", type=int, default=8, help="fewshot: examples per prefix")
    ap.add_argument("--max-running", type=int, default=8, help="--max-running-requests of the engine")
    ap.add_argument("--runs", type=int, default=4, help="timed runs per mode (after one warm-up run)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the server's engine default on 2 CPUs)")
    ap.add_argument("--ops", type=int, default=12, help="operators to list from torch.profiler (0: no profile)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--step-rows", type=int, default=32, help="steps computing at most this many rows are "
                    "reported on their own (the block steps; default: the block length)")
    args = ap.parse_args(argv)
    from bicache_sgl.config import parse_prefix_cache_mode
    try:
        for m in args.modes.split(","):
            parse_prefix_cache_mode(m)
    except ValueError as e:
        ap.error(str(e))
    if args.runs < 1:
        ap.error("--runs must be >= 1")
    return args


def build_prompts(args, tokenizer) -> list[list[int]]:
    rng = random.Random(args.seed)
    if args.workload == "fewshot":
        from bicache_sgl.training import task
        items = task.heldout_items(args.questions, num_shots=args.shots, seed=args.seed, questions_per_family=6)
        prompts = [list(tokenizer.encode(it["prompt"])) for it in items]
    else:
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        vocab = sorted(set(tokenizer.get_vocab().values()) - special)
        systems = [[rng.choice(vocab) for _ in range(args.system_len)] for _ in range(args.groups)]
        prompts = [s + [rng.choice(vocab) for _ in range(args.question_len)]
                   for s in systems for _ in range(args.per_group)]
    rng.shuffle(prompts)
    return prompts


def run(eng, prompts: list[list[int]], sp) -> float:
    """One timed pass of the workload from an empty prefix cache."""
    from bicache_sgl.io_struct import GenerateRequest

    eng.cache.flush()
    greqs = [GenerateRequest(p, sp) for p in prompts]
    t = time.perf_counter()
    eng.run_sync(greqs)
    return time.perf_counter() - t


class StepTimer:
    """Times every engine step and the model forward inside it, with the rows it computed."""

    def __init__(self, eng) -> None:
        self.records: list[tuple[int, float, float, float]] = []  # (rows, step s, forward s, step CPU s)
        self._cur: dict = {}
        forward, step = eng.runner.forward, eng.step

        def timed_forward(works):
            t = time.perf_counter()
            out = forward(works)
            self._cur["forward"] = time.perf_counter() - t
            self._cur["rows"] = sum(len(w.positions) for w in works)
            return out

        def timed_step():
            self._cur.clear()
            t, c = time.perf_counter(), time.thread_time()
            ran = step()
            dt, dc = time.perf_counter() - t, time.thread_time() - c
            if "rows" in self._cur:
                self.records.append((self._cur["rows"], dt, self._cur["forward"], dc))
            return ran
        eng.runner.forward, eng.step = timed_forward, timed_step

    def summary(self, max_rows: int) -> dict:
        def med(xs):
            return statistics.median(xs) * 1e3 if xs else float("nan")
        small = [r for r in self.records if r[0] <= max_rows]
        return {"step_ms": med([r[1] for r in self.records]), "forward_ms": med([r[2] for r in self.records]),
                "small_n": len(small), "small_step_ms": med([r[1] for r in small]),
                "small_forward_ms": med([r[2] for r in small]), "small_cpu_ms": med([r[3] for r in small])}


def count_ops(prof) -> tuple[int, int]:
    """(top-level aten ops, all aten ops) recorded by ``prof``."""
    top = every = 0
    for e in prof.events():
        if not e.name.startswith("aten::"):
            continue
        every += 1
        p = e.cpu_parent
        while p is not None and not p.name.startswith("aten::"):
            p = p.cpu_parent
        top += p is None
    return top, every


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch

    from bicache_sgl import Engine
    from bicache_sgl.config import SamplingParams

    torch.set_num_threads(args.threads)
    gsp = args.workload == "gsp"
    sp = SamplingParams(max_new_tokens=args.output_len if gsp else 32, temperature=0, ignore_eos=gsp)
    results = {}
    for mode in args.modes.split(","):
        eng = Engine(args.model_path, prefix_cache=mode, max_running_requests=args.max_running,
                     num_threads=args.threads)
        try:
            prompts = build_prompts(args, eng.tokenizer)

            run(eng, prompts, sp)  # warm-up
            timer = StepTimer(eng)
            base = dict(eng.get_stats())
            times = [run(eng, prompts, sp) for _ in range(args.runs)]
            st = eng.get_stats()
            n = max(1, args.runs)
            res = {"times": times, "best": min(times), "median": statistics.median(times),
                   "forwards": (st["num_forward_passes"] - base["num_forward_passes"]) // n,
                   "computed": (st["computed_layer_tokens"] - base["computed_layer_tokens"]) // n,
                   **timer.summary(args.step_rows)}
            if args.ops > 0:
                from torch.profiler import ProfilerActivity, profile
                f0 = eng.get_stats()["num_forward_passes"]
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    run(eng, prompts, sp)
                fwd = max(1, eng.get_stats()["num_forward_passes"] - f0)
                top, every = count_ops(prof)
                res["ops_top"], res["ops_all"] = top / fwd, every / fwd
                res["ops"] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.ops)
            results[mode] = res
        finally:
            eng.shutdown()
    ref = results[args.modes.split(",")[0]]
    print(f"workload: {args.workload}, {len(prompts)} requests, max running {args.max_running}, "
          f"torch threads {args.threads}, best and median of {args.runs} runs")
    print("\n| mode | best (s) | median (s) | speedup (best) | forwards | computed layer-tokens | ideal |")
    print("|---|---|---|---|---|---|---|")
    for mode, r in results.items():
        print(f"| {mode} | {r['best']:.3f} | {r['median']:.3f} | {ref['best'] / r['best']:.2f}x | {r['forwards']} "
              f"| {r['computed']} | {ref['computed'] / r['computed']:.2f}x |")
    print(f"\nPer forward (median ms; small: the steps computing <= {args.step_rows} rows; aten ops per forward "
          "from the profiled run)\n")
    print("| mode | step | forward | small steps | small: step | small: forward | small: step CPU "
          "| aten ops (top-level) | aten ops (all) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for mode, r in results.items():
        ops = f"{r['ops_top']:.0f} | {r['ops_all']:.0f}" if "ops_top" in r else "n/a | n/a"
        print(f"| {mode} | {r['step_ms']:.2f} | {r['forward_ms']:.2f} | {r['small_n'] // args.runs} "
              f"| {r['small_step_ms']:.2f} | {r['small_forward_ms']:.2f} | {r['small_cpu_ms']:.2f} | {ops} |")
    for mode, r in results.items():
        if "ops" in r:
            print(f"\n### {mode}: top operators by self CPU time (one run)\n{r['ops']}")
    return results


if __name__ == "__main__":
    main()
