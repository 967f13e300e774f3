"""Calibration prompts synthesised from a tokenizer, for a first-run profile without a data file.

No model hub and no network: the words come from a small built-in list plus, where the tokenizer
has them, whole-word tokens of its own vocabulary (a BPE vocabulary's space-prefixed alphabetic
tokens). Six shapes, each a group of its own (the auto-calibration counts a disagreement in any
shape, so every shape can lower a bucket):

- ``text``: a document (sentences of random words) followed by a question whose last token is a
  number (so the shared prefix, which always leaves the prompt's last token, never holds it);
- ``fewshot``: a fixed instruction, a few ``Question: ...\\nAnswer: ...`` examples and a final
  ``Question: ... N?\\nAnswer:``, the shape of SGLang's few-shot scripts;
- ``chat``: a system turn holding a document and a user question about one of its parts, through
  the tokenizer's chat template;
- ``headed``: a shared head ("You are a helpful assistant. ...") in front of a document and
  few-shot examples;
- ``twoblock``: the shared head, few-shot examples of one kind, then examples of another kind and a
  question of that second kind (a suffix that changes what the prefix means);
- ``multiturn``: a conversation with earlier answers, then the next question.

Every prompt's question differs from its neighbours' in its last tokens (a different number, other
words), so the ``first_request`` cached context always has a different question to put after the
shared prefix. Deterministic given the seed.
"""

from __future__ import annotations

import random
import re

# A small list of common English words (written for this module).
_BUILTIN_TEXT = """
the of and to in is was for on that with as by at from this have not are but had his they which
one you were her all she there would their will when who more other time could about into than
them some these two may then first any like now over only new also after use way many must
through back years where much your well down should because each just those people how too
little state good very make world still own see men work long get here between both life being
under never day same another know while last might great old year off come since against go came
right used take three small large number part place point water house city name story table road
river garden window letter morning evening question answer example market school family friend
company paper light music color field power system order report change value reason result
"""
BUILTIN_WORDS = tuple(_BUILTIN_TEXT.split())

_VOCAB_WORD = re.compile(r"^[a-z]{4,12}$")
_DIGITS = "0123456789"


def _encodable(tokenizer, words) -> list[str]:
    """Words whose encoding holds no unknown token."""
    unk = getattr(tokenizer, "unk_token_id", None)
    out = []
    for w in words:
        ids = tokenizer.encode(" " + w, add_special_tokens=False) if _takes_flag(tokenizer) else \
            tokenizer.encode(" " + w)
        if ids and (unk is None or unk not in ids):
            out.append(w)
    return out


def _takes_flag(tokenizer) -> bool:
    try:
        tokenizer.encode("a", add_special_tokens=False)
        return True
    except TypeError:
        return False


def word_pool(tokenizer, max_vocab_words: int = 400, seed: int = 0) -> list[str]:
    """The built-in words plus up to ``max_vocab_words`` whole-word tokens of the vocabulary
    (tokens spelled with a word-start marker, ``Ġ`` or ``▁``, then 4-12 lower-case letters)."""
    words = list(BUILTIN_WORDS)
    try:
        pieces = list(tokenizer.get_vocab())
    except Exception:  # a tokenizer without a vocabulary listing: the built-in words only
        pieces = []
    found = sorted({p[1:] for p in pieces if p[:1] in ("\u0120", "\u2581") and _VOCAB_WORD.match(p[1:])})
    rng = random.Random(seed)
    rng.shuffle(found)
    words += [w for w in found[:max_vocab_words] if w not in BUILTIN_WORDS]
    return _encodable(tokenizer, words) or list(BUILTIN_WORDS)


class _Writer:
    def __init__(self, tokenizer, words: list[str], rng: random.Random) -> None:
        self.tok, self.words, self.rng = tokenizer, words, rng
        self.flag = _takes_flag(tokenizer)

    def n_tokens(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=False) if self.flag else self.tok.encode(text))

    def phrase(self, lo: int, hi: int) -> str:
        return " ".join(self.rng.choice(self.words) for _ in range(self.rng.randint(lo, hi)))

    def sentence(self) -> str:
        s = self.phrase(5, 13)
        return s[:1].upper() + s[1:] + self.rng.choice(".....!?")


def _text_prompt(w: _Writer, target: int, digit: str) -> str:
    question = f"\n\nQuestion: {w.phrase(3, 7)}? Hint: {digit}"
    budget = target - w.n_tokens(question)
    doc: list[str] = []
    para: list[str] = []
    while w.n_tokens(" ".join(para)) + sum(w.n_tokens(p) + 2 for p in doc) < budget:
        para.append(w.sentence())
        if len(para) >= w.rng.randint(3, 6):
            doc.append(" ".join(para))
            para = []
    if para:
        doc.append(" ".join(para))
    return "\n\n".join(doc) + question


def _fewshot_prompt(w: _Writer, target: int, digit: str, header: str) -> str:
    final = f"Question: {w.phrase(3, 7)} {digit}?\nAnswer:"
    shots: list[str] = []
    while w.n_tokens(header + "".join(shots) + final) < target:
        ans = w.rng.choice([w.rng.choice(_DIGITS), w.phrase(1, 3)])
        shots.append(f"Question: {w.phrase(3, 8)}?\nAnswer: {ans}\n\n")
    return header + "".join(shots) + final


