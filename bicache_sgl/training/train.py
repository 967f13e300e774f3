"""Train the bundled masked-diffusion LM (LLaDA format) on the few-shot task (task.py).

The model is the serving runtime's own ``bicache_sgl.models.DiffusionLM`` (its differentiable
``forward``); checkpoints are written with LLaDA's tensor names (``models/weights.py``), so
``bicache_sgl.models.loader.load_model`` and the server read them as they are.

    python -m bicache_sgl.training.train --task code --out bicache_sgl/assets/default_model \\
        --seed 0 --steps 1200 --minutes 600

Objective (LLaDA SFT): each training sequence is ``prompt + " " + answer + EOS * pad``
with a generation region of G positions (G mostly short, see --long-gen-prob).
Per sequence a ratio t ~ U(eps, 1) is drawn and every generation position is
replaced by the mask token with probability t; the loss is the cross-entropy on the
masked positions divided by t, normalised by G and averaged over the batch.
With ``--dup-queries N`` the few-shot block of a training sequence also repeats
1..N of its examples with the value replaced by the mask token: in-prefix lookup
queries (the value is shown in the other copy) that add an auxiliary CE term
(weight ``--query-weight``, averaged over the queries of a sequence).  They give
several lookup targets per sequence instead of one.

The number of few-shot examples follows a curriculum: during the first
``--curriculum-steps`` steps it is drawn from [1, k] with k growing linearly from 2 to
``--max-shots``; afterwards from [1, --max-shots].

Data, initialisation and masking are all drawn from ``--seed``; with one thread the
run is reproducible step for step as long as the ``--minutes`` wall-clock cap does
not bind (the learning-rate schedule follows the step count, or the fraction of
``--minutes`` used when that is further along, so a capped run still anneals).  A checkpoint (config.json,
model.safetensors, tokenizer files, train_info.json) is written to ``--out`` every
``--save-every-min`` minutes and at the end.  The quick evaluations during training decode
through the serving engine (``evaluate.py``) from a temporary copy of the current weights.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..models.config import parse_model_config
from ..models.model import DiffusionLM
from ..models.weights import checkpoint_names
from . import task
from . import tokenizer as tk

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--task", default=task.DEFAULT_KIND, choices=list(task.KINDS),
                    help="family kind (see bicache_sgl/training/task.py)")
    ap.add_argument("--steps", type=int, default=3600)
    ap.add_argument("--minutes", type=float, default=75.0, help="wall-clock cap")
    ap.add_argument("--batch-size", type=int, default=48)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--n-layers", type=int, default=8)
    ap.add_argument("--n-heads", type=int, default=4)
    ap.add_argument("--mlp-hidden", type=int, default=0, help="0: 3 * d_model")
    ap.add_argument("--weight-tying", action="store_true")
    ap.add_argument("--max-shots", type=int, default=6)
    ap.add_argument("--curriculum-steps", type=int, default=1000)
    ap.add_argument("--min-gen", type=int, default=4)
    ap.add_argument("--max-gen", type=int, default=32)
    ap.add_argument("--long-gen-prob", type=float, default=0.3,
                    help="probability that G is drawn from the full [min-gen, max-gen] range "
                         "(otherwise from [min-gen, 2*min-gen+2])")
    ap.add_argument("--mask-eps", type=float, default=0.05)
    ap.add_argument("--dup-queries", type=int, default=2,
                    help="each training prefix repeats 1..N of its examples with the value masked "
                         "(in-prefix lookup queries, an auxiliary loss); 0 disables")
    ap.add_argument("--query-weight", type=float, default=1.0)
    ap.add_argument("--format-prob", type=float, default=0.0,
                    help="share of sequences whose generation region continues in the prompt's format "
                         "past the answer (task.continuation_text: the question and answer again, no "
                         "EOS) instead of EOS padding; see docs/default_model.md")
    ap.add_argument("--init", default=None,
                    help="checkpoint folder to start from (fine-tuning); its config must match the "
                         "model flags (default: a fresh initialisation from --seed)")
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--eval-questions", type=int, default=100)
    ap.add_argument("--save-every-min", type=float, default=5.0)
    ap.add_argument("--save-dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=1)
    return ap.parse_args(argv)


def max_shots_at(step: int, args) -> int:
    if step >= args.curriculum_steps:
        return args.max_shots
    return min(args.max_shots, 2 + int((args.max_shots - 1) * step / max(1, args.curriculum_steps)))


def make_sequence(rng: random.Random, num_shots: int, gen_len: int, dup_queries: int,
                  kind: str = task.DEFAULT_KIND, format_prob: float = 0.0):
    """Token ids, generation-region start, and positions of in-prefix value queries.

    With probability ``format_prob`` the generation region is ``task.continuation_text`` (the
    answer, then the same question and answer again in the prompt's format, no EOS) instead of the
    answer + EOS padding. The two targets agree on the answer and differ only past it, where the
    model learns P(EOS) = 1 - format_prob and, among the other tokens, the format: greedy decoding
    stops after the answer, and with EOS banned (``ignore_eos``) continues in format."""
    fam = task.random_family(rng, num_shots, "train", kind)
    examples = [(k, v, False) for k, v in fam.pairs]
    for _ in range(rng.randint(1, dup_queries) if dup_queries else 0):
        k, v = fam.pairs[rng.randrange(num_shots)]
        examples.insert(rng.randrange(len(examples) + 1), (k, v, True))
    qk, qv = fam.pairs[rng.randrange(num_shots)]
    ids, queries = [], []
    for i, (k, v, is_dup) in enumerate(examples):
        if i:
            ids += tk.encode(task.EXAMPLE_SEP)
        ids += tk.encode(task.format_example(k, v))
        if is_dup:
            queries.append(len(ids) - 1)  # the value character
    ids += tk.encode((task.EXAMPLE_SEP if examples else "") + task.build_prompt("", qk))
    start = len(ids)
    # drawn only when used, so that --format-prob 0 replays the earlier runs' data stream
    if format_prob > 0 and rng.random() < format_prob:
        ids += tk.encode(task.continuation_text(qk, qv, gen_len))
    else:
        tgt = tk.encode(task.target_text(qv))
        ids += tgt + [tk.EOS_ID] * (gen_len - len(tgt))
    return ids, start, queries


def sample_gen_len(rng: random.Random, args) -> int:
    """Generation-region length: mostly short (cheap), sometimes up to --max-gen."""
    if rng.random() < args.long_gen_prob:
        return rng.randint(args.min_gen, args.max_gen)
    return rng.randint(args.min_gen, min(args.max_gen, 2 * args.min_gen + 2))


def make_batch(rng: random.Random, gen: torch.Generator, step: int, args):
    B = args.batch_size
    seqs = []
    hi = max_shots_at(step, args)
    for _ in range(B):
        m = rng.randint(1, hi)
        g = sample_gen_len(rng, args)
        seqs.append((make_sequence(rng, m, g, args.dup_queries, args.task, args.format_prob), g))
    n = max(len(s[0][0]) for s in seqs)
    ids = torch.full((B, n), tk.EOS_ID, dtype=torch.long)
    valid = torch.zeros((B, n), dtype=torch.bool)
    region = torch.zeros((B, n), dtype=torch.bool)  # generation region (masked with prob t)
    query = torch.zeros((B, n), dtype=torch.bool)  # in-prefix lookup queries (always masked)
    for b, ((seq, start, queries), g) in enumerate(seqs):
        ids[b, :len(seq)] = torch.tensor(seq)
        valid[b, :len(seq)] = True
        region[b, start:start + g] = True
        query[b, queries] = True
    t = args.mask_eps + (1 - args.mask_eps) * torch.rand(B, 1, generator=gen)
    masked = (torch.rand(B, n, generator=gen) < t) & region
    # at least one masked position per sequence
    none = ~masked.any(1)
    if none.any():
        for b in torch.nonzero(none).flatten().tolist():
            cand = torch.nonzero(region[b]).flatten()
            masked[b, cand[torch.randint(len(cand), (1,), generator=gen)]] = True
    noisy = ids.masked_fill(masked | query, tk.MASK_ID)
    weight = masked.float() / t / region.sum(1, keepdim=True).float()
    if query.any():
        weight = weight + args.query_weight * query.float() / query.sum(1, keepdim=True).clamp(min=1)
    attn_mask = valid[:, None, None, :]
    return noisy, ids, weight, attn_mask


def lr_at(step: int, args, elapsed_s: float = 0.0) -> float:
    """Warmup, then cosine decay to min_lr_ratio * lr.  Progress is the larger of the
    step fraction and the wall-clock fraction of --minutes, so a run cut short by the
    time cap still ends annealed (without the cap binding, the schedule is by step)."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    p = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
    p = max(p, min(1.0, elapsed_s / (args.minutes * 60)))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p)))


