"""The mission's workloads, cache off against bicache, default server flags, the bundled model (issue 38, item 4).

One table: workload | off | bicache | measured ratio | ideal | answers equal to off | accuracy.

Both servers are started once with ``bicache_sgl.runtime.Runtime`` (``python -m bicache_sgl.launch_server``
on a free loopback port) with the server's DEFAULT flags: the baseline gets ``--prefix-cache off`` and
nothing else, bicache gets no flag at all (bicache is the default), both get ``--num-threads`` only when
``--num-threads`` is given here. Each workload then runs through the client a user runs, once per server
per round, the two servers taking turns (off first in odd rounds, bicache first in even ones), every run
from an empty prefix cache (``/flush_cache`` before it):

- ``fewshot_gsm8k``: SGLang's own ``python -m sglang.test.few_shot_gsm8k --data-path FILE --num-questions
  200 --num-shots 5 --max-new-tokens 8 --parallel 16``, unchanged, from the newest sglang frontend
  (0.5.23, first on the subprocess's PYTHONPATH), in a fresh temporary folder (it writes
  ``tmp_output_gsm8k.txt`` there: the answers compared across the two servers). FILE is written here:
  one held-out family of the bundled model's task (``bicache_sgl.training.task``) in GSM8K's jsonl format
  (``question`` = the key, ``answer`` = the family's code digit). Its first 5 rows are the family's
  few-shot block in block order, so few_shot_gsm8k's prompt ``"Question: X\\nAnswer: Y\\n\\n" * 5 +
  "Question: K\\nAnswer:"`` is exactly the task's prompt; the later rows ask the family's keys again.
- ``frontend``: an SGLang frontend program (``sgl.function`` + ``sgl.gen``, ``run_batch``, the few-shot
  blocks first as ``cache_prefix`` requests) on held-out families of the bundled task:
  ``python -m bicache_sgl.bench.fewshot`` (examples/bench_fewshot.py), pinned sglang from the venv.
- ``gsp``: ``python -m sglang.bench_serving --backend sglang --dataset-name generated-shared-prefix``
  (pinned sglang; random-token system prompts shared by each group, random questions, ``ignore_eos``),
  private HOME so both servers get the same cached dataset, ``--seed``, ``--output-details`` for the
  generated texts.
- ``differential``: the workload of tests/test_profile_safety.py
  (``bicache_sgl.training.calib_shapes.compositions``, batches of 4, as examples/bench_profile_safety.py)
  on the offline ``bicache_sgl.Engine`` (default flags; ``prefix_cache="off"`` for the baseline; the
  server's default torch threads, every CPU but one, unless ``--num-threads``), a fresh engine per run;
  time = the batches' wall time, counters = the engine's (the same scheduler counters the server
  reports in ``/get_server_info``).

Columns: off and bicache = medians over the rounds (output tok/s as the client reports it; seconds for
``differential``); measured ratio = the median over rounds of bicache speed / off speed in the same round;
ideal = off's computed layer-tokens / bicache's computed layer-tokens (counter deltas over the same run,
``internal_states[0]`` of ``/get_server_info``, median over rounds): the speedup if time were
proportional to the layer-tokens computed; answers equal = bicache's answers equal to off's in the same
round, summed over rounds; accuracy (off / bicache, medians) where the workload has ground truth.

    python examples/bench_mission.py                              # every workload, full size, 1 round
    python examples/bench_mission.py --repeat 3 --out mission.md
    python examples/bench_mission.py --workloads fewshot_gsm8k --gsm8k-questions 48

Needs the pinned SGLang frontend (``pip install "sglang==0.5.2" pybase64``) and, for ``fewshot_gsm8k``,
the newest frontend in ``~/.cache/bicache-sgl/sglang-frontend-0.5.23`` (``pytest
tests/test_sglang_frontends.py -k newest`` installs it) or ``--sglang-frontend DIR``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..runtime import Runtime
from .serving_sweep import Workload, bench_serving_cmd, client_env, counter_delta, fewshot_cmd, git_rev

SOURCE_ROOT = Path(__file__).resolve().parents[2]
WORKLOADS = ("fewshot_gsm8k", "frontend", "gsp", "differential")
MODES = ("off", "bicache")
NEWEST_FRONTEND = "0.5.23"  # the newest sglang release the project checks (tests/test_sglang_frontends.py)
GSM8K_STATE_DUMP = "tmp_output_gsm8k.txt"


# ---------------------------------------------------------------------------------------- arguments

def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python examples/bench_mission.py", description=__doc__.split("\n\n")[0] + "\n\n" + __doc__.split(
            "\n\n", 1)[1].split("\n\n    python")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default=",".join(WORKLOADS),
                    help=f"comma-separated, from {', '.join(WORKLOADS)} (default: all, in this order)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="rounds; each round runs every workload on both servers, taking turns (default: 1)")
    ap.add_argument("--num-threads", type=int, default=None,
                    help="server --num-threads and the differential Engine's num_threads (default: not passed, "
                         "the server's own default)")
    ap.add_argument("--out", default=None, help="also write the table (with the commands) as markdown to FILE")
    ap.add_argument("--work-dir", default=None,
                    help="server logs, client logs, the GSM8K file (default: a new temporary folder, kept)")
    g = ap.add_argument_group("fewshot_gsm8k (sglang.test.few_shot_gsm8k, newest frontend)")
    g.add_argument("--gsm8k-questions", type=int, default=200, help="--num-questions (default: 200)")
    g.add_argument("--gsm8k-shots", type=int, default=5, help="--num-shots (default: 5)")
    g.add_argument("--gsm8k-max-new-tokens", type=int, default=8, help="--max-new-tokens (default: 8)")
    g.add_argument("--gsm8k-parallel", type=int, default=16, help="--parallel (default: 16)")
    g.add_argument("--gsm8k-seed", type=int, default=0, help="which held-out family (task.heldout_families seed)")
    g.add_argument("--sglang-frontend", default=None,
                   help="folder holding the newest sglang frontend (default: $BICACHE_SGL_SGLANG_NEWEST, else "
                        f"~/.cache/bicache-sgl/sglang-frontend-{NEWEST_FRONTEND})")
    g = ap.add_argument_group("frontend (bicache_sgl.bench.fewshot: run_batch, pinned sglang)")
    g.add_argument("--frontend-questions", type=int, default=200, help="--num-questions (default: 200)")
    g.add_argument("--frontend-shots", type=int, default=5, help="--num-shots (default: 5)")
    g.add_argument("--frontend-parallel", type=int, default=16, help="--parallel (default: 16)")
    g = ap.add_argument_group("gsp (sglang.bench_serving --dataset-name generated-shared-prefix, pinned sglang)")
    g.add_argument("--gsp-groups", type=int, default=4, help="--gsp-num-groups (default: 4)")
    g.add_argument("--gsp-per-group", type=int, default=8, help="--gsp-prompts-per-group (default: 8)")
    g.add_argument("--gsp-system-len", type=int, default=256, help="--gsp-system-prompt-len (default: 256)")
    g.add_argument("--gsp-question-len", type=int, default=32, help="--gsp-question-len (default: 32)")
    g.add_argument("--gsp-output-len", type=int, default=16, help="--gsp-output-len (ignore_eos; default: 16)")
    g.add_argument("--gsp-concurrency", type=int, default=8, help="--max-concurrency (default: 8)")
    g.add_argument("--seed", type=int, default=1, help="bench_serving --seed (default: 1)")
    g = ap.add_argument_group("differential (calib_shapes.compositions on the offline Engine)")
    g.add_argument("--diff-seeds", type=int, default=4, help="composition seeds 0..N-1 (default: 4, as the test)")
    g.add_argument("--diff-batch", type=int, default=4, help="requests per run_sync batch (default: 4)")
    ap.add_argument("--server-timeout", type=float, default=300.0, help="seconds to wait for a server")
    ap.add_argument("--run-timeout", type=float, default=900.0, help="seconds per client run")
    return ap


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    args.workload_list = [w.strip() for w in args.workloads.split(",") if w.strip()]
    bad = [w for w in args.workload_list if w not in WORKLOADS]
    if bad or not args.workload_list:
        ap.error(f"--workloads: unknown {bad}; choose from {', '.join(WORKLOADS)}")
    args.workload_list = [w for w in WORKLOADS if w in args.workload_list]  # the table's order
    if args.repeat < 1:
        ap.error("--repeat must be >= 1")
    if args.gsm8k_shots < 1 or args.gsm8k_questions < 1:
        ap.error("--gsm8k-shots and --gsm8k-questions must be >= 1")
    return args


# ---------------------------------------------------------------------------------------- fewshot_gsm8k

def gsm8k_rows(num_questions: int, num_shots: int, seed: int = 0) -> list[dict]:
    """GSM8K-format rows (``question``, ``answer``) of ONE held-out family of the bundled task.

    few_shot_gsm8k uses rows[:num_shots] (with answers) as its few-shot block and rows[:num_questions]
    as its questions. Rows[:num_shots] are the family's examples in block order, so its block is the
    family's ``build_prefix(pairs) + EXAMPLE_SEP`` and every prompt is ``task.build_prompt(block, key)``;
    the further rows ask the family's shown keys in a seeded order. ``answer`` is the code digit, the
    number few_shot_gsm8k's ``get_answer_value`` reads."""
    import random

    from bicache_sgl.training import task

    fam = task.heldout_families(1, num_shots, seed)[0]
    pairs = list(fam.pairs)
    rows = [{"question": k, "answer": v} for k, v in pairs]
    rng = random.Random(f"bicache-mission-gsm8k|{seed}|{num_shots}")
    while len(rows) < num_questions:
        k, v = rng.choice(pairs)
        rows.append({"question": k, "answer": v})
    return rows


