"""Masked-diffusion decoding primitives (LLaDA's algorithm and Fast-dLLM threshold decoding).

Pure functions on logits of the positions being decided; the per-request state machine that
uses them lives in ``bicache_sgl.scheduler.request``.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def num_transfer_schedule(n_masked: int, steps: int) -> list[int]:
    """LLaDA's schedule: spread ``n_masked`` unmaskings over ``steps`` as evenly as possible,
    the remainder going to the earliest steps."""
    steps = max(1, min(steps, n_masked)) if n_masked > 0 else 1
    base, rem = divmod(n_masked, steps)
    return [base + (1 if i < rem else 0) for i in range(steps)]


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Standard top-k / nucleus filtering (logits [n, V] fp32); off when top_k=-1, top_p=1."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, NEG_INF)
    if top_p < 1.0:
        sorted_l, idx = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_l, dim=-1)
        drop = probs.cumsum(-1) - probs > top_p  # keep the token that crosses top_p
        sorted_l = sorted_l.masked_fill(drop, NEG_INF)
        logits = torch.full_like(logits, NEG_INF).scatter(-1, idx, sorted_l)
    return logits


def gumbel_argmax(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """LLaDA's sampler: argmax of exp(logits) / (-log u)^T in float64 (T=0: plain argmax)."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    l64 = logits.to(torch.float64)
    u = torch.rand(l64.shape, dtype=torch.float64, generator=generator, device=l64.device)
    return (l64.exp() / (-torch.log(u)) ** temperature).argmax(dim=-1)


def decide(logits: torch.Tensor, *, temperature: float, top_k: int, top_p: float, remasking: str,
           generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For masked positions' logits [n, V] -> (tokens [n], confidence [n] fp64, logprob [n] fp32).

    Confidence is the softmax probability of the chosen token under the unnoised, filtered
    logits (``low_confidence``) or uniform noise (``random``), as in LLaDA's reference code.
    """
    logits = filter_logits(logits, top_k, top_p)
    x0 = gumbel_argmax(logits, temperature, generator)
    logp = torch.log_softmax(logits.to(torch.float64), dim=-1)
    chosen = logp.gather(-1, x0[:, None])[:, 0]
    if remasking == "low_confidence":
        conf = chosen.exp()
    elif remasking == "random":
        conf = torch.rand(x0.shape, dtype=torch.float64, generator=generator, device=logits.device)
    else:
        raise ValueError(f"unknown remasking {remasking!r}")
    return x0, conf, chosen.float()


def select_transfer(conf: torch.Tensor, k: int, threshold: float | None) -> torch.Tensor:
    """Indices (into conf) to unmask this step. Fixed schedule: the top-k. Threshold (Fast-dLLM):
    every position with confidence >= threshold, and at least the most confident one."""
    if conf.numel() == 0:
        return torch.empty(0, dtype=torch.long)
    if threshold is not None and threshold > 0:
        order = torch.argsort(conf, descending=True, stable=True)
        keep = conf[order] >= threshold
        keep[0] = True
        return order[keep]
    k = max(1, min(k, conf.numel()))
    return torch.topk(conf, k, sorted=True).indices
