"""Decode benchmark: in-request caching modes and batching on a scaled-down LLaDA-shape model.

Measures, in one run on the same random-weight model (8 layers, hidden 512 by default):
  - tokens/s of cache mode `none` vs `prefix` vs `dual`, same number of denoising steps;
  - the batched speedup: a batch of B requests in one engine vs the same B requests one by one.
Prints the ratios. Usage:
    python examples/bench_decode.py [--prompt-len 512 --gen-len 256 --block-length 32 --steps 64]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

import numpy as np


def build_parser() -> argparse.ArgumentParser:
    """The flags (their dests and defaults are pinned in tests/test_config_flags.py)."""
    from bicache_sgl.config import DecodeDefaults
    from bicache_sgl.flags import add_flags

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--mlp", type=int, default=1536)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen-len", type=int, default=256)
    add_flags(ap, DecodeDefaults, only=("block_length",))
    ap.add_argument("--steps", type=int, default=64, help="total denoising steps (same for every mode)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--batch-gen-len", type=int, default=64, help="generation length in the batching comparison")
    ap.add_argument("--threads", type=int, default=None)
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)

    from bicache_sgl import Engine
    from bicache_sgl.testing import make_tiny_llada

    print("command: python examples/bench_decode.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_llada(tmp, n_layers=args.layers, d_model=args.hidden, n_heads=args.heads,
                               mlp_hidden_size=args.mlp)
        eng = Engine(path, prefix_cache="off", threshold=None, block_length=args.block_length,
                     max_running_requests=max(16, args.batch), num_threads=args.threads)
        rng = np.random.default_rng(0)
        prompt = rng.integers(0, 256, args.prompt_len).tolist()
        sp = {"max_new_tokens": args.gen_len, "temperature": 0, "steps": args.steps, "ignore_eos": True}
        eng.generate(input_ids=prompt[:32], sampling_params={**sp, "max_new_tokens": args.block_length})  # warm-up
        res = {}
        for mode in ("none", "prefix", "dual"):
            t = time.perf_counter()
            out = eng.generate(input_ids=prompt, sampling_params={**sp, "cache_mode": mode})
            dt = time.perf_counter() - t
            meta = out["meta_info"]
            res[mode] = (len(out["output_ids"]) / dt, meta["forward_passes"], meta["tokens_computed"])
        print(f"\nmodel: {args.layers} layers, hidden {args.hidden}; prompt {args.prompt_len}, gen {args.gen_len}, "
              f"block {args.block_length}, steps {args.steps}\n")
        print("| cache mode | tokens/s | forwards | tokens computed | speedup vs none |")
        print("|---|---|---|---|---|")
        for mode, (tps, fw, tc) in res.items():
            print(f"| {mode} | {tps:.1f} | {fw} | {tc} | {tps / res['none'][0]:.2f}x |")

        prompts = [rng.integers(0, 256, args.prompt_len // 2 + 16 * i).tolist() for i in range(args.batch)]
        bsp = {**sp, "cache_mode": "dual", "max_new_tokens": args.batch_gen_len,
               "steps": args.batch_gen_len // 4}
        t = time.perf_counter()
        singles = [eng.generate(input_ids=p, sampling_params=bsp) for p in prompts]
        t_single = time.perf_counter() - t
        t = time.perf_counter()
        batched = eng.generate(input_ids=prompts, sampling_params=bsp)
        t_batch = time.perf_counter() - t
        same = [a["output_ids"] for a in singles] == [b["output_ids"] for b in batched]
        print(f"\nbatching ({args.batch} requests, dual cache, gen {args.batch_gen_len}): one by one {t_single:.2f} s, "
              f"batched {t_batch:.2f} s -> speedup {t_single / t_batch:.2f}x; identical outputs: {same}")
        print(f"dual vs none: {res['dual'][0] / res['none'][0]:.2f}x   prefix vs none: "
              f"{res['prefix'][0] / res['none'][0]:.2f}x")
        eng.shutdown()


if __name__ == "__main__":
    main()
