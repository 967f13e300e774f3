"""Masked-diffusion decoding primitives: LLaDA's algorithm (``low_confidence``, ``random``),
Dream's (``bicache_sgl.decoding.dream``: ``origin``, ``maskgit_plus``, ``topk_margin``,
``entropy``) and Fast-dLLM threshold decoding.

Pure functions on logits of the positions being decided. Built on them, per request: the
denoiser of each step schedule (``decoding.denoiser``, with ``decoding.plan``), logit
processing (``decoding.sampling``), stop handling (``decoding.stop``), logprobs
(``decoding.logprobs``) and text (``decoding.text``); the request that drives them is
``bicache_sgl.scheduler.request``.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .dream import (
    dream_confidence,
    dream_decide,
    dream_next_transfer,
    dream_origin_draw,
    dream_probs,
    dream_select,
    dream_timesteps,
    dream_transfer_count,
    threshold_score,
)

NEG_INF = float("-inf")

__all__ = ["NEG_INF", "apply_logit_bias", "apply_penalties", "decide", "decide_greedy", "dream_confidence",
           "dream_decide", "dream_next_transfer", "dream_origin_draw", "dream_probs", "dream_select", "dream_timesteps",
           "dream_transfer_count", "filter_logits", "gumbel_argmax", "num_transfer_schedule", "select_transfer",
           "threshold_score", "token_counts"]


def num_transfer_schedule(n_masked: int, steps: int) -> list[int]:
    """LLaDA's schedule: spread ``n_masked`` unmaskings over ``steps`` as evenly as possible,
    the remainder going to the earliest steps."""
    steps = max(1, min(steps, n_masked)) if n_masked > 0 else 1
    base, rem = divmod(n_masked, steps)
    return [base + (1 if i < rem else 0) for i in range(steps)]


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    """Standard top-k / nucleus / min-p filtering (logits [n, V] fp32); off when top_k=-1, top_p=1,
    min_p=0. Min-p keeps the tokens whose probability is at least ``min_p`` times the most likely
    token's (the untempered distribution, as top-p here), i.e. logit >= max logit + log(min_p)."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, NEG_INF)
    if top_p < 1.0:
        sorted_l, idx = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_l, dim=-1)
        drop = probs.cumsum(-1) - probs > top_p  # keep the token that crosses top_p
        sorted_l = sorted_l.masked_fill(drop, NEG_INF)
        logits = torch.full_like(logits, NEG_INF).scatter(-1, idx, sorted_l)
    if min_p > 0.0:
        floor = logits.max(dim=-1, keepdim=True).values + math.log(min_p)
        logits = logits.masked_fill(logits < floor, NEG_INF)
    return logits


def token_counts(tokens: torch.Tensor, vocab: int, exclude: tuple[int, ...] = ()) -> torch.Tensor:
    """How often each token id occurs in ``tokens`` (1-D), ids in ``exclude`` (the mask, EOS
    padding) and ids >= ``vocab`` left out -> float32 [vocab]."""
    t = tokens.reshape(-1).long()
    keep = t < vocab
    if exclude:
        keep &= ~torch.isin(t, torch.tensor(exclude, dtype=torch.long, device=t.device))
    return torch.bincount(t[keep], minlength=vocab)[:vocab].float()


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor | None, seen: torch.Tensor | None, *,
                    frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
                    repetition_penalty: float = 1.0) -> torch.Tensor:
    """Penalties for a diffusion LM (docs/server.md, "Penalties"). ``logits`` [n, V] (the masked
    positions being decided); ``counts`` [V]: occurrences of each token among the output tokens
    unmasked so far; ``seen`` [V] bool: tokens of the prompt or unmasked so far.

    - repetition (HF / CTRL): a seen token's logit is divided by ``repetition_penalty`` when
      positive and multiplied by it when negative;
    - frequency / presence (OpenAI): ``logit - frequency_penalty * count - presence_penalty * (count > 0)``.
    Returns a new tensor (the input is not modified); -inf stays -inf."""
    out = logits
    if repetition_penalty != 1.0 and seen is not None and bool(seen.any()):
        s = seen.to(out.device)[None, :]
        pen = torch.where(out > 0, out / repetition_penalty, out * repetition_penalty)
        out = torch.where(s, pen, out)
    if counts is not None and (frequency_penalty != 0.0 or presence_penalty != 0.0):
        c = counts.to(device=out.device, dtype=out.dtype)
        out = out - (frequency_penalty * c + presence_penalty * (c > 0).to(out.dtype))[None, :]
    return out


