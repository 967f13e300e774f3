"""Reference backend: torch scaled_dot_product_attention. Runs everywhere.

Sequences with similar query lengths are padded into one SDPA call (key-padding mask), so a
layer costs a handful of kernel launches instead of one per sequence; a sequence alone in its
group takes the unpadded call. Padding changes float rounding in the last bits (the kernel
blocks over a longer key axis), never the tokens in practice; the exactness tests check tokens.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from .base import AttentionBackend

# Sequences whose query lengths are within this ratio share one padded call: a 32-row block
# step is not padded up to a 500-row refresh.
_GROUP_RATIO = 1.5


class TorchAttention(AttentionBackend):
    name = "torch"

    def __init__(self, device: torch.device | None = None) -> None:
        self._plans: dict = {}

    def begin_forward(self) -> None:
        self._plans = {}

    def attend(self, q: torch.Tensor, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
               q_indptr: Sequence[int], layout_key: object) -> torch.Tensor:
        out = torch.empty_like(q)
        plan = self._plans.get(layout_key)
        if plan is None:
            plan = self._plans[layout_key] = _plan(q_indptr, [k.shape[0] for k in keys], q.device)
        for group in plan:
            if isinstance(group, int):
                s, e = q_indptr[group], q_indptr[group + 1]
                out[s:e] = sdpa_one(q[s:e], keys[group], values[group])
                continue
            members, q_idx, q_valid, key_mask = group
            kp = torch.nn.utils.rnn.pad_sequence([keys[i] for i in members], batch_first=True)
            vp = torch.nn.utils.rnn.pad_sequence([values[i] for i in members], batch_first=True)
            qp = q[q_idx]  # [B, nq, H, Dh]
            o = sdpa_batched(qp, kp, vp, key_mask)
            out[q_idx[q_valid]] = o[q_valid]
        return out


def _plan(q_indptr: Sequence[int], kv_lens: list[int], device: torch.device) -> list:
    """Group sequences by query length; per group the gather index, valid mask and key mask."""
    q_lens = [q_indptr[i + 1] - q_indptr[i] for i in range(len(kv_lens))]
    order = sorted((i for i in range(len(kv_lens)) if q_lens[i] > 0), key=lambda i: q_lens[i])
    groups, cur = [], []
    for i in order:
        if cur and q_lens[i] > _GROUP_RATIO * q_lens[cur[0]]:
            groups.append(cur)
            cur = []
        cur.append(i)
    if cur:
        groups.append(cur)
    plan: list = []
    for g in groups:
        if len(g) == 1:
            plan.append(g[0])
            continue
        nq = max(q_lens[i] for i in g)
        nk = max(kv_lens[i] for i in g)
        ar = torch.arange(nq, device=device)
        starts = torch.tensor([q_indptr[i] for i in g], device=device)
        lens = torch.tensor([q_lens[i] for i in g], device=device)
        q_valid = ar[None, :] < lens[:, None]
        q_idx = torch.where(q_valid, starts[:, None] + ar[None, :], starts[:, None])
        kl = torch.tensor([kv_lens[i] for i in g], device=device)
        key_mask = (torch.arange(nk, device=device)[None, :] < kl[:, None])[:, None, None, :]  # [B,1,1,nk]
        plan.append((g, q_idx, q_valid, key_mask))
    return plan


def _expand_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim: int):
    rep = q.shape[head_dim] // k.shape[head_dim]
    if rep > 1:
        k = k.repeat_interleave(rep, dim=head_dim)
        v = v.repeat_interleave(rep, dim=head_dim)
    return k, v


def sdpa_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [n, H, Dh], k/v [N, Hkv, Dh] -> [n, H, Dh]; GQA by repeating KV heads."""
    k, v = _expand_kv(q, k, v, 1)
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=False)
    return o.transpose(0, 1)


def sdpa_batched(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
    """q [B, nq, H, Dh], k/v [B, nk, Hkv, Dh], key_mask [B, 1, 1, nk] -> [B, nq, H, Dh]."""
    k, v = _expand_kv(q, k, v, 2)
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=key_mask)
    return o.transpose(1, 2)

