"""One batched model forward: what each sequence computes, where its K/V live, and the packed
row layout.

A *sequence* is one row-set of the batch (a request, its classifier-free-guidance shadow, a
likelihood probe, an audit shadow). Each sequence computes a sorted set of positions. With bicache
depth d > 0 a contiguous run of ``skip`` of those positions (the reused span S, from entry
``skip_from``: a short head before it may be recomputed) are not computed in layers < d: their
K/V at those layers are read where they live, in prefix-pool rows of the shared ``KVStore``, and
they join at layer d from the stored residual.

K/V live in ONE store of rows (``KVStore``); a sequence's ``SeqKV.rows[l, j]`` is the row holding
its K/V of layer l at position j (a private row, or a prefix-pool row for reused S positions at
l < d). Each layer writes all computed rows with one ``index_copy_`` and attention gathers keys
through the rows, so nothing is copied per request.

Layout: rows are sequence-major, positions ascending. The active row set only grows with depth,
so the forward is split into *segments* (layer ranges with a constant active set); between
segments the joining rows are inserted. All index bookkeeping here is built once per forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..kv_cache.store import Capture, KVStore, SeqKV


@dataclass
class SeqWork:
    kv: SeqKV
    input_ids: torch.Tensor  # [N] long, the whole sequence as it is now
    positions: np.ndarray  # int64 sorted: positions computed (at layers >= depth for S rows)
    logit_positions: np.ndarray  # int64: positions whose final hidden state goes through the LM head
    depth: int = 0
    skip: int = 0  # entries of `positions` that are S (only meaningful when depth > 0) ...
    skip_from: int = 0  # ... starting at this entry: S need not start at position 0
    resume_rows: np.ndarray | None = None  # [skip] prefix-pool rows whose h is S entering layer `depth`
    capture: Capture | None = None

    def __post_init__(self) -> None:
        if self.depth == 0 or self.skip == 0:
            self.depth, self.skip, self.skip_from, self.resume_rows = 0, 0, 0, None


@dataclass
class Segment:
    start_layer: int
    end_layer: int
    rows: np.ndarray  # indices into the full layout, ascending
    q_indptr: list[int]  # per sequence, into the packed active rows
    write_rows: torch.Tensor  # [end_layer - start_layer, n_active] store row of each active row, per layer
    join_into: torch.Tensor | None = None  # where the previous segment's rows land in this one
    join_new: torch.Tensor | None = None  # where the joining rows land
    join_h: torch.Tensor | None = None  # [n_join, D] their residual stream
    rows_t: torch.Tensor | None = None  # ``rows`` on the device (long)


@dataclass
class ForwardBatch:
    """The metadata of one packed forward, built once (``build``) with array operations over all
    sequences at once: no per-sequence numpy or torch calls, so its cost does not grow with the
    number of sequences by more than the arrays' lengths."""

    seqs: list[SeqWork]
    device: torch.device
    store: KVStore
    segments: list[Segment] = field(default_factory=list)
    row_ids: torch.Tensor | None = None  # [T] token id per full-layout row
    row_pos: torch.Tensor | None = None  # [T] position per full-layout row
    logit_rows: np.ndarray | None = None  # full-layout rows needing logits, in sequence order
    logit_indptr: list[int] = field(default_factory=list)
    # the last segment's active rows whose logits are read (None: all of them, in order)
    logit_sel: torch.Tensor | None = None
    # captures merged across sequences, one write per layer: layer -> (source active rows, store rows)
    capture_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # residual leaving layer l - 1, written at the start of layer l: l -> (source active rows, store rows)
    capture_h: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # every sequence's K/V rows side by side: int64 [L, sum N_i]; sequence i owns columns
    # kv_indptr[i]:kv_indptr[i + 1] (its SeqKV.rows)
    kv_flat: np.ndarray | None = None
    kv_indptr: np.ndarray | None = None
    _offsets: list[int] = field(default_factory=list)
    _row_cache: dict = field(default_factory=dict)

    def build(self, n_layers: int) -> "ForwardBatch":
        dev, seqs = self.device, self.seqs
        B = len(seqs)
        lens = np.fromiter((len(s.positions) for s in seqs), dtype=np.int64, count=B)
        offsets = np.zeros(B + 1, dtype=np.int64)
        np.cumsum(lens, out=offsets[1:])
        T = int(offsets[-1])
        self._offsets = offsets.tolist()
        depth = np.fromiter((s.depth for s in seqs), dtype=np.int64, count=B)
        skip_from = np.fromiter((s.skip_from for s in seqs), dtype=np.int64, count=B)
        skip = np.fromiter((s.skip for s in seqs), dtype=np.int64, count=B)
        all_pos = np.concatenate([s.positions for s in seqs]) if B else np.zeros(0, dtype=np.int64)
        row_seq = np.repeat(np.arange(B), lens)  # [T] the sequence of each full-layout row
        local = np.arange(T) - offsets[row_seq]  # [T] entry of the row in its sequence's positions
        # every row's K/V columns in kv_flat: sequence i's position j is column kv_indptr[i] + j
        n_pos = np.fromiter((s.kv.n_positions for s in seqs), dtype=np.int64, count=B)
        self.kv_indptr = np.zeros(B + 1, dtype=np.int64)
        np.cumsum(n_pos, out=self.kv_indptr[1:])
        if B == 1:
            self.kv_flat = seqs[0].kv.rows  # read only: no copy for the lone sequence
        else:
            self.kv_flat = np.concatenate([s.kv.rows for s in seqs], axis=1) if B else np.zeros((n_layers, 0), np.int64)
        col = self.kv_indptr[row_seq] + all_pos

        # token ids: one gather from every sequence's ids side by side
        if B == 0:
            self.row_ids = torch.empty(0, dtype=torch.long, device=dev)
        elif B == 1:
            ids = seqs[0].input_ids
            self.row_ids = ids.index_select(0, torch.from_numpy(all_pos).to(ids.device)).to(dev)
        else:
            ids = torch.cat([s.input_ids for s in seqs])
            id_start = np.zeros(B, dtype=np.int64)
            np.cumsum(np.fromiter((len(s.input_ids) for s in seqs[:-1]), dtype=np.int64, count=B - 1),
                      out=id_start[1:])
            at = torch.from_numpy(id_start[row_seq] + all_pos).to(ids.device)
            self.row_ids = ids.index_select(0, at).to(dev)
        self.row_pos = torch.from_numpy(all_pos).to(dev)

        # logit positions -> rows: rows are sorted by (sequence, position), so one searchsorted over
        # the key sequence * stride + position maps every logit position exactly
        lp = [s.logit_positions for s in seqs]
        n_logit = np.fromiter((len(x) for x in lp), dtype=np.int64, count=B)
        lp_all = np.concatenate(lp) if B else np.zeros(0, dtype=np.int64)
        lp_seq = np.repeat(np.arange(B), n_logit)
        stride = int(max(all_pos.max(initial=0), lp_all.max(initial=0))) + 1
        keys = row_seq * stride + all_pos
        want = lp_seq * stride + lp_all
        idx = np.searchsorted(keys, want)
        if lp_all.size and (lp_all.min() < 0 or idx.max() >= T or (keys[idx] != want).any()):
            raise ValueError("a logit position is not among the computed positions")
        in_s = (local >= skip_from[row_seq]) & (local < skip_from[row_seq] + skip[row_seq])  # [T] row is in S
        assert not in_s[idx].any(), "logit row inside S"
        self.logit_rows = idx
        self.logit_indptr = [0, *np.cumsum(n_logit).tolist()]

        # segments: a row of S is active from its sequence's depth on (depth 0 rows: always)
        row_depth = np.where(in_s, depth[row_seq], 0)
        starts = sorted({0} | {int(d) for d in depth if 0 < d < n_layers})
        prev_rows = None
        for si, start in enumerate(starts):
            end = starts[si + 1] if si + 1 < len(starts) else n_layers
            rows = np.flatnonzero(row_depth <= start)
            q_indptr = [0, *np.searchsorted(rows, offsets[1:]).tolist()]
            write_rows = np.ascontiguousarray(self.kv_flat[start:end][:, col[rows]])
            seg = Segment(start, end, rows, q_indptr, torch.from_numpy(write_rows).to(dev),
                          rows_t=torch.from_numpy(rows).to(dev))
            if prev_rows is not None:
                seg.join_into = torch.from_numpy(np.searchsorted(rows, prev_rows)).to(dev)
                seg.join_new = torch.from_numpy(np.searchsorted(rows, np.flatnonzero(row_depth == start))).to(dev)
                resume = np.concatenate([s.resume_rows for s in seqs if s.depth == start])
                seg.join_h = self.store.h.index_select(0, torch.from_numpy(resume).to(dev))
            self.segments.append(seg)
            prev_rows = rows
        last = self.segments[-1].rows
        sel = np.searchsorted(last, self.logit_rows)
        if not (len(sel) == len(last) and np.array_equal(sel, np.arange(len(last)))):
            self.logit_sel = torch.from_numpy(sel).to(dev)
        self._merge_captures(n_layers)
        return self

    def segment_of(self, layer: int) -> Segment:
        seg = self.segments[0]
        for s in self.segments:
            if s.start_layer <= layer:
                seg = s
        return seg

    def _merge_captures(self, n_layers: int) -> None:
        kv: dict[int, list] = {}
        hh: dict[int, list] = {}
        for i, s in enumerate(self.seqs):
            if s.capture is None:
                continue
            for layer, (pos, prow) in s.capture.layers.items():
                kv.setdefault(layer, []).append((self.segment_rows(i, pos, self.segment_of(layer)), prow))
                if layer + 1 < n_layers:
                    hh.setdefault(layer + 1, []).append((self.segment_rows(i, pos, self.segment_of(layer + 1)), prow))
        for out, parts in ((self.capture_kv, kv), (self.capture_h, hh)):
            for layer, lst in parts.items():
                # one capturing sequence (the usual case): its index tensors as they are, no copy
                out[layer] = lst[0] if len(lst) == 1 else \
                    (torch.cat([a for a, _ in lst]), torch.cat([b for _, b in lst]))

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