def write_gsm8k_file(path: Path, num_questions: int, num_shots: int, seed: int = 0) -> list[dict]:
    rows = gsm8k_rows(num_questions, num_shots, seed)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def parse_state_dump(text: str) -> list[str]:
    """The program states sglang's ``dump_state_text`` wrote (``=`*40 i =`*40``, the text, ``=`*80``),
    in index order."""
    pat = re.compile(r"^={40} (\d+) ={40}\n(.*?)\n={80}\n\n", re.S | re.M)
    found = {int(m.group(1)): m.group(2) for m in pat.finditer(text)}
    return [found[i] for i in sorted(found)]


def parse_client_stdout(text: str) -> dict:
    """Accuracy / Invalid / Latency / Output throughput lines of few_shot_gsm8k (and bench_fewshot)."""
    out = {}
    for key, pat in (("accuracy", r"^Accuracy: ([\d.]+)"), ("invalid", r"^Invalid: ([\d.]+)"),
                     ("latency", r"^Latency: ([\d.]+) s"), ("output_throughput", r"^Output throughput: ([\d.]+)")):
        m = re.search(pat, text, re.M)
        if m:
            out[key] = float(m.group(1))
    return out


def frontend_dir(args) -> Path:
    if args.sglang_frontend:
        return Path(args.sglang_frontend)
    env = os.environ.get("BICACHE_SGL_SGLANG_NEWEST")
    if env:
        return Path(env)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "bicache-sgl" / f"sglang-frontend-{NEWEST_FRONTEND}"


