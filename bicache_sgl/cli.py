"""One-shot generation from the command line.

    python -m bicache_sgl --prompt "Question: ...\nAnswer:" [--model-path M] [--max-new-tokens 64]

Without --model-path it runs the bundled default model.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bicache_sgl", description="One-shot generation with a diffusion LM.")
    ap.add_argument("--model-path", default=None, help="checkpoint folder or hub id (default: the bundled model)")
    ap.add_argument("--prompt", action="append", help="prompt text (repeat for a batch); '-' reads stdin")
    ap.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--block-length", type=int, default=32)
    ap.add_argument("--steps", type=int, default=None, help="total denoising steps (default: one per token)")
    ap.add_argument("--threshold", type=float, default=0.9, help="Fast-dLLM confidence threshold (0: fixed schedule)")
    ap.add_argument("--remasking", choices=["low_confidence", "random"], default="low_confidence")
    ap.add_argument("--cache-mode", choices=["none", "prefix", "dual"], default="dual")
    ap.add_argument("--cfg-scale", type=float, default=0.0)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--attention-backend", default="torch")
    ap.add_argument("--json", action="store_true", help="print the full result dicts as JSON")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from . import Engine
    from .models.config import CheckpointError

    prompts = args.prompt or ["Question: K\nAnswer: 5\n\nQuestion: D\nAnswer: 5\n\nQuestion: K\nAnswer:"]
    prompts = [sys.stdin.read() if p == "-" else p.encode().decode("unicode_escape") for p in prompts]
    try:
        eng = Engine(args.model_path, dtype=args.dtype, device=args.device, attention_backend=args.attention_backend,
                     block_length=args.block_length, threshold=args.threshold or None, remasking=args.remasking,
                     cache_mode=args.cache_mode)
    except (CheckpointError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.chat:
        prompts = [eng.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                     add_generation_prompt=True) for p in prompts]
    sp = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "steps": args.steps,
          "cfg_scale": args.cfg_scale}
    t = time.perf_counter()
    try:
        outs = eng.generate(prompts, sp)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        eng.shutdown()
    dt = time.perf_counter() - t
    if args.json:
        print(json.dumps(outs, indent=1))
    else:
        for p, o in zip(prompts, outs):
            m = o["meta_info"]
            bold = ("\033[1m", "\033[0m") if sys.stdout.isatty() else ("", "")
            print(f"{p}{bold[0]}{o['text']}{bold[1]}")
            print(f"-- {m['completion_tokens']} tokens, {m['forward_passes']} forwards, finish {m['finish_reason']}")
        n = sum(o["meta_info"]["completion_tokens"] for o in outs)
        print(f"-- {dt:.2f} s, {n / dt:.1f} tokens/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
