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

from .config import REMASKING


def build_parser() -> argparse.ArgumentParser:
    """The one-shot flags; the engine's settings among them are the server's flags (same names,
    defaults and validation: built from EngineConfig's fields)."""
    from .config import DecodeDefaults, EngineConfig
    from .flags import add_flags

    ap = argparse.ArgumentParser(prog="python -m bicache_sgl", description="One-shot generation with a diffusion LM.")
    add_flags(ap, EngineConfig, only=("model_path",),
              helps={"model_path": "checkpoint folder or hub id (default: the bundled model)"})
    ap.add_argument("--prompt", action="append", help="prompt text (repeat for a batch); '-' reads stdin")
    ap.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="length of the answer (default: %(default)s)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default: %(default)s)")
    add_flags(ap, DecodeDefaults, only=("block_length",))
    ap.add_argument("--steps", type=int, default=None, help="total denoising steps (default: one per token)")
    add_flags(ap, DecodeDefaults, only=("threshold",))
    ap.add_argument("--remasking", choices=REMASKING, default="low_confidence",
                    help="LLaDA's unmasking algorithm (the server's --remasking; default: %(default)s)")
    add_flags(ap, DecodeDefaults, only=("cache_mode",))
    ap.add_argument("--cfg-scale", type=float, default=0.0, help="classifier-free guidance scale (0: off)")
    add_flags(ap, EngineConfig, only=("dtype", "device", "attention_backend"))
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
                     block_length=args.block_length, threshold=args.threshold or None,
                     # low_confidence is also the built-in fallback: only another choice is set over the
                     # checkpoint's generation_config.json alg
                     dllm_algorithm=None if args.remasking == "low_confidence" else args.remasking,
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
