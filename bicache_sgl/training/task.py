"""Synthetic few-shot task for the bundled diffusion LM.

Prompts have the shape of SGLang's few-shot GSM8K scripts::

    Question: K
    Answer: 7

    Question: D
    Answer: 7

    Question: K
    Answer:

and the model generates `` 7`` followed by EOS.  A *family* is a set of
single-letter keys, each with a one-digit answer, shown as the few-shot block in a
fixed, family-specific order; every question of the family asks for one of the keys
shown in that block.  Two kinds of family:

- ``"code"`` (the default, what the bundled model is trained on): all keys of a
  family share one random digit, the family's secret code.  The answer is the code,
  which appears only in the family's few-shot block: the question (a letter) carries
  no information about it, and the same question has different answers in
  different families.
- ``"lookup"``: every key has its own random digit, so the model must find the
  example whose key matches the question (in-context associative recall).  Much
  harder for a small model: it did not learn within the CPU budget (see
  docs/default_model.md).
- ``"group"``: the keys fall into two fixed halves of the alphabet (``GROUPS``); a
  family has one code per half (the first half's from 0-4, the second's from 5-9,
  ``GROUP_CODES``), and the question's key decides which of the two codes is the
  answer.  The question selects which part of the prefix matters, so the
  same prefix means something else after another question (the context-dependent
  model of docs/fidelity.md is trained on it).

Without the few-shot block (or with the block of another family) the best a model
can do is guess one of ten digits: chance is 10%.

A family is identified by its mapping (the sorted key/value pairs).  A fixed
hash of that identity puts about one family in ten into the held-out split;
training only ever samples families outside it, so held-out families are never
seen in training.

Every public helper is deterministic given its seed.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# Upper-case letters except "A" and "Q" (which begin "Answer" / "Question").
KEY_CHARS = "BCDEFGHIJKLMNOPRSTUVWXYZ"
VALUE_CHARS = "0123456789"
MAX_SHOTS = 12
# The family kind the bundled model was trained on (see docs/default_model.md):
#   "code":   every example of a family answers with the family's secret digit;
#   "lookup": every key of a family has its own digit (harder; did not learn in budget).
DEFAULT_KIND = "code"
KINDS = ("code", "lookup", "group")
# kind "group": the two halves of KEY_CHARS; every key of a half answers its half's code
GROUPS = (KEY_CHARS[:12], KEY_CHARS[12:])
GROUP_CODES = ("01234", "56789")  # a half's code is drawn from its own digits
HELDOUT_MOD = 10  # one family in HELDOUT_MOD is held out

QUESTION_PREFIX = "Question: "
ANSWER_PREFIX = "\nAnswer:"
EXAMPLE_SEP = "\n\n"

Pair = tuple  # (question, answer), both str


@dataclass(frozen=True)
class Family:
    """A key -> value mapping, with the display order of its few-shot examples."""

    pairs: tuple  # tuple[tuple[str, str], ...] in display order

    @property
    def canonical(self) -> str:
        return family_canonical(self.pairs)

    @property
    def name(self) -> str:
        return "fam-" + hashlib.sha1(self.canonical.encode()).hexdigest()[:10]

    @property
    def mapping(self) -> dict:
        return dict(self.pairs)

    @property
    def heldout(self) -> bool:
        return is_heldout(self.pairs)


def key_group(key: str) -> int:
    """Kind "group": which half of the alphabet (0 or 1) a key belongs to."""
    return 0 if key in GROUPS[0] else 1


def family_canonical(pairs: Iterable[Pair]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(pairs))


def is_heldout(pairs: Iterable[Pair]) -> bool:
    digest = hashlib.sha256(("bicache-task-v1|" + family_canonical(pairs)).encode()).digest()
    return int.from_bytes(digest[:8], "big") % HELDOUT_MOD == 0


def random_family(rng: random.Random, num_shots: int, split: str = "train",
                  kind: str = DEFAULT_KIND) -> Family:
    """Sample a family with `num_shots` distinct keys from the given split.

    kind="lookup": every key gets its own random digit.  kind="code": every key of the
    family gets the same random digit (the family's code).  kind="group": two codes, one
    per half of the alphabet (``GROUPS``), drawn from that half's digits (``GROUP_CODES``);
    with two or more shots both halves are shown.
    """
    if not 1 <= num_shots <= MAX_SHOTS:
        raise ValueError(f"num_shots must be in [1, {MAX_SHOTS}], got {num_shots}")
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    want_heldout = split == "heldout"
    while True:
        keys = rng.sample(KEY_CHARS, num_shots)
        if kind == "code":
            code = rng.choice(VALUE_CHARS)
            pairs = tuple((k, code) for k in keys)
        elif kind == "group":
            if num_shots >= 2 and len({key_group(k) for k in keys}) < 2:
                continue
            codes = (rng.choice(GROUP_CODES[0]), rng.choice(GROUP_CODES[1]))
            pairs = tuple((k, codes[key_group(k)]) for k in keys)
        else:
            pairs = tuple((k, rng.choice(VALUE_CHARS)) for k in keys)
        if is_heldout(pairs) == want_heldout:
            return Family(pairs)


# --------------------------------------------------------------------------- text


def format_example(question: str, answer: str) -> str:
    return f"{QUESTION_PREFIX}{question}{ANSWER_PREFIX} {answer}"


def build_prefix(examples: Sequence[Pair]) -> str:
    """The few-shot block: examples joined by a blank line (no trailing separator)."""
    return EXAMPLE_SEP.join(format_example(q, a) for q, a in examples)


def build_prompt(prefix_examples: str | Sequence[Pair], question: str) -> str:
    """Few-shot prefix (a string from `build_prefix` or a list of (q, a)) + the question.

    The model is expected to continue with ``" " + answer`` and then EOS.
    """
    prefix = prefix_examples if isinstance(prefix_examples, str) else build_prefix(prefix_examples)
    tail = f"{QUESTION_PREFIX}{question}{ANSWER_PREFIX}"
    return f"{prefix}{EXAMPLE_SEP}{tail}" if prefix else tail


def target_text(answer: str) -> str:
    """What the generation region should hold before the EOS padding."""
    return " " + answer


def continuation_text(question: str, answer: str, gen_len: int) -> str:
    """The generation region of a sample trained to continue in the prompt's format (train.py
    ``--format-prob``): the answer, then the same question and answer again, example after example,
    cut at ``gen_len`` characters with no EOS::

        " 7" + "\n\nQuestion: K\nAnswer: 7" + "\n\nQuestion: K\nAnswer: 7" + ...

    It repeats the question just asked (not a new key): every character is a copy of the one an
    example's length (23 characters) earlier, a function of the prompt, so a forced continuation
    (``ignore_eos``) is decided as firmly as the answer is; a new key would be an argmax among
    near-equal candidates, which any perturbation of the prefix state flips."""
    one = EXAMPLE_SEP + format_example(question, answer)
    text = target_text(answer)
    while len(text) < gen_len:
        text += one
    return text[:gen_len]


def in_format(generated: str, answer: str) -> bool:
    """Whether a forced continuation has the prompt's format: ``continuation_text`` with any
    upper-case letter as each repeated question's key (the answer must be right everywhere)."""
    want = continuation_text("K", answer, len(generated))
    keys = {i for i in range(len(want)) if want[:i].endswith(QUESTION_PREFIX)}
    return all(g.isupper() if i in keys else g == w for i, (g, w) in enumerate(zip(generated, want)))