def llada_config(args) -> dict[str, Any]:
    """The checkpoint's config.json: LLaDA's keys (``LLaDAModelLM``), sized by the arguments."""
    d, mlp = args.d_model, args.mlp_hidden or 3 * args.d_model
    return {
        "d_model": d, "n_layers": args.n_layers, "n_heads": args.n_heads, "n_kv_heads": args.n_heads,
        "mlp_hidden_size": mlp, "max_sequence_length": 1024, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
        "vocab_size": tk.VOCAB_SIZE, "embedding_size": tk.VOCAB_SIZE, "mask_token_id": tk.MASK_ID,
        "eos_token_id": tk.EOS_ID, "pad_token_id": tk.PAD_ID, "weight_tying": args.weight_tying,
        "torch_dtype": args.save_dtype, "architectures": ["LLaDAModelLM"], "model_type": "llada",
        "mlp_ratio": mlp / d, "include_bias": False, "include_qkv_bias": False, "layer_norm_type": "rms",
        "activation_type": "silu", "block_type": "llama", "rope": True, "scale_logits": False, "use_cache": False,
    }


def init_weights(model: DiffusionLM, generator: torch.Generator) -> None:
    """Norms 1; the residual-branch outputs (o_proj, down_proj) N(0, 0.02 / sqrt(2 L)); the rest
    N(0, 0.02). Drawn in parameter order (LLaDA's checkpoint order)."""
    out_std = 0.02 / math.sqrt(2 * model.cfg.n_layers)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            nn.init.ones_(p)
        else:
            std = out_std if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
            nn.init.normal_(p, 0.0, std, generator=generator)


