"""Calibration records for the bundled models in the shapes users send (issue 34, section 2).

``python -m bicache_sgl.training.calib_shapes --kind code > shapes.jsonl`` writes ``{"prefix",
"suffix"}`` records for ``python -m bicache_sgl.calibrate``: the prefix is what a request shares
with an earlier one (what the prefix cache matches), the suffix the rest of its prompt, its question
kept whole. The calibration's cached context (``first_request``) puts ANOTHER record's suffix after
the prefix, as the runtime stores the prefix from whichever request computed it first. Shapes:

- ``head``: a shared head (a system line such as "You are a helpful assistant. ...") and nothing
  else in common: the suffix is the whole task content (one or two few-shot blocks, the question);
- ``fewshot``: optional head + one family's few-shot block; the suffix is the question;
- ``twofamily``: optional head + one family's block; the suffix is a second family's block and a
  question about it (a suffix that changes what the prefix means: the code to answer is another);
- ``document``: several families' blocks (a document with parts); the question asks a key of one
  part (the first, a middle or the last);
- ``multiturn``: a conversation with the model's earlier answers (``Question: K\\nAnswer: 7`` turns
  after the block); the suffix is a further turn with its own earlier answer and the next question.

Held-out families only (never seen in training). Deterministic given the seed.
"""

from __future__ import annotations

import argparse
import json
import random
import sys

from . import task as T

HEADS = ("You are a helpful assistant. Answer with the code.\n\n", "You are a careful assistant.\n\n",
         "System: answer each question with one digit.\n\n")
SHAPES = ("head", "fewshot", "twofamily", "document", "multiturn")


def _fam(rng: random.Random, lo: int, hi: int, kind: str) -> T.Family:
    return T.random_family(rng, rng.randint(lo, hi), "heldout", kind)


def _question(fam: T.Family, rng: random.Random) -> str:
    return T.QUESTION_PREFIX + rng.choice([k for k, _ in fam.pairs]) + T.ANSWER_PREFIX


def _turn(fam: T.Family, rng: random.Random) -> str:
    k, v = rng.choice(list(fam.pairs))
    return T.format_example(k, v) + T.EXAMPLE_SEP


def shape_group(shape: str, rng: random.Random, kind: str, per_prefix: int) -> list[dict]:
    """``per_prefix`` records sharing one prefix (each with its own suffix)."""
    head = rng.choice(HEADS) if shape == "head" or rng.random() < 0.5 else ""
    fam = _fam(rng, 2, 6, kind)
    block = T.build_prefix(fam.pairs) + T.EXAMPLE_SEP
    out = []
    if shape == "head":
        for _ in range(per_prefix):
            fams = [_fam(rng, 2, 6, kind) for _ in range(rng.choice((1, 1, 2)))]  # one family's block or two
            content = "".join(T.build_prefix(f.pairs) + T.EXAMPLE_SEP for f in fams)
            out.append({"prefix": head, "suffix": content + _question(fams[-1], rng)})
        return out
    if shape == "fewshot":
        prefix = head + block
        return [{"prefix": prefix, "suffix": _question(fam, rng)} for _ in range(per_prefix)]
    if shape == "twofamily":
        prefix = head + block
        for _ in range(per_prefix):
            f = _fam(rng, 2, 4, kind)
            out.append({"prefix": prefix, "suffix": T.build_prefix(f.pairs) + T.EXAMPLE_SEP + _question(f, rng)})
        return out
    if shape == "document":
        parts = [fam] + [_fam(rng, 2, 4, kind) for _ in range(rng.randint(1, 2))]
        prefix = head + "".join(T.build_prefix(p.pairs) + T.EXAMPLE_SEP for p in parts)
        return [{"prefix": prefix, "suffix": _question(rng.choice(parts), rng)} for _ in range(per_prefix)]
    if shape == "multiturn":
        prefix = head + block + "".join(_turn(fam, rng) for _ in range(rng.randint(0, 2)))
        return [{"prefix": prefix, "suffix": _turn(fam, rng) + _question(fam, rng)} for _ in range(per_prefix)]
    raise ValueError(f"shape must be one of {SHAPES}, got {shape!r}")


def shape_records(groups_per_shape: int = 4, per_prefix: int = 3, seed: int = 0, kind: str = T.DEFAULT_KIND,
                  shapes: tuple[str, ...] = SHAPES) -> list[dict]:
    """Records of every shape, shape by shape, group by group (a record's neighbour shares its
    prefix and asks something else)."""
    rng = random.Random(f"bicache-calib-shapes|{seed}|{kind}")
    out = []
    for shape in shapes:
        for _ in range(groups_per_shape):
            out += shape_group(shape, rng, kind, per_prefix)
    return out


# --------------------------------------------------------------------- served compositions
# The differential workload of tests/test_profile_safety.py and examples/bench_profile_safety.py:
# whole requests (not calibration records) in the shapes of issue 34.
COMPOSITION_HEADS = ("", "You are a helpful assistant. Answer with the code.\n\n", "You are a careful assistant.\n\n")
SHORT = {"temperature": 0, "max_new_tokens": 8}
LONG = {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}


def compositions(seed: int, groups: int = 6, kind: str = T.DEFAULT_KIND) -> list[tuple[str, dict]]:
    """(prompt, sampling params) in arrival order: ``groups`` groups sharing an optional system
    line + a first family's 2-6 examples; each group's 2-4 requests differ in the question and in
    an optional second family's 2-4 examples after the first's (about one in three); 8 new tokens
    (stopping at EOS), or 32 with ``ignore_eos`` (about one in three). Shuffled, so a request
    meets state captured in another request's context. Held-out families; deterministic."""
    rng = random.Random(f"profile-safety|{seed}")
    out = []
    for _ in range(groups):
        head = rng.choice(COMPOSITION_HEADS)
        fam_a = T.random_family(rng, rng.randint(2, 6), "heldout", kind)
        base = head + T.build_prefix(fam_a.pairs)
        for _ in range(rng.randint(2, 4)):
            text, fam = base, fam_a
            if rng.random() < 0.35:  # a second family's examples after the first's
                fam_b = T.random_family(rng, rng.randint(2, 4), "heldout", kind)
                text, fam = text + T.EXAMPLE_SEP + T.build_prefix(fam_b.pairs), fam_b
            prompt = T.build_prompt(text, rng.choice([k for k, _ in fam.pairs]))
            out.append((prompt, LONG if rng.random() < 0.3 else SHORT))
    rng.shuffle(out)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bicache_sgl.training.calib_shapes", description=__doc__.split("\n")[0])
    ap.add_argument("--kind", choices=T.KINDS, default=T.DEFAULT_KIND, help="family kind (default: %(default)s)")
    ap.add_argument("--groups", type=int, default=4, help="prefixes per shape (default: %(default)s)")
    ap.add_argument("--per-prefix", type=int, default=3, help="records per prefix (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    args = ap.parse_args(argv)
    for rec in shape_records(args.groups, args.per_prefix, args.seed, args.kind):
        sys.stdout.write(json.dumps(rec) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
