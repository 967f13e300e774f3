"""Host side of the prefix cache at GPU scale, no model: what admission, share, commit, release and
eviction cost per request as prompts and the radix tree grow.

Everything the scheduler does per request on the host (the radix index, the planner, the pool's
slot -> row and capture-context tables) is pure Python + numpy, so it is measured alone here with a
model shape of --layers layers (default 32, LLaDA-8B / Dream-7B) and a store of 1-element rows.

Workload per configuration (prompt length P, tree size N nodes):
  fill     N nodes of short diverse prompts (shared 16-token heads, 8-token tails; generation region
           256, so they hold a few layers), then the pool is sized so that the replay must trim and
           evict to make room (steady state of a full cache);
  replay   --requests requests of P tokens: a template head (64) shared by all, a per-tenant system
           prompt (P/4, 16 tenants), a few-shot block (P/4, 8 blocks), a conversation history that
           grows by one turn (P/32) per request of that conversation (32 conversations, each with its
           tenant and block; from P/8 up to P/2, then it starts over), a unique question (the rest);
           generation region 256. One untimed pass warms the shared parts,
           then one timed pass: peek (scheduler ordering), admit (match, lock, plan, reserve; the
           trims and evictions it needs are also shown alone), alloc (the request's private
           [L, P + 256] rows, ``KVPool.alloc_seq``), share, commit (bind, insert, node depths),
           release (with ``free_seq``).

    python examples/bench_host.py                                  # the full table and a PNG
    python examples/bench_host.py --prompt-lens 4096 --nodes 100000 --requests 100
    python examples/bench_host.py --prompt-lens 64,128 --nodes 50,200 --requests 4 --no-plot
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

from bicache_sgl.bicache.planner import RequestFacts
from bicache_sgl.bicache.policy import ProfilePolicy
from bicache_sgl.bicache.profile import BicacheProfile
from bicache_sgl.kv_cache.manager import CacheManager
from bicache_sgl.kv_cache.pool import KVPool
from radix import RadixTree

GEN = 256  # generation region of every request: r = shared / (prompt + GEN)
OPS = ("peek", "admit", "alloc", "share", "commit", "release")


@dataclass(frozen=True)
class HostShape:
    """A model shape for the host tables only: L layers, 1-element K/V rows (the tensors are not
    what is measured)."""

    n_layers: int
    n_kv_heads: int = 1
    head_dim: int = 1
    hidden_size: int = 1

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim


def profile_policy(n_layers: int) -> ProfilePolicy:
    """A bicache profile shaped like the shipped ones: deeper with a larger shared fraction."""
    steps = ((0.0, 0), (5.0, max(1, n_layers // 8)), (20.0, n_layers // 4), (40.0, n_layers // 2),
             (60.0, 3 * n_layers // 4), (80.0, n_layers))
    return ProfilePolicy(n_layers, BicacheProfile(steps, n_layers))


def make_cache(n_layers: int, tokens: int, rows: int, request_rows: int) -> CacheManager:
    pool = KVPool(HostShape(n_layers), tokens, rows, request_rows, torch.float16, torch.device("cpu"))
    return CacheManager(RadixTree(), pool, profile_policy(n_layers))


def serve(cache: CacheManager, prompt: np.ndarray, times: dict[str, list[float]] | None = None) -> int:
    """One request's whole life in the cache; returns its matched length. ``times`` gets each op's
    seconds appended."""
    n = len(prompt) + GEN
    facts = RequestFacts(len(prompt), n)
    clock = time.perf_counter
    t0 = clock()
    cache.peek(prompt)
    t1 = clock()
    grant = cache.admit(prompt, facts)
    t2 = clock()
    kv = cache.pool.alloc_seq(n)
    t3 = clock()
    cache.share(grant, kv)
    t4 = clock()
    cache.commit(prompt, grant, n)
    t5 = clock()
    cache.release(grant)
    cache.pool.free_seq(kv)
    t6 = clock()
    if times is not None:
        for op, dt in (("peek", t1 - t0), ("admit", t2 - t1), ("alloc", t3 - t2), ("share", t4 - t3),
                       ("commit", t5 - t4), ("release", t6 - t5)):
            times[op].append(dt)
    return grant.plan.matched


class Trace:
    """Synthetic prompts with realistic sharing (see the module docstring)."""

    def __init__(self, prompt_len: int, seed: int, vocab: int = 100_000) -> None:
        self.rng = np.random.default_rng(seed)
        self.vocab, self.p = vocab, prompt_len
        q = max(1, prompt_len // 4)
        self.head = self._tok(min(64, q))
        self.tenants = [self._tok(q) for _ in range(16)]
        self.blocks = [self._tok(q) for _ in range(8)]
        self.convs = [self._tok(max(1, q // 2)) for _ in range(32)]  # conversation c: tenant c % 16, block c % 8

    def _tok(self, n: int) -> np.ndarray:
        return self.rng.integers(0, self.vocab, n, dtype=np.int64)

    def next(self) -> np.ndarray:
        r = self.rng
        c = int(r.integers(len(self.convs)))
        hist = self.convs[c]
        # the next turn extends this one (its prompt is a prefix of the next); a conversation past
        # P/2 tokens starts over
        grown = np.concatenate([hist, self._tok(max(1, self.p // 32))])
        self.convs[c] = grown if len(grown) <= self.p // 2 else self._tok(max(1, self.p // 8))
        parts = [self.head, self.tenants[c % 16], self.blocks[c % 8], hist]
        used = sum(len(x) for x in parts)
        parts.append(self._tok(max(1, self.p - used)))
        return np.concatenate(parts)[:self.p]


def fill(cache: CacheManager, nodes: int, seed: int) -> None:
    """Grow the tree to ``nodes`` nodes with short diverse prompts (2 nodes each, about)."""
    rng = np.random.default_rng(seed + 1)
    heads = rng.integers(0, 100_000, (max(1, int(np.sqrt(nodes))), 16), dtype=np.int64)
    tree = cache.index
    while tree.num_nodes() < nodes:
        prompt = np.concatenate([heads[int(rng.integers(len(heads)))],
                                 rng.integers(0, 100_000, 9, dtype=np.int64)])
        serve(cache, prompt)


def make_room_us(cache: CacheManager, prompt_len: int, n_layers: int, requests: int) -> tuple[float, int]:
    """Full pool: hold every free slot and row, then time making room for one request's capture
    (P tokens, P x L/4 rows: trims of cold nodes, then LRU evictions) ``requests`` times."""
    pool = cache.pool
    pool.tokens.alloc(pool.tokens.num_free)
    pool.rows.alloc(pool.rows.num_free)
    nodes0, t = cache.index.num_nodes(), time.perf_counter()
    done = 0
    for _ in range(requests):
        if not cache._make_room(prompt_len * n_layers // 4, prompt_len):
            break
        done += 1
        # the capture takes what was made free (as admission would)
        pool.tokens.alloc(pool.tokens.num_free)
        pool.rows.alloc(pool.rows.num_free)
    dt = time.perf_counter() - t
    return (1e6 * dt / done if done else float("nan")), nodes0 - cache.index.num_nodes()


def run_config(n_layers: int, prompt_len: int, nodes: int, requests: int, seed: int) -> dict:
    fill_tokens = nodes * 12 + 1024
    trace_tokens = 2 * requests * prompt_len + 4 * prompt_len
    # room for the fill and the whole replay: the timed pass measures the hot path; making room in
    # a full pool is timed on its own after it
    tokens = fill_tokens + trace_tokens
    rows = fill_tokens * n_layers // 4 + trace_tokens * n_layers
    cache = make_cache(n_layers, tokens, rows, n_layers * (prompt_len + GEN))
    t = time.perf_counter()
    fill(cache, nodes, seed)
    fill_s = time.perf_counter() - t
    trace = Trace(prompt_len, seed)
    for _ in range(requests):  # warm: the shared parts get cached
        serve(cache, trace.next())
    times: dict[str, list[float]] = {op: [] for op in OPS}
    matched = 0
    n0 = cache.index.num_nodes()
    for _ in range(requests):
        matched += serve(cache, trace.next(), times)
    # medians: on a shared machine a mean is one other job's burst away from meaningless
    us = {op: 1e6 * float(np.median(s)) for op, s in times.items()}
    us["total"] = sum(us[op] for op in OPS)  # sum of the medians
    nodes_during = (n0 + cache.index.num_nodes()) // 2
    us["room"], room_nodes = make_room_us(cache, prompt_len, n_layers, max(1, requests // 4))
    return {"prompt_len": prompt_len, "nodes": nodes, "nodes_during": nodes_during,
            "matched": matched / requests, "fill_s": fill_s, "us": us, "room_nodes_evicted": room_nodes,
            "evicted_tokens": cache.evicted_tokens, "trimmed_layer_tokens": cache.trimmed_layer_tokens}


def table(results: list[dict], n_layers: int) -> str:
    head = ("| prompt tokens | tree nodes (fill / during) | mean matched | peek | admit | alloc | share | commit "
            "| release | total us/request | full pool: make room for one request |")
    lines = [f"Host side per request, L = {n_layers} layers (microseconds, median over the timed pass)", "",
             head, "|" + "---|" * 11]
    for r in results:
        u = r["us"]
        lines.append(f"| {r['prompt_len']} | {r['nodes']} / {r['nodes_during']} | {r['matched']:.0f} | "
                     f"{u['peek']:.0f} | {u['admit']:.0f} | {u['alloc']:.0f} | {u['share']:.0f} | {u['commit']:.0f} | "
                     f"{u['release']:.0f} | {u['total']:.0f} | {u['room']:.0f} |")
    return "\n".join(lines)


def plot(results: list[dict], path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not importable: no plot")
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, other in ((axes[0], "prompt_len", "nodes"), (axes[1], "nodes", "prompt_len")):
        for fixed in sorted({r[other] for r in results}):
            pts = sorted((r[key], r["us"]["total"]) for r in results if r[other] == fixed)
            if len(pts) > 1:
                ax.plot(*zip(*pts), marker="o", label=f"{other} = {fixed}")
        ax.set_xscale("log")
        ax.set_xlabel(key.replace("_", " "))
        ax.set_ylabel("us per request (all six ops)")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"plot: {path}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--prompt-lens", default="1024,4096,16384,32768",
                    help="prompt lengths swept at the largest --nodes")
    ap.add_argument("--nodes", default="1000,10000,100000", help="tree sizes swept at --at-len")
    ap.add_argument("--at-len", type=int, default=4096, help="prompt length of the tree-size sweep")
    ap.add_argument("--requests", type=int, default=40, help="timed requests per configuration")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", default="bench_host.png")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    lens = [int(x) for x in args.prompt_lens.split(",") if x]
    sizes = [int(x) for x in args.nodes.split(",") if x]
    if args.layers < 1 or not lens or not sizes or min(lens) < 2 or min(sizes) < 1 or args.requests < 1:
        ap.error("--layers, --requests, --prompt-lens (>= 2) and --nodes (>= 1) must be positive")
    at_len = min(lens, key=lambda p: abs(p - args.at_len))
    configs = [(p, max(sizes)) for p in lens] + [(at_len, n) for n in sizes if n != max(sizes)]
    results = []
    for p, n in sorted(set(configs), key=lambda c: (c[1], c[0])):
        r = run_config(args.layers, p, n, args.requests, args.seed)
        results.append(r)
        print(f"# prompt {p} nodes {n}: {r['us']['total']:.0f} us/request (fill {r['fill_s']:.1f} s)",
              file=sys.stderr, flush=True)
    print(table(results, args.layers))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"layers": args.layers, "results": results}, f, indent=1)
    if not args.no_plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
