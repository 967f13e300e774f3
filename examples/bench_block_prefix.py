"""Exact prefix reuse on a block-diffusion model (LLaDA2 format): reuse on vs off.

Two workloads on a random-weight LLaDA2-format checkpoint built on the fly (docs/block_diffusion.md):

  fewshot    --groups groups of --per-group requests; a group's requests share a --prefix-len token
             prefix and differ in a --question-len question. The first request of every group runs
             first (its prompt blocks enter the cache), then the rest together.
  multiturn  --conversations conversations of --turns turns; each turn's prompt is the previous
             prompt + its answer + --user-len new tokens (so a turn repeats the previous answer).

Each workload runs through a fresh BlockEngine with the exact block cache on, and with it off,
on the same requests, interleaved (--repeat times, best of each). Printed per workload: wall time
of each, the speedup, the ideal speedup from the computed layer-tokens (rows computed x layers,
off / on), the reused tokens, and whether every answer is identical (it must be: reuse is exact).

    python examples/bench_block_prefix.py
    python examples/bench_block_prefix.py --hidden 512 --layers 6 --prefix-len 1024 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from bicache_sgl.blockdiff.engine import BlockEngine, BlockEngineOptions, BlockParams
from bicache_sgl.models.block_model import load_block_model
from bicache_sgl.testing.block import make_tiny_llada2


def _ids(n: int, g: torch.Generator) -> list[int]:
    return torch.randint(0, 256, (n,), generator=g).tolist()


def run_waves(model, waves: list[list[list[int]]], params: BlockParams, cache: bool) -> tuple[float, list, int, int]:
    eng = BlockEngine(model, BlockEngineOptions(prefix_cache=cache, max_running=64))
    t = time.perf_counter()
    out = []
    for wave in waves:
        out += eng.run(wave, params)
    dt = time.perf_counter() - t
    rows = sum(r.meta["computed_rows"] for r in out)
    reused = sum(r.meta["cached_tokens"] for r in out)
    return dt, [r.tokens for r in out], rows, reused


def run_multiturn(model, starts: list[list[int]], turns: int, user_len: int, params: BlockParams, cache: bool,
                  seed: int) -> tuple[float, list, int, int]:
    eng = BlockEngine(model, BlockEngineOptions(prefix_cache=cache, max_running=64))
    g = torch.Generator().manual_seed(seed)
    prompts = [list(p) for p in starts]
    t = time.perf_counter()
    out = []
    for _ in range(turns):
        res = eng.run(prompts, params)  # every conversation's turn together
        out += res
        prompts = [p + r.tokens + _ids(user_len, g) for p, r in zip(prompts, res)]
    dt = time.perf_counter() - t
    return dt, [r.tokens for r in out], sum(r.meta["computed_rows"] for r in out), \
        sum(r.meta["cached_tokens"] for r in out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--block-length", type=int, default=32)
    ap.add_argument("--steps-per-block", type=int, default=8)
    ap.add_argument("--groups", type=int, default=3)
    ap.add_argument("--per-group", type=int, default=3)
    ap.add_argument("--prefix-len", type=int, default=384)
    ap.add_argument("--question-len", type=int, default=24)
    ap.add_argument("--conversations", type=int, default=3)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--user-len", type=int, default=40)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=2, help="interleaved off/on runs; the best of each is shown")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_tiny_llada2(f"{tmp}/llada2", hidden_size=args.hidden, n_layers=args.layers, n_heads=8,
                                  n_kv_heads=2, head_dim=args.hidden // 8, num_experts=args.experts,
                                  experts_per_tok=2, n_group=4, topk_group=2, moe_intermediate_size=args.hidden // 2,
                                  intermediate_size=args.hidden * 2, block_length=args.block_length)
        model = load_block_model(folder)
    params = BlockParams(max_new_tokens=args.max_new_tokens, steps=args.steps_per_block)
    g = torch.Generator().manual_seed(0)
    prefixes = [_ids(args.prefix_len, g) for _ in range(args.groups)]
    reqs = [[p + _ids(args.question_len, g) for _ in range(args.per_group)] for p in prefixes]
    waves = [[r[0] for r in reqs], [q for r in reqs for q in r[1:]]]
    starts = [_ids(args.prefix_len // 2, g) for _ in range(args.conversations)]
    L = args.layers
    print(f"LLaDA2-format random model: hidden {args.hidden}, {L} layers, {args.experts} experts, block "
          f"{args.block_length}, {args.steps_per_block} steps/block, {args.max_new_tokens} new tokens, "
          f"{torch.get_num_threads()} threads")
    for name, fn in (("fewshot", lambda c: run_waves(model, waves, params, c)),
                     ("multiturn", lambda c: run_multiturn(model, starts, args.turns, args.user_len, params, c, 1))):
        fn(False)  # warm-up (allocator, kernels)
        # off and on interleaved, best of --repeat each (the machine may be shared)
        offs, ons = [], []
        for _ in range(args.repeat):
            offs.append(fn(False))
            ons.append(fn(True))
        t_off, out_off, rows_off, _ = min(offs, key=lambda r: r[0])
        t_on, out_on, rows_on, reused = min(ons, key=lambda r: r[0])
        print(f"{name:10s} off {t_off:6.2f} s  exact-reuse {t_on:6.2f} s  speedup {t_off / t_on:4.2f}x  "
              f"ideal {rows_off / rows_on:4.2f}x (layer-tokens {rows_off * L:,} -> {rows_on * L:,})  "
              f"reused {reused:,} tokens  identical {sum(a == b for a, b in zip(out_on, out_off))}/{len(out_on)}")


if __name__ == "__main__":
    main()
