"""Train a LLaDA-format model whose shared-prefix state depends on the rest of the sequence.

The fidelity evidence of issue 12 needs a trained model on which reusing a shared prefix's state
computed in another context (``--prefix-cache naive``) changes answers. The bundled model
(``train.py``, kind ``code``) does not: its answer never depends on what follows the prefix. This
trainer builds one in two phases, both through the serving runtime's ``DiffusionLM.forward``:

1. **Pre-training** (LLaDA's objective): a mixture of Python standard-library source text (read
   from the running interpreter's own ``Lib`` folder, so it is available offline) and few-shot task
   sequences. A ratio ``t ~ U(eps, 1)`` is drawn per sequence and *every* position, the prefix
   included, is masked with probability ``t``; the loss is the masked cross-entropy divided by
   ``t``, normalised by the sequence length.
2. **SFT** (LLaDA's SFT objective): few-shot task sequences of kind ``group``
   (``task.py``: two codes per family, the question's key decides which one is the answer), only
   the generation region masked (``t ~ U(eps, 1)``), loss divided by ``t`` and by the region's
   length.

**Routing through the prefix.** In a task sequence the question's key token (the one token that
differs between two questions sharing a few-shot block) is, with probability ``--route-prob``,
hidden from every position after it (the attention mask blocks that one key column for those
rows; the positions before it, the shared prefix included, still read it). The answer can then
learn the key only through the prefix positions' states: the model is pushed to let the prefix
read the suffix, which is what a bidirectional model's deep prefix states do and what makes naive
prefix reuse wrong. At inference nothing is blocked (the runtime is unchanged); the
``1 - --route-prob`` unblocked sequences teach the model that a visible key is no surprise.

Generation regions are mostly short (4..10), sometimes up to ``--max-gen`` (so that prefix fractions
down to 0.2 can be evaluated). Checkpoints are written every ``--save-every-min`` minutes
(LLaDA-format folder plus ``train_state.pt`` for ``--resume``, which continues a killed run from
its last checkpoint: optimizer, step, random states and elapsed time are restored).

    python -m bicache_sgl.training.train_context --out /tmp/ctx_model --minutes 40
    python -m bicache_sgl.training.train_context --out /tmp/ctx_model --minutes 40 --resume
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import random
import sys
import sysconfig
import tempfile
import time
from typing import Any

import torch
import torch.nn.functional as F

from ..models.config import parse_model_config
from ..models.model import DiffusionLM
from . import task
from . import tokenizer as tk
from .train import init_weights, llada_config, save

KIND = "group"
# question layout: "Question: K\nAnswer:" -> the key sits this many tokens before the generation region
KEY_OFFSET = len(task.ANSWER_PREFIX) + 1


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--resume", action="store_true", help="continue from --out/train_state.pt if it exists")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--task", default=KIND, choices=list(task.KINDS))
    ap.add_argument("--steps", type=int, default=100000, help="step cap (the time cap usually binds)")
    ap.add_argument("--minutes", type=float, default=40.0, help="wall-clock cap over all runs of --resume")
    ap.add_argument("--pretrain-frac", type=float, default=0.3,
                    help="fraction of --minutes spent in phase 1 (pre-training)")
    ap.add_argument("--text-frac", type=float, default=0.5,
                    help="phase 1: share of sequences that are standard-library source (the rest: task)")
    ap.add_argument("--text-len", type=int, default=160)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--long-batch-size", type=int, default=12)
    ap.add_argument("--long-prob", type=float, default=0.15,
                    help="SFT: probability that a batch has long generation regions (33..--max-gen)")
    ap.add_argument("--max-gen", type=int, default=320)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--n-layers", type=int, default=8)
    ap.add_argument("--n-heads", type=int, default=4)
    ap.add_argument("--mlp-hidden", type=int, default=0, help="0: 3 * d_model")
    ap.add_argument("--weight-tying", action="store_true")
    ap.add_argument("--min-shots", type=int, default=2)
    ap.add_argument("--max-shots", type=int, default=6)
    ap.add_argument("--mask-eps", type=float, default=0.05)
    ap.add_argument("--route-prob", type=float, default=0.9,
                    help="probability that a task sequence hides its question key from the positions after it")
    ap.add_argument("--eval-every-min", type=float, default=6.0)
    ap.add_argument("--eval-questions", type=int, default=60)
    ap.add_argument("--save-every-min", type=float, default=4.0)
    ap.add_argument("--save-dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=1)
    return ap.parse_args(argv)


# ------------------------------------------------------------------------------------------ data
def stdlib_corpus(holdout_mod: int = 20) -> tuple[list[str], list[str]]:
    """The interpreter's standard-library ``*.py`` files (top level of ``Lib``), sorted; every
    ``holdout_mod``-th file is held out (for the held-out loss)."""
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    train, held = [], []
    for i, path in enumerate(files):
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        (held if i % holdout_mod == 0 else train).append(text)
    if not train:
        raise SystemExit("no standard-library sources found")
    return train, held


def text_window(rng: random.Random, docs: list[str], n: int) -> list[int]:
    while True:
        doc = docs[rng.randrange(len(docs))]
        if len(doc) > n:
            i = rng.randrange(len(doc) - n)
            return tk.encode(doc[i:i + n])


def task_sequence(rng: random.Random, num_shots: int, gen_len: int, kind: str) -> tuple[list[int], int]:
    """``prompt + " " + answer + EOS`` padding to a region of gen_len; returns (ids, region start)."""
    fam = task.random_family(rng, num_shots, "train", kind)
    qk, qv = fam.pairs[rng.randrange(num_shots)]
    ids = tk.encode(task.build_prompt(fam.pairs, qk))
    start = len(ids)
    tgt = tk.encode(task.target_text(qv))
    return ids + tgt + [tk.EOS_ID] * (gen_len - len(tgt)), start


def make_batch(rng: random.Random, gen: torch.Generator, phase: str, args):
    """(noisy ids, targets, loss weights, attention mask [B, 1, N, N])."""
    long = phase == "sft" and rng.random() < args.long_prob
    B = args.long_batch_size if long else args.batch_size
    rows = []  # (ids, region start or None for text/whole-sequence, route)
    for _ in range(B):
        if phase == "pretrain" and rng.random() < args.text_frac:
            rows.append((text_window(rng, args.corpus, args.text_len), 0, False, None))
            continue
        shots = rng.randint(args.min_shots, args.max_shots)
        g = rng.randint(33, args.max_gen) if long else rng.randint(4, 10)
        ids, start = task_sequence(rng, shots, g, args.task)
        route = rng.random() < args.route_prob
        rows.append((ids, 0 if phase == "pretrain" else start, route, start - KEY_OFFSET))
    n = max(len(r[0]) for r in rows)
    ids = torch.full((B, n), tk.EOS_ID, dtype=torch.long)
    valid = torch.zeros((B, n), dtype=torch.bool)
    region = torch.zeros((B, n), dtype=torch.bool)
    attn = torch.ones((B, 1, n, n), dtype=torch.bool)
    for b, (seq, start, route, key_pos) in enumerate(rows):
        ids[b, :len(seq)] = torch.tensor(seq)
        valid[b, :len(seq)] = True
        region[b, start:len(seq)] = True
        if route:
            attn[b, 0, key_pos + 1:, key_pos] = False
    attn &= valid[:, None, None, :]
    t = args.mask_eps + (1 - args.mask_eps) * torch.rand(B, 1, generator=gen)
    masked = (torch.rand(B, n, generator=gen) < t) & region
    for b in torch.nonzero(~masked.any(1)).flatten().tolist():
        cand = torch.nonzero(region[b]).flatten()
        masked[b, cand[torch.randint(len(cand), (1,), generator=gen)]] = True
    noisy = ids.masked_fill(masked, tk.MASK_ID)
    weight = masked.float() / t / region.sum(1, keepdim=True).float()
    return noisy, ids, weight, attn


def lr_at(step: int, frac: float, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


# ------------------------------------------------------------------------------------------ eval
@torch.no_grad()
def heldout_text_loss(model, args, n: int = 16) -> float:
    """Whole-sequence masked loss (t = 0.5, fixed seed) on held-out standard-library windows."""
    rng = random.Random("heldout-text")
    gen = torch.Generator().manual_seed(0)
    ids = torch.tensor([text_window(rng, args.heldout_corpus, args.text_len) for _ in range(n)])
    masked = torch.rand(ids.shape, generator=gen) < 0.5
    model.eval()
    logits = model(ids.masked_fill(masked, tk.MASK_ID))
    model.train()
    return float(F.cross_entropy(logits[masked], ids[masked]))


def quick_eval(model, config, args) -> dict:
    """Held-out accuracy through the serving engine with the prefix cache off and naive (5 shots,
    8 generation positions; each family's first question fills the cache, the others reuse it)."""
    from .evaluate import make_engine, score_modes

    with tempfile.TemporaryDirectory(prefix="bicache-ctx-eval-") as tmp:
        from .train import save_checkpoint
        save_checkpoint(model, config, tmp, "float32")
        items = task.heldout_items(args.eval_questions, 5, seed=1, kind=args.task)
        res = score_modes(lambda mode: make_engine(tmp, threads=args.threads, prefix_cache=mode), items,
                          ["off", "naive"], gen_length=8)
    return {f"acc_{m}": round(r["accuracy"], 3) for m, r in res.items()} | \
        {"agree_naive": round(res["naive"]["agreement"], 3)}


# ------------------------------------------------------------------------------------------ main
def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    args.corpus, args.heldout_corpus = stdlib_corpus()
    config = llada_config(args)
    model = DiffusionLM(parse_model_config(config))
    torch.manual_seed(args.seed)
    init_weights(model, torch.Generator().manual_seed(args.seed))
    decay = [p for _, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for _, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.98), eps=1e-8)
    rng = random.Random(f"bicache-train-context|{args.seed}")
    gen = torch.Generator().manual_seed(args.seed + 1)
    saved_args = {k: v for k, v in vars(args).items() if k not in ("corpus", "heldout_corpus")}
    info: dict[str, Any] = {"args": saved_args, "params": sum(p.numel() for p in model.parameters()),
                            "command": " ".join(["python -m bicache_sgl.training.train_context"] + sys.argv[1:]),
                            "corpus_files": len(args.corpus), "evals": [], "log": [], "phase_switch_step": None}
    step, elapsed0 = 0, 0.0
    state_path = os.path.join(args.out, "train_state.pt")
    if args.resume and os.path.exists(state_path):
        st = torch.load(state_path, weights_only=False)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        rng.setstate(st["rng"])
        gen.set_state(st["gen"])
        step, elapsed0, info = st["step"], st["elapsed"], st["info"]
        info.setdefault("resumed_at", []).append(step)
        print(f"resumed at step {step}, {elapsed0 / 60:.1f} min", flush=True)
    print(f"params: {info['params']:,}  args: {json.dumps(saved_args)}", flush=True)

    def checkpoint(finished: bool):
        info.update(step=step, minutes=round(elapsed() / 60, 2), finished=finished)
        save(model, config, args, args.out, info)
        tmp = state_path + ".tmp"
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "rng": rng.getstate(),
                    "gen": gen.get_state(), "step": step, "elapsed": elapsed(), "info": info}, tmp)
        os.replace(tmp, state_path)

    t0 = time.time()

    def elapsed() -> float:
        return elapsed0 + time.time() - t0

    budget = args.minutes * 60
    last_save = last_eval = elapsed()
    ema = None
    model.train()
    while step < args.steps and elapsed() < budget:
        frac = elapsed() / budget
        phase = "pretrain" if frac < args.pretrain_frac else "sft"
        if phase == "sft" and info["phase_switch_step"] is None:
            info["phase_switch_step"] = step
            ema = None
            print(f"phase 2 (SFT) from step {step}", flush=True)
        for g in opt.param_groups:
            g["lr"] = lr = lr_at(step, frac, args)
        noisy, target, weight, attn = make_batch(rng, gen, phase, args)
        logits = model(noisy, attn)
        ce = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), target.view(-1), reduction="none")
        loss = (ce.view(target.shape) * weight).sum() / target.shape[0]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        ema = loss.item() if ema is None else 0.97 * ema + 0.03 * loss.item()
        if step % 25 == 0:
            rec = {"step": step, "minutes": round(elapsed() / 60, 2), "phase": phase, "loss_ema": round(ema, 4),
                   "lr": round(lr, 6)}
            info["log"].append(rec)
            print(json.dumps(rec), flush=True)
        if elapsed() - last_eval > args.eval_every_min * 60:
            rec = {"step": step, "minutes": round(elapsed() / 60, 2), "phase": phase,
                   "heldout_text_loss": round(heldout_text_loss(model, args), 4)}
            if phase == "sft":
                rec.update(quick_eval(model, config, args))
            info["evals"].append(rec)
            print(json.dumps(rec), flush=True)
            last_eval = elapsed()
        if elapsed() - last_save > args.save_every_min * 60:
            checkpoint(False)
            last_save = elapsed()
            print(f"checkpoint at step {step} -> {args.out}", flush=True)
    rec = {"step": step, "minutes": round(elapsed() / 60, 2), "final": True,
           "heldout_text_loss": round(heldout_text_loss(model, args), 4), **quick_eval(model, config, args)}
    info["evals"].append(rec)
    print(json.dumps(rec), flush=True)
    checkpoint(True)
    print(f"done: step {step}, {elapsed() / 60:.1f} min, saved to {args.out}", flush=True)


if __name__ == "__main__":
    main()
