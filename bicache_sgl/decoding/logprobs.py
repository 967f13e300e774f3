"""A request's logprobs (docs/server.md, "Logprobs for a diffusion model"): each output token's,
recorded at the step that unmasks it, and the prompt's, read from one forward with the scored
positions masked together; formatted as SGLang's meta_info fields."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .text import Detokenizer

Top = list[tuple[float, int]]  # [(logprob, token id), ...], most likely first


class Logprobs:
    """``top_n``: top logprobs per position (0: none); ``with_text``: each token's text too."""

    def __init__(self, top_n: int, detok: Detokenizer, with_text: bool) -> None:
        self.top_n, self.detok, self.with_text = top_n, detok, with_text
        self.output: dict[int, tuple[float, Top]] = {}  # absolute position -> (logprob, top)
        self.input: list[tuple[float | None, int, Top | None]] | None = None  # (logprob, id, top) per reported position
        self._scoring: tuple[np.ndarray, np.ndarray] | None = None  # (reported positions, scored positions)

    def record_output(self, lg: torch.Tensor, chosen: torch.Tensor, lp: torch.Tensor, positions: np.ndarray) -> None:
        """The positions just unmasked: ``chosen`` rows of the decided positions ``positions``
        ([n], absolute), their logits ``lg`` [n, V] (mask token banned) and logprobs ``lp`` [n]."""
        k = self.top_n
        top = None
        if k > 0:
            lsm = torch.log_softmax(lg[chosen].double(), dim=-1)
            tv, ti = torch.topk(lsm, min(k, lsm.shape[-1]), dim=-1)
        for j, c in enumerate(chosen.tolist()):
            if k > 0:
                top = list(zip(tv[j].tolist(), ti[j].tolist()))
            self.output[int(positions[c])] = (float(lp[c]), top or [])

    def plan_input(self, prompt: torch.Tensor, start: int, mask_id: int) -> tuple[torch.Tensor, np.ndarray]:
        """The scoring forward over ``prompt`` [n] from ``start`` (< 0: every position) -> (its
        tokens, the scored positions masked together; the scored positions). Position 0 has no
        logprob (nothing before it), as in SGLang it is reported as None."""
        n = len(prompt)
        start = max(start, 0)
        s = max(start, 1)
        x = prompt.clone()
        x[s:n] = mask_id
        targets = np.arange(s, n, dtype=np.int64)
        self._scoring = (np.arange(start, n, dtype=np.int64), targets)
        return x, targets

    def record_input(self, lg: torch.Tensor, prompt: list[int]) -> None:
        """The scoring forward's logits [len(targets), V] of the planned positions."""
        report, targets = self._scoring
        lsm = torch.log_softmax(lg.double(), dim=-1)
        tgt = torch.tensor([prompt[t] for t in targets], dtype=torch.long, device=lsm.device)
        vals = lsm.gather(-1, tgt[:, None])[:, 0].tolist()
        k = self.top_n
        if k > 0:
            tv, ti = torch.topk(lsm, min(k, lsm.shape[-1]), dim=-1)
        by_pos = {}
        for j, t in enumerate(targets.tolist()):
            by_pos[t] = (vals[j], list(zip(tv[j].tolist(), ti[j].tolist())) if k > 0 else None)
        out = []
        for pos in report.tolist():
            lpv, tops = by_pos.get(pos, (None, None))
            out.append((lpv, prompt[pos], tops))
        self.input = out
        self._scoring = None

    def _text(self, tid: int) -> str | None:
        return self.detok.token(tid) if self.with_text else None

    def meta(self, prompt_len: int, out_ids: list[int]) -> dict[str, Any]:
        """SGLang's logprob fields of meta_info for the output ``out_ids`` so far."""
        def top_list(tops):
            return None if tops is None else [[lp, t, self._text(t)] for lp, t in tops]
        inp = self.input or []
        outs = [self.output.get(prompt_len + i, (None, [])) for i in range(len(out_ids))]
        m = {
            "input_token_logprobs": [[lp, t, self._text(t)] for lp, t, _ in inp],
            "output_token_logprobs": [[lp, t, self._text(t)] for (lp, _), t in zip(outs, out_ids)],
            "output_token_logprobs_length": len(out_ids),
        }
        if self.top_n > 0:
            m["input_top_logprobs"] = [top_list(tops) for _, _, tops in inp]
            m["output_top_logprobs"] = [top_list(tops) for (_, tops) in outs]
        return m
