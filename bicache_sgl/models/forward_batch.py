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


@dataclass
class ForwardBatch:
    seqs: list[SeqWork]
    device: torch.device
    store: KVStore
    segments: list[Segment] = field(default_factory=list)
    row_ids: torch.Tensor | None = None  # [T] token id per full-layout row
    row_pos: torch.Tensor | None = None  # [T] position per full-layout row
    logit_rows: np.ndarray | None = None  # full-layout rows needing logits, in sequence order
    logit_indptr: list[int] = field(default_factory=list)
    # captures merged across sequences, one write per layer: layer -> (source active rows, store rows)
    capture_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # residual leaving layer l - 1, written at the start of layer l: l -> (source active rows, store rows)
    capture_h: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    _offsets: list[int] = field(default_factory=list)
    _row_cache: dict = field(default_factory=dict)

    def build(self, n_layers: int) -> "ForwardBatch":
        dev = self.device
        offsets, ids, pos, skip_rows, depths = [0], [], [], [], []
        logit_rows, logit_indptr = [], [0]
        for s in self.seqs:
            base = offsets[-1]
            ids.append(s.input_ids.index_select(0, torch.from_numpy(s.positions).to(s.input_ids.device)))
            pos.append(s.positions)
            offsets.append(base + len(s.positions))
            depths.append(s.depth)
            skip_rows.append(np.arange(base + s.skip_from, base + s.skip_from + s.skip))
            # positions -> rows: positions are sorted, so searchsorted maps exactly
            idx = np.searchsorted(s.positions, s.logit_positions)
            ok = idx < len(s.positions)
            if not (ok.all() and np.all(s.positions[idx[ok]] == s.logit_positions)):
                raise ValueError("a logit position is not among the computed positions")
            lr = base + idx
            assert s.skip == 0 or not np.any((idx >= s.skip_from) & (idx < s.skip_from + s.skip)), "logit row inside S"
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
        for si, start in enumerate(starts):
            end = starts[si + 1] if si + 1 < len(starts) else n_layers
            inactive = np.zeros(T, dtype=bool)
            for s_i, s in enumerate(self.seqs):
                if s.depth > start:
                    inactive[skip_rows[s_i]] = True
            rows = np.nonzero(~inactive)[0]
            q_indptr, write = [0], []
            for s_i, s in enumerate(self.seqs):
                lo, hi = np.searchsorted(rows, [offsets[s_i], offsets[s_i + 1]])
                q_indptr.append(int(hi))
                write.append(s.kv.rows[start:end][:, all_pos[rows[lo:hi]]])
            write_rows = np.concatenate(write, axis=1) if write else np.zeros((end - start, 0), dtype=np.int64)
            seg = Segment(start, end, rows, q_indptr, torch.from_numpy(np.ascontiguousarray(write_rows)).to(dev))
            if prev_rows is not None:
                seg.join_into = torch.from_numpy(np.searchsorted(rows, prev_rows)).to(dev)
                joined = [i for i, s in enumerate(self.seqs) if s.depth == start]
                new_rows = np.concatenate([skip_rows[i] for i in joined])
                seg.join_new = torch.from_numpy(np.searchsorted(rows, new_rows)).to(dev)
                resume = np.concatenate([self.seqs[i].resume_rows for i in joined])
                seg.join_h = self.store.h.index_select(0, torch.from_numpy(resume).to(dev))
            self.segments.append(seg)
            prev_rows = rows
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
                out[layer] = (torch.cat([a for a, _ in lst]), torch.cat([b for _, b in lst]))

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
