"""Cost of the block DP per denoising step (docs/structured.md).

``python -m bicache_sgl.bench.constrained [--tokenizer PATH] [--block-length 32]`` compiles a few
constraints for the tokenizer (default: the bundled model's) and times ``block_path`` with random
log-probabilities, from a fully masked block down to two masked positions.
"""

from __future__ import annotations

import argparse
import time

import torch

from ..config import DecodeDefaults
from ..constrained import compile_constraint
from ..flags import add_flags

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}, "ok": {"type": "boolean"}},
    "required": ["name", "age"]}
CASES = [("regex", r"[A-Z]{3}-[0-9]{4}"), ("json_schema", SCHEMA), ("json_object", None)]


def measure(tokenizer, block_length: int = 32, steps: int = 20, seed: int = 0) -> list[dict]:
    rows = []
    V = len(tokenizer)
    for kind, spec in CASES:
        t0 = time.perf_counter()
        c = compile_constraint(kind, spec, tokenizer)
        build = time.perf_counter() - t0
        g = torch.Generator().manual_seed(seed)
        st = c.start(8 * block_length)
        L = block_length
        prev = torch.zeros(L, dtype=torch.long)
        times = []
        for step in range(steps):
            n = max(2, L - (step * L) // steps)
            masked = torch.zeros(L, dtype=torch.bool)
            masked[L - n:] = True
            block = prev.clone()
            scores = torch.randn(n, V, generator=g).log_softmax(-1)
            t0 = time.perf_counter()
            path = c.block_path(st, block, masked, scores)
            times.append(time.perf_counter() - t0)
            block[masked] = path
            prev = block
        times.sort()
        rows.append({"kind": kind, "vocab": V, "states": c.n_states, "classes": c.n_classes, "class_edges": c.n_edges,
                     "token_edges": c.index.token_edges, "build_s": build,
                     "median_ms": 1e3 * times[len(times) // 2], "max_ms": 1e3 * times[-1]})
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the bundled model's)")
    add_flags(ap, DecodeDefaults, only=("block_length",))
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from ..models.loader import default_model_path, load_tokenizer
    tok = load_tokenizer(args.tokenizer or default_model_path())
    for r in measure(tok, args.block_length):
        print(f"{r['kind']:12s} V={r['vocab']} states={r['states']} classes={r['classes']} "
              f"class_edges={r['class_edges']} token_edges={r['token_edges']} build={r['build_s']:.2f}s "
              f"block_path(L={args.block_length}) median {r['median_ms']:.2f} ms, max {r['max_ms']:.2f} ms")


if __name__ == "__main__":
    main()
