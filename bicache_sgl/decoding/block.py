"""Block decoding as the block-diffusion families publish it (LLaDA2's ``generate`` in its
modeling file, SDAR's ``block_diffusion_generate``): pure functions, no model.

- The sequence is ``num_blocks = ceil((prompt + gen_length) / block_length)`` blocks from absolute
  position 0; everything after the prompt starts as the mask token. Decoding starts at block
  ``prompt // block_length`` (the block holding the prompt's tail, or the first all-mask block).
- Per block, at most ``steps`` denoising steps, ``steps = min(steps, gen_length // minimal_topk)``;
  step s may unmask ``schedule[s]`` tokens (block_length spread over the steps, the remainder on
  the first ones). A step samples every position of the block (greedy: argmax, confidence = its
  softmax probability); among still-masked positions, if at least ``schedule[s]`` are above
  ``threshold`` all of those are unmasked, otherwise the ``min(schedule[s], masked)`` most
  confident. The block ends when no mask is left.
- After a block, generation stops if any EOS id appears in the generated region so far; the
  answer is the first ``gen_length`` generated tokens, cut after the first EOS (inclusive).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from . import filter_logits


@dataclass(frozen=True)
class BlockLayout:
    """Where a request's blocks are: decoding covers blocks first_block .. num_blocks - 1."""

    prompt_len: int
    gen_length: int
    block_length: int

    @property
    def num_blocks(self) -> int:
        return (self.prompt_len + self.gen_length + self.block_length - 1) // self.block_length

    @property
    def total_length(self) -> int:
        return self.num_blocks * self.block_length

    @property
    def first_block(self) -> int:
        return self.prompt_len // self.block_length


def effective_steps(steps: int, gen_length: int, minimal_topk: int = 1) -> int:
    """The published cap: ``min(steps, gen_length // minimal_topk)`` (at least 1)."""
    return max(1, min(steps, gen_length // minimal_topk))


def transfer_schedule(block_length: int, steps: int) -> list[int]:
    """Tokens a step may unmask: block_length // steps each, the remainder one more on the first
    steps (sums to block_length)."""
    base, rem = divmod(block_length, steps)
    return [base + (1 if s < rem else 0) for s in range(steps)]


def sample_tokens(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
                  top_p: float | None = None, generator: torch.Generator | None = None, min_p: float = 0.0
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [m, V] -> (token [m], its probability [m]). temperature 0: argmax and the plain
    softmax probability of it (the published greedy branch); otherwise min-p on the untempered
    logits (docs/server.md, "Penalties"), temperature, then top-k, then top-p filtering, softmax,
    one multinomial draw per row. Like top-k and top-p, min-p filters the sampled distribution
    only: it changes neither the argmax nor its probability at temperature 0."""
    logits = logits.float()
    if temperature == 0:
        tok = logits.argmax(dim=-1)
        p = torch.softmax(logits, dim=-1).gather(1, tok[:, None])[:, 0]
        return tok, p
    logits = filter_logits(logits, -1, 1.0, min_p)
    z = logits / temperature
    if top_k is not None and top_k > 0:
        kth = z.topk(min(top_k, z.shape[-1]), dim=-1).values[:, -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        srt, order = z.sort(dim=-1, descending=True)
        cum = torch.softmax(srt, dim=-1).cumsum(-1)
        drop = cum > top_p
        drop[:, 1:] = drop[:, :-1].clone()
        drop[:, 0] = False
        z = z.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), float("-inf"))
    probs = torch.softmax(z, dim=-1)
    tok = torch.multinomial(probs, 1, generator=generator)[:, 0]
    return tok, probs.gather(1, tok[:, None])[:, 0]


def select_transfer(confidence: torch.Tensor, masked: torch.Tensor, k: int, threshold: float) -> torch.Tensor:
    """confidence [m] (any value on unmasked rows), masked bool [m] -> bool [m]: the positions
    this step unmasks (only masked ones)."""
    conf = torch.where(masked, confidence, torch.full_like(confidence, float("-inf")))
    high = conf > threshold
    if int(high.sum()) >= k:
        return high
    out = torch.zeros_like(masked)
    n = min(k, int(masked.sum()))
    if n > 0:
        out[conf.topk(n).indices] = True
    return out


def cut_answer(generated: Sequence[int], gen_length: int, eos_ids: Sequence[int], min_tokens: int = 0) -> list[int]:
    """The first gen_length generated tokens, up to and including the first EOS at or after
    position ``min_tokens`` (``min_new_tokens``: an end id before it does not end the answer)."""
    out = []
    for i, t in enumerate(list(generated)[:gen_length]):
        out.append(int(t))
        if i >= min_tokens and t in eos_ids:
            break
    return out
