"""Dream's unmasking algorithms (``diffusion_generate`` of Dream-v0), as pure functions.

The published algorithm, per generation region of ``steps`` steps: timesteps
``linspace(1, eps, steps + 1)``; at step ``i`` with ``t = timesteps[i]``, ``s = timesteps[i + 1]``
it unmasks ``int(n_masked * (1 - s / t))`` of the ``n_masked`` positions still masked (all of
them at the last step), the most confident ones by the algorithm's confidence:

- ``maskgit_plus``: the probability of the decided token (top-1 when greedy);
- ``topk_margin``: top-1 minus top-2 probability;
- ``entropy``: the negative entropy of the position's distribution;

or, with ``alg_temp > 0``, a draw without replacement weighted by ``softmax(confidence /
alg_temp)``. ``origin`` instead unmasks each masked position independently with probability
``1 - s / t`` (all at the last step). The distribution of a position is the model's, divided by
``temperature`` (when > 0), then top-p, then top-k filtered; greedy (temperature 0) takes its
top token, sampling draws from it.

The arithmetic follows the reference's dtypes (float32 timesteps and confidences) so that a
greedy fp32 run picks the same positions. The one deliberate difference: the mask token is
never a decision here (the reference would "unmask" a position to [MASK], leaving it masked);
confidences are still computed over the full distribution, mask included, so every decision
the reference makes without choosing [MASK] is the same. How this composes with blocks, the
in-request caches and threshold decoding: ``bicache_sgl.decoding.denoiser`` and docs/server.md.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")
_ENTROPY_EPS = 1e-10  # inside the log of Dream's entropy confidence, as published


def dream_timesteps(steps: int, eps: float) -> torch.Tensor:
    """Dream's timesteps for ``steps`` steps: 1 down to ``eps``, float32, ``steps + 1`` values."""
    return torch.linspace(1.0, eps, max(1, steps) + 1, dtype=torch.float32)


def _is_last(i: int, timesteps: torch.Tensor) -> bool:
    return i >= len(timesteps) - 2


def dream_transfer_count(n_masked: int, i: int, timesteps: torch.Tensor) -> int:
    """How many of ``n_masked`` masked positions step ``i`` unmasks: ``int(n * (1 - s / t))``
    in float32, every one at the last step (and after it)."""
    if n_masked <= 0:
        return 0
    if _is_last(i, timesteps):
        return n_masked
    t, s = timesteps[i], timesteps[i + 1]
    return int(torch.tensor(float(n_masked), dtype=torch.float32) * (1 - s / t))


def dream_next_transfer(n_masked: int, i: int, timesteps: torch.Tensor) -> tuple[int, int]:
    """The first step at or after ``i`` that unmasks something, and how many: (step, count)
    with the counts of :func:`dream_transfer_count` (computed for all the remaining steps at
    once, in the same float32 arithmetic). The last step takes every one."""
    last = len(timesteps) - 2
    if n_masked <= 0 or i >= last:
        return max(i, 0), max(n_masked, 0)
    t, s = timesteps[i:last], timesteps[i + 1:last + 1]
    counts = (torch.tensor(float(n_masked), dtype=torch.float32) * (1 - s / t)).long()
    nz = torch.nonzero(counts)
    if len(nz) == 0:
        return last, n_masked
    j = int(nz[0, 0])
    return i + j, int(counts[j])


def dream_origin_draw(n_masked: int, i: int, timesteps: torch.Tensor,
                      generator: torch.Generator | None) -> torch.Tensor:
    """``origin``: which of the ``n_masked`` positions (in sequence order) step ``i`` unmasks,
    each with probability ``1 - s / t`` (all at the last step) -> bool [n_masked]. Draws
    ``n_masked`` float32 uniforms, at every step, the last included, as the reference does."""
    u = torch.rand(n_masked, dtype=torch.float32, generator=generator)
    if _is_last(i, timesteps):
        return u < 1
    t, s = timesteps[i], timesteps[i + 1]
    return u < (1 - s / t)


