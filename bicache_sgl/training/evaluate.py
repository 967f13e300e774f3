"""Greedy masked-diffusion evaluation of a checkpoint on the held-out task, through the serving engine.

Decoding is the serving runtime's own (``bicache_sgl.Engine``, offline API), set to the plainest
schedule: the prompt is followed by ``gen_length`` mask tokens in one block; every step runs a full
forward (in-request cache ``none``, prefix cache ``off``) and unmasks the single most confident
masked position with its argmax token (``threshold 0``, ``steps_per_block = gen_length``,
``low_confidence`` remasking, temperature 0) until none is left. The output is cut at the first EOS
and compared to the answer (exact match).

    python -m bicache_sgl.training.evaluate --model bicache_sgl/assets/default_model \\
        --num-questions 500 --num-shots 5 --gen-length 8 --control none,remove,shuffle

``--prefix-cache off,naive,bicache`` (any list of modes, ``fixed:N`` too) scores every mode with a
fresh engine each and prints them side by side (``score_modes``): each family's first question runs
first and stores the shared prefix, the family's other questions reuse it; ``agreement`` is the
share of outputs equal to the first mode's. ``--bicache-profile FILE`` picks the profile (default:
the one beside the model).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from .. import Engine
from ..config import EngineConfig
from ..flags import add_flags
from ..io_struct import span_depth
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


def score_format(engine, items: list, gen_length: int = 32) -> dict:
    """Forced continuation (``ignore_eos``: EOS banned, every position output): ``format``, the share
    whose whole region equals ``task.continuation_text`` (the answer, then the question and answer
    again); ``shape``, the share in that format with any key letter (``task.in_format``); the share
    whose answer is right; the outputs."""
    params = {**greedy_params(gen_length), "ignore_eos": True}
    outs = engine.generate([it["prompt"] for it in items], params) if items else []
    fmt = shape = correct = 0
    texts = []
    for it, out in zip(items, outs):
        texts.append(out["text"])
        fmt += int(out["text"] == task.continuation_text(it["question"], it["answer"], gen_length))
        shape += int(task.in_format(out["text"], it["answer"]))
        correct += int(task.extract_answer(out["text"]) == it["answer"])
    n = max(1, len(items))
    return {"format": fmt / n, "shape": shape / n, "accuracy": correct / n, "n": len(items), "outputs": texts}


def _first_per_family(items: list) -> tuple[list[int], list[int]]:
    """Indices of each family's first item, and of the others (in order)."""
    seen, first, rest = set(), [], []
    for i, it in enumerate(items):
        (rest if it["family"] in seen else first).append(i)
        seen.add(it["family"])
    return first, rest


def score_modes(engine_for: Any, items: list, modes: list, gen_length: int = 8,
                cached_context: str = "first_request", params: dict | None = None) -> dict:
    """Accuracy under several prefix-cache modes, each with a fresh engine (``engine_for(mode)``).

    The prefix cache is filled the way a server sees it: ``first_request`` (default) runs each
    family's first question alone first (its own first forward stores the shared prefix, computed in
    its context), then the other questions, which reuse it; ``prefix_only`` first sends every
    distinct few-shot block with ``max_new_tokens: 0`` (SGLang's ``cache_prefix``), then all
    questions. Returns per mode: accuracy, invalid, agreement (share of items whose output ids equal
    the first mode's), the outputs, mean ``bicache_depth`` and ``cached_tokens`` over the items, and
    the engine's layer-token counters."""
    params = params or greedy_params(gen_length)
    first, rest = _first_per_family(items)
    res: dict = {}
    for mode in modes:
        engine = engine_for(mode)
        try:
            if cached_context == "prefix_only":
                blocks = list(dict.fromkeys(it["prefix"] + task.EXAMPLE_SEP for it in items if it["prefix"]))
                if blocks:
                    engine.generate(blocks, {"max_new_tokens": 0})
                order = [list(range(len(items)))]
            else:
                order = [first, rest]
            outs: list = [None] * len(items)
            for idx in order:
                if idx:
                    for i, o in zip(idx, engine.generate([items[i]["prompt"] for i in idx], params)):
                        outs[i] = o
            stats = engine.get_stats()
        finally:
            engine.shutdown()
        correct = invalid = 0
        for it, o in zip(items, outs):
            pred = task.extract_answer(o["text"])
            invalid += int(pred not in task.VALUE_CHARS or not pred)
            correct += int(pred == it["answer"])
        n = max(1, len(items))
        base = res[modes[0]]["output_ids"] if res else None
        ids = [o["output_ids"] for o in outs]
        metas = [o["meta_info"] for o in outs]
        res[mode] = {
            "accuracy": correct / n, "invalid": invalid / n, "n": len(items),
            "agreement": 1.0 if base is None else sum(a == b for a, b in zip(ids, base)) / n,
            "outputs": [o["text"] for o in outs], "output_ids": ids, "metas": metas,
            "mean_depth": sum(span_depth(m) for m in metas) / n,
            "mean_cached_tokens": sum(m.get("cached_tokens") or 0 for m in metas) / n,
            "skipped_layer_tokens": stats.get("skipped_layer_tokens", 0),
            "computed_layer_tokens": stats.get("computed_layer_tokens", 0),
        }
    return res


