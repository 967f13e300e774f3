"""Few-shot batch evaluation against a running server, in the style of SGLang's
``benchmark/gsm8k/bench_sglang.py``. (A benchmark, not the runtime; a little over 450 lines: the
data loaders, the frontend program, the scoring and the cache statistics of one run.)

An SGLang frontend program (``sgl.function`` + ``sgl.gen``, run with ``run_batch``) sends every
question to the server behind ``--host``/``--port``, scores the answers, and prints::

    Accuracy: 0.950
    Invalid: 0.000
    Latency: 12.345 s
    Output throughput: 45.678 token/s

followed by the server's cache statistics for the run. It then appends one JSON line to
``--result-file``.

Data:

- ``--data-path FILE``: GSM8K-format jsonl (``question`` / ``answer`` ending in ``#### N``). The
  few-shot block is the first ``--num-shots`` items with their answers, as in SGLang. The
  evaluated items are the first ``--num-questions``, so they overlap the shots as they do in SGLang.
  The prediction is the last integer in the output, after commas are removed.
- Without ``--data-path``: the held-out families of the bundled few-shot task
  (``bicache_sgl.training.task``). Each question's prompt is its family's few-shot block followed
  by ``Question: K\\nAnswer:``. Answers are compared exactly after stripping. Every family's block
  is a shared prefix for the radix tree and bicache. ``--control shuffle`` gives each family
  another family's block, and ``--control remove`` drops the blocks. Both are the "does the model
  use the prefix" control.

The distinct few-shot blocks are sent once with ``max_new_tokens: 0`` before the batch, inside the
timed region. This is what SGLang's ``run_batch`` does for a program's constant prefix.

    # against a server you started (bicache-sgl or SGLang):
    python -m bicache_sgl.launch_server --port 30000 --num-threads 1 &
    python examples/bench_fewshot.py --num-questions 200 --parallel 16
    # one command: start a server, run, stop it
    python examples/bench_fewshot.py --launch --prefix-cache naive --server-args "--num-threads 1"
    # several modes side by side (one launched server each; agreement = outputs equal to the first mode's)
    python examples/bench_fewshot.py --launch --prefix-cache off,naive,bicache --server-args "--num-threads 1"

``python -m bicache_sgl.bench.fewshot`` is the same command (the serving sweep runs it that way).

Needs the SGLang frontend package: ``pip install "sglang==0.5.2" pybase64``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import urllib.error
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..config import EngineConfig
from ..flags import add_flags
from ..io_struct import span_depth
from ..runtime import Runtime, http_json, parse_server_args

INVALID = -9999999
STOP = ["Question", "Assistant:", "<|separator|>"]
BUNDLED_TASK = "bundled_fewshot"


# --------------------------------------------------------------------------------- parsing helpers

def base_url(host: str, port: int) -> str:
    """``("http://127.0.0.1", 30000)`` or ``("127.0.0.1", 30000)`` -> ``"http://127.0.0.1:30000"``.

    SGLang's scripts join ``f"{host}:{port}"`` and so need a scheme in ``--host``. Here a plain host
    (``127.0.0.1``, ``localhost``, ``::1``, ``[::1]``) is accepted too and gets ``http://``.
    """
    host = host.strip().rstrip("/")
    m = re.match(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://(.*)$", host)
    scheme, rest = (m.group(1), m.group(2)) if m else ("http", host)
    if ":" in rest and not rest.startswith("["):  # a bare IPv6 address
        rest = f"[{rest}]"
    return f"{scheme}://{rest}:{port}"


def get_answer_value(text: str) -> int:
    """The last integer in ``text`` once thousands separators are removed, or ``INVALID``.

    This follows SGLang's GSM8K scripts: digits only, so a minus sign is not part of the number.
    """
    numbers = re.findall(r"\d+", text.replace(",", ""))
    return int(numbers[-1]) if numbers else INVALID


def gsm8k_label(answer: str) -> int:
    """The reference value of a GSM8K ``answer`` field: the number after ``####``. If there is no
    ``####``, the last integer."""
    if "####" in answer:
        answer = answer.split("####")[-1]
    return get_answer_value(answer)