def frontend_version(folder: Path) -> str | None:
    """The sglang version installed in ``folder`` (its dist-info), or None."""
    found = sorted(folder.glob("sglang-*.dist-info"))
    return found[0].name[len("sglang-"):-len(".dist-info")] if found else None


# ---------------------------------------------------------------------------------------- running

def run_logged(cmd: list[str], env: dict, log_path: Path, timeout: float, cwd: Path | None = None) -> tuple:
    """(returncode, wall s, stdout + stderr); everything is appended to ``log_path`` too."""
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, timeout=timeout,
                           cwd=None if cwd is None else str(cwd))
        rc, out = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        rc, out = 124, (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
    with open(log_path, "a", encoding="utf-8") as log:
        log.write("$ " + shlex.join(cmd) + (f"  (cwd {cwd})" if cwd else "") + "\n" + out + "\n")
    return rc, time.perf_counter() - t0, out


def with_pythonpath(env: dict, *first: str) -> dict:
    return dict(env, PYTHONPATH=os.pathsep.join([*first, *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])]))


class Ctx:
    """What every workload run needs: the parsed flags, the work folder, the data, the model path."""

    def __init__(self, args, work: Path, model_path: str) -> None:
        self.args, self.work, self.model_path = args, work, model_path
        self.logs = work / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.home = work / "client_home"
        self.home.mkdir(exist_ok=True)
        self.gsm8k_file = work / "gsm8k_bundled_task.jsonl"
        self.commands: dict[str, str] = {}