def _atomic_write(path: str, write: Callable[[str], None]) -> None:
    tmp = path + ".tmp"
    write(tmp)
    os.replace(tmp, path)


def _write_json(obj: Any) -> Callable[[str], None]:
    def write(path: str) -> None:
        with open(path, "w") as f:
            json.dump(obj, f, indent=2)
            f.write("\n")
    return write


def save_checkpoint(model: DiffusionLM, config: dict[str, Any], out: str, dtype: str) -> None:
    """config.json, model.safetensors (LLaDA tensor names) and the tokenizer, each written atomically."""
    from safetensors.torch import save_file

    os.makedirs(out, exist_ok=True)
    sd = model.state_dict()
    names = checkpoint_names(model.cfg)
    assert set(names) == set(sd), "DiffusionLM parameters and checkpoint names differ"
    tensors = {ck: sd[ours].detach().to(DTYPES[dtype]).contiguous().clone() for ours, (ck, _) in names.items()}
    _atomic_write(os.path.join(out, "model.safetensors"),
                  lambda path: save_file(tensors, path, metadata={"format": "pt"}))
    _atomic_write(os.path.join(out, "config.json"), _write_json({**config, "torch_dtype": dtype}))
    tk.save_tokenizer(out)


def save(model, config, args, out, info):
    save_checkpoint(model, config, out, args.save_dtype)
    _atomic_write(os.path.join(out, "train_info.json"), _write_json(info))


def load_init(model: DiffusionLM, folder: str) -> None:
    """Start from a checkpoint (``--init``): its LLaDA tensors, by name, into ``model`` (strict)."""
    from safetensors.torch import load_file

    tensors = load_file(os.path.join(folder, "model.safetensors"))
    names = checkpoint_names(model.cfg)
    missing = [ck for ck, _ in names.values() if ck not in tensors]
    if missing or len(tensors) != len(names):
        raise ValueError(f"--init {folder}: tensors differ from the model's (missing {missing[:3]})")
    model.load_state_dict({ours: tensors[ck].float() for ours, (ck, _) in names.items()}, strict=True)