def extract_answer(generated: str) -> str:
    """Parse a model continuation: the first line, stripped."""
    return generated.strip().split("\n")[0].strip()


# --------------------------------------------------------------------------- items


def family_items(family: Family, questions_per_family: int | None = None,
                 rng: random.Random | None = None) -> list:
    keys = [k for k, _ in family.pairs]
    if rng is not None:
        keys = keys[:]
        rng.shuffle(keys)
    if questions_per_family is not None:
        keys = keys[:questions_per_family]
    prefix = build_prefix(family.pairs)
    mapping = family.mapping
    return [
        {
            "prefix": prefix,
            "examples": [list(p) for p in family.pairs],
            "question": k,
            "answer": mapping[k],
            "family": family.name,
            "prompt": build_prompt(prefix, k),
        }
        for k in keys
    ]


def heldout_families(num_families: int, num_shots: int = 5, seed: int = 0,
                     kind: str = DEFAULT_KIND) -> list:
    """`num_families` distinct held-out families, deterministic in (num_shots, seed)."""
    rng = random.Random(f"bicache-heldout|{seed}|{num_shots}")
    seen, out = set(), []
    attempts = 0
    while len(out) < num_families:
        fam = random_family(rng, num_shots, "heldout", kind)
        attempts += 1
        if fam.canonical in seen:
            if attempts > 1000 * (num_families + 10):
                raise ValueError(f"only {len(out)} distinct held-out families exist with "
                                 f"num_shots={num_shots}; ask for fewer questions")
            continue
        seen.add(fam.canonical)
        out.append(fam)
    return out


