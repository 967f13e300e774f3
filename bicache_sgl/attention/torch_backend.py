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

    def begin_forward(self, kv_rows, flat=None) -> None:
        super().begin_forward(kv_rows, flat)
        self._plans = {}

    def attend(self, q: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor, layer: int,
               q_indptr: Sequence[int], layout_key: object) -> torch.Tensor:
        plan = self._plans.get(layout_key)
        if plan is None:
            plan = self._plans[layout_key] = _plan(q_indptr, self, q.device)
        if plan.whole is not None:  # one call whose output rows are q's rows, in order
            return plan.whole.run(self, q, k_store, v_store, layer, q_indptr)
        out = torch.empty_like(q)
        for group in plan.groups:
            o = group.run(self, q, k_store, v_store, layer, q_indptr)
            if group.q_rows is None:
                i = group.members[0]
                out[q_indptr[i]:q_indptr[i + 1]] = o
            else:
                out.index_copy_(0, group.dst, o)
        return out


class _Group:
    """Sequences sharing one SDPA call. ``q_rows`` [B, nq]: packed query row of each padded slot
    (None for a lone sequence); output row ``dst[j]`` is the flattened ``o`` row ``src[j]`` (src
    None: all). Key rows are built for every layer at once, on first use: ``[L, B * nk]`` flat,
    each member padded with its own first row."""

    def __init__(self, members: list[int], nk: int, q_rows: torch.Tensor | None = None,
                 src: torch.Tensor | None = None, dst: torch.Tensor | None = None,
                 key_mask: torch.Tensor | None = None) -> None:
        self.members, self.nk = members, nk
        self.q_rows, self.src, self.dst, self.key_mask = q_rows, src, dst, key_mask
        self._rows: torch.Tensor | None = None
        self._run_start: list[int | None] = []  # lone sequence: per layer, the first row of a contiguous run

    def key_rows(self, backend: AttentionBackend, device: torch.device) -> torch.Tensor:
        """long [L, B * nk]: the store row of every key slot of the group, per layer."""
        if self._rows is None:
            if len(self.members) == 1:
                idx = backend.kv_rows[self.members[0]]
                # layers whose rows are one ascending run [a, a + N) (private rows as allocated):
                # their keys are a view of the store, no gather
                run = (np.diff(idx, axis=1) == 1).all(axis=1) if idx.shape[1] > 1 else np.ones(len(idx), bool)
                self._run_start = [int(idx[li, 0]) if ok else None for li, ok in enumerate(run)]
            else:
                flat, indptr = backend.flat_rows()
                m = np.asarray(self.members)
                lens = indptr[m + 1] - indptr[m]
                ar = np.arange(self.nk)
                cols = indptr[m][:, None] + np.where(ar[None, :] < lens[:, None], ar[None, :], 0)  # [B, nk]
                idx = flat[:, cols.reshape(-1)]
            self._rows = torch.from_numpy(np.ascontiguousarray(idx)).to(device)
        return self._rows

    def run(self, backend: AttentionBackend, q: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor,
            layer: int, q_indptr: Sequence[int]) -> torch.Tensor:
        """The group's attention output at ``layer``: [n_i, H, Dh] for a lone sequence i, else the
        valid rows of the padded call ([len(dst), H, Dh], in dst order)."""
        kv_idx = self.key_rows(backend, q.device)[layer]
        # Gathers use index_select on flat indices: on CPU it copies whole rows, ~6x faster than
        # advanced indexing with a 2-D index (which goes element by element).
        if self.q_rows is None:  # one sequence: no padding
            i = self.members[0]
            a = self._run_start[layer]
            if a is None:
                k, v = k_store.index_select(0, kv_idx), v_store.index_select(0, kv_idx)
            else:
                k, v = k_store[a:a + self.nk], v_store[a:a + self.nk]
            return sdpa_one(q[q_indptr[i]:q_indptr[i + 1]], k, v)
        B, nq = self.q_rows.shape
        qg = q.index_select(0, self.q_rows.view(-1)).view(B, nq, *q.shape[1:])
        kg = k_store.index_select(0, kv_idx).view(B, self.nk, *k_store.shape[1:])
        vg = v_store.index_select(0, kv_idx).view(B, self.nk, *v_store.shape[1:])
        o = sdpa_batched(qg, kg, vg, self.key_mask).reshape(B * nq, *q.shape[1:])
        return o if self.src is None else o.index_select(0, self.src)


