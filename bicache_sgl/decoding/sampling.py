"""The logits a request's decision is made on: logit bias, penalties, then the bans (the mask
token, EOS with ``ignore_eos`` or before ``min_new_tokens``, stop ids before ``min_new_tokens``)."""

from __future__ import annotations

import numpy as np
import torch

from ..config import SamplingParams
from . import NEG_INF, apply_logit_bias, apply_penalties, token_counts


class LogitsProcessor:
    """One request's logit processing (docs/server.md, "Penalties"). ``eos_ids`` are the model's
    end ids (banned with ``ignore_eos`` and before ``min_new_tokens``, whatever stops the output);
    the output region is the first ``out_len`` generated positions."""

    def __init__(self, params: SamplingParams, prompt: list[int], out_len: int, *, mask_id: int,
                 eos_ids: tuple[int, ...]) -> None:
        self.params, self.mask_id = params, mask_id
        self.prompt_len, self.out_len = len(prompt), out_len
        self.suppress_ids = tuple(eos_ids) + (mask_id,)  # never output: EOS padding and the mask
        self._suppress = list(self.suppress_ids)
        # the early-position ban (before min_new_tokens): end ids and stop ids alike
        self._early_ban = torch.tensor(self._suppress + sorted(set(params.stop_token_ids)))
        p = params
        self.penalized = p.frequency_penalty != 0 or p.presence_penalty != 0 or p.repetition_penalty != 1
        self._prompt_ids = torch.unique(torch.tensor(prompt, dtype=torch.long)) if p.repetition_penalty != 1 else None

    def __call__(self, lg: torch.Tensor, x: torch.Tensor, positions: np.ndarray, ban_mask: bool = True) -> torch.Tensor:
        """Logits [n, V] of the sequence ``x``'s ``positions`` (absolute, [n]) -> the logits the
        decision is made on (a new tensor). ``ban_mask`` False keeps the mask token (Dream's
        algorithms exclude it from the decision themselves)."""
        p = self.params
        lg = apply_logit_bias(lg, p.logit_bias) if p.logit_bias else lg.clone()
        if self.penalized:
            lg = apply_penalties(lg, *self.penalty_state(x, lg.shape[-1]), frequency_penalty=p.frequency_penalty,
                                 presence_penalty=p.presence_penalty, repetition_penalty=p.repetition_penalty)
        if ban_mask:
            lg[:, self.mask_id] = NEG_INF
        if p.ignore_eos:
            lg[:, self._suppress] = NEG_INF
        elif p.min_new_tokens > 0:
            early = torch.from_numpy(positions - self.prompt_len < p.min_new_tokens)
            if early.any():
                rows = early.nonzero()[:, 0]
                lg[rows[:, None], self._early_ban[None, :]] = NEG_INF
        return lg

    def penalty_state(self, x: torch.Tensor, V: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(counts [V] of the output tokens of ``x`` unmasked so far, seen [V] for the repetition
        penalty). The mask and EOS (padding) are not counted."""
        s = self.prompt_len
        counts = token_counts(x[s:s + self.out_len], V, self.suppress_ids)
        seen = None
        if self._prompt_ids is not None:
            seen = counts > 0
            ids = self._prompt_ids[self._prompt_ids < V]
            seen[ids] = True
        return counts, seen
