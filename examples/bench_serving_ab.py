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
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    model = args.model_path or default_model_path()
    out = Path(args.out_dir or tempfile.mkdtemp(prefix="bench-ab-"))
    (out / "logs").mkdir(parents=True, exist_ok=True)
    home = out / "home"
    home.mkdir(exist_ok=True)
    configs = args.configs.split(",")
    extra = parse_server_args(args.server_args)
    wl = Workload("gsp", "gsp", 0.0, {"num_groups": args.groups, "prompts_per_group": args.per_group,
                                      "system_prompt_len": args.system_len, "question_len": args.question_len,
                                      "output_len": args.output_len})
    servers = {}
    try:
        for c in configs:
            servers[c] = Runtime(model, prefix_cache=c, log_path=str(out / "logs" / f"server_{c}.log"), **extra)
            print(f"server {c}: {shlex.join(servers[c].cmd)}", flush=True)
        rows = []
        for rnd in range(args.rounds):
            order = configs if rnd % 2 == 0 else configs[::-1]
            for c in order:
                srv = servers[c]
                srv.flush_cache(timeout=30)
                before = srv.internal_state()
                res_file = out / "logs" / f"{c}_r{rnd}.jsonl"
                cmd = bench_serving_cmd(srv.url, model, wl, args.concurrency, args.seed, res_file)
                rc, _ = run_client(cmd, client_env(home), out / "logs" / f"client_{c}.log", 600)
                if rc != 0 or not res_file.exists():
                    sys.exit(f"bench_serving failed for {c} (rc {rc}); see {out / 'logs'}")
                b = json.loads(res_file.read_text().splitlines()[-1])
                d = counter_delta(before, srv.internal_state())
                rows.append({"round": rnd, "config": c, "out_tok_s": b["output_throughput"],
                             "completed": b["completed"], **d})
                print(f"round {rnd} {c:>8}: {b['output_throughput']:7.1f} out tok/s  "
                      f"computed layer-tokens {d.get('computed_layer_tokens')}", flush=True)
                time.sleep(0.5)
    finally:
        for s in servers.values():
            s.shutdown()
    base = configs[0]
    print(f"\ncommand (per server): {shlex.join(cmd)}\nserver flags: defaults"
          + (f" + {args.server_args}" if args.server_args else ""))
    print("\n| config | out tok/s per round | median | ratio to " + base + " per round | median ratio | ideal |")
    print("|---|---|---|---|---|---|")
    summary = {}
    for c in configs:
        tps = [r["out_tok_s"] for r in rows if r["config"] == c]
        btps = [r["out_tok_s"] for r in rows if r["config"] == base]
        ratios = [a / b for a, b in zip(tps, btps)]
        comp = sum(r.get("computed_layer_tokens", 0) for r in rows if r["config"] == c)
        bcomp = sum(r.get("computed_layer_tokens", 0) for r in rows if r["config"] == base)
        ideal = bcomp / comp if comp else float("nan")
        summary[c] = {"median_tok_s": statistics.median(tps), "median_ratio": statistics.median(ratios),
                      "ratios": ratios, "ideal": ideal}
        print(f"| {c} | {', '.join(f'{x:.0f}' for x in tps)} | {statistics.median(tps):.0f} | "
              f"{', '.join(f'{x:.2f}' for x in ratios)} | {statistics.median(ratios):.2f}x | {ideal:.2f}x |")
    (out / "results.json").write_text(json.dumps({"rows": rows, "summary": summary, "argv": sys.argv[1:]}, indent=1))
    print(f"\nresults: {out / 'results.json'}")
    return summary


if __name__ == "__main__":
    main()