def apply_logit_bias(logits: torch.Tensor, bias: tuple[tuple[int, float], ...]) -> torch.Tensor:
    """Add ``bias`` ((token id, value), ...) to every row; ids past the logits' width are ignored
    (they are checked against the vocabulary when the request is built). Returns a new tensor."""
    if not bias:
        return logits
    V = logits.shape[-1]
    ids = torch.tensor([t for t, _ in bias if t < V], dtype=torch.long, device=logits.device)
    vals = torch.tensor([b for t, b in bias if t < V], dtype=logits.dtype, device=logits.device)
    out = logits.clone()
    out[:, ids] += vals[None, :]
    return out


def gumbel_argmax(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """LLaDA's sampler: argmax of exp(logits) / (-log u)^T in float64 (T=0: plain argmax)."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    l64 = logits.to(torch.float64)
    u = torch.rand(l64.shape, dtype=torch.float64, generator=generator, device=l64.device)
    return (l64.exp() / (-torch.log(u)) ** temperature).argmax(dim=-1)


def decide(logits: torch.Tensor, *, temperature: float, top_k: int, top_p: float, remasking: str,
           generator: torch.Generator | None, min_p: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For masked positions' logits [n, V] -> (tokens [n], confidence [n] fp64, logprob [n] fp32).

    Confidence is the softmax probability of the chosen token under the unnoised, filtered
    logits (``low_confidence``) or uniform noise (``random``), as in LLaDA's reference code.
    """
    logits = filter_logits(logits, top_k, top_p, min_p)
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


def decide_greedy(parts: list[torch.Tensor], banned: list[tuple[int, ...]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """:func:`decide` at temperature 0 with ``low_confidence`` and no filtering, for many
    requests' logits at once: ``parts[i]`` [n_i, V] with ids ``banned[i]`` banned at every row ->
    per request (tokens [n_i], confidence [n_i] fp64), on the CPU. Row by row the same operations
    as the per-request path (the ban, argmax, fp64 log-softmax, the chosen token's probability),
    so the same values; a handful of ops per step instead of per request."""
    if not parts:
        return []
    lg = torch.cat(parts)  # a new [R, V] tensor: the forward's logits are not changed
    ends = [0]
    for p in parts:
        ends.append(ends[-1] + p.shape[0])
    if len(set(banned)) == 1:
        lg[:, list(banned[0])] = NEG_INF
    else:
        for i, ids in enumerate(banned):
            lg[ends[i]:ends[i + 1], list(ids)] = NEG_INF
    x0 = lg.argmax(dim=-1)
    conf = torch.log_softmax(lg.to(torch.float64), dim=-1).gather(-1, x0[:, None])[:, 0].exp()
    x0, conf = x0.cpu(), conf.cpu()  # one copy for the whole batch
    return [(x0[ends[i]:ends[i + 1]], conf[ends[i]:ends[i + 1]]) for i in range(len(parts))]


def select_transfer(conf: torch.Tensor, k: int, threshold: float | None) -> torch.Tensor:
    """Indices (into conf) to unmask this step. Fixed schedule: the top-k. Threshold (Fast-dLLM):
    every position with confidence >= threshold, and at least the most confident one (as a CPU
    tensor)."""
    if conf.numel() == 0:
        return torch.empty(0, dtype=torch.long)
    if threshold is not None and threshold > 0:
        # on the host whatever the device (the request applies the indices there): one numpy
        # sort instead of four dispatched torch ops
        c = conf.cpu().numpy()
        order = np.argsort(-c, kind="stable")  # descending, ties in position order (torch's stable sort)
        keep = c[order] >= threshold
        keep[0] = True
        return torch.from_numpy(order[keep])
    k = max(1, min(k, conf.numel()))
    return torch.topk(conf, k, sorted=True).indices
