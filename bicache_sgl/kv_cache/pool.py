"""The K/V pool: one store of K/V rows (``KVStore``) shared by the prefix cache and the running
requests, so attention reads reused prefix state where it lives. (About 450 lines: the row and
slot tables, their capture contexts and allocators change together; the invariants below bind them.)

Rows ``[0, prefix_rows)`` hold cached prefix state per (cached token, layer), so a cached token
costs memory in proportion to the depth its node holds; rows ``[prefix_rows, total)`` are the
running sequences' private K/V (``alloc_seq`` / ``free_seq``).

Prefix layout (docs/prefix_cache.md, "One row store"). A prefix *row* holds one token's state at one layer l:
  K[row], V[row]  K/V of layer l                      -> [rows, Hkv, Dh]
  H[row]          residual leaving layer l (= entering layer l + 1)   -> [prefix rows, hidden]
A cached token has a *token slot* (what the radix index stores); ``table[slot, l]`` is its row at
layer l, or -1. The tables are stored layer-major (``layer_table[l, slot]``, ``layer_ctx``; ``table``
and ``ctx`` are their ``[slot, L]`` views): a stored range or a reused span is a rectangle of slots
x layers, and layer-major each of its layers is one contiguous slice of slots. A node of depth k
holds rows for layers 0..k-1 of each of its tokens, so a request
can skip those tokens in layers < d and resume them at layer d (reading H of layer d - 1) for
any d <= k. Bytes per layer-token = (2 * kv_dim + hidden) * itemsize:
LLaDA-8B bf16 (kv_dim 4096, hidden 4096): 24 KiB; Dream-7B bf16 (kv_dim 512, hidden 3584): 9 KiB.
(Storing only the residual and re-projecting K/V would cost 8 / 7 KiB per layer-token, for extra
projection work on every hit; for GQA models K/V alone is the cheaper half.) The residual of
the last layer is never read (a request never resumes after the last layer).

Capture contexts (docs/prefix_cache.md, "The capture-context rule"). Every bound row also records
the context it was computed in: ``ctx[slot, l]`` is an id into ``contexts`` (the capturing
request's prompt tokens and the length of the sequence its forward saw, generation positions
included). A row may serve a request only to the depth the planner derives from the shared
fraction of the two sequences (bicache/planner.py); the pool only keeps the record.

Capture classes. ``cls[slot]`` is an int64 label with one guarantee: two slots with the same label
have equal ``ctx`` rows (and so equal table occupancy). Every change of a slot's ctx row gives it
a fresh label that depends only on its old label and the change, so tokens captured together
keep sharing one label and a match is cut into runs of equal rows by comparing one label per
token instead of L contexts per token. Labels may split a class of equal rows (harmless: one
more run); they never join unequal rows (``check_exact_classes``).

Allocators are free lists of indices (numpy; no tensors in the bookkeeping). Row ids and context
ids are stored as int32 where the row count allows (half the bytes for every table write, share
copy and free); ids handed out are int64 (``SeqKV.rows``, the capture's device rows).
"""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import torch

from .memory import layer_token_bytes
from .store import KVShape, KVStore, SeqKV


