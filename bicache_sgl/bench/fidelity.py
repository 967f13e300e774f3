"""The fidelity table (issue 12.3): what prefix reuse does to a model's outputs, per mode and r.

For each model (the bundled one, the planted one of ``bicache_sgl.testing.planted``, the trained
context-dependent one, or any ``--model NAME=PATH:KIND``) and each prefix fraction r, a set of
few-shot items (families of questions sharing one prefix) runs through ``bicache_sgl.Engine`` once per
prefix-cache mode (``off``, ``naive``, ``bicache``, ``fixed:k``), each with a fresh engine: each
family's first question runs first, alone in its batch, and stores the shared prefix computed in
its own context; the family's other questions then reuse it (the state a server reuses). r is set by
the generation length G: ``r = shared tokens / (prompt + G)``. Reported over the reusing requests:

- ``acc``: accuracy against the task's answer;
- ``agree``: share of requests whose output token ids equal ``off``'s;
- ``KL``, ``top1``: mean KL(off || mode) and top-1 agreement of the first forward's distributions at
  the masked positions (recorded by wrapping ``engine.model.forward_batch``, matched to ``off`` by
  the sequence's token ids); ``KL@ans``: the same KL at the first two positions only, where the
  answer goes (the rest is EOS padding);
- ``depth``: mean ``bicache_depth`` used; ``saved``: layer-token compute saved,
  ``skipped_layer_tokens / (skipped + computed)`` over the whole run (first requests included).

Decoding: one block of G positions, ``min(G, --steps)`` steps (``G / steps`` tokens unmasked per
step, lowest confidence remasked), argmax, in-request cache off, so the only difference between modes
is the prefix reuse.

    python examples/fidelity_table.py --out docs/fidelity_table.json --plot docs/images/fidelity.png
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import EngineConfig
from ..flags import add_flags
from ..io_struct import span_depth

DEFAULT_RS = (0.2, 0.4, 0.6, 0.8)
DEFAULT_FIXED = (1, 2, 4)

# planted model: prefixes without digits, one digit per question (docs/fidelity.md); each prefix ends
# with a blank line, a segment boundary, so the span cut leaves it reusable (docs/prefix_cache.md)
PLANTED_PREFIXES = (
    "System: answer with the digit that the question holds. Be brief and exact.\n\n",
    "You are a careful assistant. Read the question and repeat its digit, nothing else.\n\n",
    "Instructions: find the number in the question below and write it as the answer.\n\n",
    "Note: every question names one digit; the answer is that digit, written alone.\n\n",
    "Task description: output the single digit you see in the question. Keep it short.\n\n",
)
PLANTED_QUESTIONS = ("Question {d}: which digit?", "Question {d}: what is it?", "Question {d}: tell me.")


@dataclass
class ModelSpec:
    name: str
    path: str
    kind: str  # a task.KINDS entry, or "planted"
    profile: str | None = None  # bicache profile file (None: the one beside the model)
    shots: int = 3
    n_layers: int = 0
    extra: dict = field(default_factory=dict)


# ------------------------------------------------------------------------------------------- items
def task_items(spec: ModelSpec, num_questions: int, seed: int = 0) -> list[dict]:
    """Items: prompt, answer, family, and a ``check(text) -> bool``."""
    if spec.kind == "planted":
        items = []
        for f in range(max(1, -(-num_questions // len(PLANTED_QUESTIONS)))):
            prefix = PLANTED_PREFIXES[f % len(PLANTED_PREFIXES)] * (1 + f // len(PLANTED_PREFIXES))
            for j, q in enumerate(PLANTED_QUESTIONS):
                d = str((seed + 3 * f + 7 * j) % 10)
                items.append({"prompt": prefix + q.format(d=d), "answer": d, "family": f"planted-{f}"})
        return items[:num_questions]
    from ..training import task
    return task.heldout_items(num_questions, spec.shots, seed=seed, kind=spec.kind)


def is_correct(spec: ModelSpec, item: dict, text: str) -> bool:
    if spec.kind == "planted":
        t = text.strip()
        return bool(t) and set(t) == {item["answer"]}
    from ..training import task
    return task.extract_answer(text) == item["answer"]


def shared_lengths(tokenizer, items: list[dict]) -> dict[str, int]:
    """Per family: the tokens its prompts share (what a reusing request finds cached)."""
    by_fam: dict[str, list[list[int]]] = {}
    for it in items:
        by_fam.setdefault(it["family"], []).append(list(tokenizer.encode(it["prompt"])))
    out = {}
    for fam, seqs in by_fam.items():
        n = min(len(s) for s in seqs)
        k = 0
        while k < n and all(s[k] == seqs[0][k] for s in seqs):
            k += 1
        out[fam] = k
    return out


def gen_length_for(r: float, shared: float, prompt: float, min_gen: int = 2) -> int:
    return max(min_gen, round(shared / r - prompt))


# ------------------------------------------------------------------------------------------- logits
def record_first_logits(engine) -> dict[tuple, torch.Tensor]:
    """Wrap ``engine.model.forward_batch``: the first logits seen for every distinct token sequence
    (a request's first forward: its prompt followed by G masks), keyed by the token ids."""
    seen: dict[tuple, torch.Tensor] = {}
    orig = engine.model.forward_batch

    def record(fb, *a, **kw):
        out = orig(fb, *a, **kw)
        ptr = getattr(fb, "logit_indptr", None)
        offs, o = [], 0
        for s in fb.seqs:
            offs.append(o)
            o += len(s.logit_positions)
        for i, s in enumerate(fb.seqs):
            lo = ptr[i] if ptr else offs[i]
            key = tuple(s.input_ids.tolist())
            if key not in seen:
                seen[key] = out[lo:lo + len(s.logit_positions)].detach().float().clone()
        return out
    engine.model.forward_batch = record
    return seen


def kl_top1(p_logits: torch.Tensor, q_logits: torch.Tensor) -> tuple[float, float, float]:
    """Mean KL(p || q) per position, top-1 agreement, and KL at the first two positions."""
    lp, lq = torch.log_softmax(p_logits.double(), -1), torch.log_softmax(q_logits.double(), -1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    top1 = (p_logits.argmax(-1) == q_logits.argmax(-1)).double()
    return float(kl.mean()), float(top1.mean()), float(kl[:2].mean())


# ------------------------------------------------------------------------------------------- runs
def run_mode(spec: ModelSpec, mode: str, items: list[dict], gen_length: int, steps: int,
             threads: int = 1, device: str = "cpu") -> dict:
    """One fresh engine in ``mode``: each family's first question, then the others (reusing)."""
    from .. import Engine
    kw: dict[str, Any] = {}
    if spec.profile:
        kw["bicache_profile"] = spec.profile
    elif mode == "bicache":
        kw["bicache_profile"] = os.path.join(spec.path, "bicache_profile.json")
    engine = Engine(spec.path, prefix_cache=mode, cache_mode="none", threshold=None, num_threads=threads,
                    device=device, random_seed=0, max_running_requests=64, **kw)
    logits = record_first_logits(engine)
    params = {"max_new_tokens": gen_length, "block_length": gen_length, "steps_per_block": min(gen_length, steps),
              "threshold": 0.0, "remasking": "low_confidence", "cache_mode": "none", "temperature": 0.0}
    seen, first, rest = set(), [], []
    for i, it in enumerate(items):
        (rest if it["family"] in seen else first).append(i)
        seen.add(it["family"])
    outs: list = [None] * len(items)
    try:
        for idx in (first, rest):
            for i, o in zip(idx, engine.generate([items[i]["prompt"] for i in idx], params)):
                outs[i] = o
        stats = engine.get_stats()
        mask_id = engine.model_config.mask_token_id
        encode = engine.encode
    finally:
        engine.shutdown()
    first_logits = []
    for it in items:
        ids = list(encode(it["prompt"]))
        first_logits.append(logits.get(tuple(ids + [mask_id] * gen_length)))
    return {"outs": outs, "rest": rest, "stats": stats, "first_logits": first_logits}


def summarize(spec: ModelSpec, items: list[dict], run: dict, base: dict | None) -> dict:
    rest = run["rest"]
    outs = run["outs"]
    n = max(1, len(rest))
    acc = sum(is_correct(spec, items[i], outs[i]["text"]) for i in rest) / n
    depth = sum(span_depth(outs[i]["meta_info"]) for i in rest) / n
    cached = sum(outs[i]["meta_info"].get("cached_tokens") or 0 for i in rest) / n
    st = run["stats"]
    sk, co = st.get("skipped_layer_tokens", 0), st.get("computed_layer_tokens", 0)
    row = {"acc": acc, "depth": depth, "cached_tokens": cached, "saved": sk / (sk + co) if sk + co else 0.0,
           "n": len(rest)}
    if base is None:
        row.update(agree=1.0, kl=0.0, top1=1.0, kl_ans=0.0)
        return row
    agree = sum(outs[i]["output_ids"] == base["outs"][i]["output_ids"] for i in rest) / n
    kls, tops, kans = [], [], []
    for i in rest:
        a, b = base["first_logits"][i], run["first_logits"][i]
        if a is not None and b is not None and a.shape == b.shape:
            k, t, ka = kl_top1(a, b)
            kls.append(k)
            tops.append(t)
            kans.append(ka)
    row.update(agree=agree, kl=sum(kls) / len(kls) if kls else math.nan,
               top1=sum(tops) / len(tops) if tops else math.nan,
               kl_ans=sum(kans) / len(kans) if kans else math.nan, logits_matched=len(kls))
    return row


def fidelity_table(specs: Sequence[ModelSpec], rs: Sequence[float] = DEFAULT_RS,
                   fixed: Sequence[int] = DEFAULT_FIXED, num_questions: int = 45, steps: int = 8,
                   threads: int = 1, device: str = "cpu", log: Callable[[str], None] = print) -> list[dict]:
    from ..models.loader import load_model_config, load_tokenizer
    rows = []
    for spec in specs:
        spec.n_layers = load_model_config(spec.path).n_layers
        tok = load_tokenizer(spec.path)
        items = task_items(spec, num_questions)
        shared = shared_lengths(tok, items)
        mean_shared = sum(shared[it["family"]] for it in items) / len(items)
        mean_prompt = sum(len(tok.encode(it["prompt"])) for it in items) / len(items)
        modes = ["off", "naive", "bicache"] + [f"fixed:{k}" for k in fixed if k < spec.n_layers]
        for r in rs:
            g = gen_length_for(r, mean_shared, mean_prompt)
            r_real = sum(shared[it["family"]] / (len(tok.encode(it["prompt"])) + g) for it in items) / len(items)
            base = None
            for mode in modes:
                t0 = time.time()
                run = run_mode(spec, mode, items, g, steps, threads, device)
                row = {"model": spec.name, "r_target": r, "r": round(r_real, 3), "gen_length": g, "mode": mode,
                       **summarize(spec, items, run, base)}
                if mode == "off":
                    base = run
                row["seconds"] = round(time.time() - t0, 1)
                rows.append(row)
                log(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}))
    return rows


