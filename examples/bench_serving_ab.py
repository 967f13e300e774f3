"""Issue 13's headline: bicache vs prefix cache off, DEFAULT server flags, SGLang's own client.

Starts one server per configuration with ``python -m bicache_sgl.launch_server`` and the default
flags (only ``--prefix-cache`` differs; extra flags for both with --server-args), keeps both up,
and lets them take turns for --rounds rounds (order alternates each round) running

    python -m sglang.bench_serving --backend sglang --dataset-name generated-shared-prefix
      --gsp-num-groups 4 --gsp-prompts-per-group 8 --gsp-system-prompt-len 512
      --gsp-question-len 48 --gsp-output-len 32 --max-concurrency 8

against each (cache flushed before each run). Prints output tok/s per round, the per-round ratio,
the medians, and the ideal ratio from the servers' counted layer tokens (work skipped by the
prefix cache). Slow changes of background load hit both configurations alike.

    python examples/bench_serving_ab.py                   # 5 rounds, ~3 min on 2 cores
    python examples/bench_serving_ab.py --server-args "--num-threads 1"

``--workload fewshot`` runs the few-shot evaluation (``bicache_sgl.bench.fewshot``: an SGLang
frontend ``run_batch`` program, --questions held-out questions with --shots examples) instead of
bench_serving. ``--code OLD,NEW`` compares two source trees (checkouts, e.g. from ``git archive``):
one server per tree and configuration (``PYTHONPATH`` = the tree), all taking turns in every round,
so a slow change of the machine's load hits both trees alike; it then also prints NEW / OLD per
configuration, round by round.

    python examples/bench_serving_ab.py --code /tmp/old,$PWD                       # the headline, two trees
    python examples/bench_serving_ab.py --code /tmp/old,$PWD --workload fewshot --concurrency 16
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bicache_sgl.bench.serving_sweep import (
    Workload,
    bench_serving_cmd,
    client_env,
    counter_delta,
    default_model_path,
    fewshot_cmd,
    run_client,
)
from bicache_sgl.runtime import Runtime, parse_server_args


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None, help="checkpoint folder (default: the bundled model)")
    ap.add_argument("--configs", default="off,bicache", help="comma-separated --prefix-cache modes (first = baseline)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--per-group", type=int, default=8)
    ap.add_argument("--system-len", type=int, default=512)
    ap.add_argument("--question-len", type=int, default=48)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--workload", choices=["gsp", "fewshot"], default="gsp",
                    help="gsp: sglang.bench_serving generated-shared-prefix; fewshot: the few-shot evaluation")
    ap.add_argument("--shots", type=int, default=6, help="fewshot: examples per prefix")
    ap.add_argument("--questions", type=int, default=96, help="fewshot: questions")
    ap.add_argument("--code", default=None,
                    help="OLD,NEW: two source trees, each config served from each (PYTHONPATH), turns interleaved")
    ap.add_argument("--server-args", default="", help='extra server flags for every server, e.g. "--num-threads 1"')
    ap.add_argument("--out-dir", default=None, help="logs and results.json (default: a temp folder)")
    args = ap.parse_args(argv)
    from bicache_sgl.config import parse_prefix_cache_mode
    try:
        for c in args.configs.split(","):
            parse_prefix_cache_mode(c)
        parse_server_args(args.server_args)
    except ValueError as e:
        ap.error(str(e))
    if args.rounds < 1 or len(args.configs.split(",")) < 2:
        ap.error("need --rounds >= 1 and at least two --configs (the first is the baseline)")
    if args.code is not None:
        trees = args.code.split(",")
        if len(trees) != 2 or not all((Path(t) / "bicache_sgl").is_dir() for t in trees):
            ap.error("--code takes OLD,NEW: two source trees, each holding bicache_sgl/")
    return args


def run_workload(srv: Runtime, args, model: str, wl: Workload, out: Path, tag: str,
                 home: Path) -> tuple[float, list[str]]:
    """One timed client run against ``srv``: its output tokens per second, and the client command."""
    if wl.kind == "gsp":
        res_file = out / "logs" / f"{tag}.jsonl"
        cmd = bench_serving_cmd(srv.url, model, wl, args.concurrency, args.seed, res_file)
    else:
        res_file = out / "logs" / f"{tag}.result.jsonl"
        cmd = fewshot_cmd(srv.url, wl, args.concurrency, res_file, out / "logs" / f"{tag}.raw.jsonl")
    rc, _ = run_client(cmd, client_env(home), out / "logs" / f"client_{tag.rsplit('_r', 1)[0]}.log", 600)
    if rc != 0 or not res_file.exists():
        sys.exit(f"the client failed for {tag} (rc {rc}); see {out / 'logs'}")
    b = json.loads(res_file.read_text().splitlines()[-1])
    return (b["output_throughput"] if wl.kind == "gsp" else b["other"]["output_throughput"]), cmd


def main(argv=None) -> dict:
    args = parse_args(argv)
    model = args.model_path or default_model_path()
    out = Path(args.out_dir or tempfile.mkdtemp(prefix="bench-ab-"))
    (out / "logs").mkdir(parents=True, exist_ok=True)
    home = out / "home"
    home.mkdir(exist_ok=True)
    configs = args.configs.split(",")
    extra = parse_server_args(args.server_args)
    if args.workload == "gsp":
        wl = Workload("gsp", "gsp", 0.0, {"num_groups": args.groups, "prompts_per_group": args.per_group,
                                          "system_prompt_len": args.system_len, "question_len": args.question_len,
                                          "output_len": args.output_len})
    else:
        wl = Workload("fewshot", "fewshot", 0.0, {"num_questions": args.questions, "num_shots": args.shots})
    trees = args.code.split(",") if args.code else [None]
    sides = ["old", "new"] if args.code else [None]
    keys = [(i, c) for i in range(len(trees)) for c in configs]  # one server each

    def label(key) -> str:
        i, c = key
        return c if sides[i] is None else f"{sides[i]}:{c}"

    servers = {}
    try:
        for key in keys:
            t, c = trees[key[0]], key[1]
            env = {"PYTHONPATH": str(Path(t).resolve())} if t else None
            name = label(key).replace(":", "_")
            servers[key] = Runtime(model, prefix_cache=c, log_path=str(out / "logs" / f"server_{name}.log"), env=env,
                                   **extra)
            print(f"server {label(key)}: {shlex.join(servers[key].cmd)}" + (f"  (PYTHONPATH={t})" if t else ""),
                  flush=True)
        rows = []
        for rnd in range(args.rounds):
            order = keys if rnd % 2 == 0 else keys[::-1]
            for key in order:
                srv = servers[key]
                srv.flush_cache(timeout=30)
                before = srv.internal_state()
                tps, cmd = run_workload(srv, args, model, wl, out, f"{label(key).replace(':', '_')}_r{rnd}", home)
                d = counter_delta(before, srv.internal_state())
                rows.append({"round": rnd, "side": sides[key[0]], "tree": trees[key[0]], "config": key[1],
                             "out_tok_s": tps, **d})
                print(f"round {rnd} {label(key):>12}: {tps:7.1f} out tok/s  "
                      f"computed layer-tokens {d.get('computed_layer_tokens')}", flush=True)
                time.sleep(0.5)
    finally:
        for s in servers.values():
            s.shutdown()
    base = configs[0]
    print(f"\ncommand (per server): {shlex.join(cmd)}\nserver flags: defaults"
          + (f" + {args.server_args}" if args.server_args else ""))
    summary: dict = {}
    for i, t in enumerate(trees):
        if t is not None:
            print(f"\n{sides[i]} = {t}")
        print("\n| config | out tok/s per round | median | ratio to " + base + " per round | median ratio | ideal |")
        print("|---|---|---|---|---|---|")
        mine = [r for r in rows if r["side"] == sides[i]]
        for c in configs:
            tps = [r["out_tok_s"] for r in mine if r["config"] == c]
            btps = [r["out_tok_s"] for r in mine if r["config"] == base]
            ratios = [a / b for a, b in zip(tps, btps)]
            comp = sum(r.get("computed_layer_tokens", 0) for r in mine if r["config"] == c)
            bcomp = sum(r.get("computed_layer_tokens", 0) for r in mine if r["config"] == base)
            ideal = bcomp / comp if comp else float("nan")
            summary[label((i, c))] = {"median_tok_s": statistics.median(tps), "median_ratio": statistics.median(ratios),
                                      "ratios": ratios, "ideal": ideal}
            print(f"| {c} | {', '.join(f'{x:.0f}' for x in tps)} | {statistics.median(tps):.0f} | "
                  f"{', '.join(f'{x:.2f}' for x in ratios)} | {statistics.median(ratios):.2f}x | {ideal:.2f}x |")
    if args.code:
        print("\n| config | new / old out tok/s per round | median |")
        print("|---|---|---|")
        for c in configs:
            old = [r["out_tok_s"] for r in rows if r["side"] == "old" and r["config"] == c]
            new = [r["out_tok_s"] for r in rows if r["side"] == "new" and r["config"] == c]
            q = [b / a for a, b in zip(old, new)]
            summary[f"new/old:{c}"] = statistics.median(q)
            print(f"| {c} | {', '.join(f'{x:.2f}' for x in q)} | {statistics.median(q):.2f}x |")
    (out / "results.json").write_text(json.dumps({"rows": rows, "summary": summary, "argv": sys.argv[1:]}, indent=1))
    print(f"\nresults: {out / 'results.json'}")
    return summary


if __name__ == "__main__":
    main()
