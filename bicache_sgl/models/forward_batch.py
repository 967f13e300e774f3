"""One batched model forward: what each sequence computes, and the packed row layout.

A *sequence* is one row-set of the batch (a request, its classifier-free-guidance shadow, or a
likelihood probe). Each sequence computes a sorted set of positions. With bicache depth d > 0 the
first ``skip`` of those positions (the matched prefix S) are not computed in layers < d: their
K/V at those layers already sit in the sequence's private cache (copied from the prefix pool at
admission), and they join at layer d from the stored residual stream ``resume_h``.

Layout: rows are sequence-major, positions ascending. The active row set only grows with depth,
so the forward is split into *segments* (layer ranges with a constant active set); between
segments the joining rows are inserted. All index bookkeeping here is built once per forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class SeqKV:
    """Private (per-request) K/V for every layer and every position of one sequence.
    k, v: [L, N, Hkv, Dh]."""

    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def allocate(cls, n_layers: int, seq_len: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> "SeqKV":
        # Uninitialised on purpose: a sequence's first forward writes every position of every
        # layer (or copies it from the prefix pool) before any attention reads it.
        shape = (n_layers, seq_len, n_kv_heads, head_dim)
        return cls(torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device))

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


@dataclass
class Capture:
    """Write this sequence's prefix state into prefix-pool rows while it runs.

    ``layers[l] = (positions, rows)``: the K/V of layer l at ``positions`` go to pool rows
    ``rows`` (long, on the pool's device), and so does the residual leaving layer l (entering
    l + 1; never for the last layer). Every position must be computed by the sequence at layer l
    (a reused S position only from the sequence's depth on)."""

    layers: dict[int, tuple[np.ndarray, torch.Tensor]]


@dataclass
class SeqWork:
    kv: SeqKV
    input_ids: torch.Tensor  # [N] long, the whole sequence as it is now
    positions: np.ndarray  # int64 sorted: positions computed (at layers >= depth for S rows)
    logit_positions: np.ndarray  # int64: positions whose final hidden state goes through the LM head
    depth: int = 0
    skip: int = 0  # leading entries of `positions` that are S (only meaningful when depth > 0)
    resume_h: torch.Tensor | None = None  # [skip, D]: residual stream of S entering layer `depth`
    capture: Capture | None = None

    def __post_init__(self) -> None:
        if self.depth == 0 or self.skip == 0:
            self.depth, self.skip, self.resume_h = 0, 0, None


@dataclass
class Segment:
    start_layer: int
    rows: np.ndarray  # indices into the full layout, ascending
    q_indptr: list[int]  # per sequence, into the packed active rows
    seq_positions: list[torch.Tensor]  # per sequence: positions of its active rows (long, device)
    join_into: torch.Tensor | None = None  # where the previous segment's rows land in this one
    join_new: torch.Tensor | None = None  # where the joining rows land
    join_h: torch.Tensor | None = None  # [n_join, D] their residual stream


@dataclass
class ForwardBatch:
    seqs: list[SeqWork]
    device: torch.device
    segments: list[Segment] = field(default_factory=list)
    row_ids: torch.Tensor | None = None  # [T] token id per full-layout row
    row_pos: torch.Tensor | None = None  # [T] position per full-layout row
    logit_rows: np.ndarray | None = None  # full-layout rows needing logits, in sequence order
    logit_indptr: list[int] = field(default_factory=list)
    _offsets: list[int] = field(default_factory=list)
    _row_cache: dict = field(default_factory=dict)

    def build(self, n_layers: int) -> "ForwardBatch":
        dev = self.device
        offsets, ids, pos, skip_rows, depths = [0], [], [], [], []
        logit_rows, logit_indptr = [], [0]
        for s in self.seqs:
            base = offsets[-1]
            ids.append(s.input_ids[torch.from_numpy(s.positions).to(s.input_ids.device)])
            pos.append(s.positions)
            offsets.append(base + len(s.positions))
            depths.append(s.depth)
            skip_rows.append(np.arange(base, base + s.skip))
            # positions -> rows: positions are sorted, so searchsorted maps exactly
            idx = np.searchsorted(s.positions, s.logit_positions)
            ok = idx < len(s.positions)
            if not (ok.all() and np.all(s.positions[idx[ok]] == s.logit_positions)):
                raise ValueError("a logit position is not among the computed positions")
            lr = base + idx
            assert s.skip == 0 or np.all(s.logit_positions >= s.positions[s.skip - 1] + 1), "logit row inside S"
            logit_rows.append(lr)
            logit_indptr.append(logit_indptr[-1] + len(lr))
        self.row_ids = torch.cat(ids).to(dev) if ids else torch.empty(0, dtype=torch.long, device=dev)
        all_pos = np.concatenate(pos) if pos else np.zeros(0, dtype=np.int64)
        self.row_pos = torch.from_numpy(all_pos).to(dev)
        self.logit_rows = np.concatenate(logit_rows) if logit_rows else np.zeros(0, dtype=np.int64)
        self.logit_indptr = logit_indptr
        T = offsets[-1]
        self._offsets = offsets
        starts = sorted({0} | {d for d in depths if d > 0 and d < n_layers})
        prev_rows = None
        for start in starts:
            inactive = np.zeros(T, dtype=bool)
            for s_i, s in enumerate(self.seqs):
                if s.depth > start:
                    inactive[skip_rows[s_i]] = True
            rows = np.nonzero(~inactive)[0]
            q_indptr, seq_pos = [0], []
            for s_i in range(len(self.seqs)):
                lo, hi = np.searchsorted(rows, [offsets[s_i], offsets[s_i + 1]])
                q_indptr.append(int(hi))
                seq_pos.append(torch.from_numpy(all_pos[rows[lo:hi]]).to(dev))
            seg = Segment(start, rows, q_indptr, seq_pos)
            if prev_rows is not None:
                seg.join_into = torch.from_numpy(np.searchsorted(rows, prev_rows)).to(dev)
                joined = [i for i, s in enumerate(self.seqs) if s.depth == start]
                new_rows = np.concatenate([skip_rows[i] for i in joined])
                seg.join_new = torch.from_numpy(np.searchsorted(rows, new_rows)).to(dev)
                seg.join_h = torch.cat([self.seqs[i].resume_h for i in joined], dim=0)
            self.segments.append(seg)
            prev_rows = rows
        return self

    def segment_rows(self, seq: int, positions: np.ndarray, seg: Segment) -> torch.Tensor:
        """Indices into ``seg``'s active rows of sequence ``seq``'s ``positions`` (all active)."""
        key = (seq, id(positions), seg.start_layer)
        hit = self._row_cache.get(key)
        if hit is None:
            s = self.seqs[seq]
            full = self._offsets[seq] + np.searchsorted(s.positions, positions)
            hit = torch.from_numpy(np.searchsorted(seg.rows, full)).to(self.device)
            self._row_cache[key] = hit
        return hit

    @property
    def num_rows(self) -> int:
        return int(self.row_ids.shape[0])
