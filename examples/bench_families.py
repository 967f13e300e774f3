"""The families workload of the capture-context rule (docs/prefix_cache.md): speed and answers of
bicache against cache off, with and without a head shared by every family.

Workload: --families families x --questions questions (--shots examples each) on the bundled model, each prompt
``Question: k\\nAnswer: c`` for the family's keys and code, then one question. ``shared head``:
every family begins with the same tokens ("Question: "), whose cached rows were captured by
whichever family came first; ``own head``: each family starts with its own tag line, so families
share nothing. Every mode runs the same requests through a fresh Engine with the default flags,
the family's first question first (it fills the cache) and the rest submitted together.
Reported per (head, mode): seconds (best of --repeat), requests/s, the speedup over off, answers
equal to off's, mean depth and mean reused tokens.

    python examples/bench_families.py
    python examples/bench_families.py --families 8 --questions 6 --repeat 3
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

from bicache_sgl import Engine

P = {"max_new_tokens": 32, "temperature": 0, "cache_mode": "dual", "threshold": 0.9}
LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def fewshot(keys: str, code: str, q: str, head: str = "") -> str:
    return head + "\n\n".join(f"Question: {k}\nAnswer: {code}" for k in keys) + f"\n\nQuestion: {q}\nAnswer:"


def workload(families: int, questions: int, shots: int, own_head: bool, seed: int) -> list[list[str]]:
    rng = random.Random(seed)
    out = []
    for f in range(families):
        keys = "".join(rng.sample(LETTERS, shots))
        head = f"Family {LETTERS[f % 26]}{f}:\n" if own_head else ""
        qs = [keys[j] if j < len(keys) else rng.choice(LETTERS) for j in range(questions)]
        code = str(rng.randrange(10))
        out.append([fewshot(keys, code, q, head) for q in qs])
    return out


def run(mode: str, fams: list[list[str]]) -> tuple[float, list[dict]]:
    eng = Engine(prefix_cache=mode)
    try:
        eng.generate("Question: A\nAnswer: 1\n\nQuestion: A\nAnswer:", {"max_new_tokens": 4})  # warm-up
        eng.flush_cache()
        t0 = time.perf_counter()
        outs = [eng.generate(f[0], P) for f in fams]  # each family's first question fills the cache
        outs += eng.generate([p for f in fams for p in f[1:]], P)  # the rest together
        return time.perf_counter() - t0, outs
    finally:
        eng.shutdown()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--families", type=int, default=8)
    ap.add_argument("--questions", type=int, default=6, help="questions per family (>= 2)")
    ap.add_argument("--shots", type=int, default=5, help="examples per family (1-26)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per (head, mode); the best time is reported")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.families < 1 or args.questions < 2 or args.repeat < 1 or not 1 <= args.shots <= 26:
        ap.error("--families >= 1, --questions >= 2, --repeat >= 1 and --shots in [1, 26] are required")
    print("| head | mode | seconds (best) | requests/s | speedup vs off | answers equal to off | mean depth "
          "| mean reused tokens |")
    print("|---|---|---|---|---|---|---|---|")
    for own in (False, True):
        fams = workload(args.families, args.questions, args.shots, own, args.seed)
        n = sum(len(f) for f in fams)
        res = {}
        for _ in range(args.repeat):  # modes alternate, so machine noise hits both
            for mode in ("off", "bicache"):
                t, outs = run(mode, fams)
                if mode not in res or t < res[mode][0]:
                    res[mode] = (t, outs)
        t_off, off = res["off"]
        for mode in ("off", "bicache"):
            t, outs = res[mode]
            same = sum(a["text"] == b["text"] for a, b in zip(outs, off))
            depth = statistics.mean(o["meta_info"]["bicache_depth"] for o in outs)
            reused = statistics.mean(o["meta_info"]["reused_prefix_tokens"] for o in outs)
            print(f"| {'own' if own else 'shared'} | {mode} | {t:.2f} | {n / t:.1f} | {t_off / t:.2f}x | {same}/{n} "
                  f"| {depth:.2f} | {reused:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
