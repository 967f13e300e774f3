"""The runtime's packed depth-d forward (``DiffusionLM.forward_batch``) against the independent
float64 reference (``bicache_sgl.reference``), on any device.

A main sequence reuses, at positions [a, p), the prefix state of ANOTHER sequence that shares its
first p tokens (the state the reference computes for that other context), at every depth d in
0..L, alone and all depths in one batch, with the reused span from position 0 and after a
recomputed head of p // 3 tokens. ``compare_depth_forward`` returns every error and the margins
that make the comparison meaningful; tests/test_fidelity.py and the self-test judge them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ..attention import AttentionBackend
from ..kv_cache.store import KVStore, SeqKV
from ..models.config import ModelConfig
from ..models.forward_batch import ForwardBatch, SeqWork
from ..models.loader import load_model
from ..models.model import DiffusionLM
from ..reference import RefState, load_reference_model, reference_depth_forward, reference_states

# (p, tokens after the prefix) of the cases: r = p / N from 0.10 to 0.67 with 8 generation positions
DEFAULT_CASES = ((3, 20), (12, 10), (24, 4))


class PrefixRowStore:
    """A row store for hand-built forwards: prefix rows hold a cached state (K/V, and the residual
    a sequence resumes from), private rows the sequences' own K/V (as the engine lays them out)."""

    def __init__(self, cfg: ModelConfig, n_private: int, n_prefix: int, dev: torch.device,
                 dtype: torch.dtype = torch.float32) -> None:
        self.cfg, self.dev = cfg, dev
        self.store = KVStore.allocate(n_prefix + n_private, cfg.n_kv_heads, cfg.head_dim, dtype, dev,
                                      prefix_rows=n_prefix, hidden=cfg.hidden_size)
        self._prefix, self._private = 0, n_prefix

    def prefix(self, k: torch.Tensor, v: torch.Tensor, h: torch.Tensor | None = None) -> np.ndarray:
        """Write n cached rows (k, v [n, Hkv, Dh], h [n, D]); returns their row ids."""
        n = k.shape[0]
        rows = np.arange(self._prefix, self._prefix + n)
        self._prefix += n
        idx = torch.from_numpy(rows).to(self.dev)
        self.store.k[idx], self.store.v[idx] = k.to(self.store.k), v.to(self.store.v)
        if h is not None:
            self.store.h[idx] = h.to(self.store.h)
        return rows

    def seq(self, n_pos: int) -> SeqKV:
        """Private rows for every layer and position of one sequence."""
        L = self.cfg.n_layers
        rows = np.arange(self._private, self._private + L * n_pos)
        self._private += L * n_pos
        return SeqKV(rows.reshape(L, n_pos).copy(), rows)

    def reuse(self, n_pos: int, p: int, d: int, kvs: Sequence[tuple[torch.Tensor, torch.Tensor]],
              resume_h: torch.Tensor | None, a: int = 0) -> tuple[SeqKV, np.ndarray | None]:
        """A sequence whose positions [a, p) read cached K/V ``kvs[li] = (k, v)`` at layers < d
        and resume at d from ``resume_h`` (stored with the rows of layer d - 1)."""
        kv = self.seq(n_pos)
        resume_rows = None
        for li in range(d):
            h = resume_h if li == d - 1 and d < self.cfg.n_layers else None
            rows = self.prefix(kvs[li][0][a:p], kvs[li][1][a:p], h)
            kv.rows[li, a:p] = rows
            if h is not None:
                resume_rows = rows
        return kv, resume_rows


def reference_sequences(cfg: ModelConfig, p: int, n_rest: int, seed: int, gen: int = 8) -> tuple[list[int], list[int]]:
    """A main sequence and another context sharing its first p tokens (ids below 256 and the
    vocabulary), each ending in masks (``gen`` and ``gen + 4``)."""
    g = np.random.default_rng(seed)
    high = min(256, cfg.vocab_size)
    prefix = g.integers(0, high, p).tolist()
    main = prefix + g.integers(0, high, n_rest).tolist() + [cfg.mask_token_id] * gen
    other = prefix + g.integers(0, high, n_rest + 3).tolist() + [cfg.mask_token_id] * (gen + 4)
    return main, other


