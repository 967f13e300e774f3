"""Segment boundaries of a prompt: where the reused span may end (docs/prefix_cache.md, "Where the
reused span ends").

A cached row of a bidirectional model was computed beside everything its capturer's sequence held,
after it included. Two prompts that share a prefix and then diverge mid-segment ("...\\n\\nQuestion: "
then two different questions) share the opening tokens of a segment whose meaning the divergent
rest decides: those tokens' state, captured beside the other question, is the most
context-dependent state of the match. So rows are reused only up to the last *segment boundary* at
or before the two prompts' common prefix, a boundary being the position right after

- an **end-of-turn token**: the model's end ids (``eos_token_id`` of config.json /
  generation_config.json, e.g. ``<|eot_id|>``, ``<|im_end|>``) and the special tokens the chat
  template puts right after a message's content (read by rendering the template);
- a **blank line** (the text up to here ends with ``"\\n\\n"``): the end of a complete few-shot
  example or paragraph. A blank line right after a special token is a template header's
  (``<|end_header_id|>\\n\\n``: the last turn's opening, not a completed segment) and does not count.

Everything here is read from the tokenizer once, at engine build (:meth:`SegmentBoundaries.
from_tokenizer`), into per-id numpy lookup tables; :meth:`SegmentBoundaries.positions` then finds a
prompt's boundaries with a few vectorised lookups. A tokenizer with none of these tokens gives no
boundary at all: only whole captures (a prefix-only or output capture the request extends) are
reused, the official BiCache engine's span (the planner's rule).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

import numpy as np

log = logging.getLogger(__name__)

_MARK = "\x00bicache-segment-{}\x00"  # message contents while rendering a chat template


class SegmentBoundaries:
    """Per-token-id tables ``[vocab]``: ``end_turn`` (a boundary right after it), ``special``,
    ``tail_nl`` (trailing newlines of the token's text, capped at 2) and ``all_nl`` (its text is
    newlines only). Ids beyond the tables are ordinary tokens."""

    def __init__(self, end_turn: np.ndarray, special: np.ndarray, tail_nl: np.ndarray, all_nl: np.ndarray) -> None:
        n = len(end_turn)
        if not (len(special) == len(tail_nl) == len(all_nl) == n):
            raise ValueError("SegmentBoundaries: the per-id tables must have one length")
        self.end_turn = np.asarray(end_turn, dtype=bool)
        self.special = np.asarray(special, dtype=bool)
        self.tail_nl = np.minimum(np.asarray(tail_nl, dtype=np.int8), 2)
        self.all_nl = np.asarray(all_nl, dtype=bool)

    @property
    def empty(self) -> bool:
        """No token ever ends a segment (no end-of-turn id, no newline in the vocabulary)."""
        return not (self.end_turn.any() or self.tail_nl.any())

    @classmethod
    def from_texts(cls, texts: Sequence[str], *, end_turn_ids: Iterable[int] = (),
                   special_ids: Iterable[int] = ()) -> "SegmentBoundaries":
        """From each id's decoded text (``texts[i]``: token i) and the end-of-turn / special ids."""
        n = len(texts)
        end_turn = np.zeros(n, dtype=bool)
        special = np.zeros(n, dtype=bool)
        for ids, table in ((end_turn_ids, end_turn), (special_ids, special)):
            for i in ids:
                if 0 <= int(i) < n:
                    table[int(i)] = True
        tail = np.zeros(n, dtype=np.int8)
        all_nl = np.zeros(n, dtype=bool)
        for i, t in enumerate(texts):
            if t.endswith("\n"):
                tail[i] = 2 if t.endswith("\n\n") else 1
                all_nl[i] = t.strip("\n") == ""
        return cls(end_turn, special, tail, all_nl)

    @classmethod
    def from_tokenizer(cls, tokenizer, eos_ids: Iterable[int] = ()) -> "SegmentBoundaries":
        """Read the tables from a Hugging Face tokenizer: every id's text (one batched decode), its
        special ids, the model's end ids ``eos_ids`` and the special tokens its chat template puts
        right after a message (:func:`template_turn_ends`)."""
        vocab = max(len(tokenizer), int(getattr(tokenizer, "vocab_size", 0) or 0))
        texts = tokenizer.batch_decode([[i] for i in range(vocab)], skip_special_tokens=False,
                                       clean_up_tokenization_spaces=False)
        special = set(int(i) for i in getattr(tokenizer, "all_special_ids", ()) or ())
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        special |= {int(i) for i, t in added.items() if getattr(t, "special", False)}
        ends = set(int(i) for i in eos_ids) | template_turn_ends(tokenizer, special)
        out = cls.from_texts(texts, end_turn_ids=ends, special_ids=special)
        if out.empty:
            log.warning("the tokenizer has no end-of-turn or newline token: the bicache span ends at no segment "
                        "boundary, so only whole prefix-only / output captures are reused")
        return out

    def positions(self, ids: np.ndarray | Sequence[int]) -> tuple[int, ...]:
        """Sorted boundary positions p in [1, len(ids)] of a prompt: the position right after a
        token that ends a segment (so [0, p) holds whole segments only)."""
        ids = np.asarray(ids, dtype=np.int64)
        if len(ids) == 0:
            return ()
        n = len(self.end_turn)
        known = (ids >= 0) & (ids < n)
        safe = np.where(known, ids, 0)
        end_turn = self.end_turn[safe] & known
        special = self.special[safe] & known
        tail = np.where(known, self.tail_nl[safe], 0)
        all_nl = self.all_nl[safe] & known
        prev_tail = np.concatenate([[0], tail[:-1]])
        prev_special = np.concatenate([[False], special[:-1]])
        # the text through token i ends with a blank line: the token's own text does, or it is
        # newlines only and completes one the previous token began
        blank = (tail >= 2) | (all_nl & (tail + prev_tail >= 2))
        # ... unless the newlines open a template turn right after its header's special token
        header = all_nl & prev_special
        ends = end_turn | (blank & ~header)
        return tuple((np.flatnonzero(ends) + 1).tolist())


def template_turn_ends(tokenizer, special: set[int]) -> set[int]:
    """The special tokens the tokenizer's chat template writes right after a message's content
    (``<|eot_id|>``, ``<|im_end|>``): rendered on a short conversation with marker contents; empty
    without a template or when rendering fails."""
    if not getattr(tokenizer, "chat_template", None):
        return set()
    msgs = [{"role": "system", "content": _MARK.format(0)}, {"role": "user", "content": _MARK.format(1)},
            {"role": "assistant", "content": _MARK.format(2)}, {"role": "user", "content": _MARK.format(3)}]
    out: set[int] = set()
    for conv in (msgs, msgs[1:]):
        try:
            text = tokenizer.apply_chat_template(conv, tokenize=False)
        except Exception:
            continue
        for i in range(4):
            mark = _MARK.format(i)
            at = text.find(mark)
            if at < 0:
                continue
            after = tokenizer.encode(text[at + len(mark):], add_special_tokens=False)[:1]
            out |= {t for t in after if t in special}
        if out:
            break
    return out