def run_fewshot_gsm8k(ctx: Ctx, server: Runtime, mode: str, rnd: int) -> dict:
    a = ctx.args
    cwd = ctx.work / f"gsm8k_{mode}_round{rnd + 1}"
    cwd.mkdir(exist_ok=True)
    (cwd / GSM8K_STATE_DUMP).unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "sglang.test.few_shot_gsm8k", "--data-path", str(ctx.gsm8k_file),
           "--num-questions", str(a.gsm8k_questions), "--num-shots", str(a.gsm8k_shots),
           "--max-new-tokens", str(a.gsm8k_max_new_tokens), "--parallel", str(a.gsm8k_parallel),
           "--host", "127.0.0.1", "--port", str(server.port)]
    ctx.commands["fewshot_gsm8k"] = f"PYTHONPATH={frontend_dir(a)} " + shlex.join(
        ["python", *cmd[1:-1], "PORT"])
    env = with_pythonpath(client_env(ctx.home), str(frontend_dir(a)))
    rc, wall, out = run_logged(cmd, env, ctx.logs / f"fewshot_gsm8k_{mode}.log", a.run_timeout, cwd)
    got = parse_client_stdout(out)
    if rc != 0 or "output_throughput" not in got:
        return {"error": f"few_shot_gsm8k exited with {rc} (log: {ctx.logs / f'fewshot_gsm8k_{mode}.log'})"}
    dump = cwd / GSM8K_STATE_DUMP
    answers = parse_state_dump(dump.read_text()) if dump.exists() else None
    return {"speed": got["output_throughput"], "shown": got["output_throughput"], "unit": "tok/s",
            "accuracy": got.get("accuracy"), "answers": answers, "wall": wall}


def run_frontend(ctx: Ctx, server: Runtime, mode: str, rnd: int) -> dict:
    a = ctx.args
    rf = ctx.logs / f"frontend_{mode}_round{rnd + 1}.result.jsonl"
    raw = ctx.logs / f"frontend_{mode}_round{rnd + 1}.raw.jsonl"
    rf.unlink(missing_ok=True)
    wl = Workload("frontend", "fewshot", 0.0, {"num_questions": a.frontend_questions, "num_shots": a.frontend_shots})
    cmd = fewshot_cmd(server.url, wl, a.frontend_parallel, rf, raw)
    ctx.commands["frontend"] = shlex.join(["python", *cmd[1:cmd.index("--port") + 1], "PORT",
                                           *cmd[cmd.index("--port") + 2:cmd.index("--result-file")]])
    env = with_pythonpath(client_env(ctx.home), str(SOURCE_ROOT))
    rc, wall, _ = run_logged(cmd, env, ctx.logs / f"frontend_{mode}.log", a.run_timeout)
    if rc != 0 or not rf.exists():
        return {"error": f"bench_fewshot exited with {rc} (log: {ctx.logs / f'frontend_{mode}.log'})"}
    b = json.loads(rf.read_text().splitlines()[-1])
    answers = [json.loads(ln)["output"] for ln in raw.read_text().splitlines() if ln.strip()]
    return {"speed": b["other"]["output_throughput"], "shown": b["other"]["output_throughput"], "unit": "tok/s",
            "accuracy": b["accuracy"], "answers": answers, "wall": wall}