# --------------------------------------------------------------------------------- data

def read_jsonl(path: str) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except ValueError as e:
                raise SystemExit(f"{path}:{n}: not valid JSON ({e})") from None
    return rows


def gsm8k_question(q: str) -> str:
    return "Question: " + q + "\nAnswer:"


def gsm8k_few_shot_block(rows: Sequence[dict], k: int) -> str:
    """The first ``k`` rows with their answers, each followed by a blank line."""
    return "".join(gsm8k_question(r["question"]) + " " + r["answer"] + "\n\n" for r in rows[:k])


def load_gsm8k(path: str, num_shots: int, num_questions: int, control: str) -> list[dict]:
    rows = read_jsonl(path)
    for n, r in enumerate(rows, 1):
        if "question" not in r or "answer" not in r:
            raise SystemExit(f"{path}: item {n} has no 'question' / 'answer'")
    if control == "shuffle":
        raise SystemExit("--control shuffle needs several prefix families (the bundled task); "
                         "use --control remove with --data-path")
    prefix = "" if control == "remove" else gsm8k_few_shot_block(rows, num_shots)
    return [{"prefix": prefix, "question": gsm8k_question(r["question"]), "label": gsm8k_label(r["answer"]),
             "family": "gsm8k"} for r in rows[:num_questions]]


def bundled_kinds() -> tuple:
    from bicache_sgl.training import task

    return tuple(getattr(task, "KINDS", ()))


def load_bundled(num_shots: int, num_questions: int, control: str, seed: int = 0,
                 kind: str | None = None) -> list[dict]:
    from bicache_sgl.training import task

    kw = {} if kind is None else {"kind": kind}
    items = task.heldout_items(num_questions, num_shots, seed=seed, **kw)
    if control != "none":
        items = task.control_items(items, control, seed=seed)
    out = []
    for it in items:
        prefix = it["prefix"] + task.EXAMPLE_SEP if it["prefix"] else ""
        question = task.QUESTION_PREFIX + it["question"] + task.ANSWER_PREFIX
        assert prefix + question == it["prompt"], "the task's prompt layout changed"
        out.append({"prefix": prefix, "question": question, "label": it["answer"], "family": it["family"]})
    return out


def score_bundled(output: str) -> tuple[str, bool]:
    """(prediction, invalid) for the bundled task: the first line, stripped; one digit is valid."""
    from bicache_sgl.training import task

    pred = task.extract_answer(output)
    return pred, pred not in set(task.VALUE_CHARS)


# --------------------------------------------------------------------------------- server stats

def fetch_server_info(url: str, api_key: str | None = None) -> dict | None:
    for route in ("/server_info", "/get_server_info"):
        try:
            info = http_json(url + route, api_key=api_key, timeout=30)
        except (OSError, ValueError):
            continue
        if isinstance(info, dict):
            return info
    return None


def internal_state(info: dict | None) -> dict:
    states = (info or {}).get("internal_states") or [{}]
    return states[0] if isinstance(states[0], dict) else {}


