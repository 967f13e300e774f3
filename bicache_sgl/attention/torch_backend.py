"""Reference backend: torch scaled_dot_product_attention, one call per sequence. Runs everywhere."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from .base import AttentionBackend, register_backend


class TorchAttention(AttentionBackend):
    name = "torch"

    def attend(self, q: torch.Tensor, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
               q_indptr: Sequence[int], layout_key: object) -> torch.Tensor:
        out = torch.empty_like(q)
        for i, (k, v) in enumerate(zip(keys, values)):
            s, e = q_indptr[i], q_indptr[i + 1]
            if e == s:
                continue
            out[s:e] = sdpa_one(q[s:e], k, v)
        return out


def sdpa_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [n, H, Dh], k/v [N, Hkv, Dh] -> [n, H, Dh]; GQA by repeating KV heads."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=False)
    return o.transpose(0, 1)


@register_backend("torch")
def _make(device: torch.device) -> AttentionBackend:
    return TorchAttention()
