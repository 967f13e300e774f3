"""Structured generation from an SGLang frontend program (docs/structured.md).

1. The demo (default): one ``sgl.function`` extracts fields from a short text with a regex
   (``gen(regex=...)``), an ``int`` dtype (the frontend sends it as a regex), a choice
   (``gen(choices=...)``, the select path) and a JSON schema (``gen(json_schema=...)``), then checks
   every field: the regexes match in full, the JSON parses and validates against the schema.
   With the bundled model (trained only on the few-shot digit task) the fields are well formed
   but their content is not meaningful; with a real checkpoint (``--model-path``) it is.

2. ``--bench``: the cost of a constraint on the few-shot workload of the bundled model
   (``bicache_sgl.training.task``, held-out families). The same questions run without a
   constraint (``free``), with the answer-format regex ``" [0-9]"`` (``regex``) and with a JSON
   schema ``{"answer": 0..9}`` (``json``), ``--repeat`` times in turn; it prints accuracy, invalid
   answers, output tokens/s, requests/s and forward passes per request, the median over the repeats.

    # against a server you started
    python -m bicache_sgl.launch_server --port 30000 --num-threads 1 &
    python examples/frontend_structured.py --port 30000
    # or let the script start one (bundled model unless --model-path) and stop it at the end
    python examples/frontend_structured.py --launch
    python examples/frontend_structured.py --launch --bench --num-questions 200 --parallel 16 --repeat 3

Needs the SGLang frontend package: ``pip install "sglang==0.5.2" pybase64``.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

ORDER_TEXT = ("Order 4411 was placed by Alice Moreau on 2024-05-17: three boxes of green tea, "
              "express shipping, paid by card.")
ORDER_SCHEMA = {
    "type": "object",
    "properties": {
        "customer": {"type": "string", "maxLength": 16},
        "items": {"type": "integer", "minimum": 1, "maximum": 99},
        "ship_date": {"type": "string", "format": "date"},
        "express": {"type": "boolean"},
    },
    "required": ["customer", "items", "ship_date", "express"],
}
ORDER_ID = r" [0-9]{4}"
ANSWER_REGEX = r" [0-9]"
ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 9}},
                 "required": ["answer"]}
STOP = ["Question", "Assistant:", "<|separator|>"]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--launch", action="store_true", help="start a server (bicache_sgl.Runtime) and stop it after")
    ap.add_argument("--model-path", default=None, help="--launch: the model (default: the bundled model)")
    ap.add_argument("--num-threads", type=int, default=1, help="--launch: the engine's torch threads")
    ap.add_argument("--bench", action="store_true", help="measure the few-shot workload instead of the demo")
    ap.add_argument("--num-questions", type=int, default=200)
    ap.add_argument("--num-shots", type=int, default=5)
    ap.add_argument("--control", default="none", choices=["none", "remove", "shuffle"],
                    help="bench: 'remove' drops the few-shot blocks (the model can only guess)")
    ap.add_argument("--parallel", type=int, default=16, help="bench: concurrent requests (run_batch threads)")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="bench: one block of the default server")
    ap.add_argument("--repeat", type=int, default=3, help="bench: rounds of (free, regex, json)")
    ap.add_argument("--modes", default="free,regex,json")
    return ap.parse_args(argv)


# ------------------------------------------------------------------------------------------- demo

def demo(sgl) -> bool:
    @sgl.function
    def extract(s, text):
        s += "Text: " + text + "\n"
        s += "Order id:" + sgl.gen("order_id", max_tokens=8, regex=ORDER_ID, temperature=0)
        s += "\nBoxes:" + sgl.gen("boxes", max_tokens=6, dtype=int, temperature=0)
        s += "\nShipping:" + sgl.gen("shipping", choices=[" standard", " express"])
        s += "\nRecord: " + sgl.gen("record", max_tokens=96, json_schema=json.dumps(ORDER_SCHEMA), temperature=0)

    st = extract.run(text=ORDER_TEXT)
    record = st["record"]
    print(f"order_id: {st['order_id']!r}\nboxes:    {st['boxes']!r}\nshipping: {st['shipping']!r}\n"
          f"record:   {record}")
    ok = bool(re.fullmatch(ORDER_ID, st["order_id"]))
    from sglang.lang.ir import REGEX_INT

    ok &= bool(re.fullmatch(REGEX_INT, st["boxes"])) and st["shipping"] in (" standard", " express")
    try:
        obj = json.loads(record)
        try:
            import jsonschema

            jsonschema.validate(obj, ORDER_SCHEMA)
        except ImportError:
            pass
    except Exception as e:  # json.JSONDecodeError or jsonschema.ValidationError
        print(f"record does not validate: {e}")
        ok = False
    print("all fields well formed" if ok else "SOME FIELD IS MALFORMED")
    return ok


# ------------------------------------------------------------------------------------------ bench

def load_items(args) -> list[dict]:
    from bicache_sgl.training import task

    items = task.heldout_items(args.num_questions, args.num_shots, seed=0)
    if args.control != "none":
        items = task.control_items(items, args.control, seed=0)
    out = []
    for it in items:
        prefix = it["prefix"] + task.EXAMPLE_SEP if it["prefix"] else ""
        question = task.QUESTION_PREFIX + it["question"] + task.ANSWER_PREFIX
        out.append({"prefix": prefix, "question": question, "label": it["answer"]})
    return out


def score(mode: str, text: str, label: str) -> tuple[bool, bool]:
    """(correct, invalid)."""
    from bicache_sgl.training import task

    if mode == "json":
        try:
            pred = str(json.loads(text)["answer"])
        except (ValueError, KeyError, TypeError):
            return False, True
    else:
        pred = task.extract_answer(text)
    return pred == label, pred not in set(task.VALUE_CHARS)


def run_mode(sgl, backend, items: list[dict], mode: str, args) -> dict:
    constraint = {"free": {}, "regex": {"regex": ANSWER_REGEX},
                  "json": {"json_schema": json.dumps(ANSWER_SCHEMA)}}[mode]

    @sgl.function
    def few_shot(s, prefix, question):
        s += prefix + question
        s += sgl.gen("answer", max_tokens=args.max_new_tokens, stop=STOP, **constraint)

    backend.flush_cache()
    prefixes = list(dict.fromkeys(it["prefix"] for it in items if it["prefix"]))
    tic = time.perf_counter()
    if prefixes:  # as run_batch does for a program's constant prefix
        with ThreadPoolExecutor(min(args.parallel, len(prefixes))) as pool:
            list(pool.map(backend.cache_prefix, prefixes))
    states = few_shot.run_batch([{"prefix": it["prefix"], "question": it["question"]} for it in items],
                                temperature=0, num_threads=args.parallel)
    wall = time.perf_counter() - tic
    texts = [st["answer"] for st in states]
    metas = [st.get_meta_info("answer") or {} for st in states]
    scored = [score(mode, t, it["label"]) for t, it in zip(texts, items)]
    tokens = sum(m.get("completion_tokens", 0) for m in metas)
    return {"accuracy": sum(c for c, _ in scored) / len(items), "invalid": sum(b for _, b in scored) / len(items),
            "tokens_per_s": tokens / wall, "requests_per_s": len(items) / wall,
            "tokens_per_request": tokens / len(items),
            "forwards_per_request": sum(m.get("forward_passes", 0) for m in metas) / len(items),
            "aborted": sum((m.get("finish_reason") or {}).get("type") == "abort" for m in metas), "wall_s": wall}


def bench(sgl, backend, args) -> None:
    items = load_items(args)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    rows: dict[str, list[dict]] = {m: [] for m in modes}
    run_mode(sgl, backend, items[: min(len(items), 16)], modes[0], args)  # warm-up (compiles, first calls)
    for r in range(args.repeat):
        for m in modes:
            rows[m].append(run_mode(sgl, backend, items, m, args))
            print(f"round {r + 1} {m:5s} " + " ".join(f"{k}={v:.3f}" for k, v in rows[m][-1].items()), flush=True)
    print(f"\n{len(items)} questions, {args.num_shots} shots, control={args.control}, parallel={args.parallel}, "
          f"max_new_tokens={args.max_new_tokens}; median of {args.repeat} rounds")
    print("| mode | accuracy | invalid | output tokens/s | requests/s | tokens/request | forwards/request |")
    print("|---|---|---|---|---|---|---|")
    for m in modes:
        med = {k: statistics.median(x[k] for x in rows[m]) for k in rows[m][0]}
        print(f"| {m} | {med['accuracy']:.3f} | {med['invalid']:.3f} | {med['tokens_per_s']:.1f} | "
              f"{med['requests_per_s']:.2f} | {med['tokens_per_request']:.2f} | {med['forwards_per_request']:.2f} |")


def main(argv=None) -> int:
    args = parse_args(argv)
    import sglang as sgl

    runtime = None
    if args.launch:
        from bicache_sgl.runtime import Runtime

        runtime = Runtime(args.model_path, num_threads=args.num_threads)
        url = runtime.url
        print(f"server at {url} (log: {runtime.log_path})", flush=True)
    else:
        url = f"http://{args.host}:{args.port}"
    try:
        backend = sgl.RuntimeEndpoint(url)
        sgl.set_default_backend(backend)
        if args.bench:
            bench(sgl, backend, args)
            return 0
        return 0 if demo(sgl) else 1
    finally:
        if runtime is not None:
            runtime.shutdown()


if __name__ == "__main__":
    sys.exit(main())