def heldout_items(num_questions: int = 200, num_shots: int = 5, seed: int = 0,
                  questions_per_family: int | None = None, kind: str = DEFAULT_KIND) -> list:
    """Held-out evaluation items, family by family (consecutive items share a prefix).

    Each item is a dict with ``prefix`` (the few-shot block), ``examples`` (its
    (question, answer) pairs), ``question``, ``answer``, ``family`` and ``prompt``
    (``build_prompt(prefix, question)``).  A family contributes
    ``questions_per_family`` questions (default: one per shown key, i.e. num_shots).
    """
    qpf = num_shots if questions_per_family is None else questions_per_family
    if not 1 <= qpf <= num_shots:
        raise ValueError("questions_per_family must be in [1, num_shots]")
    num_families = -(-num_questions // qpf)
    rng = random.Random(f"bicache-heldout-questions|{seed}|{num_shots}")
    items = []
    for fam in heldout_families(num_families, num_shots, seed, kind):
        items.extend(family_items(fam, qpf, rng))
    return items[:num_questions]


def control_items(items: Sequence[dict], mode: str = "shuffle", seed: int = 0) -> list:
    """Control variants of `items` in which the few-shot prefix carries no answer.

    mode="remove": the few-shot examples are dropped (prompt = the question only).
    mode="shuffle": each family gets the few-shot prefix of a different family
    (a random derangement of the families in `items`); answers stay the same.
    """
    if mode == "remove":
        return [dict(it, prefix="", examples=[], prompt=build_prompt("", it["question"]))
                for it in items]
    if mode != "shuffle":
        raise ValueError(f"mode must be 'remove' or 'shuffle', got {mode!r}")
    fams = []
    by_fam = {}
    for it in items:
        if it["family"] not in by_fam:
            fams.append(it["family"])
            by_fam[it["family"]] = (it["prefix"], it["examples"])
    if len(fams) < 2:
        raise ValueError("shuffle control needs at least two families")
    rng = random.Random(f"bicache-control|{seed}")
    perm = fams[:]
    while True:
        rng.shuffle(perm)
        if all(a != b for a, b in zip(fams, perm)):
            break
    donor = dict(zip(fams, perm))
    out = []
    for it in items:
        prefix, examples = by_fam[donor[it["family"]]]
        out.append(dict(it, prefix=prefix, examples=examples,
                        prompt=build_prompt(prefix, it["question"])))
    return out


def chance_accuracy() -> float:
    """Accuracy of guessing a digit uniformly (the floor a prefix-blind model reaches)."""
    return 1.0 / len(VALUE_CHARS)


# --------------------------------------------------------------------------- training


def training_sample(rng: random.Random, num_shots: int, kind: str = DEFAULT_KIND) -> tuple:
    """One training (prompt, answer) pair from a random training-split family."""
    fam = random_family(rng, num_shots, "train", kind)
    k, v = fam.pairs[rng.randrange(num_shots)]
    return build_prompt(fam.pairs, k), v


def prompt_length(num_shots: int) -> int:
    """Characters (= tokens) of a prompt with `num_shots` examples (all keys are 1 char)."""
    ex = len(format_example("K", "7"))
    tail = len(build_prompt("", "K"))
    return num_shots * ex + num_shots * len(EXAMPLE_SEP) + tail


def calibration_records(num_families: int = 4, shots: Sequence[int] = (2, 3, 4, 5, 6), seed: int = 0,
                        kind: str = DEFAULT_KIND) -> list:
    """``{"prefix", "suffix"}`` records for ``python -m bicache_sgl.calibrate`` (one jsonl line each):
    the prefix is what a family's questions share (its few-shot block + ``"\\n\\nQuestion: "``), the
    suffix one question's key + ``"\\nAnswer:"``; held-out families, family by family (so a record's
    neighbour, which calibration takes as the cached context's other question, asks another key of
    the same block)."""
    out = []
    for n in shots:
        for it in heldout_items(num_families * n, n, seed=seed, kind=kind):
            prefix = it["prefix"] + EXAMPLE_SEP + QUESTION_PREFIX
            assert (prefix + it["question"] + ANSWER_PREFIX) == it["prompt"]
            out.append({"prefix": prefix, "suffix": it["question"] + ANSWER_PREFIX})
    return out