class _Plan:
    """The groups of one layout; ``whole``: the one group when its output is already q's rows in
    order (no scatter needed)."""

    def __init__(self, groups: list[_Group], whole: _Group | None) -> None:
        self.groups, self.whole = groups, whole


def _plan(q_indptr: Sequence[int], backend: AttentionBackend, device: torch.device) -> _Plan:
    """Group sequences by query length; per group the query gather index, the output scatter and
    the key mask (key rows: ``_Group.key_rows``, all layers at once)."""
    kv_rows = backend.kv_rows
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
    whole = None
    total = q_indptr[n] if n else 0
    for g in groups:
        kv_lens = [kv_rows[i].shape[1] for i in g]
        nk = max(kv_lens)
        if len(g) == 1:
            plan.append(_Group(g, nk))
            if len(groups) == 1:  # every query row belongs to this sequence
                whole = plan[-1]
            continue
        nq = max(q_lens[i] for i in g)
        ar = np.arange(nq)
        starts = np.array([q_indptr[i] for i in g])
        lens = np.array([q_lens[i] for i in g])
        q_valid = ar[None, :] < lens[:, None]  # [B, nq]
        q_idx = np.where(q_valid, starts[:, None] + ar[None, :], starts[:, None])  # padded with a valid row
        # o (flattened [B * nq]) row src[j] goes to output row dst[j]; src None: every row is valid
        src = None if q_valid.all() else torch.from_numpy(np.flatnonzero(q_valid)).to(device)
        dst_np = q_idx[q_valid]
        dst = torch.from_numpy(dst_np).to(device)
        # no key mask when every member has the same number of keys (the kernel's fastest path)
        key_mask = None
        if min(kv_lens) != nk:
            kl = torch.tensor(kv_lens, device=device)
            key_mask = (torch.arange(nk, device=device)[None, :] < kl[:, None])[:, None, None, :]  # [B,1,1,nk]
        plan.append(_Group(g, nk, torch.from_numpy(q_idx).to(device), src, dst, key_mask))
        if len(groups) == 1 and len(dst_np) == total and np.array_equal(dst_np, np.arange(total)):
            whole = plan[-1]
    return _Plan(plan, whole)


def _expand_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim: int):
    rep = q.shape[head_dim] // k.shape[head_dim]
    if rep > 1:
        k = k.repeat_interleave(rep, dim=head_dim)
        v = v.repeat_interleave(rep, dim=head_dim)
    return k, v


def sdpa_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [n, H, Dh], k/v [N, Hkv, Dh] -> [n, H, Dh]; GQA by sharing KV heads."""
    # 4-D with a batch of one: on CPU a 3-D call takes SDPA's unfused math fallback (~2.5x slower)
    return sdpa_batched(q[None], k[None], v[None], None)[0]


def sdpa_batched(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
    """q [B, nq, H, Dh], k/v [B, nk, Hkv, Dh], key_mask [B, 1, 1, nk] bool or None (all keys) ->
    [B, nq, H, Dh]."""
    gqa = q.shape[2] != k.shape[2]
    if gqa and q.device.type != "cpu":
        # elsewhere enable_gqa can push SDPA off its fused kernels; repeat the KV heads instead
        k, v = _expand_kv(q, k, v, 2)
        gqa = False
    # on CPU the fused kernel takes GQA itself (bit-equal to repeating the heads, without the copies)
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=key_mask,
                                       enable_gqa=gqa)
    return o.transpose(1, 2)
