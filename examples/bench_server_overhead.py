"""The per-request server cost: one request at a time through the HTTP server against the same
requests through ``Engine.run_sync`` in this process (docs/performance.md, "the per-request
server cost").

Workload: ``--items`` held-out few-shot questions (bicache_sgl.training.task, 8 shots), each
generating ``--max-new-tokens`` greedily, sent one after another (concurrency 1). Per mode and
round it prints three medians:

- ``server``: wall time of ``Runtime.generate`` (HTTP POST /generate on a new connection, the
  server's parse + tokenization, the ZMQ hop to the engine process, the engine, the hop back,
  the JSON answer);
- ``alone``: wall time of ``Engine.run_sync`` on the same items (tokenization included);
- ``paired``: per request, the server wall time minus the engine's own ``meta_info.e2e_latency``
  (measured inside the engine process from when it built the request to its final event), so the
  model's share cancels out request by request and the figure is what the server adds around the
  engine; far less noisy on a loaded machine than ``server - alone``.

Servers and engines are started once per mode and kept up; rounds alternate between them, so a
slow stretch of a shared machine hits every mode alike.

``--code PATH,PATH`` compares source trees instead (A/B of two checkouts of this project, e.g.
one made with ``git worktree add /tmp/base OLD``; each PATH is a PYTHONPATH whose last folder is
a tree, so ``/opt/extra:/tmp/base`` adds packages to one side): one server per tree and mode,
started from an empty folder with that PYTHONPATH (so ``python -m`` cannot pick up the current
folder), the same request sent to each in turn (A B, then B A), and per tree the medians above
plus the median per-request ratio of its paired overhead to the first tree's.

    python examples/bench_server_overhead.py                       # off and bicache, 3 rounds
    python examples/bench_server_overhead.py --modes off --rounds 5 --items 32
    python examples/bench_server_overhead.py --modes off --no-alone --code /tmp/base,$PWD
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import time


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="off,bicache", help="comma-separated --prefix-cache modes")
    ap.add_argument("--items", type=int, default=48, help="requests per round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per mode, alternating modes")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--server-args", default="", help="extra launch_server flags, e.g. '--num-threads 1'")
    ap.add_argument("--no-alone", action="store_true", help="skip Engine.run_sync (only the paired figure)")
    ap.add_argument("--code", default="", help="comma-separated source trees to compare, request by request")
    args = ap.parse_args(argv)
    if args.code:
        compare_code(args, [c for c in args.code.split(",") if c])
        return

    from bicache_sgl import Engine, SamplingParams
    from bicache_sgl.io_struct import GenerateRequest
    from bicache_sgl.runtime import Runtime
    from bicache_sgl.training import task

    items = task.heldout_items(args.items, num_shots=8, seed=0, questions_per_family=6)
    sp = {"max_new_tokens": args.max_new_tokens, "temperature": 0}
    modes = [m for m in args.modes.split(",") if m]
    extra = _flags(args.server_args)
    runtimes = {m: Runtime(None, prefix_cache=m, **extra) for m in modes}
    engines = {} if args.no_alone else {m: Engine(prefix_cache=m, num_threads=1) for m in modes}
    try:
        for m in modes:  # warm both paths up (first forward, caches), then start from an empty cache
            runtimes[m].generate(items[0]["prompt"], sp)
            runtimes[m].flush_cache()
            if m in engines:
                eng = engines[m]
                eng.run_sync([GenerateRequest(eng.encode(items[0]["prompt"]), SamplingParams(**sp))])
                eng.cache.flush()
        for r in range(args.rounds):
            for m in modes:
                rt = runtimes[m]
                rt.flush_cache()
                lat, paired = [], []
                for it in items:
                    t = time.perf_counter()
                    out = rt.generate(it["prompt"], sp)
                    wall = time.perf_counter() - t
                    lat.append(wall)
                    paired.append(wall - out["meta_info"]["e2e_latency"])
                line = (f"round {r + 1} {m:>8}: server {_ms(lat)} ms, paired overhead {_ms(paired, 2)} ms")
                if m in engines:
                    eng = engines[m]
                    eng.cache.flush()
                    alone = []
                    for it in items:
                        t = time.perf_counter()
                        eng.run_sync([GenerateRequest(eng.encode(it["prompt"]), SamplingParams(**sp))])
                        alone.append(time.perf_counter() - t)
                    line += (f", engine alone {_ms(alone)} ms, server - alone "
                             f"{(statistics.median(lat) - statistics.median(alone)) * 1e3:.1f} ms")
                print(line, flush=True)
    finally:
        for rt in runtimes.values():
            rt.shutdown()
        for eng in engines.values():
            eng.shutdown()


def compare_code(args: argparse.Namespace, trees: list[str]) -> None:
    """One server per tree and mode; each request goes to every tree in turn (order alternating)."""
    import os
    import tempfile

    from bicache_sgl import Engine, SamplingParams
    from bicache_sgl.io_struct import GenerateRequest
    from bicache_sgl.runtime import Runtime
    from bicache_sgl.training import task

    # each entry is a PYTHONPATH (a tree, or e.g. /opt/extra:/tmp/base to add packages to one side)
    paths = [os.pathsep.join(os.path.abspath(p) for p in t.split(os.pathsep)) for t in trees]
    for t, p in zip(trees, paths):
        if not os.path.isdir(os.path.join(p.split(os.pathsep)[-1], "bicache_sgl")):
            raise SystemExit(f"--code: the last folder of {t!r} has no bicache_sgl folder")
    items = task.heldout_items(args.items, num_shots=8, seed=0, questions_per_family=6)
    sp = {"max_new_tokens": args.max_new_tokens, "temperature": 0}
    extra = _flags(args.server_args)
    here = os.getcwd()  # the paths above are already absolute
    os.chdir(tempfile.mkdtemp(prefix="bicache-ab-"))  # `python -m` puts the cwd first on sys.path
    try:
        for mode in [m for m in args.modes.split(",") if m]:
            rts = [Runtime(None, prefix_cache=mode, env={"PYTHONPATH": p},
                           **extra) for p in paths]
            eng = None if args.no_alone else Engine(prefix_cache=mode, num_threads=1)  # this process's tree
            try:
                for rt in rts:
                    rt.generate(items[0]["prompt"], sp)
                    rt.flush_cache()
                if eng is not None:
                    eng.run_sync([GenerateRequest(eng.encode(items[0]["prompt"]), SamplingParams(**sp))])
                lat: list[list[float]] = [[] for _ in trees]
                paired: list[list[float]] = [[] for _ in trees]
                alone: list[float] = []
                for r in range(args.rounds):
                    for rt in rts:
                        rt.flush_cache()
                    if eng is not None:
                        eng.cache.flush()
                    for k, it in enumerate(items):
                        if eng is not None:
                            t0 = time.perf_counter()
                            eng.run_sync([GenerateRequest(eng.encode(it["prompt"]), SamplingParams(**sp))])
                            alone.append(time.perf_counter() - t0)
                        order = range(len(trees)) if (r * len(items) + k) % 2 == 0 else reversed(range(len(trees)))
                        for i in order:
                            t0 = time.perf_counter()
                            out = rts[i].generate(it["prompt"], sp)
                            wall = time.perf_counter() - t0
                            lat[i].append(wall)
                            paired[i].append(wall - out["meta_info"]["e2e_latency"])
                for i, t in enumerate(trees):
                    ratio = statistics.median(b / a for a, b in zip(paired[0], paired[i]))
                    vs = (f", server - alone {(statistics.median(lat[i]) - statistics.median(alone)) * 1e3:.1f} ms"
                          if alone else "")
                    print(f"{mode:>8} {t}: server {_ms(lat[i])} ms, paired overhead {_ms(paired[i], 2)} ms, "
                          f"paired / first tree's per request {ratio:.2f} (n={len(lat[i])}){vs}", flush=True)
                if alone:
                    print(f"{mode:>8} engine alone (Engine.run_sync, this process): {_ms(alone)} ms", flush=True)
            finally:
                for rt in rts:
                    rt.shutdown()
                if eng is not None:
                    eng.shutdown()
    finally:
        os.chdir(here)


def _ms(xs: list[float], digits: int = 1) -> str:
    return f"{statistics.median(xs) * 1e3:.{digits}f}"


def _flags(text: str) -> dict[str, object]:
    """``--num-threads 1 --foo`` -> ``{"num_threads": "1", "foo": True}`` (Runtime's keyword form)."""
    out: dict[str, object] = {}
    words = shlex.split(text)
    i = 0
    while i < len(words):
        w = words[i]
        if not w.startswith("--"):
            raise SystemExit(f"--server-args: expected a flag, got {w!r}")
        key = w[2:].replace("-", "_")
        if i + 1 < len(words) and not words[i + 1].startswith("--"):
            out[key] = words[i + 1]
            i += 2
        else:
            out[key] = True
            i += 1
    return out


if __name__ == "__main__":
    main()