def cache_stats(before: dict, after: dict, metas: list[dict]) -> dict:
    """Cache statistics for this run.

    Server counters are differences between ``/server_info`` before and after the run, so they
    include the prefix requests. ``None`` where the server does not report a counter (for
    example SGLang itself).
    """
    def delta(key: str) -> float | None:
        if key not in after:
            return None
        return after[key] - before.get(key, 0)

    cached, prompt = delta("cached_tokens_total"), delta("prompt_tokens_total")
    skipped, computed = delta("skipped_layer_tokens"), delta("computed_layer_tokens")
    depths = [span_depth(m) for m in metas if m.get("bicache_depth") is not None]
    req_cached = sum(m.get("cached_tokens", 0) or 0 for m in metas)
    req_prompt = sum(m.get("prompt_tokens", 0) or 0 for m in metas)
    return {
        "prefix_cache": after.get("prefix_cache", after.get("prefix_cache_mode")),
        "cached_tokens": cached,
        "prompt_tokens": prompt,
        "cache_hit_rate": (cached / prompt) if cached is not None and prompt else None,
        "saved_compute_fraction": (skipped / (skipped + computed))
        if skipped is not None and computed is not None and skipped + computed > 0 else None,
        "request_cached_tokens": req_cached,
        "request_prompt_tokens": req_prompt,
        "request_cache_hit_rate": req_cached / req_prompt if req_prompt else None,
        "bicache_depth_mean": sum(depths) / len(depths) if depths else None,
        # avg_tokens_per_forward: bicache-sgl; avg_spec_accept_length: its alias, and SGLang's name
        "tokens_per_forward": after.get("avg_tokens_per_forward", after.get("avg_spec_accept_length")),
    }


def _default_kind() -> str | None:
    from bicache_sgl.training import task

    return getattr(task, "DEFAULT_KIND", None)


def _fmt(v: Any, spec: str = ".3f") -> str:
    if v is None:
        return "n/a"
    return format(v, spec) if isinstance(v, float) else str(v)


# --------------------------------------------------------------------------------- main