# ------------------------------------------------------------------------------------------- output
def markdown(rows: list[dict]) -> str:
    out = ["| model | r | G | mode | acc | agree | KL | KL@ans | top1 | depth | saved |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['model']} | {r['r']:.2f} | {r['gen_length']} | {r['mode']} | {100 * r['acc']:.1f} | "
                   f"{100 * r['agree']:.1f} | {r['kl']:.3g} | {r['kl_ans']:.3g} | {100 * r['top1']:.1f} | "
                   f"{r['depth']:.2f} | {100 * r['saved']:.1f}% |")
    return "\n".join(out)


def plot(rows: list[dict], path: str, metric: str = "acc") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models), 3.6), squeeze=False)
    for ax, m in zip(axes[0], models):
        mrows = [r for r in rows if r["model"] == m]
        modes = list(dict.fromkeys(r["mode"] for r in mrows))
        for i, mode in enumerate(modes):
            dx = 0.008 * (i - (len(modes) - 1) / 2)  # dodge: coinciding modes stay visible
            pts = sorted((r["r"] + dx, 100 * r[metric]) for r in mrows if r["mode"] == mode)
            style = {"off": "k-o", "naive": "r-s", "bicache": "g-^"}.get(mode, "--.")
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=mode, alpha=0.85)
        ax.set_title(m)
        ax.set_xlabel("prefix fraction r")
        ax.set_ylim(-3, 103)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel({"acc": "accuracy (%)", "agree": "outputs equal to off (%)"}[metric])
    axes[0][-1].legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------- CLI