@dataclass
class DepthForwardReport:
    """Every error of one comparison (max |runtime - reference| over the logits compared)."""

    backend: str  # the attention backend that ran (a kernel may fall back to torch)
    n_layers: int
    logit_shift: int
    ref_shift: int  # the reference's reading of the checkpoint (1 for Dream)
    states_err: float = 0.0  # runtime dense forward's per-layer (h, K, V) vs the reference's, other context
    ref_scale: float = 0.0  # max |reference logit| over the logits compared (errors scale with it)
    errors: list[tuple[int, int, int, str, float]] = field(default_factory=list)  # (p, a, d, alone|mixed, err)
    head_effect: dict[int, float] = field(default_factory=dict)  # p -> max_d |ref(a=p//3) - ref(a=0)|
    reuse_effect: list[tuple[int, int, float]] = field(default_factory=list)  # (p, d >= 1, |ref_d - ref_0|)
    outputs: list[torch.Tensor] = field(default_factory=list)  # the runtime's logits of each error, same order

    @property
    def max_err(self) -> float:
        return max((e[-1] for e in self.errors), default=float("nan"))

    @property
    def min_reuse_effect(self) -> float:
        """The smallest change reuse from another context makes at any depth >= 1: a check whose
        tolerance is not far below it proves nothing."""
        return min((e[-1] for e in self.reuse_effect), default=float("nan"))


def _runtime(model: DiffusionLM, works: list[SeqWork], st: PrefixRowStore, attn: AttentionBackend) -> torch.Tensor:
    fb = ForwardBatch(works, st.dev, st.store).build(model.cfg.n_layers)
    return model.forward_batch(fb, attn).double().cpu()


def compare_depth_forward(folder: str, device: torch.device, attn: AttentionBackend, *,
                          dtype: str = "float32", cases: Sequence[tuple[int, int]] = DEFAULT_CASES,
                          gen: int = 8, model: DiffusionLM | None = None) -> DepthForwardReport:
    """Run every case on ``device`` with ``attn`` and return the errors (nothing is judged
    here). ``model`` replaces the checkpoint's runtime model (to check a modified one)."""
    if model is None:
        model, cfg = load_model(folder, dtype, device)
    cfg = model.cfg
    store_dtype = next(model.parameters()).dtype
    m = load_reference_model(folder)
    L, shift = cfg.n_layers, cfg.logit_shift
    rep = DepthForwardReport(attn.name, L, shift, m["shift"])
    for p, n_rest in cases:
        main, other = reference_sequences(cfg, p, n_rest, seed=p, gen=gen)
        N = len(main)
        want = np.arange(N - gen, N)  # the masked positions; their logits come from rows want - shift
        # the cached state: the prefix inside the other context's dense forward (the reference's),
        # which the runtime's own dense forward reproduces
        cached: list[RefState] = reference_states(m, other)
        _, ours = model.forward_dense(torch.tensor(other, device=device), return_states=True)
        for (h_r, k_r, v_r), (h_o, k_o, v_o) in zip(cached, ours):
            for x, y in ((h_r, h_o), (k_r, k_o), (v_r, v_o)):
                rep.states_err = max(rep.states_err, float((x - y.double().cpu()).abs().max()))

        def work(st: PrefixRowStore, d: int, a: int = 0, main=main, p=p, cached=cached, want=want) -> SeqWork:
            """The runtime's unit of work: this sequence at depth d, its positions [a, p) skipped
            below d (their K/V read in place from prefix rows, as the engine shares pool rows)."""
            resume = cached[d][0][a:p] if 0 < d < L else None
            kv, resume_rows = st.reuse(len(main), p, d, [(c[1], c[2]) for c in cached], resume, a)
            return SeqWork(kv, torch.tensor(main), np.arange(len(main)), want - shift, depth=d, skip=p - a,
                           skip_from=a, resume_rows=resume_rows)

        def store(N=N, p=p) -> PrefixRowStore:
            return PrefixRowStore(cfg, 2 * (L + 1) * L * N, 2 * (L + 1) * L * p, device, store_dtype)

        by_a = {}
        for a in (0, p // 3):
            refs = by_a[a] = [reference_depth_forward(m, main, p, d, cached, a)[want - shift] for d in range(L + 1)]
            alone = []
            for d in range(L + 1):
                st = store()
                alone.append(_runtime(model, [work(st, d, a)], st, attn))
            st = store()
            mixed = _runtime(model, [work(st, d, a) for d in range(L + 1)], st, attn)
            for d in range(L + 1):
                rep.ref_scale = max(rep.ref_scale, float(refs[d][torch.isfinite(refs[d])].abs().max()))
                for kind, out in (("alone", alone[d]), ("mixed", mixed[d * gen:(d + 1) * gen])):
                    rep.errors.append((p, a, d, kind, float((out - refs[d]).abs().max())))
                    rep.outputs.append(out)
            if a:
                rep.head_effect[p] = max(float((refs[d] - by_a[0][d]).abs().max()) for d in range(1, L + 1))
        for d in range(1, L + 1):
            rep.reuse_effect.append((p, d, float((by_a[0][d] - by_a[0][0]).abs().max())))
    return rep