class SlotAllocator:
    """Free list over ``capacity`` indices starting at ``offset``. Pure bookkeeping: tested
    without tensors.

    The free indices are ``_free[_lo:]``, taken from the front: ``alloc(n)`` is the slice
    ``_free[_lo:_lo + n]`` and ``free`` writes in front of it, so both are forward copies (no
    reversed one) and an ``alloc`` hands back the last freed indices in the order they were freed
    (sorted frees come back as ascending runs); fresh indices come low first."""

    def __init__(self, capacity: int, offset: int = 0, dtype: type = np.int64) -> None:
        self.capacity = capacity
        # ``dtype``: how the free list stores them (int32 halves its memory and every free); alloc
        # hands out int64 ids either way, widened by the one copy it makes anyway
        if offset + capacity > np.iinfo(dtype).max:
            raise ValueError(f"SlotAllocator: indices up to {offset + capacity} do not fit {np.dtype(dtype).name}")
        self._free = np.arange(offset, offset + capacity, dtype=dtype)
        self._lo = 0

    @property
    def num_free(self) -> int:
        return self.capacity - self._lo

    def alloc(self, n: int) -> np.ndarray | None:
        if n > self.capacity - self._lo:
            return None
        out = self._free[self._lo:self._lo + n].astype(np.int64)  # a copy, int64 whatever the storage
        self._lo += n
        return out

    def free(self, slots: np.ndarray) -> None:
        self.free_parts([np.asarray(slots).ravel()])  # written into the free list in its dtype

    def free_parts(self, parts: list[np.ndarray]) -> None:
        """:meth:`free` of the concatenation of ``parts`` (any shapes, C order), each written
        straight into the free list (no concatenated copy first)."""
        total = sum(p.size for p in parts)
        if total > self._lo:
            raise RuntimeError("prefix pool: freeing more slots than allocated (double free)")
        at = self._lo - total
        for p in parts:
            if p.size:
                self._free[at:at + p.size].reshape(p.shape)[...] = p
                at += p.size
        self._lo -= total

    def free_set(self) -> np.ndarray:
        return self._free[self._lo:].copy()


class CaptureContexts:
    """The contexts rows were captured in: id -> (prompt token ids, sequence length), kept while a
    bound row refers to it (reference counted per row). Pure bookkeeping."""

    def __init__(self) -> None:
        self._tokens: dict[int, np.ndarray] = {}
        self._seq_len: dict[int, int] = {}
        self._refs: dict[int, int] = {}
        self._next = 0
        # ids of forgotten contexts, reused: ids stay below the most contexts ever alive at once
        # (each bound row refers to one), so they fit the pool's int32 ctx table however long it runs
        self._spare: list[int] = []

    def new(self, tokens: np.ndarray, seq_len: int) -> int:
        """Register one capturing forward's context (no reference yet: :meth:`ref` on bind). A
        forgotten context's id may be given again: no row refers to it any more."""
        if self._spare:
            cid = self._spare.pop()
        else:
            cid = self._next
            self._next += 1
        self._tokens[cid] = np.asarray(tokens, dtype=np.int64)
        self._seq_len[cid] = int(seq_len)
        self._refs[cid] = 0
        return cid

    def ref(self, cid: int, n: int) -> None:
        self._refs[cid] += n
        if self._refs[cid] == 0:
            self.forget(cid)

    def unref(self, ids: np.ndarray) -> None:
        """Drop one reference per entry of ``ids`` (the contexts of rows being freed)."""
        if len(ids) == 0:
            return
        u, c = np.unique(ids, return_counts=True)
        for cid, n in zip(u.tolist(), c.tolist()):
            self._refs[cid] -= n
            if self._refs[cid] <= 0:
                self.forget(cid)

    def forget(self, cid: int) -> None:
        """Drop a context no row refers to (an unused registration, or the last row freed)."""
        if self._refs.get(cid, 0) <= 0 and cid in self._tokens:
            del self._tokens[cid], self._seq_len[cid], self._refs[cid]
            self._spare.append(cid)

    def tokens(self, cid: int) -> np.ndarray:
        return self._tokens[cid]

    def seq_len(self, cid: int) -> int:
        return self._seq_len[cid]

    def __len__(self) -> int:
        return len(self._tokens)

    def refs(self) -> dict[int, int]:
        return dict(self._refs)