def calibrate_planted(path: str, threads: int = 1) -> str:
    """Calibrate a profile for the planted checkpoint in ``path`` (either planted build) with
    ``python -m bicache_sgl.calibrate`` (agreement criterion); returns the profile's path
    (``path``/bicache_profile.json)."""
    prof = os.path.join(path, "bicache_profile.json")
    # prefix/suffix pairs: a shared prefix without digits, suffixes that start with their own digit.
    # The planner keeps a question whole and reaches a fraction through the generation region
    # only, so questions of several lengths (filler repeated 0-6 times) cover r = 10-90%.
    data = os.path.join(path, "calib.jsonl")
    filler = " is the question: tell me which digit it is, please, in as few characters as you can"
    with open(data, "w") as f:
        for i, prefix in enumerate(PLANTED_PREFIXES[:3]):
            for d in "37" if i % 2 else "58":
                for reps in range(7):
                    f.write(json.dumps({"prefix": prefix, "suffix": d + filler * reps}) + "\n")
    cmd = [sys.executable, "-m", "bicache_sgl.calibrate", "--model-path", path, "--data", data, "--out", prof,
           "--plot", "none", "--criterion", "agreement", "--gen-length", "64", "--block-length", "8",
           "--device", "cpu", "--num-threads", str(threads), "--no-progress"]
    subprocess.run(cmd, check=True, capture_output=True, text=True,
                   env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    return prof


def planted_spec(folder: str, k: int = 2, n_layers: int = 6, calibrate: bool = True, threads: int = 1) -> ModelSpec:
    """The planted model, with a profile calibrated by :func:`calibrate_planted` (agreement)."""
    from ..testing.planted import make_planted_llada
    path = str(make_planted_llada(folder, k=k, n_layers=n_layers))
    prof = os.path.join(path, "bicache_profile.json")
    if calibrate:
        prof = calibrate_planted(path, threads)
    return ModelSpec("planted", path, "planted", profile=prof)


def build_parser() -> argparse.ArgumentParser:
    """The flags (their dests and defaults are pinned in tests/test_config_flags.py)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", default=None,
                    help="NAME=PATH:KIND[:SHOTS] (KIND a task kind, or 'planted'); repeatable. Default: "
                         "bundled (default_model, code), context (assets/context_model, group) and planted")
    ap.add_argument("--r", default=",".join(str(r) for r in DEFAULT_RS))
    ap.add_argument("--fixed", default=",".join(str(k) for k in DEFAULT_FIXED))
    ap.add_argument("--num-questions", type=int, default=45, help="per model and r (a third are first requests)")
    ap.add_argument("--steps", type=int, default=8, help="decoding steps per request (at most G)")
    ap.add_argument("--out", default=None, help="write the rows as JSON")
    ap.add_argument("--plot", default=None, help="PNG: accuracy against r per mode, one panel per model")
    ap.add_argument("--threads", type=int, default=1)
    add_flags(ap, EngineConfig, only=("device",), defaults={"device": "cpu"})
    ap.add_argument("--rows", default=None, help="render the table and plot from a JSON written by --out (no runs)")
    return ap


def parse_args(argv=None):
    return build_parser().parse_args(argv)


def default_specs(tmp: str, threads: int) -> list[ModelSpec]:
    assets = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets")
    specs = [ModelSpec("bundled", os.path.join(assets, "default_model"), "code")]
    ctx = os.path.join(assets, "context_model")
    if os.path.exists(os.path.join(ctx, "model.safetensors")):
        specs.append(ModelSpec("context", ctx, "group"))
    specs.append(planted_spec(os.path.join(tmp, "planted"), threads=threads))
    return specs


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.rows:
        with open(args.rows) as f:
            rows = json.load(f)
        print(markdown(rows))
        if args.plot:
            plot(rows, args.plot)
        return rows
    with tempfile.TemporaryDirectory(prefix="bicache-fidelity-") as tmp:
        if args.model:
            specs = []
            for m in args.model:
                name, rest = m.split("=", 1)
                parts = rest.split(":")
                if parts[1] == "planted":
                    specs.append(planted_spec(os.path.join(tmp, name), threads=args.threads))
                else:
                    specs.append(ModelSpec(name, parts[0], parts[1], shots=int(parts[2]) if len(parts) > 2 else 3))
        else:
            specs = default_specs(tmp, args.threads)
        rows = fidelity_table(specs, [float(x) for x in args.r.split(",")], [int(x) for x in args.fixed.split(",")],
                              args.num_questions, args.steps, args.threads, args.device)
    print(markdown(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
            f.write("\n")
    if args.plot:
        plot(rows, args.plot)
    return rows


if __name__ == "__main__":
    main()