def run_gsp(ctx: Ctx, server: Runtime, mode: str, rnd: int) -> dict:
    a = ctx.args
    out_file = ctx.logs / f"gsp_{mode}_round{rnd + 1}.jsonl"
    out_file.unlink(missing_ok=True)
    wl = Workload("gsp", "gsp", 0.0, {"num_groups": a.gsp_groups, "prompts_per_group": a.gsp_per_group,
                                      "system_prompt_len": a.gsp_system_len, "question_len": a.gsp_question_len,
                                      "output_len": a.gsp_output_len})
    cmd = bench_serving_cmd(server.url, ctx.model_path, wl, a.gsp_concurrency, a.seed, out_file) + ["--output-details"]
    shown = [("http://127.0.0.1:PORT" if c == server.url else c) for c in cmd[1:]]
    shown[shown.index("--output-file") + 1] = "OUT.jsonl"
    ctx.commands["gsp"] = "HOME=PRIVATE_DIR " + shlex.join(["python", *shown])
    rc, wall, _ = run_logged(cmd, client_env(ctx.home), ctx.logs / f"gsp_{mode}.log", a.run_timeout)
    if rc != 0 or not out_file.exists():
        return {"error": f"bench_serving exited with {rc} (log: {ctx.logs / f'gsp_{mode}.log'})"}
    b = json.loads(out_file.read_text().splitlines()[-1])
    return {"speed": b["output_throughput"], "shown": b["output_throughput"], "unit": "tok/s", "accuracy": None,
            "answers": b.get("generated_texts"), "wall": wall, "completed": b.get("completed")}


def differential_truth(prompt: str) -> str | None:
    """The answer a composition's prompt asks for: the value shown for the asked key in the LAST block
    that shows it (the question's family's block is the last one in the prompt)."""
    m = re.search(r"Question: (\S+)\nAnswer:$", prompt)
    if not m:
        return None
    found = re.findall(r"Question: " + re.escape(m.group(1)) + r"\nAnswer: (\S+)\n", prompt)
    return found[-1] if found else None


def run_differential(ctx: Ctx, mode: str, rnd: int) -> dict:
    """The differential test's workload on a fresh offline Engine (cold cache), batches of --diff-batch."""
    from bicache_sgl import Engine
    from bicache_sgl.config import SamplingParams
    from bicache_sgl.io_struct import GenerateRequest
    from bicache_sgl.training.calib_shapes import compositions

    a = ctx.args
    reqs = [r for s in range(a.diff_seeds) for r in compositions(s)]
    from bicache_sgl.engine.process_child import default_engine_threads

    kw: dict[str, Any] = {} if mode == "bicache" else {"prefix_cache": "off"}
    # The server's engine process sets every CPU but one when --num-threads is not given; the offline
    # Engine leaves torch's default (every core), which on a loaded 2-core machine made these runs
    # 30x slower (OpenMP threads waiting on each other). So the Engine gets the server's default.
    threads = a.num_threads or default_engine_threads()
    if threads:
        kw["num_threads"] = threads
    ctx.commands["differential"] = (f"Engine({', '.join(f'{k}={v!r}' for k, v in kw.items())}).run_sync over "
                                    f"calib_shapes.compositions(seed) for seed < {a.diff_seeds}, batches of "
                                    f"{a.diff_batch} ({len(reqs)} requests)")
    eng = Engine(**kw)
    try:
        before = dict(eng.get_stats())
        t0 = time.perf_counter()
        events = []
        for i in range(0, len(reqs), a.diff_batch):
            events += eng.run_sync([GenerateRequest(eng.encode(p), SamplingParams.from_dict(sp))
                                    for p, sp in reqs[i:i + a.diff_batch]])
        secs = time.perf_counter() - t0
        after = dict(eng.get_stats())
    finally:
        eng.shutdown()
    truth = [differential_truth(p) for p, _ in reqs]
    # the answer is the first character after the leading space: with ignore_eos the noise after the
    # digit runs on in the same line (" 9004449..."), so task.extract_answer's first line is not it
    graded = [(e.text.lstrip()[:1], t) for e, t in zip(events, truth) if t is not None]
    return {"speed": 1.0 / secs, "shown": secs, "unit": "s", "answers": [list(e.output_ids) for e in events],
            "accuracy": sum(p == t for p, t in graded) / len(graded) if graded else None, "wall": secs,
            **counter_delta(before, after)}