def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--num-shots", type=int, default=5)
    ap.add_argument("--data-path", default=None,
                    help="GSM8K-format jsonl; without it, the bundled task's held-out set")
    ap.add_argument("--num-questions", type=int, default=200)
    ap.add_argument("--max-new-tokens", type=int, default=None,
                    help="default: 512 with --data-path (as SGLang), 32 (one block) for the bundled task")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--parallel", type=int, default=64, help="run_batch threads (concurrent requests)")
    ap.add_argument("--host", default="http://127.0.0.1", help="a plain host (127.0.0.1) works too")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--backend", default="srt", choices=["srt"], help="only the SGLang runtime API")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--result-file", default="result.jsonl", help="one JSON line is appended per run")
    ap.add_argument("--raw-result-file", default=None,
                    help="also write one JSON line per question (prompt_id, prompt, output, pred, label, correct)")
    ap.add_argument("--control", default="none", choices=["none", "shuffle", "remove"],
                    help="shuffle: each family gets another family's few-shot block; remove: no few-shot block")
    ap.add_argument("--seed", type=int, default=0, help="bundled task: which held-out families")
    ap.add_argument("--task-kind", default=None,
                    help="bundled task: the family kind (bicache_sgl.training.task.KINDS; default: the kind "
                         "the bundled model was trained on, task.DEFAULT_KIND)")
    ap.add_argument("--no-precache", action="store_true",
                    help="do not send the few-shot blocks as prefix-only requests first")
    ap.add_argument("--launch", action="store_true",
                    help="start a server with bicache_sgl.Runtime (a free loopback port; --host/--port "
                         "are ignored), run, and stop it")
    add_flags(ap, EngineConfig, only=("model_path",),
              helps={"model_path": "--launch: the model (default: the bundled model)"})
    ap.add_argument("--server-args", default="",
                    help='--launch: extra server flags, e.g. "--num-threads 1 --block-length 32"')
    ap.add_argument("--prefix-cache", default=None,
                    help="--launch: the server's --prefix-cache (off, naive, bicache, fixed:N). Without "
                         "--launch the script checks that the running server uses this mode. With --launch, "
                         "a comma-separated list (e.g. off,naive,bicache) runs every mode in turn, one server "
                         "each, and prints them side by side (accuracy, outputs equal to the first mode's, "
                         "compute saved, mean depth)")
    args = ap.parse_args(argv)
    if args.prefix_cache and "," in args.prefix_cache and not args.launch:
        ap.error("a list of --prefix-cache modes needs --launch")
    if args.max_new_tokens is None:
        args.max_new_tokens = 512 if args.data_path else 32
    if args.num_shots < 0 or args.num_questions < 1 or args.parallel < 1:
        ap.error("--num-shots must be >= 0, --num-questions and --parallel >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    import sglang as sgl

    if args.data_path:
        task_name = "gsm8k"
        items = load_gsm8k(args.data_path, args.num_shots, args.num_questions, args.control)
    else:
        task_name = BUNDLED_TASK
        if args.task_kind is not None and args.task_kind not in bundled_kinds():
            raise SystemExit(f"--task-kind must be one of {bundled_kinds()}, got {args.task_kind!r}")
        items = load_bundled(args.num_shots, args.num_questions, args.control, args.seed, args.task_kind)

    if args.prefix_cache and "," in args.prefix_cache:
        return compare_modes(args, sgl, task_name, items)
    return _launch_and_run(args, sgl, task_name, items)


def compare_modes(args: argparse.Namespace, sgl: Any, task_name: str, items: list[dict]) -> dict:
    """Run every mode of the comma-separated ``--prefix-cache`` (one launched server each) and print
    them side by side; the first mode is the reference for output agreement."""
    modes = [m.strip() for m in args.prefix_cache.split(",") if m.strip()]
    results, outputs = {}, {}
    for mode in modes:
        print(f"=== --prefix-cache {mode}", flush=True)
        outputs[mode] = []
        results[mode] = _launch_and_run(argparse.Namespace(**{**vars(args), "prefix_cache": mode}),
                                        sgl, task_name, items, outputs[mode])
    ref = outputs[modes[0]]
    print(f"\n| mode | accuracy | outputs equal to {modes[0]} | cache hit rate | saved compute | mean depth |")
    print("|---|---|---|---|---|---|")
    for mode in modes:
        r = results[mode]
        agree = sum(a == b for a, b in zip(outputs[mode], ref)) / max(1, len(ref))
        r["agreement_with_first_mode"] = agree
        o = r["other"]
        print(f"| {mode} | {r['accuracy']:.3f} | {agree:.3f} | {_fmt(o['cache_hit_rate'])} | "
              f"{_fmt(o['saved_compute_fraction'])} | {_fmt(o['bicache_depth_mean'], '.2f')} |")
    return {"modes": modes, "results": results}


def _launch_and_run(args: argparse.Namespace, sgl: Any, task_name: str, items: list[dict],
                    outputs_out: list | None = None) -> dict:
    runtime = None
    if args.launch:
        server_kwargs = parse_server_args(args.server_args)
        if args.prefix_cache is not None:
            server_kwargs["prefix_cache"] = args.prefix_cache
        if args.model_path is not None:
            server_kwargs["model_path"] = args.model_path
        if args.api_key is not None:
            server_kwargs["api_key"] = args.api_key
        print(f"starting the server: {server_kwargs} ...", flush=True)
        runtime = Runtime(**server_kwargs)
        print(f"server at {runtime.url} (log: {runtime.log_path})", flush=True)
        url = runtime.url
    else:
        url = base_url(args.host, args.port)

    try:
        return _run(args, sgl, url, task_name, items, outputs_out)
    finally:
        if runtime is not None:
            runtime.shutdown()


def _run(args: argparse.Namespace, sgl: Any, url: str, task_name: str, items: list[dict],
         outputs_out: list | None = None) -> dict:
    try:
        backend = sgl.RuntimeEndpoint(url, api_key=args.api_key)
    except (urllib.error.URLError, OSError) as e:
        raise SystemExit(f"cannot reach a server at {url} ({e}); start one, or pass --launch") from None
    sgl.set_default_backend(backend)

    before = internal_state(fetch_server_info(url, args.api_key))
    mode = before.get("prefix_cache")
    if args.prefix_cache is not None and not args.launch and mode is not None and mode != args.prefix_cache:
        raise SystemExit(f"--prefix-cache {args.prefix_cache} was asked for, but the server at {url} uses "
                         f"{mode!r} (without --launch the flag only checks the running server)")

    @sgl.function
    def few_shot(s, prefix, question):
        s += prefix + question
        s += sgl.gen("answer", max_tokens=args.max_new_tokens, stop=STOP)

    prefixes = list(dict.fromkeys(it["prefix"] for it in items if it["prefix"]))
    arguments = [{"prefix": it["prefix"], "question": it["question"]} for it in items]

    tic = time.perf_counter()
    if prefixes and not args.no_precache:
        with ThreadPoolExecutor(min(args.parallel, len(prefixes))) as pool:
            list(pool.map(backend.cache_prefix, prefixes))
    states = few_shot.run_batch(arguments, temperature=args.temperature, num_threads=args.parallel,
                                progress_bar=True)
    latency = time.perf_counter() - tic

    outputs, metas, errors = [], [], 0
    for st in states:
        try:
            outputs.append(st["answer"])
            metas.append(st.get_meta_info("answer") or {})
        except Exception as e:
            errors += 1
            outputs.append("")
            metas.append({})
            if errors == 1:
                print(f"request failed: {e!r}", file=sys.stderr)
    if errors == len(states):
        raise SystemExit(f"all {errors} requests failed")

    preds, invalid = [], []
    for out in outputs:
        if task_name == "gsm8k":
            p = get_answer_value(out)
            preds.append(p)
            invalid.append(p == INVALID)
        else:
            p, bad = score_bundled(out)
            preds.append(p)
            invalid.append(bad)
    correct = [p == it["label"] for p, it in zip(preds, items)]
    acc = sum(correct) / len(items)
    inv = sum(invalid) / len(items)
    completion_tokens = sum(m.get("completion_tokens", 0) or 0 for m in metas)
    throughput = completion_tokens / latency

    after = internal_state(fetch_server_info(url, args.api_key))
    stats = cache_stats(before, after, metas)

    print(f"Accuracy: {acc:.3f}")
    print(f"Invalid: {inv:.3f}")
    print(f"Latency: {latency:.3f} s")
    print(f"Output throughput: {throughput:.3f} token/s")
    print(f"Prefix cache: {_fmt(stats['prefix_cache'])}")
    print(f"Cached tokens: {_fmt(stats['cached_tokens'])} of {_fmt(stats['prompt_tokens'])} prompt tokens "
          f"(server, incl. {len(prefixes) if not args.no_precache else 0} prefix requests)")
    print(f"Cache hit rate: {_fmt(stats['cache_hit_rate'])} "
          f"(questions only: {_fmt(stats['request_cache_hit_rate'])})")
    print(f"Saved compute fraction: {_fmt(stats['saved_compute_fraction'])}")
    print(f"Bicache depth (mean): {_fmt(stats['bicache_depth_mean'], '.2f')}")
    if errors:
        print(f"Failed requests: {errors}")

    result = {
        "task": task_name,
        "backend": args.backend,
        "num_gpus": 1,
        "latency": round(latency, 3),
        "accuracy": round(acc, 3),
        "num_requests": len(items),
        "other": {
            "num_questions": len(items),
            "parallel": args.parallel,
            "num_shots": args.num_shots,
            "invalid": round(inv, 3),
            "output_throughput": round(throughput, 3),
            "completion_tokens": completion_tokens,
            "max_new_tokens": args.max_new_tokens,
            "control": args.control,
            "task_kind": None if task_name == "gsm8k" else (args.task_kind or _default_kind()),
            "num_prefixes": len(prefixes),
            "failed_requests": errors,
            **stats,
        },
    }
    with open(args.result_file, "a", encoding="utf-8") as f:
        f.write(json.dumps(result) + "\n")
    if args.raw_result_file:
        with open(args.raw_result_file, "w", encoding="utf-8") as f:
            for i, (it, out, p, c) in enumerate(zip(items, outputs, preds, correct)):
                f.write(json.dumps({"prompt_id": i, "prompt": it["prefix"] + it["question"], "output": out,
                                    "pred": p, "label": it["label"], "correct": c}) + "\n")
    if outputs_out is not None:
        outputs_out.extend(outputs)
    return result


if __name__ == "__main__":
    main()
