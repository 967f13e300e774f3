"""Export the bundled model's few-shot task (held-out families) to a JSONL file for lm-eval.

Each line is one question of ``bicache_sgl.training.task.heldout_items``::

    {"prompt": "<family block>\\n\\nQuestion: K\\nAnswer:", "answer": "7", "label": 7,
     "question": "K", "family": "fam-...", "prefix": "<family block>"}

``prompt`` already holds the family's few-shot block (the task's shots are in-context examples of
the same family, which lm-eval's own ``--num_fewshot`` sampler cannot pick), so the lm-eval tasks
in this folder run with ``num_fewshot: 0``. ``label`` is the answer's index among the choices
``"0"`` .. ``"9"`` of the multiple-choice task.

    python examples/lm_eval/export_task.py                  # -> examples/lm_eval/data/bicache_fewshot.jsonl
    python examples/lm_eval/export_task.py --num-questions 50 --out /tmp/x/examples/lm_eval/data/bicache_fewshot.jsonl
    python examples/lm_eval/export_task.py --control shuffle   # each family gets another family's block

The task YAMLs read ``examples/lm_eval/data/bicache_fewshot.jsonl`` relative to the directory
lm-eval runs in (see docs/evaluation.md).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bicache_sgl.training import task

DEFAULT_OUT = Path("examples/lm_eval/data/bicache_fewshot.jsonl")


def records(num_questions: int, num_shots: int, seed: int, kind: str | None, control: str = "none") -> list[dict]:
    kw = {} if kind is None else {"kind": kind}
    items = task.heldout_items(num_questions, num_shots, seed=seed, **kw)
    if control != "none":
        items = task.control_items(items, control)
    out = []
    for it in items:
        out.append({"prompt": it["prompt"], "answer": it["answer"], "label": task.VALUE_CHARS.index(it["answer"]),
                    "question": it["question"], "family": it["family"], "prefix": it["prefix"]})
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSONL file to write (default: {DEFAULT_OUT})")
    ap.add_argument("--num-questions", type=int, default=200)
    ap.add_argument("--num-shots", type=int, default=5, help="few-shot examples per family block")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--task-kind", default=None, help=f"family kind (default: {task.DEFAULT_KIND}, "
                    "the kind the bundled model was trained on)")
    ap.add_argument("--control", choices=["none", "shuffle", "remove"], default="none",
                    help="shuffle: every family gets another family's block (answers kept); remove: no block. "
                    "The 'does the model use the prefix' controls of docs/evaluation.md")
    args = ap.parse_args(argv)
    rows = records(args.num_questions, args.num_shots, args.seed, args.task_kind, args.control)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print(f"wrote {len(rows)} questions to {args.out}")


if __name__ == "__main__":
    main()