HEADED_HEAD = "You are a helpful assistant. Read the instructions below and answer the last question.\n\n"


def _paragraph(w: _Writer, target: int) -> str:
    out: list[str] = []
    while w.n_tokens(" ".join(out)) < target:
        out.append(w.sentence())
    return " ".join(out)


def _chat(tokenizer, system: str, user: str) -> str:
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    try:
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        if isinstance(text, str) and user in text:
            return text
    except Exception:  # no template (or none that takes a system turn): the plain one below
        pass
    return f"System: {system}\n\nUser: {user}\n\nAssistant:"


def _chat_prompt(w: _Writer, target: int, digit: str) -> str:
    part = w.rng.choice(["first", "second", "last", "middle"])
    user = f"In the {part} part, which {w.phrase(1, 3)} is meant? Say it with the number {digit}"
    system = _paragraph(w, max(8, target - w.n_tokens(user) - 24))
    return _chat(w.tok, system, user)


def _headed_prompt(w: _Writer, target: int, digit: str) -> str:
    final = f"Question: {w.phrase(3, 7)} {digit}?\nAnswer:"
    system = _paragraph(w, max(8, (target - w.n_tokens(HEADED_HEAD + final)) // 2)) + "\n\n"
    shots: list[str] = []
    while w.n_tokens(HEADED_HEAD + system + "".join(shots) + final) < target:
        shots.append(f"Question: {w.phrase(3, 8)}?\nAnswer: {w.phrase(1, 3)}\n\n")
    return HEADED_HEAD + system + "".join(shots) + final


def _twoblock_prompt(w: _Writer, target: int, digit: str) -> str:
    """A shared head, few-shot examples of one kind, then examples of another kind (answers of
    another form) and a question of that second kind: a suffix that changes what the first block
    means for the answer."""
    final = f"Q: {w.phrase(2, 5)} {digit}?\nA:"
    first: list[str] = []
    second: list[str] = []
    while w.n_tokens(HEADED_HEAD + "".join(first + second) + final) < target:
        if len(first) <= len(second):
            first.append(f"Question: {w.phrase(3, 8)}?\nAnswer: {w.phrase(1, 3)}\n\n")
        else:
            second.append(f"Q: {w.phrase(2, 6)}?\nA: {w.rng.choice(_DIGITS)}\n\n")
    return HEADED_HEAD + "".join(first + second) + final


def _multiturn(tokenizer, system: str, turns: list[tuple[str, str]], user: str) -> str:
    msgs = [{"role": "system", "content": system}]
    for u, a in turns:
        msgs += [{"role": "user", "content": u}, {"role": "assistant", "content": a}]
    msgs.append({"role": "user", "content": user})
    try:
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        if isinstance(text, str) and user in text:
            return text
    except Exception:  # no template: the plain one below
        pass
    body = "".join(f"User: {u}\n\nAssistant: {a}\n\n" for u, a in turns)
    return f"System: {system}\n\n{body}User: {user}\n\nAssistant:"


def _multiturn_prompt(w: _Writer, target: int, digit: str) -> str:
    """A conversation with the model's earlier answers, then the next question."""
    system = "You are a helpful assistant."
    user = f"And the {w.phrase(1, 3)}? Answer with the number {digit}"
    turns: list[tuple[str, str]] = []
    while w.n_tokens(_multiturn(w.tok, system, turns, user)) < target:
        turns.append((w.sentence(), w.rng.choice([w.rng.choice(_DIGITS), w.sentence()])))
    return _multiturn(w.tok, system, turns, user)


SHAPES = ("text", "fewshot", "chat", "headed", "twoblock", "multiturn")


def synthesize(tokenizer, num_prompts: int = 16, *, min_tokens: int = 128, max_tokens: int = 320,
               seed: int = 0) -> list[tuple[str, str]]:
    """``num_prompts`` (group, prompt text) pairs, cycling through ``SHAPES``, each about
    ``min_tokens``..``max_tokens`` tokens long. Consecutive prompts end with different numbers
    (0-9), so any two neighbours' questions differ."""
    rng = random.Random(seed)
    w = _Writer(tokenizer, word_pool(tokenizer, seed=seed), rng)
    digits = list(_DIGITS)
    rng.shuffle(digits)
    header = "Answer each question in a few words.\n\n"
    out = []
    for i in range(num_prompts):
        target = rng.randint(min_tokens, max(min_tokens, max_tokens))
        digit = digits[i % len(digits)]
        shape = SHAPES[i % len(SHAPES)]
        if shape == "text":
            out.append((shape, _text_prompt(w, target, digit)))
        elif shape == "fewshot":
            out.append((shape, _fewshot_prompt(w, target, digit, header)))
        elif shape == "chat":
            out.append((shape, _chat_prompt(w, target, digit)))
        elif shape == "twoblock":
            out.append((shape, _twoblock_prompt(w, target, digit)))
        elif shape == "multiturn":
            out.append((shape, _multiturn_prompt(w, target, digit)))
        else:
            out.append((shape, _headed_prompt(w, target, digit)))
    return out