def run_on_server(ctx: Ctx, name: str, server: Runtime, mode: str, rnd: int) -> dict:
    try:
        server.flush_cache(timeout=30)
        before = server.internal_state()
    except (OSError, ValueError) as e:
        return {"error": f"server not answering before the run: {e} (log: {server.log_path})"}
    res = {"fewshot_gsm8k": run_fewshot_gsm8k, "frontend": run_frontend, "gsp": run_gsp}[name](ctx, server, mode, rnd)
    try:
        after = server.internal_state()
    except (OSError, ValueError) as e:
        return {"error": f"server not answering after the run: {e} (log: {server.log_path})"}
    res.update(counter_delta(before, after))
    return res


# ---------------------------------------------------------------------------------------- the table

def _median(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def build_row(name: str, off_runs: list[dict], bic_runs: list[dict]) -> dict:
    """One table row from the rounds' runs (off_runs[i] and bic_runs[i] are round i's).

    measured = median over rounds of bicache speed / off speed (speed: tok/s, or 1/s for a time);
    ideal = median over rounds of off computed_layer_tokens / bicache computed_layer_tokens;
    equal = bicache answers equal to the same round's off answers, summed over rounds."""
    row: dict[str, Any] = {"workload": name, "rounds": len(off_runs)}
    errors = [r["error"] for r in off_runs + bic_runs if "error" in r]
    if errors:
        row["errors"] = errors
    pairs = [(o, b) for o, b in zip(off_runs, bic_runs) if "error" not in o and "error" not in b]
    ok_off = [r for r in off_runs if "error" not in r]
    ok_bic = [r for r in bic_runs if "error" not in r]
    row["unit"] = (ok_off or ok_bic or [{}])[0].get("unit")
    row["off"] = _median([r["shown"] for r in ok_off])
    row["bicache"] = _median([r["shown"] for r in ok_bic])
    row["measured"] = _median([b["speed"] / o["speed"] for o, b in pairs if o["speed"] > 0])
    row["ideal"] = _median([o["computed_layer_tokens"] / b["computed_layer_tokens"] for o, b in pairs
                            if b.get("computed_layer_tokens") and o.get("computed_layer_tokens") is not None])
    equal = total = 0
    for o, b in pairs:
        if o.get("answers") is None or b.get("answers") is None:
            continue
        total += len(o["answers"])
        equal += sum(x == y for x, y in zip(o["answers"], b["answers"]))
    row["equal"], row["total"] = (equal, total) if total else (None, None)
    row["acc_off"] = _median([r.get("accuracy") for r in ok_off])
    row["acc_bicache"] = _median([r.get("accuracy") for r in ok_bic])
    skipped = [b.get("skipped_layer_tokens", 0) / (b.get("skipped_layer_tokens", 0) + b["computed_layer_tokens"])
               for _, b in pairs if b.get("computed_layer_tokens")]
    row["skipped_fraction"] = _median(skipped)
    return row


def _num(v: float | None, unit: str | None) -> str:
    if v is None:
        return "n/a"
    return f"{v:.2f} s" if unit == "s" else f"{v:.1f} {unit or ''}".strip()


TABLE_HEAD = ("| workload | off | bicache | measured ratio (bicache / off speed) | ideal (off / bicache computed "
              "layer-tokens) | answers equal to off | accuracy (off / bicache) |")


def format_table(rows: list[dict]) -> str:
    lines = [TABLE_HEAD, "|---|---|---|---|---|---|---|"]
    for r in rows:
        eq = "n/a" if r.get("total") is None else f"{r['equal']}/{r['total']}"
        a_off, a_bic = (("n/a" if v is None else f"{v:.3f}") for v in (r.get("acc_off"), r.get("acc_bicache")))
        acc = "n/a" if a_off == a_bic == "n/a" else f"{a_off} / {a_bic}"
        ratio = "n/a" if r.get("measured") is None else f"{r['measured']:.2f}x"
        ideal = "n/a" if r.get("ideal") is None else f"{r['ideal']:.2f}x"
        err = f" (errors: {'; '.join(r['errors'])})" if r.get("errors") else ""
        lines.append(f"| {r['workload']}{err} | {_num(r.get('off'), r.get('unit'))} | "
                     f"{_num(r.get('bicache'), r.get('unit'))} | {ratio} | {ideal} | {eq} | {acc} |")
    return "\n".join(lines)


WORKLOAD_LABEL = {
    "fewshot_gsm8k": "SGLang few_shot_gsm8k (sglang {ver}, {q} questions, {s} shots, {t} new tokens, parallel {p})",
    "frontend": "SGLang frontend run_batch, shared few-shot prefixes ({q} questions, {s} shots, parallel {p})",
    "gsp": "sglang.bench_serving generated-shared-prefix ({g}x{n} requests, system {sl} + question {ql}, "
           "{o} tokens ignore_eos, concurrency {c})",
    "differential": "differential workload (tests/test_profile_safety.py, {n} requests, offline Engine, "
                    "batches of {b})",
}


def label(name: str, args, ver: str | None = None) -> str:
    a = args
    if name == "fewshot_gsm8k":
        return WORKLOAD_LABEL[name].format(ver=ver or "?", q=a.gsm8k_questions, s=a.gsm8k_shots,
                                           t=a.gsm8k_max_new_tokens, p=a.gsm8k_parallel)
    if name == "frontend":
        return WORKLOAD_LABEL[name].format(q=a.frontend_questions, s=a.frontend_shots, p=a.frontend_parallel)
    if name == "gsp":
        return WORKLOAD_LABEL[name].format(g=a.gsp_groups, n=a.gsp_per_group, sl=a.gsp_system_len,
                                           ql=a.gsp_question_len, o=a.gsp_output_len, c=a.gsp_concurrency)
    from bicache_sgl.training.calib_shapes import compositions
    n = sum(len(compositions(s)) for s in range(a.diff_seeds))
    return WORKLOAD_LABEL[name].format(n=n, b=a.diff_batch)


# ---------------------------------------------------------------------------------------- main

def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def start_servers(ctx: Ctx) -> dict[str, Runtime]:
    servers: dict[str, Runtime] = {}
    for mode in MODES:
        flags: dict[str, Any] = {} if mode == "bicache" else {"prefix_cache": "off"}
        if ctx.args.num_threads:
            flags["num_threads"] = ctx.args.num_threads
        progress(f"starting the {mode} server ({flags or 'default flags'}) ...")
        t0 = time.perf_counter()
        rt = Runtime(timeout=ctx.args.server_timeout, log_path=str(ctx.logs / f"server_{mode}.log"),
                     env={"TOKENIZERS_PARALLELISM": "false"}, **flags)
        servers[mode] = rt
        # first-call costs out of the timed runs; the runs start from an empty cache anyway
        rt.generate("Question: B\nAnswer:", {"max_new_tokens": 8, "temperature": 0}, timeout=600)
        rt.flush_cache(timeout=30)
        progress(f"  {mode}: {shlex.join(rt.cmd[1:])} ({time.perf_counter() - t0:.0f} s)")
    return servers


def describe_run(res: dict) -> str:
    if "error" in res:
        return "ERROR " + res["error"]
    s = _num(res["shown"], res["unit"])
    acc = "" if res.get("accuracy") is None else f", accuracy {res['accuracy']:.3f}"
    ct = res.get("computed_layer_tokens")
    return s + acc + ("" if ct is None else f", computed {ct} / skipped {res.get('skipped_layer_tokens', 0)} "
                                            f"layer-tokens") + f" ({res.get('wall', 0):.0f} s)"


def main(argv: Sequence[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    command = "python examples/bench_mission.py" + ("" if not argv else " " + shlex.join(argv))
    from bicache_sgl.models.loader import resolve_model_path

    model_path = resolve_model_path(None)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bicache-mission-"))
    work.mkdir(parents=True, exist_ok=True)
    ctx = Ctx(args, work, model_path)
    ver = None
    if "fewshot_gsm8k" in args.workload_list:
        fdir = frontend_dir(args)
        ver = frontend_version(fdir)
        if ver is None:
            raise SystemExit(f"no sglang frontend in {fdir}: run `pytest tests/test_sglang_frontends.py -k newest` "
                             "(installs it there) or pass --sglang-frontend DIR")
        write_gsm8k_file(ctx.gsm8k_file, args.gsm8k_questions, args.gsm8k_shots, args.gsm8k_seed)
    progress(f"command: {command}\nmodel: {model_path}\nwork folder: {work}\nworkloads: "
             + ", ".join(args.workload_list) + f"; {args.repeat} round(s)")
    runs: dict[tuple[str, str], list[dict]] = {}
    server_cmds: dict[str, str] = {}
    t_start = time.perf_counter()
    servers: dict[str, Runtime] = {}
    try:
        if any(w != "differential" for w in args.workload_list):
            servers = start_servers(ctx)
            server_cmds = {m: shlex.join(["python", *rt.cmd[1:]]) for m, rt in servers.items()}
        for rnd in range(args.repeat):
            order = MODES if rnd % 2 == 0 else MODES[::-1]
            for name in args.workload_list:
                for mode in order:
                    progress(f"[round {rnd + 1}/{args.repeat}] {name} {mode} ...")
                    if name == "differential":
                        res = run_differential(ctx, mode, rnd)
                    else:
                        res = run_on_server(ctx, name, servers[mode], mode, rnd)
                    runs.setdefault((name, mode), []).append(res)
                    progress(f"[round {rnd + 1}/{args.repeat}] {name} {mode}: {describe_run(res)}")
    finally:
        for rt in servers.values():
            rt.shutdown()
    total_s = time.perf_counter() - t_start
    rows = []
    for name in args.workload_list:
        row = build_row(label(name, args, ver), runs.get((name, "off"), []), runs.get((name, "bicache"), []))
        row["key"] = name
        rows.append(row)
    table = format_table(rows)
    setup = [f"- model: the bundled `{model_path}`",
             *(f"- {m} server: `{c}`" for m, c in server_cmds.items()),
             *(f"- {n}: `{c}`" for n, c in ctx.commands.items()),
             f"- {args.repeat} round(s), off and bicache taking turns on each workload (off first in odd rounds); "
             "each run from an empty prefix cache",
             f"- git {git_rev()}, {os.cpu_count()} CPUs, total {total_s / 60:.1f} min, logs in {work}"]
    notes = ("off / bicache: medians over rounds (output tok/s as the client reports it; seconds for the "
             "differential workload). measured ratio: median over rounds of bicache speed / off speed. ideal: off's "
             "computed layer-tokens / bicache's (server counters, same run). answers equal: bicache's outputs equal "
             "to off's in the same round, summed over rounds.")
    md = "\n".join([f"command: `{command}`", "", *setup, "", table, "", notes]) + "\n"
    if args.out:
        Path(args.out).write_text(md)
    (work / "results.json").write_text(json.dumps(
        {"command": command, "rows": rows, "commands": ctx.commands, "servers": server_cmds,
         "runs": {f"{n}|{m}": [{k: v for k, v in r.items() if k != "answers"} for r in rs]
                  for (n, m), rs in runs.items()}}, indent=1, default=str))
    print("\n" + md, flush=True)
    return {"rows": rows, "runs": runs, "markdown": md}


__all__ = ["build_row", "format_table", "gsm8k_rows", "main", "parse_state_dump"]


if __name__ == "__main__":
    main()
