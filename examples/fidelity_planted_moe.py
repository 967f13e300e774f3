"""The fidelity-table rows of the planted LLaDA-MoE (bicache_sgl/testing/planted_moe.py, safe depth
2 by construction): the planted_spec recipe of bicache_sgl/bench/fidelity.py (a profile
calibrated with ``python -m bicache_sgl.calibrate``, agreement criterion) on the MoE build, then
``fidelity_table`` over r and the modes off / naive / bicache / fixed:N (docs/models.md).

    python examples/fidelity_planted_moe.py [--out rows.json]   # about 10 min on one CPU thread
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch

from bicache_sgl.bench.fidelity import ModelSpec, calibrate_planted, fidelity_table, markdown
from bicache_sgl.testing.planted_moe import make_planted_llada_moe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="write the rows as JSON")
    ap.add_argument("--num-questions", type=int, default=45)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="fidelity-moe-") as tmp:
        path = make_planted_llada_moe(os.path.join(tmp, "planted_moe"), k=2, n_layers=6)
        prof = calibrate_planted(path, threads=1)
        with open(prof) as f:
            print("calibrated profile (r% -> depth):", json.load(f)["table"])
        rows = fidelity_table([ModelSpec("planted-moe", path, "planted", profile=prof)], [0.2, 0.4, 0.6, 0.8],
                              [1, 2, 4], args.num_questions, 8, 1, "cpu")
    print(markdown(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