class KVPool:
    """Token slots (``tokens``), prefix rows (``rows``), request rows (``request_rows``), the slot ->
    row table, and the ``KVStore`` tensors behind all rows."""

    def __init__(self, cfg: KVShape, token_capacity: int, row_capacity: int, request_row_capacity: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.cfg, self.dtype, self.device = cfg, dtype, device
        self.n_layers = cfg.n_layers
        # prefix row ids and capture-context ids (below the row count: CaptureContexts) as int32
        # where they fit: every table write, share copy and allocation moves half the bytes
        self.index_dtype = np.int32 if row_capacity < np.iinfo(np.int32).max - 1 else np.int64
        self.tokens = SlotAllocator(token_capacity)
        self.rows = SlotAllocator(row_capacity, dtype=self.index_dtype)
        # the request rows' free list too (a SeqKV still reads int64 ids: alloc widens them)
        all_rows = row_capacity + request_row_capacity
        self.request_rows = SlotAllocator(request_row_capacity, offset=row_capacity,
                                          dtype=np.int32 if all_rows < np.iinfo(np.int32).max else np.int64)
        # layer-major [L, token slots] (module docstring): row, and capture context, per (layer, slot)
        self.layer_table = np.full((cfg.n_layers, token_capacity), -1, dtype=self.index_dtype)
        self.layer_ctx = np.full((cfg.n_layers, token_capacity), -1, dtype=self.index_dtype)
        self.contexts = CaptureContexts()
        self.cls = np.zeros(token_capacity, dtype=np.int64)  # capture class per slot (module docstring)
        self._next_cls = 1
        # Readers of each prefix row: running sequences whose K/V point at it (``share_prefix``, one
        # count per (sequence, position, layer) cell). A re-capture (``rebind_block``) replaces rows
        # in place; a replaced row that is still read is *retired*: out of the table, freed when its
        # last reader lets go (``free_seq``), so a running request's rows never change under it.
        self.readers = np.zeros(row_capacity, dtype=np.int32)
        self.retired = np.zeros(row_capacity, dtype=bool)
        self.retired_rows = 0
        self.store = KVStore.allocate(row_capacity + request_row_capacity, cfg.n_kv_heads, cfg.head_dim, dtype,
                                      device, prefix_rows=row_capacity, hidden=cfg.hidden_size)
        self.store.prefault_prefix()  # CPU: page faults at startup, not in the captures (store.prefault)

    @property
    def table(self) -> np.ndarray:
        """[token slots, L] view of ``layer_table``: the row of (slot, layer), or -1."""
        return self.layer_table.T

    @property
    def ctx(self) -> np.ndarray:
        """[token slots, L] view of ``layer_ctx``: the capture context of (slot, layer)'s row, or -1."""
        return self.layer_ctx.T

    # ------------------------------------------------------------------------ request K/V
    def alloc_seq(self, n_positions: int) -> SeqKV | None:
        """Private rows for one sequence, all layers; None when the request rows are exhausted."""
        rows = self.request_rows.alloc(self.n_layers * n_positions)
        if rows is None:
            return None
        # one copy of the row ids: the private rows are ``rows`` outside ``given`` (SeqKV), so no
        # second ``owned`` grid is kept
        return SeqKV(rows.reshape(self.n_layers, n_positions))

    def alloc_request(self, n_positions: int) -> SeqKV:
        """:meth:`alloc_seq` for an admitted request: the admission budget guarantees room, so
        running out is a bug (raised, not None)."""
        kv = self.alloc_seq(n_positions)
        if kv is None:
            raise RuntimeError(f"request K/V rows exhausted ({n_positions} positions asked)")
        return kv

    def _private_mask(self, kv: SeqKV) -> np.ndarray:
        """[L, N] True where ``kv.rows`` is still a private row (outside every reused rectangle)."""
        mine = np.ones(kv.rows.shape, dtype=bool)
        for d, a, e in kv.given:
            mine[:d, a:e] = False
        return mine

    def free_seq(self, kv: SeqKV) -> None:
        """Give back ``kv``'s private rows (not the prefix rows it reads). Idempotent."""
        if kv.owned is not None:
            raise ValueError("free_seq: SeqKV.owned is set, so its rows are not this pool's (alloc_seq)")
        rows = kv.rows
        if rows.size == 0:
            return
        if len(kv.given) == 0:
            self.request_rows.free_parts([rows])
        elif len(kv.given) == 1:
            # one reused rectangle [:d, a:e]: the private rows are the three slices around it
            d, a, e = kv.given[0]
            self.request_rows.free_parts([rows[d:], rows[:d, :a], rows[:d, e:]])
            self._unread(rows[:d, a:e].reshape(-1), unique=True)
        else:
            mine = self._private_mask(kv)
            self.request_rows.free(rows[mine])
            self._unread(rows[~mine], unique=False)
        kv.rows = rows[:, :0]
        kv.given = []

    def _unread(self, rows: np.ndarray, unique: bool) -> None:
        """One reader fewer for each of ``rows`` (prefix rows a sequence read); retired rows
        nobody reads any more go back to the free list. ``unique``: no row is listed twice."""
        if rows.size == 0:
            return
        if unique:
            self.readers[rows] -= 1
        else:
            np.subtract.at(self.readers, rows, 1)
        if self.retired_rows:
            gone = rows[self.retired[rows] & (self.readers[rows] == 0)]
            if gone.size:
                gone = np.unique(gone)
                self.retired[gone] = False
                self.retired_rows -= len(gone)
                self.rows.free(np.sort(gone))

    def share_prefix(self, kv: SeqKV, slots: np.ndarray, depth: int, start: int = 0) -> None:
        """Point ``kv``'s positions [start, start + len(slots)) at layers < depth to the cached rows
        (read in place; the caller keeps the node locked) and give back the private rows they
        replace."""
        if kv.owned is not None:
            raise ValueError("share_prefix: SeqKV.owned is set, so its rows are not this pool's (alloc_seq)")
        if self.held_depth_by_class(slots) < depth:  # before any row is given back
            raise ValueError(f"share_prefix: depth {depth} reads a layer the slots do not hold")
        end = start + len(slots)
        block = kv.rows[:depth, start:end]  # [depth, n] view: the private rows given back, then the reused ones
        # free before the copy overwrites them; O(reused rows), no pass over the whole sequence
        if not kv.given:  # the first share: every row of the block is still private
            self.request_rows.free_parts([block])
            self._copy_rows(kv.rows[:, start:end], slots, depth)
            self.readers[block.reshape(-1)] += 1  # distinct (slot, layer) cells: distinct rows
        else:
            mine = self._private_mask(kv)[:depth, start:end]
            self.request_rows.free(block[mine])
            self._unread(block[~mine], unique=False)  # prefix rows this share overwrites
            self._copy_rows(kv.rows[:, start:end], slots, depth)
            self.readers[block.reshape(-1)] += 1
        kv.given.append((depth, start, end))

    @property
    def token_capacity(self) -> int:
        return self.tokens.capacity

    @property
    def row_capacity(self) -> int:
        return self.rows.capacity

    @property
    def bytes_per_layer_token(self) -> int:
        return layer_token_bytes(self.cfg, self.dtype)

    @property
    def nbytes(self) -> int:
        """Bytes of the prefix rows (the request rows are the request K/V budget)."""
        return self.rows.capacity * self.bytes_per_layer_token

    def to_device(self, idx: np.ndarray) -> torch.Tensor:
        """Row ids as a long tensor on the pool's device."""
        return torch.from_numpy(np.ascontiguousarray(idx, dtype=np.int64)).to(self.device)

    def held_depth(self, slots: np.ndarray) -> int:
        """Leading layers for which every one of ``slots`` has a row."""
        if len(slots) == 0:
            return self.n_layers
        have = self.layer_table[:, slots] >= 0  # [L, n]: every row of every slot is looked at
        full = have.all(axis=1)
        return int(np.argmin(full)) if not full.all() else self.n_layers

    def class_runs(self, slots: np.ndarray) -> np.ndarray:
        """Indices into ``slots`` of the first token of each run of equal capture classes (equal
        ctx rows, so equal held layers)."""
        if len(slots) == 0:
            return np.zeros(0, dtype=np.int64)
        cls = self.cls[slots]
        return np.concatenate([[0], np.flatnonzero(cls[1:] != cls[:-1]) + 1]).astype(np.int64)

    def held_depth_by_class(self, slots: np.ndarray) -> int:
        """:meth:`held_depth` from one ctx row per run of equal capture classes (a row is bound
        exactly where it has a context), not the whole ``[n, L]`` table."""
        if len(slots) == 0:
            return self.n_layers
        cls = self.cls[slots]
        if cls[0] == cls[-1] and not (cls != cls[0]).any():  # one class (a node's usual case): one column
            have = self.layer_ctx[:, int(slots[0])] >= 0
        else:
            runs = np.flatnonzero(cls[1:] != cls[:-1]) + 1
            have = (self.layer_ctx[:, slots[runs]] >= 0).all(axis=1) & (self.layer_ctx[:, int(slots[0])] >= 0)
        lacking = np.flatnonzero(~have)
        return int(lacking[0]) if lacking.size else self.n_layers

    def copy_rows_to(self, out: np.ndarray, slots: np.ndarray, depth: int) -> None:
        """``out[:depth] = rows_of(slots, depth)`` ([depth, n]), reading each contiguous run of
        slots as one slice of the table (a match is a few such runs: its nodes' slots come off
        the free list in ascending runs) instead of gathering every row."""
        assert self.held_depth_by_class(slots) >= depth, "reading a layer the node does not hold"
        self._copy_rows(out, slots, depth)

    def _copy_rows(self, out: np.ndarray, slots: np.ndarray, depth: int) -> None:
        """:meth:`copy_rows_to` without the held check (the caller made it)."""
        n = len(slots)
        if n == 0 or depth == 0:
            return
        breaks = np.flatnonzero(np.diff(slots) != 1) + 1
        if len(breaks) > 16:  # scattered slots: one gather
            out[:depth] = self.layer_table[:depth, slots]
            return
        for i, j in pairwise([0, *breaks.tolist(), n]):
            a = int(slots[i])
            out[:depth, i:j] = self.layer_table[:depth, a:a + j - i]  # one contiguous slice per layer

    def rows_of(self, slots: np.ndarray, depth: int) -> np.ndarray:
        """[depth, n] rows of layers < depth (all must exist)."""
        assert self.held_depth_by_class(slots) >= depth, "reading a layer the node does not hold"
        return self.layer_table[:depth, slots].astype(np.int64)

    # Bookkeeping (host only).
    def _relabel(self, cut, key: np.ndarray | None = None, same: bool = False) -> None:
        """Fresh capture classes for ``cls[cut]`` after a change that is the same function of the old
        row for all of them (``key``: a per-slot parameter of the change, e.g. its first dropped
        layer): slots that shared a class and a key share the new one. ``same``: the caller knows
        every slot's new row is the same (one label for all)."""
        if same:
            self.cls[cut] = self._next_cls
            self._next_cls += 1
            return
        old = self.cls[cut]
        if key is not None:
            old = old * (self.n_layers + 1) + np.asarray(key, dtype=np.int64)
        if old.size and old.min() == old.max():  # the common case: one class in, one out
            self.cls[cut] = self._next_cls
            self._next_cls += 1
            return
        _, inv = np.unique(old, return_inverse=True)
        self.cls[cut] = self._next_cls + inv.reshape(-1)
        self._next_cls += int(inv.max()) + 1 if inv.size else 0

    def bind(self, slots: np.ndarray, layers: np.ndarray, rows: np.ndarray, ctx: int) -> np.ndarray:
        """Record ``rows[i]`` as the row of token ``slots[i]`` at layer ``layers[i]``, captured in
        context ``ctx`` (from ``contexts.new``); returns the rows NOT bound because the slot
        already had that layer (a concurrent upgrade won): the caller frees them."""
        flat = layers * self.token_capacity + slots  # layer-major [layer, token] tables: one flat index
        table, ctxs = self.layer_table.reshape(-1), self.layer_ctx.reshape(-1)
        new = np.take(table, flat) < 0
        if not new.all():
            flat, rows_new, lost = flat[new], rows[new], rows[~new]
        else:
            rows_new, lost = rows, rows[:0]
        table[flat] = rows_new
        ctxs[flat] = ctx
        self.contexts.ref(ctx, len(rows_new))
        # each slot's change depends on which of its layers were listed: a fresh class per slot
        touched = np.unique(slots)
        self.cls[touched] = self._next_cls + np.arange(len(touched))
        self._next_cls += len(touched)
        return lost

    def bind_block(self, slots: np.ndarray, lo: int, rows: np.ndarray, ctx: int, fresh: bool = False) -> np.ndarray:
        """:meth:`bind` for one rectangle: ``rows[i, j]`` [k, n] becomes the row of token
        ``slots[j]`` at layer ``lo + i``, captured in ``ctx``. Returns the rows not bound (that
        slot already had that layer: a concurrent upgrade won). ``fresh``: the caller guarantees
        the slots hold no row (just allocated, not yet in the index), so nothing is compared."""
        k, n = rows.shape
        if k == 0 or n == 0:
            return rows.reshape(-1)[:0]
        if n != len(slots) or not 0 <= lo <= lo + k <= self.n_layers:
            raise ValueError(f"bind_block: rows {rows.shape} do not fit {len(slots)} slots at layers "
                             f"[{lo}, {lo + k}) of {self.n_layers}")
        a = int(slots[0])
        # token slots come off the free list in ascending runs: a run is a basic slice of the
        # tables (views, no gather); otherwise one fancy index per table
        run = bool(slots[-1] - a == n - 1) and bool((np.diff(slots) == 1).all())
        cut = np.s_[lo:lo + k, a:a + n] if run else np.s_[lo:lo + k, slots]
        vals = rows  # [k, n]: layer-major like the tables
        # the new row of each slot is a function of its old row (which layers it lacked), so one
        # class in gives one class out; fresh slots all had the empty row, so they share one
        self._relabel(np.s_[a:a + n] if run else slots, same=fresh)
        if not fresh:
            old = self.layer_table[cut]  # [k, n]
            new = old < 0
        if fresh or new.all():
            self.layer_table[cut] = vals
            self.layer_ctx[cut] = ctx
            self.contexts.ref(ctx, vals.size)
            return rows.reshape(-1)[:0]
        self.layer_table[cut] = np.where(new, vals, old)
        self.layer_ctx[cut] = np.where(new, ctx, self.layer_ctx[cut])
        n_new = int(np.count_nonzero(new))
        if n_new:
            self.contexts.ref(ctx, n_new)
        return vals[~new]

    def rebind_block(self, slots: np.ndarray, lo: int, rows: np.ndarray, ctx: int, expect: np.ndarray
                     ) -> tuple[np.ndarray, int]:
        """A re-capture: ``rows[i, j]`` [k, n] becomes the row of ``slots[j]`` at layer ``lo + i``,
        captured in ``ctx``, REPLACING the rows there, for every slot whose capture class is still
        ``expect[j]`` (the class the planner judged at admission: its rows did not serve the
        capturing request). A slot whose class changed since (another capture replaced or upgraded
        it first) only gets the layers it lacks, as :meth:`bind_block`. Replaced rows still read by
        a running sequence are retired (freed by :meth:`free_seq`), the others freed now.

        Returns (the rows not bound: the caller frees them, the number of slots replaced)."""
        k, n = rows.shape
        if k == 0 or n == 0:
            return rows.reshape(-1)[:0], 0
        if n != len(slots) or len(expect) != n or not 0 <= lo <= lo + k <= self.n_layers:
            raise ValueError(f"rebind_block: rows {rows.shape} do not fit {len(slots)} slots at layers "
                             f"[{lo}, {lo + k}) of {self.n_layers}")
        ok = self.cls[slots] == expect
        lost: list[np.ndarray] = []
        if not ok.all():  # beaten slots: only the layers they lack (their rows stay)
            lost.append(self.bind_block(slots[~ok], lo, np.ascontiguousarray(rows[:, ~ok]), ctx))
            slots, rows = slots[ok], rows[:, ok]
        if len(slots):
            cut = np.s_[lo:lo + k, slots]
            old, old_ctx = self.layer_table[cut], self.layer_ctx[cut]  # [k, m] copies
            had = old >= 0
            if had.any():
                self.contexts.unref(old_ctx[had])
                self._retire(old[had])
            self.layer_table[cut] = rows
            self.layer_ctx[cut] = ctx
            self.contexts.ref(ctx, rows.size)
            # the same change (layers [lo, lo + k) all from ctx) for every slot: one class in, one out
            self._relabel(slots)
        return (np.concatenate(lost) if lost else rows.reshape(-1)[:0]), len(slots)

    def _retire(self, rows: np.ndarray) -> None:
        """Rows just taken out of the table: free the unread ones, retire the rest."""
        read = self.readers[rows] > 0
        if read.any():
            self.retired[rows[read]] = True
            self.retired_rows += int(np.count_nonzero(read))
            rows = rows[~read]
        if rows.size:
            self.rows.free(np.sort(rows))

    def drop_layers(self, slots: np.ndarray, from_layer: int | np.ndarray) -> int:
        """Free the rows of layers >= ``from_layer`` of ``slots`` (one layer for all, or one per
        slot: a batch of trims in one call); returns rows freed."""
        if np.ndim(from_layer) == 0:
            cut = np.s_[int(from_layer):, slots]
            part = self.layer_table[cut]  # [L - from_layer, n]
            have = part >= 0
        else:  # [L, n] mask of the layers each slot loses
            cut = np.s_[:, slots]
            part = self.layer_table[cut]
            have = (part >= 0) & (np.arange(self.n_layers)[:, None] >= np.asarray(from_layer)[None, :])
        rows = part[have]
        if rows.size == 0:
            return 0
        scalar = np.ndim(from_layer) == 0
        # dropping every layer leaves the empty row, whatever the old one was
        self._relabel(slots, None if scalar else from_layer, same=scalar and int(from_layer) == 0)
        ctx = self.layer_ctx[cut]
        self.contexts.unref(ctx[have])
        ctx[have] = -1
        part[have] = -1
        self.layer_ctx[cut], self.layer_table[cut] = ctx, part
        # sorted: the free list hands them out again as ascending runs, so a layer's rows for a
        # later node are contiguous (gathers read runs of memory, not every L-th row)
        self.rows.free(np.sort(rows))
        return int(rows.size)

    def check_exact_classes(self, slots: np.ndarray) -> None:
        """Assert the capture-class guarantee over ``slots``: equal class => equal ctx rows."""
        if len(slots) == 0:
            return
        order = np.argsort(self.cls[slots], kind="stable")
        c, rows = self.cls[slots][order], self.ctx[slots][order]
        same = c[1:] == c[:-1]
        bad = same & (rows[1:] != rows[:-1]).any(axis=1)
        assert not bad.any(), "two token slots share a capture class but not their capture contexts"

    def free_tokens(self, slots: np.ndarray) -> int:
        """Free token slots and every row they hold; returns rows freed."""
        n = self.drop_layers(slots, 0)
        self.tokens.free(slots)
        return n