def build_parser() -> argparse.ArgumentParser:
    """The flags (their dests and defaults are pinned in tests/test_config_flags.py)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the bundled model)")
    ap.add_argument("--num-questions", type=int, default=500)
    ap.add_argument("--num-shots", default="5", help="comma-separated list")
    ap.add_argument("--gen-length", default="8", help="comma-separated list")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--control", default="none,remove,shuffle",
                    help="comma-separated subset of none,remove,shuffle")
    ap.add_argument("--kind", default=task.DEFAULT_KIND, choices=list(task.KINDS))
    ap.add_argument("--ignore-eos", action="store_true",
                    help="also decode with ignore_eos and report the share of continuations in the "
                         "prompt's format (score_format) with a few samples")
    ap.add_argument("--threads", type=int, default=1)
    add_flags(ap, EngineConfig, only=("max_running_requests", "device"), defaults={"max_running_requests": 64})
    ap.add_argument("--prefix-cache", default=None,
                    help="comma-separated prefix-cache modes scored side by side (e.g. off,naive,bicache)")
    ap.add_argument("--cached-context", default="first_request", choices=["first_request", "prefix_only"],
                    help="with --prefix-cache: how the shared prefixes are filled (see score_modes)")
    add_flags(ap, EngineConfig, only=("bicache_profile",))
    return ap


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.prefix_cache:
        return _main_modes(args)
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
                    if args.ignore_eos:
                        t0 = time.time()
                        f = score_format(engine, its, g)
                        print(json.dumps({"num_shots": shots, "gen_length": g, "control": mode, "ignore_eos": True,
                                          "format": round(f["format"], 4), "shape": round(f["shape"], 4),
                                          "accuracy": round(f["accuracy"], 4),
                                          "n": f["n"], "samples": f["outputs"][:3],
                                          "seconds": round(time.time() - t0, 1)}), flush=True)
    finally:
        engine.shutdown()


def _main_modes(args) -> list:
    modes = [m.strip() for m in args.prefix_cache.split(",") if m.strip()]
    extra = {"bicache_profile": args.bicache_profile} if args.bicache_profile else {}
    rows = []
    for shots in [int(s) for s in args.num_shots.split(",")]:
        items = task.heldout_items(args.num_questions, shots, args.seed, kind=args.kind)
        for g in [int(s) for s in args.gen_length.split(",")]:
            for control in args.control.split(","):
                its = items if control == "none" else task.control_items(items, control, args.seed)
                t0 = time.time()
                res = score_modes(lambda mode: make_engine(args.model, args.threads, args.max_running_requests,
                                                           device=args.device, prefix_cache=mode, **extra),
                                  its, modes, g, args.cached_context)
                for mode, r in res.items():
                    row = {"num_shots": shots, "gen_length": g, "control": control, "prefix_cache": mode,
                           "accuracy": round(r["accuracy"], 4), "agreement": round(r["agreement"], 4),
                           "invalid": round(r["invalid"], 4), "mean_depth": round(r["mean_depth"], 2),
                           "mean_cached_tokens": round(r["mean_cached_tokens"], 1), "n": r["n"],
                           "cached_context": args.cached_context, "seconds": round(time.time() - t0, 1)}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    return rows


if __name__ == "__main__":
    main()
