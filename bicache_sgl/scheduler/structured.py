"""A request's output constraint (docs/structured.md) as its block loop uses it: the decision on
the constraint's path, the automaton state after the committed blocks, and the abort reasons.

It lives here, not in ``decoding``, because it joins the two: ``constrained`` already builds on
``decoding``'s primitives."""

from __future__ import annotations

import torch

from ..config import SamplingParams
from ..constrained import Constraint, ConstraintError, constrained_decide
from ..decoding import NEG_INF
from ..decoding.denoiser import Decision, Denoiser


class StructuredOutput:
    """The compiled constraint (shared, immutable) and this request's state in it."""

    def __init__(self, constraint: Constraint, params: SamplingParams) -> None:
        self.constraint, self.params = constraint, params
        self.state = constraint.start(params.max_new_tokens)

    def decide(self, lg: torch.Tensor, block: torch.Tensor, mask_id: int, denoiser: Denoiser,
               generator: torch.Generator) -> Decision:
        """The constrained path's tokens for every masked position of ``block`` (its tokens [L]),
        from their processed logits ``lg`` [n_masked, V], with the algorithm's confidence: the
        path token's probability given the constraint for ``low_confidence`` and
        ``maskgit_plus``, noise for ``random``; Dream's margin or entropy of the model's own
        distribution for ``topk_margin`` and ``entropy``. Raises ``NoCompletion``."""
        banned = lg
        if not denoiser.bans_mask:
            banned = lg.clone()
            banned[:, mask_id] = NEG_INF
        x0, conf, lp = self.path(banned, block, block == mask_id, generator, remasking=denoiser.plan.remasking)
        return x0, denoiser.path_confidence(lg, x0, conf), lp

    def path(self, lg: torch.Tensor, block: torch.Tensor, masked: torch.Tensor, generator: torch.Generator | None,
             remasking: str = "low_confidence") -> Decision:
        """``constrained_decide`` in the current state with this request's sampling knobs: the
        path's tokens for the ``masked`` positions of ``block`` (its output tokens [L]) from their
        processed logits ``lg`` [n_masked, V] (the mask token already banned), the confidence
        ``remasking`` gives (``low_confidence``: the path token's probability given the
        constraint) and the model's logprob. Raises ``NoCompletion``. The block engine
        (blockdiff/sampling.py) calls this directly: its rule has no Denoiser."""
        p = self.params
        return constrained_decide(self.constraint, self.state, block, masked, lg, temperature=p.temperature,
                                  top_k=p.top_k, top_p=p.top_p, min_p=p.min_p, remasking=remasking,
                                  generator=generator)

    def advance(self, block: torch.Tensor) -> dict | None:
        """A block was committed: the state after it, or the abort reason when a token left the
        constraint (cannot happen: every unmasked token is on a viable path)."""
        try:
            self.state = self.constraint.advance(self.state, block)
        except ConstraintError as e:
            return self.mismatch(f"a committed token left the constraint ({e})")
        return None

    def no_completion(self, why: str, committed: int) -> dict:
        """No output matching the constraint fits: the abort reason saying so (never a partial
        output claimed as a match). Before anything is committed it names max_new_tokens."""
        c, st, p = self.constraint, self.state, self.params
        if committed == 0 and not c.feasible(st):
            need = c.min_tokens(st)
            if need is None:
                why = "the constraint matches no output this tokenizer can produce"
            elif not c.end_ids:
                why = (f"no output matching the constraint is exactly max_new_tokens={p.max_new_tokens} tokens "
                       f"long (ignore_eos: every position is output)")
            else:
                why = (f"no output matching the constraint fits in max_new_tokens={p.max_new_tokens} "
                       f"(at least {need} tokens needed)")
        return {"type": "abort", "message": why}

    def finished(self, ids: list[int], reason: dict) -> dict:
        """The output ends with ``reason``: that, unless it does not fully match (the safety
        check: never claim a non-match)."""
        return reason if self.constraint.matches(ids) else self.mismatch("the finished output is not a complete match")

    @staticmethod
    def mismatch(why: str) -> dict:
        return {"type": "abort", "message": f"the output does not match the constraint: {why}"}