def _top_p(lt: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus filter as Dream applies it: on the (tempered) logits, drop a token once the
    probability mass of the tokens ranked before it exceeds ``top_p``; the top one always stays."""
    sorted_l, idx = torch.sort(lt, dim=-1, descending=True)
    before = torch.softmax(sorted_l, dim=-1).cumsum(-1)
    drop = torch.zeros_like(before, dtype=torch.bool)
    drop[..., 1:] = before[..., :-1] > top_p
    return lt.masked_fill(torch.zeros_like(drop).scatter(-1, idx, drop), NEG_INF)


def _filtered(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Dream's order: temperature, top-p, top-k; then min-p (this server's), on the tempered logits."""
    lt = logits / temperature if temperature > 0 else logits
    if top_p < 1.0:
        lt = _top_p(lt, top_p)
    if 0 < top_k < lt.shape[-1]:
        kth = torch.topk(lt, top_k, dim=-1).values[:, -1:]
        lt = lt.masked_fill(lt < kth, NEG_INF)
    if min_p > 0.0:
        floor = lt.max(dim=-1, keepdim=True).values + torch.log(torch.tensor(min_p, dtype=lt.dtype))
        lt = lt.masked_fill(lt < floor, NEG_INF)
    return lt


def dream_probs(logits: torch.Tensor, *, temperature: float, top_k: int, top_p: float,
                min_p: float = 0.0) -> torch.Tensor:
    """The distribution Dream's confidences are computed on: softmax of the tempered, filtered
    logits [n, V] (float32; the mask token kept as the logits have it)."""
    return torch.softmax(_filtered(logits.float(), temperature, top_k, top_p, min_p), dim=-1)


def dream_confidence(probs: torch.Tensor, x0: torch.Tensor, algorithm: str) -> torch.Tensor:
    """The algorithm's confidence of each row of ``probs`` [n, V] (the filtered distribution,
    mask token included) with decided tokens ``x0`` [n] -> float [n] (probs' dtype)."""
    if algorithm == "topk_margin":
        if probs.shape[-1] < 2:
            return probs[:, 0]
        top2 = torch.topk(probs, 2, dim=-1).values
        return top2[:, 0] - top2[:, 1]
    if algorithm == "entropy":
        return (probs * torch.log(probs + _ENTROPY_EPS)).sum(-1)
    # maskgit_plus (and origin, which ranks nothing): the decided token's probability
    return probs.gather(-1, x0[:, None])[:, 0]


def dream_decide(logits: torch.Tensor, *, algorithm: str, temperature: float, top_k: int, top_p: float,
                 mask_id: int | None, generator: torch.Generator | None,
                 min_p: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Masked positions' logits [n, V] (processed: bias, penalties, bans; the mask token NOT
    banned) -> (tokens [n], confidence [n] float32, logprob [n] float32).

    Tokens: the top token (temperature 0) or a draw from the tempered, filtered distribution,
    never ``mask_id``. Confidence: :func:`dream_confidence` over that distribution with the
    mask token in it, as in the reference. Logprob: of the token under the untempered logits
    restricted to the tokens the filters keep, mask token excluded (docs/server.md)."""
    logits = logits.float()
    n, V = logits.shape
    lt = _filtered(logits, temperature, top_k, top_p, min_p)
    probs = torch.softmax(lt, dim=-1)
    cand = probs
    has_mask = mask_id is not None and 0 <= mask_id < V
    if has_mask:
        cand = probs.clone()
        cand[:, mask_id] = 0
        dead = cand.sum(-1) <= 0  # the filters kept nothing but the mask token
        if bool(dead.any()):
            banned = logits[dead].clone()
            banned[:, mask_id] = NEG_INF
            cand[dead] = torch.softmax(_filtered(banned, temperature, top_k, top_p, min_p), dim=-1)
    if temperature > 0 and n > 0:
        x0 = torch.multinomial(cand, 1, replacement=True, generator=generator)[:, 0]
    else:
        x0 = cand.argmax(dim=-1)
    conf = dream_confidence(probs, x0, algorithm)
    keep = torch.isfinite(lt)
    keep[torch.arange(n), x0] = True
    lb = logits.double().masked_fill(~keep, NEG_INF)
    if has_mask:
        lb[:, mask_id] = NEG_INF
    lp = torch.log_softmax(lb, dim=-1).gather(-1, x0[:, None])[:, 0]
    return x0, conf, lp.float()


def dream_select(conf: torch.Tensor, k: int, alg_temp: float, generator: torch.Generator | None) -> torch.Tensor:
    """Indices (into ``conf``) of the ``k`` positions to unmask: the ``k`` most confident, or
    with ``alg_temp > 0`` a draw of ``k`` without replacement weighted by
    ``softmax(conf / alg_temp)``. ``k`` 0 selects nothing."""
    k = min(k, conf.numel())
    if k <= 0:
        return torch.empty(0, dtype=torch.long)
    if alg_temp > 0:
        w = torch.softmax(conf.float() / alg_temp, dim=-1)
        return torch.multinomial(w, k, replacement=False, generator=generator)
    return torch.topk(conf, k).indices


def threshold_score(conf: torch.Tensor, algorithm: str) -> torch.Tensor:
    """A confidence on the [0, 1] scale that ``threshold`` is compared with: the probability
    (``maskgit_plus``) or margin (``topk_margin``) as it is, ``exp(-entropy)`` for ``entropy``."""
    return conf.exp() if algorithm == "entropy" else conf
