"""Logprobs of a block-diffusion request (docs/block_diffusion.md, section 5), recorded with the
bidirectional engine's ``decoding.logprobs.Logprobs`` (same definitions, same meta_info fields):

- **output**: each output token's log-probability at the step that wrote it into its block, under
  that step's logits with the request's ``top_k`` / ``top_p`` filtering (untempered, as the
  bidirectional engine reports it). Without token editing a position is written once, when it is
  unmasked; with LLaDA2.1's token editing a later step may rewrite it, and the entry is then the
  final token's logprob at the step that last wrote it (the earlier entry is replaced).
- **input**: ONE scoring forward over the prompt with the scored positions
  ``[max(start, 1), n)`` masked together and everything before them clean, through the
  block-causal model (``BlockDiffusionLM.forward_rows``) on a K/V buffer of its own. The clean
  whole blocks before the first scored position do not depend on anything after them
  (block-causal), so they are copied from the exact prefix cache when it holds them: the result is
  the same as computing them (``tests/test_block_logprobs.py`` checks it).
"""

from __future__ import annotations

import numpy as np
import torch

from ..decoding import filter_logits
from ..decoding.logprobs import Logprobs
from ..models.block_config import BlockModelConfig
from ..models.block_model import BlockKV, RowsWork


def record_written(rec: Logprobs, logits: torch.Tensor, before: torch.Tensor, after: torch.Tensor, start: int,
                   top_k: int | None, top_p: float | None) -> None:
    """Record the positions one step wrote: ``before`` / ``after`` [B] are the current block's
    tokens around the step (``start``: its first absolute position), ``logits`` [B, V] the step's
    logits of the block. A step writes only where the token changes (a mask becomes a token, or
    an edit replaces a different token), so the changed positions are exactly the written ones."""
    chosen = torch.nonzero(after != before)[:, 0]
    if chosen.numel() == 0:
        return
    lg = filter_logits(logits.float(), top_k or 0, 1.0 if top_p is None else top_p)
    lp = torch.log_softmax(lg.double(), dim=-1).gather(-1, after.to(lg.device)[:, None])[:, 0].cpu()
    rec.record_output(lg, chosen.to(lg.device), lp, np.arange(start, start + len(after), dtype=np.int64))


class BlockScore:
    """The input-logprob scoring of one request: a transient K/V buffer of the prompt's length,
    filled at admission with the cached clean blocks before the first scored position; one
    forward (packed with the engine's step) computes the rest and the scored rows' logits."""

    def __init__(self, rec: Logprobs, prompt: list[int], start: int, mask_id: int, block_length: int) -> None:
        self.rec, self.prompt, self.B = rec, prompt, block_length
        x, targets = rec.plan_input(torch.tensor(prompt, dtype=torch.long), start, mask_id)
        self.x = x
        self.first = int(targets[0]) if len(targets) else len(prompt)  # first scored position
        self.kv: BlockKV | None = None
        self.reused = 0  # clean positions copied from the prefix cache (whole blocks)

    def admit(self, cfg: BlockModelConfig, hit: list[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype,
              device: torch.device) -> None:
        """Allocate the buffer and copy the cached blocks that lie wholly before the first scored
        position (``hit``: the request's prefix-cache match, blocks from position 0)."""
        self.kv = BlockKV.empty(cfg, len(self.prompt), dtype, device)
        n = min(len(hit), self.first // self.B)
        for b in range(n):
            k, v = hit[b]
            self.kv.k[:, b * self.B:(b + 1) * self.B] = k
            self.kv.v[:, b * self.B:(b + 1) * self.B] = v
        self.reused = n * self.B

    @property
    def pending(self) -> bool:
        return self.kv is not None

    def work(self) -> RowsWork:
        """Rows ``[reused, n)`` of the masked prompt; logits from the first scored position."""
        return RowsWork(self.x[self.reused:], self.reused, self.kv, logit_from=self.first - self.reused,
                        block_length=self.B)

    @property
    def rows(self) -> int:
        return len(self.prompt) - self.reused

    def take(self, logits: torch.Tensor) -> None:
        """The scoring forward's logits [n - first, V]: record them, free the buffer."""
        self.rec.record_input(logits, self.prompt)
        self.kv = None
