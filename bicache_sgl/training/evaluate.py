"""Greedy masked-diffusion evaluation of a checkpoint on the held-out task, through the serving engine.

Decoding is the serving runtime's own (``bicache_sgl.Engine``, offline API), set to the plainest
schedule: the prompt is followed by ``gen_length`` mask tokens in one block; every step runs a full
forward (in-request cache ``none``, prefix cache ``off``) and unmasks the single most confident
masked position with its argmax token (``threshold 0``, ``steps_per_block = gen_length``,
``low_confidence`` remasking, temperature 0) until none is left. The output is cut at the first EOS
and compared to the answer (exact match).

    python -m bicache_sgl.training.evaluate --model bicache_sgl/assets/default_model \\
        --num-questions 500 --num-shots 5 --gen-length 8 --control none,remove,shuffle
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from .. import Engine
from . import task


def make_engine(model_path: str | None = None, threads: int | None = 1, max_running_requests: int = 64,
                **engine_args: Any):
    """An engine for greedy one-token-per-step decoding with the prefix cache off."""
    kw = {"prefix_cache": "off", "cache_mode": "none", "threshold": None,
          "max_running_requests": max_running_requests, "num_threads": threads, "random_seed": 0}
    return Engine(model_path, **{**kw, **engine_args})


def greedy_params(gen_length: int) -> dict[str, Any]:
    """One block of ``gen_length`` positions, one token unmasked per step, no cache, argmax."""
    return {"max_new_tokens": gen_length, "block_length": gen_length, "steps_per_block": gen_length,
            "threshold": 0.0, "remasking": "low_confidence", "cache_mode": "none", "temperature": 0.0}


def score(engine, items: list, gen_length: int = 8) -> dict:
    """Accuracy, share of invalid answers (not a single value character), and the outputs."""
    outs = engine.generate([it["prompt"] for it in items], greedy_params(gen_length)) if items else []
    correct, invalid, outputs = 0, 0, []
    for it, out in zip(items, outs):
        pred = task.extract_answer(out["text"])
        outputs.append(out["text"])
        if pred not in task.VALUE_CHARS or not pred:
            invalid += 1
        correct += int(pred == it["answer"])
    n = max(1, len(items))
    return {"accuracy": correct / n, "invalid": invalid / n, "n": len(items), "outputs": outputs}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the bundled model)")
    ap.add_argument("--num-questions", type=int, default=500)
    ap.add_argument("--num-shots", default="5", help="comma-separated list")
    ap.add_argument("--gen-length", default="8", help="comma-separated list")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--control", default="none,remove,shuffle",
                    help="comma-separated subset of none,remove,shuffle")
    ap.add_argument("--kind", default=task.DEFAULT_KIND, choices=list(task.KINDS))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-running-requests", type=int, default=64, help="requests decoded in one batch")
    ap.add_argument("--device", default="auto")
    args = ap.parse_args(argv)
    engine = make_engine(args.model, args.threads, args.max_running_requests, device=args.device)
    try:
        for shots in [int(s) for s in args.num_shots.split(",")]:
            items = task.heldout_items(args.num_questions, shots, args.seed, kind=args.kind)
            for g in [int(s) for s in args.gen_length.split(",")]:
                for mode in args.control.split(","):
                    its = items if mode == "none" else task.control_items(items, mode, args.seed)
                    t0 = time.time()
                    r = score(engine, its, g)
                    print(json.dumps({"num_shots": shots, "gen_length": g, "control": mode,
                                      "accuracy": round(r["accuracy"], 4), "invalid": round(r["invalid"], 4),
                                      "n": r["n"], "seconds": round(time.time() - t0, 1)}), flush=True)
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
