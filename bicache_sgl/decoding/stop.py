"""Where a request's output ends: end ids (EOS, ``stop_token_ids``), stop strings, the length
limits; with or without an output constraint."""

from __future__ import annotations

from typing import Protocol

from ..config import SamplingParams
from .text import Detokenizer

# {"type": "stop", "matched": id or string} | {"type": "length", "length": n}
Reason = dict


class Automaton(Protocol):
    """What stop handling reads of an output constraint (``constrained.Constraint``)."""

    initial: int

    def next_state(self, q: int, token: int) -> int: ...

    def is_accepting(self, q: int) -> bool: ...


class StopRule:
    """A request's stop conditions. ``eos_ids``: the model's end ids (none count with
    ``ignore_eos``); ``gen_len``: the generation region; ``automaton``: the output constraint,
    under which an end id only ever follows a complete match, and a stop string ends the output
    only where the tokens before it are one."""

    def __init__(self, params: SamplingParams, eos_ids: tuple[int, ...], gen_len: int, detok: Detokenizer,
                 automaton: Automaton | None = None) -> None:
        self.params, self.gen_len, self.detok, self.automaton = params, gen_len, detok, automaton
        self.end_ids = set(() if params.ignore_eos else eos_ids) | set(params.stop_token_ids)

    def check(self, gen: list[int]) -> tuple[list[int], str, Reason | None]:
        """The final generated tokens so far (whole blocks) -> (output ids, output text, why it
        ended; None: it goes on)."""
        p = self.params
        limit = min(len(gen), p.max_new_tokens)
        cut, reason = limit, None
        # under a constraint an end id only ever follows a complete match: the output ends at the
        # first one (min_new_tokens only steered the decision away from it)
        for i in range(0 if self.automaton is not None else min(p.min_new_tokens, limit), limit):
            t = gen[i]
            if t in self.end_ids:
                cut, reason = i, {"type": "stop", "matched": t}
                break
        ids = gen[:cut]
        text = self.detok.text(ids)
        if p.stop:
            hit = self._find_stop(ids, text) if self.automaton is None else self._find_stop_constrained(ids, text)
            if hit is not None:
                ids, text, matched = hit
                reason = {"type": "stop", "matched": matched}
        if reason is None and len(gen) >= p.max_new_tokens:
            reason = {"type": "length", "length": p.max_new_tokens}
        if reason is None and len(gen) >= self.gen_len:
            reason = {"type": "length", "length": len(ids)}
        return ids, text, reason

    def _find_stop(self, ids: list[int], text: str) -> tuple[list[int], str, str] | None:
        """Earliest stop string (after min_new_tokens) -> (ids up to it, trimmed text, matched)."""
        best = None
        for s in self.params.stop:
            if not s:
                continue
            i = text.find(s)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        # shortest token prefix whose text reaches the end of the stop string
        n = len(ids)
        for j in range(max(self.params.min_new_tokens, 1), len(ids) + 1):
            if len(self.detok.text(ids[:j])) >= i + len(s):
                n = j
                break
        return ids[:n], text[:i], s

    def _find_stop_constrained(self, ids: list[int], text: str) -> tuple[list[int], str, str] | None:
        """Stop strings under a constraint: the output ends at the earliest stop string that
        starts where the tokens before it are a complete match (a token boundary in an accepting
        state, at or after min_new_tokens) -> (those tokens, their text, matched). The stop string
        and what follows are dropped from both text and ids, so the output still matches;
        occurrences anywhere else are part of the constrained text."""
        c = self.automaton
        q = c.initial
        for j in range(len(ids) + 1):
            if j > 0:
                q = c.next_state(q, ids[j - 1])
                if q < 0:
                    return None
            if j < self.params.min_new_tokens or not c.is_accepting(q):
                continue
            head = self.detok.text(ids[:j])
            if not text.startswith(head):
                continue
            for s in self.params.stop:
                if s and text.startswith(s, len(head)):
                    return ids[:j], head, s
        return None
