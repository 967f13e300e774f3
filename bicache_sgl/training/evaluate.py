"""Greedy masked-diffusion evaluation of a trained checkpoint on the held-out task.

Decoding (independent of the serving runtime): the prompt is followed by
`gen_length` mask tokens; every step runs a full forward pass and unmasks the
single most confident masked position with its argmax token, until none is left.
The generated text is cut at the first EOS and compared to the answer (exact match).

    python -m bicache_sgl.training.evaluate --model bicache_sgl/assets/default_model \\
        --num-questions 500 --num-shots 5 --gen-length 8 --control none,remove,shuffle
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import torch

from . import task
from . import tokenizer as tk


@torch.no_grad()
def greedy_generate(model, prompts_ids: list, gen_length: int, batch_size: int = 256) -> list:
    """Return the generated id lists (length gen_length each) for each prompt."""
    model.eval()
    mask_id = model.config.mask_token_id
    out = [None] * len(prompts_ids)
    by_len = defaultdict(list)
    for i, p in enumerate(prompts_ids):
        by_len[len(p)].append(i)
    for plen, idxs in by_len.items():
        for s in range(0, len(idxs), batch_size):
            chunk = idxs[s:s + batch_size]
            x = torch.full((len(chunk), plen + gen_length), mask_id, dtype=torch.long)
            for r, i in enumerate(chunk):
                x[r, :plen] = torch.tensor(prompts_ids[i], dtype=torch.long)
            rows = torch.arange(len(chunk))
            for _ in range(gen_length):
                logits = model(x)[:, plen:].float()
                probs = logits.softmax(-1)
                conf, tok = probs.max(-1)
                masked = x[:, plen:] == mask_id
                conf = conf.masked_fill(~masked, -1.0)
                pos = conf.argmax(-1)
                x[rows, plen + pos] = tok[rows, pos]
            for r, i in enumerate(chunk):
                out[i] = x[r, plen:].tolist()
    return out


def score(model, items: list, gen_length: int = 8, batch_size: int = 256) -> dict:
    prompts = [tk.encode(it["prompt"]) for it in items]
    gens = greedy_generate(model, prompts, gen_length, batch_size)
    correct, invalid, outputs = 0, 0, []
    for it, g in zip(items, gens):
        text = tk.decode(g)
        pred = task.extract_answer(text)
        outputs.append(text)
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
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from .model import LLaDAModelLM

    folder = args.model
    if folder is None:
        import os
        folder = os.path.join(os.path.dirname(os.path.dirname(__file__)), "assets", "default_model")
    model = LLaDAModelLM.from_pretrained(folder)
    for shots in [int(s) for s in args.num_shots.split(",")]:
        items = task.heldout_items(args.num_questions, shots, args.seed, kind=args.kind)
        for g in [int(s) for s in args.gen_length.split(",")]:
            for mode in args.control.split(","):
                its = items if mode == "none" else task.control_items(items, mode, args.seed)
                t0 = time.time()
                r = score(model, its, g)
                print(json.dumps({"num_shots": shots, "gen_length": g, "control": mode,
                                  "accuracy": round(r["accuracy"], 4), "invalid": round(r["invalid"], 4),
                                  "n": r["n"], "seconds": round(time.time() - t0, 1)}), flush=True)


if __name__ == "__main__":
    main()
