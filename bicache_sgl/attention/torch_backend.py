"""Reference backend: torch scaled_dot_product_attention. Runs everywhere.

Sequences with similar query lengths are padded into one SDPA call (key-padding mask), their
keys gathered from the row store with one index per group, so a layer costs a handful of kernel
launches instead of one per sequence; a sequence alone in its group takes the unpadded call.
Padding changes float rounding in the last bits (the kernel blocks over a longer key axis), never
the tokens in practice; the exactness tests check tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
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

    def begin_forward(self, kv_rows) -> None:
        super().begin_forward(kv_rows)
        self._plans = {}

    def attend(self, q: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor, layer: int,
               q_indptr: Sequence[int], layout_key: object) -> torch.Tensor:
        out = torch.empty_like(q)
        plan = self._plans.get(layout_key)
        if plan is None:
            plan = self._plans[layout_key] = _plan(q_indptr, self.kv_rows, q.device)
        # Gathers use index_select on flat indices: on CPU it copies whole rows, ~6x faster than
        # advanced indexing with a 2-D index (which goes element by element).
        for group in plan:
            kv_idx = group.key_rows(self.kv_rows, layer, q.device)
            if group.q_rows is None:  # one sequence: no padding
                i = group.members[0]
                s, e = q_indptr[i], q_indptr[i + 1]
                out[s:e] = sdpa_one(q[s:e], k_store.index_select(0, kv_idx), v_store.index_select(0, kv_idx))
                continue
            B, nq = group.q_rows.shape
            nk = group.nk
            qg = q.index_select(0, group.q_rows.view(-1)).view(B, nq, *q.shape[1:])
            kg = k_store.index_select(0, kv_idx).view(B, nk, *k_store.shape[1:])
            vg = v_store.index_select(0, kv_idx).view(B, nk, *v_store.shape[1:])
            o = sdpa_batched(qg, kg, vg, group.key_mask).reshape(B * nq, *q.shape[1:])
            if group.src is None:  # no query padding: the group's rows are o's rows, in order
                out.index_copy_(0, group.dst, o)
            else:
                out.index_copy_(0, group.dst, o.index_select(0, group.src))
        return out


class _Group:
    """Sequences sharing one SDPA call. ``q_rows`` [B, nq]: packed query row of each padded slot
    (None for a lone sequence); output row ``dst[j]`` is the flattened ``o`` row ``src[j]`` (src
    None: all). Key rows are built per layer on first use (a layout serves only its segment's
    layers): ``[B * nk]`` flat, each member padded with its own first row."""

    def __init__(self, members: list[int], nk: int, q_rows: torch.Tensor | None = None,
                 src: torch.Tensor | None = None, dst: torch.Tensor | None = None,
                 key_mask: torch.Tensor | None = None) -> None:
        self.members, self.nk = members, nk
        self.q_rows, self.src, self.dst, self.key_mask = q_rows, src, dst, key_mask
        self._rows: dict[int, torch.Tensor] = {}

    def key_rows(self, kv_rows: Sequence[np.ndarray], layer: int, device: torch.device) -> torch.Tensor:
        got = self._rows.get(layer)
        if got is None:
            if len(self.members) == 1:
                idx = kv_rows[self.members[0]][layer]
            else:
                idx = np.empty((len(self.members), self.nk), dtype=np.int64)
                for b, i in enumerate(self.members):
                    r = kv_rows[i][layer]
                    idx[b, :len(r)] = r
                    idx[b, len(r):] = r[0]
                idx = idx.reshape(-1)
            got = self._rows[layer] = torch.from_numpy(np.ascontiguousarray(idx)).to(device)
        return got


def _plan(q_indptr: Sequence[int], kv_rows: Sequence[np.ndarray], device: torch.device) -> list[_Group]:
    """Group sequences by query length; per group the query gather index, the output scatter and
    the key mask (keys are gathered per layer, ``_Group.key_rows``)."""
    n = len(kv_rows)
    q_lens = [q_indptr[i + 1] - q_indptr[i] for i in range(n)]
    order = sorted((i for i in range(n) if q_lens[i] > 0), key=lambda i: q_lens[i])
    groups, cur = [], []
    for i in order:
        if cur and q_lens[i] > _GROUP_RATIO * q_lens[cur[0]]:
            groups.append(cur)
            cur = []
        cur.append(i)
    if cur:
        groups.append(cur)
    plan: list[_Group] = []
    for g in groups:
        kv_lens = [kv_rows[i].shape[1] for i in g]
        nk = max(kv_lens)
        if len(g) == 1:
            plan.append(_Group(g, nk))
            continue
        nq = max(q_lens[i] for i in g)
        ar = np.arange(nq)
        starts = np.array([q_indptr[i] for i in g])
        lens = np.array([q_lens[i] for i in g])
        q_valid = ar[None, :] < lens[:, None]  # [B, nq]
        q_idx = np.where(q_valid, starts[:, None] + ar[None, :], starts[:, None])  # padded with a valid row
        # o (flattened [B * nq]) row src[j] goes to output row dst[j]; src None: every row is valid
        src = None if q_valid.all() else torch.from_numpy(np.flatnonzero(q_valid)).to(device)
        dst = torch.from_numpy(q_idx[q_valid]).to(device)
        # no key mask when every member has the same number of keys (the kernel's fastest path)
        key_mask = None
        if min(kv_lens) != nk:
            kl = torch.tensor(kv_lens, device=device)
            key_mask = (torch.arange(nk, device=device)[None, :] < kl[:, None])[:, None, None, :]  # [B,1,1,nk]
        plan.append(_Group(g, nk, torch.from_numpy(q_idx).to(device), src, dst, key_mask))
    return plan


def _expand_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim: int):
    rep = q.shape[head_dim] // k.shape[head_dim]
    if rep > 1:
        k = k.repeat_interleave(rep, dim=head_dim)
        v = v.repeat_interleave(rep, dim=head_dim)
    return k, v


def sdpa_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [n, H, Dh], k/v [N, Hkv, Dh] -> [n, H, Dh]; GQA by repeating KV heads."""
    # 4-D with a batch of one: on CPU a 3-D call takes SDPA's unfused math fallback (~2.5x slower)
    return sdpa_batched(q[None], k[None], v[None], None)[0]


def sdpa_batched(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
    """q [B, nq, H, Dh], k/v [B, nk, Hkv, Dh], key_mask [B, 1, 1, nk] bool or None (all keys) ->
    [B, nq, H, Dh]."""
    k, v = _expand_kv(q, k, v, 2)
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=key_mask)
    return o.transpose(1, 2)

