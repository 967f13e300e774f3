"""What bicache costs when nothing can be reused: ``--prefix-cache bicache`` against ``off`` on a
workload where every request is a distinct prompt (issue 38, item 3: within 2% of off).

Workload: the bundled model's few-shot task (held-out families, one question per family), each
prompt behind a distinct random head (``--head-len`` digits and a space), so no two prompts share
more than a few leading tokens and no request can reuse anything (checked: the report shows
bicache's skipped layer-tokens, which must be 0, and the ideal, off's computed layer-tokens over
bicache's, which must be 1.00x). Every round sends new prompts, the same ones to both modes, so
later rounds cannot reuse earlier ones either. bicache still stores what a later repeat of each
prompt could reuse (the planner's store ranges: with the default 128 new tokens the prompt is
about half the sequence and the shipped profile stores nothing; with ``--max-new-tokens 8`` it is
about 80% and every prompt is stored at full depth), inserts it into the radix tree, and evicts
once the pool is full.

Both modes stay up side by side and take turns, round by round (the order alternates), so slow
changes in the machine's load hit both alike. Reported: the median over rounds of bicache's time /
off's (wall time, and the process's CPU time, which other jobs on the machine disturb less), with
the ideal 1.00x. ``--phases`` also times the host-side phases of every step (offline only).

    python examples/bench_no_reuse.py                          # offline engines, batches of 16
    python examples/bench_no_reuse.py --max-new-tokens 8       # short answers: every prompt stored
    python examples/bench_no_reuse.py --ignore-eos --rounds 5  # forced 128-token answers
    python examples/bench_no_reuse.py --batch 1                # one request at a time
    python examples/bench_no_reuse.py --phases                 # + ms per request per phase
    python examples/bench_no_reuse.py --server --concurrency 1,16   # through the HTTP server
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

MODES = ("off", "bicache")
TARGET = 1.02  # issue 38: with nothing reusable, bicache within 2% of off


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None, help="default: the bundled default model")
    ap.add_argument("--requests", type=int, default=64, help="requests per round")
    ap.add_argument("--rounds", type=int, default=8, help="timed rounds per mode (after one warm-up round)")
    ap.add_argument("--batch", type=int, default=16, help="offline: requests per run_sync call")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default: the server's (128)")
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--shots", type=int, default=5, help="few-shot examples per prompt")
    ap.add_argument("--head-len", type=int, default=6, help="digits of each prompt's distinct head (0: none)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--phases", action="store_true", help="offline: time the host-side phases of every step")
    ap.add_argument("--server", action="store_true", help="through the HTTP server (Runtime) instead of Engine")
    ap.add_argument("--concurrency", default="1,16", help="server: client concurrencies")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def make_prompts(n: int, seed: int, shots: int, head_len: int, used: set[str]) -> list[str]:
    """``n`` prompts of the bundled task, each behind a head no earlier prompt (``used``) had."""
    from bicache_sgl.training import task as T

    items = T.heldout_items(n, num_shots=shots, seed=seed, questions_per_family=1)
    rng = random.Random(f"no-reuse|{seed}")
    out = []
    for it in items:
        head = ""
        while head_len and (not head or head in used):
            head = "".join(rng.choice("0123456789") for _ in range(head_len)) + " "
        used.add(head)
        out.append(head + it["prompt"])
    return out


def sampling(args) -> dict:
    sp: dict = {}
    if args.max_new_tokens is not None:
        sp["max_new_tokens"] = args.max_new_tokens
    if args.ignore_eos:
        sp["ignore_eos"] = True
    return sp


# ---------------------------------------------------------------------------------------- phases
class PhaseTimer:
    """CPU time of this thread (``time.thread_time``) spent in named engine methods, by wrapping
    them on one engine instance. Nested phases are counted in both (forward contains build)."""

    def __init__(self) -> None:
        self.t: dict[str, float] = defaultdict(float)
        self.on = False

    def wrap(self, obj, name: str, label: str) -> None:
        fn = getattr(obj, name)
        t = self.t

        def timed(*a, **kw):
            if not self.on:
                return fn(*a, **kw)
            c = time.thread_time()
            try:
                return fn(*a, **kw)
            finally:
                t[label] += time.thread_time() - c
        setattr(obj, name, timed)

    def attach(self, eng) -> None:
        from bicache_sgl.models import forward_batch as fbm

        sch = eng.scheduler
        self.wrap(eng, "step", "step (all)")
        self.wrap(sch, "schedule", "schedule (admit + plan)")
        self.wrap(sch.cache, "admit", "  cache admit (match, plan, reserve)")
        self.wrap(sch.cache, "share", "  cache share")
        self.wrap(sch.audit, "admit", "  audit admit")
        self.wrap(eng.runner, "forward", "forward (all)")
        self.wrap(eng.runner.model, "forward_batch", "  model forward_batch")
        self.wrap(sch, "postprocess", "postprocess (commit + decide)")
        self.wrap(sch.cache, "commit", "  cache commit (bind, insert)")
        self.wrap(sch.cache, "release", "cache release")
        build = fbm.ForwardBatch.build
        t = self.t

        def timed_build(fb, n_layers):
            if not self.on:
                return build(fb, n_layers)
            c = time.thread_time()
            try:
                return build(fb, n_layers)
            finally:
                t["  ForwardBatch.build (incl. captures)"] += time.thread_time() - c
        fbm.ForwardBatch.build = timed_build  # class-wide: only the timed engine runs while on


# ---------------------------------------------------------------------------------------- offline
def offline(args) -> None:
    import torch

    from bicache_sgl import Engine
    from bicache_sgl.config import SamplingParams
    from bicache_sgl.io_struct import GenerateRequest

    torch.set_num_threads(args.threads)
    kw = {"num_threads": args.threads, "device": "cpu"}
    if args.model_path:
        kw["model_path"] = args.model_path
    engines = {m: Engine(prefix_cache=m, **kw) for m in MODES}
    sp = SamplingParams.from_dict(sampling(args))
    timers = {m: PhaseTimer() for m in MODES}
    if args.phases:
        for m in MODES:
            timers[m].attach(engines[m])
    used: set[str] = set()

    def run(m: str, prompts: list[str]) -> tuple[float, float]:
        eng = engines[m]
        greqs = [GenerateRequest(eng.encode(p), sp) for p in prompts]
        timers[m].on = True
        t, c = time.perf_counter(), time.process_time()
        for i in range(0, len(greqs), args.batch):
            eng.run_sync(greqs[i:i + args.batch])
        dt, dc = time.perf_counter() - t, time.process_time() - c
        timers[m].on = False
        return dt, dc

    try:
        warm = make_prompts(args.requests, args.seed * 1000, args.shots, args.head_len, used)
        for m in MODES:
            run(m, warm)
        for m in MODES:
            timers[m].t.clear()
        base = {m: dict(engines[m].get_stats()) for m in MODES}
        times: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
        for r in range(args.rounds):
            prompts = make_prompts(args.requests, args.seed * 1000 + r + 1, args.shots, args.head_len, used)
            for m in (MODES if r % 2 == 0 else MODES[::-1]):
                times[m].append(run(m, prompts))
        stats = {m: engines[m].get_stats() for m in MODES}
    finally:
        for e in engines.values():
            e.shutdown()
    n_req = args.requests * args.rounds

    def delta(m: str, key: str) -> int:
        return int(stats[m].get(key, 0)) - int(base[m].get(key, 0))

    print(f"command: python examples/bench_no_reuse.py {' '.join(sys.argv[1:])}")
    print(f"offline Engine, {args.requests} distinct prompts per round in batches of {args.batch}, "
          f"{args.rounds} interleaved rounds, {args.threads} thread(s), sampling {sampling(args) or 'defaults'}")
    report(times, {m: (delta(m, "computed_layer_tokens"), delta(m, "skipped_layer_tokens"),
                       delta(m, "prefix_cache_stored_layer_tokens") if m == "bicache" else 0,
                       delta(m, "num_forward_passes")) for m in MODES})
    if args.phases:
        print("\nHost CPU time per request (ms, this thread), summed over the timed rounds; nested phases "
              "are indented (their parent includes them)\n")
        print("| phase | off | bicache | bicache - off |")
        print("|---|---|---|---|")
        labels = list(dict.fromkeys([*timers["bicache"].t, *timers["off"].t]))
        for lb in labels:
            a, b = (timers[m].t.get(lb, 0.0) * 1e3 / n_req for m in MODES)
            print(f"| {lb} | {a:.3f} | {b:.3f} | {b - a:+.3f} |")


def report(times: dict[str, list[tuple[float, float]]], work: dict[str, tuple[int, int, int, int]]) -> None:
    """Per-round times, the median ratios and the ideal."""
    wall = [b[0] / o[0] for o, b in zip(times["off"], times["bicache"])]
    cpu = [b[1] / o[1] for o, b in zip(times["off"], times["bicache"])]
    print("\n| mode | wall s per round (median) | CPU s per round (median) | computed layer-tokens | "
          "skipped layer-tokens | stored layer-tokens | forwards |")
    print("|---|---|---|---|---|---|---|")
    for m in MODES:
        comp, skip, stored, fwd = work[m]
        print(f"| {m} | {statistics.median(t for t, _ in times[m]):.3f} | "
              f"{statistics.median(c for _, c in times[m]):.3f} | {comp} | {skip} | {stored} | {fwd} |")
    ideal = work["off"][0] / work["bicache"][0] if work["bicache"][0] else float("nan")
    med_w, med_c = statistics.median(wall), statistics.median(cpu)
    print(f"\nbicache / off, per round: wall {', '.join(f'{x:.3f}' for x in wall)}")
    print(f"                          CPU  {', '.join(f'{x:.3f}' for x in cpu)}")
    print(f"median time ratio bicache / off: wall {med_w:.3f}x, CPU {med_c:.3f}x; ideal 1.00x "
          f"(off's computed layer-tokens / bicache's: {ideal:.2f}x, nothing saved); target <= {TARGET:.2f}x: "
          f"{'met' if med_w <= TARGET else 'NOT met'} (wall)")


# ---------------------------------------------------------------------------------------- server
def server(args) -> None:
    from bicache_sgl.runtime import Runtime

    conc = [int(c) for c in args.concurrency.split(",")]
    flags = {"num_threads": args.threads, "max_running_requests": max(conc), "random_seed": 0}
    if args.model_path:
        flags["model_path"] = args.model_path
    sp = sampling(args)
    used: set[str] = set()
    rts = {}
    try:
        for m in MODES:
            rts[m] = Runtime(prefix_cache=m, **flags)

        def counters(m: str) -> dict:
            return rts[m].internal_state()

        def run(m: str, prompts: list[str], c: int) -> float:
            rt = rts[m]
            t = time.perf_counter()
            with ThreadPoolExecutor(c) as ex:
                list(ex.map(lambda p: rt.generate(p, dict(sp), timeout=600), prompts))
            return time.perf_counter() - t

        print(f"command: python examples/bench_no_reuse.py {' '.join(sys.argv[1:])}")
        warm = make_prompts(args.requests, args.seed * 1000, args.shots, args.head_len, used)
        for m in MODES:
            run(m, warm, max(conc))
        for c in conc:
            base = {m: counters(m) for m in MODES}
            times: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
            for r in range(args.rounds):
                prompts = make_prompts(args.requests, args.seed * 1000 + 100 * c + r + 1, args.shots,
                                       args.head_len, used)
                for m in (MODES if r % 2 == 0 else MODES[::-1]):
                    times[m].append((run(m, prompts, c), float("nan")))
            end = {m: counters(m) for m in MODES}

            def delta(m: str, key: str, end=end, base=base) -> int:
                return int(end[m].get(key, 0)) - int(base[m].get(key, 0))

            print(f"\nserver (Runtime, default flags + {flags}), concurrency {c}, {args.requests} distinct prompts "
                  f"per round, {args.rounds} interleaved rounds, sampling {sp or 'defaults'} (CPU: n/a)")
            report(times, {m: (delta(m, "computed_layer_tokens"), delta(m, "skipped_layer_tokens"),
                               delta(m, "prefix_cache_stored_layer_tokens") if m == "bicache" else 0,
                               delta(m, "num_forward_passes")) for m in MODES})
    finally:
        for rt in rts.values():
            rt.shutdown()


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.rounds < 1 or args.requests < 1:
        raise SystemExit("--rounds and --requests must be >= 1")
    (server if args.server else offline)(args)


if __name__ == "__main__":
    main()
