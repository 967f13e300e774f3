"""One block-diffusion request's logit processing and output constraint, for the block engine
(docs/block_diffusion.md, section 5; docs/structured.md, "Block-diffusion models").

Nothing here is a second implementation: the logits a decision is made on are the bidirectional
engine's ``decoding.sampling.LogitsProcessor`` (logit bias, the three penalties,
EOS with ``ignore_eos``, EOS and stop ids before ``min_new_tokens``), and a regex / JSON-schema
constraint is ``scheduler.structured.StructuredOutput`` (the DINGO block path over the automaton).
This module only maps them onto the block engine's window: the current block is
``x[a:b]`` (absolute positions; the first block may hold the prompt's tail, which is not output),
and the published per-block rule (``decoding.block``) then picks which positions to commit.
"""

from __future__ import annotations

import numpy as np
import torch

from ..config import SamplingParams
from ..constrained import NoCompletion
from ..decoding import NEG_INF
from ..decoding.block import sample_tokens
from ..decoding.sampling import LogitsProcessor
from ..scheduler.structured import StructuredOutput
from .params import BlockParams


def sampling_view(p: BlockParams) -> SamplingParams:
    """The SamplingParams the shared processors read, from a block request's parameters (their
    validation applies: a penalty or bias out of range raises ValueError)."""
    return SamplingParams(
        max_new_tokens=p.max_new_tokens, min_new_tokens=p.min_new_tokens, temperature=p.temperature,
        top_k=p.top_k if p.top_k is not None and p.top_k > 0 else -1, top_p=1.0 if p.top_p is None else p.top_p,
        stop_token_ids=tuple(p.stop_ids or ()), ignore_eos=p.ignore_eos, frequency_penalty=p.frequency_penalty,
        presence_penalty=p.presence_penalty, repetition_penalty=p.repetition_penalty, min_p=p.min_p,
        logit_bias=p.logit_bias)


class BlockSampler:
    """A request's decision on its current block: processed logits, then the published sampling
    (argmax / temperature, top-k, top-p, min-p), and under a constraint the constraint's path on
    the block's masked output positions. ``eos_ids``: the model's end ids (what ``ignore_eos``
    and ``min_new_tokens`` ban); ``vocab_size``: the logits' width."""

    def __init__(self, params: BlockParams, prompt: list[int], *, mask_id: int, eos_ids: tuple[int, ...],
                 vocab_size: int) -> None:
        self.params, self.mask_id, self.prompt_len, self.vocab = params, mask_id, len(prompt), vocab_size
        sp = sampling_view(params)
        self.processor = LogitsProcessor(sp, prompt, params.max_new_tokens, mask_id=mask_id, eos_ids=eos_ids)
        self.structured = StructuredOutput(params.constraint, sp) if params.constraint is not None else None

    def _answer(self, x: torch.Tensor, a: int, b: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        """(offset of the first output row in the block, the block's output tokens, their mask)."""
        off = max(self.prompt_len - a, 0)
        blk = x[a + off:b]
        return off, blk, blk == self.mask_id

    def decide(self, logits: torch.Tensor, x: torch.Tensor, a: int, b: int,
               generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The block's logits [b - a, V] (rows of positions a..b-1 of the window ``x``) -> the
        token and confidence of every row (CPU, [b - a]) and the processed logits [b - a, V] they
        were decided on (what output logprobs are read from). Under a
        constraint the masked output rows get the constraint's path and the path token's
        probability given the constraint (so a forced token passes the threshold at once); the
        other rows keep the plain decision (token editing reads it). Raises ``NoCompletion``."""
        p = self.params
        # the mask token is not banned: the published loops decide over the whole vocabulary
        lg = self.processor(logits, x, np.arange(a, b, dtype=np.int64), ban_mask=False)
        tok, conf = sample_tokens(lg, p.temperature, p.top_k, p.top_p, generator, min_p=p.min_p)
        tok, conf = tok.cpu(), conf.cpu()
        if self.structured is not None:
            off, blk, masked = self._answer(x, a, b)
            if bool(masked.any()):
                rows = off + masked.nonzero()[:, 0]
                sub = lg.index_select(0, rows.to(lg.device))
                sub[:, self.mask_id] = NEG_INF  # the constraint's path never writes the mask token
                x0, c, _ = self.structured.path(sub, blk, masked, generator)
                tok[rows] = x0.cpu()
                conf[rows] = c.cpu().to(conf.dtype)
        return tok, conf, lg

    def viable_edits(self, x: torch.Tensor, a: int, b: int, m2t: torch.Tensor, t2t: torch.Tensor, tok: torch.Tensor,
                     conf: torch.Tensor) -> torch.Tensor:
        """LLaDA2.1's token-to-token edits ``t2t`` (bool [b - a]) under a constraint: with this
        step's mask-to-token choice ``m2t`` in place (the constraint's path), each edit to ``tok``
        is tried, most confident first, and kept when the block still admits a full match; the
        kept ones (bool [b - a]). ``x`` is left as it was."""
        blk = x[a:b]
        before = blk.clone()
        blk[m2t] = tok[m2t]
        keep = torch.zeros_like(t2t)
        cand = t2t.nonzero()[:, 0]
        for i in cand[conf[cand].argsort(descending=True)].tolist():
            prev = int(blk[i])
            blk[i] = tok[i]
            if self.viable(x, a, b):
                keep[i] = True
            else:
                blk[i] = prev
        blk.copy_(before)
        return keep

    def viable(self, x: torch.Tensor, a: int, b: int) -> bool:
        """Whether the block's output tokens (token edits applied, masks left as they are) still
        admit a completion that fully matches the constraint (always, unconstrained)."""
        s = self.structured
        if s is None:
            return True
        _, blk, masked = self._answer(x, a, b)
        try:  # viability only: the scores do not matter (every id below the vocabulary is a candidate),
            # the DP raises when no path exists
            s.constraint.block_path(s.state, blk, masked, torch.zeros(int(masked.sum()), self.vocab))
        except NoCompletion:
            return False
        return True

    def advance(self, x: torch.Tensor, a: int, b: int) -> dict | None:
        """The block a..b is committed: the automaton moves over its output tokens; the abort
        reason when one left the constraint (None: fine, or unconstrained)."""
        if self.structured is None:
            return None
        return self.structured.advance(self._answer(x, a, b)[1])

    def no_completion(self, why: str, committed: int) -> dict:
        """The abort reason when no matching output fits (``StructuredOutput.no_completion``)."""
        assert self.structured is not None
        return self.structured.no_completion(why, committed)