def quick_eval(model, config, args):
    """Held-out accuracy of the current weights, decoded by the serving engine (float32 copy); with
    ``--format-prob``, also the share of ignore_eos continuations in format (``score_format``)."""
    from .evaluate import make_engine, score, score_format

    res = {}
    with tempfile.TemporaryDirectory(prefix="bicache-train-eval-") as tmp:
        save_checkpoint(model, config, tmp, "float32")
        engine = make_engine(tmp, threads=args.threads)
        try:
            for shots in (5, args.max_shots):
                items = task.heldout_items(args.eval_questions, shots, seed=1, kind=args.task)
                res[f"acc@{shots}shot"] = score(engine, items, gen_length=8)["accuracy"]
            items = task.heldout_items(args.eval_questions, 5, seed=1, kind=args.task)
            res["control_shuffle@5shot"] = score(engine, task.control_items(items, "shuffle"),
                                                 gen_length=8)["accuracy"]
            if args.format_prob > 0:
                for g in (16, 32):
                    res[f"format@5shot,G{g}"] = score_format(engine, items[:50], g)["format"]
        finally:
            engine.shutdown()
    return res


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from tqdm import tqdm

    torch.manual_seed(args.seed)
    rng = random.Random(f"bicache-train|{args.seed}")
    gen = torch.Generator().manual_seed(args.seed + 1)
    config = llada_config(args)
    model = DiffusionLM(parse_model_config(config))
    init_weights(model, torch.Generator().manual_seed(args.seed))
    if args.init:
        load_init(model, args.init)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.98), eps=1e-8)
    print(f"params: {n_params:,}  config: {json.dumps(config)}", flush=True)
    print(f"args: {json.dumps(vars(args))}", flush=True)

    t0 = time.time()
    last_save = t0
    info = {"args": vars(args), "command": " ".join(["python -m bicache_sgl.training.train"] + sys.argv[1:]),
            "params": n_params, "evals": []}
    ema = None
    pbar = tqdm(total=args.steps, mininterval=1.0 if sys.stderr.isatty() else 30.0, miniters=1,
                dynamic_ncols=True, file=sys.stderr)
    step = 0
    model.train()
    while step < args.steps:
        if time.time() - t0 > args.minutes * 60:
            tqdm.write(f"time cap of {args.minutes} min reached at step {step}")
            break
        for g in opt.param_groups:
            g["lr"] = lr = lr_at(step, args, time.time() - t0)
        noisy, target, weight, attn_mask = make_batch(rng, gen, step, args)
        logits = model(noisy, attn_mask)
        ce = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), target.view(-1), reduction="none")
        loss = (ce.view(target.shape) * weight).sum() / target.shape[0]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        pbar.update(1)
        pbar.set_postfix(loss=f"{ema:.4f}", shots=max_shots_at(step, args), lr=f"{lr:.2e}",
                         refresh=False)
        if step % args.eval_every == 0 or step == args.steps:
            res = quick_eval(model, config, args)
            elapsed = (time.time() - t0) / 60
            rec = {"step": step, "minutes": round(elapsed, 2), "loss_ema": round(ema, 4), **res}
            info["evals"].append(rec)
            tqdm.write(json.dumps(rec))
        if time.time() - last_save > args.save_every_min * 60:
            info.update(step=step, minutes=round((time.time() - t0) / 60, 2), finished=False)
            save(model, config, args, args.out, info)
            last_save = time.time()
            tqdm.write(f"checkpoint saved at step {step} -> {args.out}")
    pbar.close()
    info.update(step=step, minutes=round((time.time() - t0) / 60, 2), finished=True)
    save(model, config, args, args.out, info)
    print(f"done: step {step}, {info['minutes']} min, saved to {args.out}", flush=True)


if __name__ == "__main__":
    main()
