"""Speed and fidelity of ``step_rows`` (what a dual-cache block step computes): ``block`` (every
block position, the default) against ``active`` (the still-masked positions and those the previous
forward unmasked; the other block rows keep their K/V until the next refresh).

Workload: --requests windows of held-out standard-library source (the files the context model
never trained on, ``bicache_sgl.training.train_context.stdlib_corpus``): --prompt-len characters
of prompt, then --gen-len tokens generated (greedy, ignore_eos) in blocks of --block-length with
the server's default confidence threshold. The default model is ``assets/context_model``, which
was pretrained on standard-library source, so its continuations can be scored against the true
next characters. Reported per mode: wall time through the engine alone (best of --runs), computed
tokens, token agreement with ``block``, whole outputs identical to ``block``, and the fraction of
generated tokens equal to the source's own continuation.

    python examples/bench_step_rows.py
    python examples/bench_step_rows.py --gen-len 128 --prefix-cache bicache
"""

from __future__ import annotations

import argparse
import os
import random
import time


def build_parser() -> argparse.ArgumentParser:
    """The flags (their dests and defaults are pinned in tests/test_config_flags.py)."""
    from bicache_sgl.config import DecodeDefaults, EngineConfig
    from bicache_sgl.flags import add_flags

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None, help="default: bicache_sgl/assets/context_model")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=384, help="characters of source in each prompt")
    ap.add_argument("--gen-len", type=int, default=96, help="tokens generated per request")
    add_flags(ap, DecodeDefaults, only=("block_length", "threshold"),
              helps={"threshold": "0 or none: one token per step (fixed schedule)"})
    add_flags(ap, EngineConfig, only=("prefix_cache",), defaults={"prefix_cache": "off"})
    ap.add_argument("--max-running", type=int, default=8)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    if min(args.requests, args.prompt_len, args.gen_len, args.block_length, args.runs) < 1:
        ap.error("--requests, --prompt-len, --gen-len, --block-length and --runs must be >= 1")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch

    import bicache_sgl
    from bicache_sgl import Engine
    from bicache_sgl.config import SamplingParams
    from bicache_sgl.io_struct import GenerateRequest
    from bicache_sgl.training.train_context import stdlib_corpus

    torch.set_num_threads(args.threads)
    path = args.model_path or os.path.join(os.path.dirname(bicache_sgl.__file__), "assets", "context_model")
    eng = Engine(path, prefix_cache=args.prefix_cache, max_running_requests=args.max_running,
                 num_threads=args.threads, block_length=args.block_length, threshold=args.threshold or None)
    try:
        _, held = stdlib_corpus()
        rng = random.Random(args.seed)
        prompts, truths = [], []
        while len(prompts) < args.requests:
            doc = held[rng.randrange(len(held))]
            if len(doc) < args.prompt_len + 4 * args.gen_len:
                continue
            i = rng.randrange(len(doc) - args.prompt_len - 4 * args.gen_len)
            prompts.append(eng.encode(doc[i:i + args.prompt_len]))
            truths.append(eng.encode(doc[i + args.prompt_len:i + args.prompt_len + 4 * args.gen_len])[:args.gen_len])
        results = {}
        for mode in ("block", "active"):
            sp = SamplingParams(max_new_tokens=args.gen_len, temperature=0, ignore_eos=True, step_rows=mode)
            best, outs, computed = float("inf"), None, 0
            for _ in range(max(1, args.runs)):
                eng.cache.flush()
                t = time.perf_counter()
                evs = eng.run_sync([GenerateRequest(p, sp) for p in prompts])
                best = min(best, time.perf_counter() - t)
                outs = [ev.output_ids for ev in evs]
                computed = sum(ev.meta_info["tokens_computed"] for ev in evs)
            results[mode] = {"seconds": best, "outs": outs, "computed": computed}
    finally:
        eng.shutdown()
    ref = results["block"]
    n_tok = sum(len(o) for o in ref["outs"])
    print(f"model: {path}; {args.requests} held-out stdlib windows, prompt {args.prompt_len} chars, "
          f"{args.gen_len} new tokens, block {args.block_length}, threshold {args.threshold}, "
          f"prefix cache {args.prefix_cache}, engine alone, best of {args.runs}")
    print("\n| step_rows | seconds | speedup | tokens computed (vs block) | token agreement with block "
          "| outputs identical to block | tokens equal to the source |")
    print("|---|---|---|---|---|---|---|")
    for mode, r in results.items():
        agree = sum(a == b for o, q in zip(r["outs"], ref["outs"]) for a, b in zip(o, q)) / n_tok
        same = sum(o == q for o, q in zip(r["outs"], ref["outs"])) / len(ref["outs"])
        src = sum(a == b for o, t in zip(r["outs"], truths) for a, b in zip(o, t)) / sum(len(t) for t in truths)
        r.update(agreement=agree, identical=same, source_match=src)
        print(f"| {mode} | {r['seconds']:.2f} | {ref['seconds'] / r['seconds']:.2f}x "
              f"| {r['computed']} ({r['computed'] / ref['computed']:.2f}) | {agree:.1%} | {same:.0%} | {src:.1%} |")
    return results


if __name__ == "__main__":
    main()
