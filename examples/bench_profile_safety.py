"""Speed against agreement with cache off, per bicache profile and tolerance (issue 34).

The workload is the differential test's (tests/test_profile_safety.py,
``bicache_sgl.training.calib_shapes.compositions``): per seed, 6 groups of 2-4 requests sharing an
optional system line and a few-shot block, sometimes a second family's block, 8 new tokens or 32
with ``ignore_eos``, sent in batches of 4 so later requests reuse earlier captures. Each profile
runs on a fresh engine; cache off runs once. Reported per row: answers equal to cache off (and the
95% upper bound on the rate of changed answers), those that stop at EOS / run past it, prefix
matched, reused at depth > 0, mean depth, and requests/s relative to cache off (same requests,
same batches, best of --repeat). A profile with a table per generation mode is shown per mode;
"of them stop at EOS": reused requests among those that stop at EOS.

    python examples/bench_profile_safety.py                      # shipped profile at 0, 0.02, 0.05
    python examples/bench_profile_safety.py --model-path bicache_sgl/assets/context_model --kind group
    python examples/bench_profile_safety.py --profile old=old_profile.json --tolerances 0,0.2
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from bicache_sgl import Engine
from bicache_sgl.bicache.profile import flip_bound
from bicache_sgl.config import SamplingParams
from bicache_sgl.io_struct import GenerateRequest
from bicache_sgl.training import task as T
from bicache_sgl.training.calib_shapes import compositions


def run(eng: Engine, reqs: list[tuple[str, dict]], batch: int) -> list:
    events = []
    for i in range(0, len(reqs), batch):
        greqs = [GenerateRequest(eng.encode(p), SamplingParams.from_dict(sp)) for p, sp in reqs[i:i + batch]]
        events += eng.run_sync(greqs)
    return events


def describe(profile, ekw: dict) -> str:
    """The table column: the profile's table, or per generation mode where it has one each."""
    if ekw.get("prefix_cache") == "naive":
        return "every layer"
    if profile is None:
        return "-"
    def one(t):
        return ", ".join(f"{r:g}:{b}" for r, b in t if r > 0)
    if not profile.by_mode:
        return one(profile.table)
    return "; ".join(f"{m}: {one(t)}" for m, t in profile.by_mode)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default=None, help="default: the bundled default model")
    ap.add_argument("--kind", choices=T.KINDS, default=T.DEFAULT_KIND, help="family kind of the workload")
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=1, help="runs per row; the best time is reported")
    ap.add_argument("--tolerances", default="0,0.02,0.05", help="--bicache-tolerance values for the profile")
    ap.add_argument("--profile", action="append", default=[],
                    help="LABEL=FILE: also run this profile (at tolerance 0); repeatable")
    ap.add_argument("--naive", action="store_true", help="also run the naive prefix cache (every layer)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    reqs = [r for s in range(args.seeds) for r in compositions(s, kind=args.kind)]
    kw = {"device": "cpu", "num_threads": args.threads}
    if args.model_path:
        kw["model_path"] = args.model_path
    # a fresh engine per run, stepped on this thread (run_sync): every run starts with a cold cache
    def measure(**ekw):
        best, events = float("inf"), []
        for _ in range(args.repeat):
            eng = Engine(**kw, **ekw)
            try:
                t0 = time.perf_counter()
                events = run(eng, reqs, args.batch)
                best = min(best, time.perf_counter() - t0)
                table = eng.profile
            finally:
                eng.shutdown()
        return events, best, table

    off, t_off, _ = measure(prefix_cache="off")
    rows = [(f"shipped, tolerance {float(t):g}", {"bicache_tolerance": float(t)}) for t in args.tolerances.split(",")]
    rows += [(f"{lbl}", {"bicache_profile": path}) for lbl, path in (p.split("=", 1) for p in args.profile)]
    if args.naive:
        rows.append(("naive (every layer)", {"prefix_cache": "naive"}))
    print(f"command: python examples/bench_profile_safety.py {' '.join(sys.argv[1:])}")
    print(f"{len(reqs)} requests ({sum(1 for _, sp in reqs if sp.get('ignore_eos'))} with ignore_eos), "
          f"batches of {args.batch}, {args.threads} thread(s); cache off: {len(reqs) / t_off:.1f} req/s\n")
    print("| profile | table (r% -> depth) | equal to off | 95% bound on changed | stop at EOS differ | past EOS "
          "differ | prefix matched | reused (depth > 0) | of them stop at EOS | mean depth | req/s | vs off |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for label, ekw in rows:
        ev, t, table = measure(**ekw)
        n = len(reqs)
        diff = [i for i, (a, b) in enumerate(zip(off, ev)) if list(a.output_ids) != list(b.output_ids)]
        long_d = sum(1 for i in diff if reqs[i][1].get("ignore_eos"))
        matched = sum(e.meta_info["cached_tokens"] > 0 for e in ev)
        reused = sum(e.meta_info["bicache_depth"] > 0 for e in ev)
        n_stop = sum(1 for _, sp in reqs if not sp.get("ignore_eos"))
        reused_stop = sum(e.meta_info["bicache_depth"] > 0 for e, (_, sp) in zip(ev, reqs) if not sp.get("ignore_eos"))
        depth = sum(e.meta_info["bicache_depth"] for e in ev) / n
        print(f"| {label} | {describe(table, ekw)} | {n - len(diff)}/{n} | {flip_bound(len(diff), n):.3f} | "
              f"{len(diff) - long_d} | {long_d} | {matched}/{n} | {reused}/{n} | {reused_stop}/{n_stop} | "
              f"{depth:.2f} | {n / t:.1f} | {t_off / t:.2f}x |")


if __name__ == "__main__":
    main()
