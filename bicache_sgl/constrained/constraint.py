"""A compiled constraint over a tokenizer and the block dynamic program (DINGO).

States: the live DFA states 0..S-1 of the token-level index, plus END (= S) when end-of-
generation ids are given: an end id moves an accepting state to END, and END only admits end
ids (in a diffusion LM everything after EOS is EOS padding). Tokens are grouped into classes
that behave identically in every state, so the DP runs over (state, class) edges; the best
token of a class at a position is found once per position, vectorised over the vocabulary.

Over ~400 lines on purpose: one immutable automaton and the DP that reads its tables (the edge
arrays, distances and feasible sets are private layout shared by every method).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch

from ._indexer import bfs_levels
from .errors import ConstraintError, NoCompletion
from .index import IndexData

NEG_INF = float("-inf")
_FLOOR = -1e5  # scores are clamped to this before the DP; -inf ones get a larger penalty


@dataclass(frozen=True)
class ConstraintState:
    """Where a request stands: the DFA state after its committed blocks, and how many output
    positions the constraint still covers (``max_new_tokens`` minus committed ones)."""

    state: int
    remaining: int


@dataclass(frozen=True)
class _Segments:
    """A set of edges sorted by destination: edge ``eid[j]`` = (``src[j]``, ``cls[j]``) -> a
    state; segment k (``starts[k]:ends[k]``) holds the edges into ``nodes[k]``."""

    eid: np.ndarray
    src: np.ndarray
    cls: np.ndarray
    starts: np.ndarray
    ends: np.ndarray
    nodes: np.ndarray
    seg_of: np.ndarray  # state -> segment (-1: no incoming edge)


class Constraint:
    """A constraint compiled for one tokenizer and one set of end-of-generation ids. Immutable
    and shared between requests; per-request progress is a :class:`ConstraintState`."""

    def __init__(self, kind: str, regex: str, index: IndexData, end_ids: tuple[int, ...]) -> None:
        self.kind, self.regex, self.end_ids = kind, regex, tuple(sorted(set(int(i) for i in end_ids)))
        self.index = index
        S, C = index.n_states, index.n_classes
        tok_cls = index.token_class.astype(np.int64)
        src, cls, dst = (index.src.astype(np.int64), index.cls.astype(np.int64), index.dst.astype(np.int64))
        accepting = index.accepting.copy()
        self.end_state = -1
        if self.end_ids:
            end, eos_cls = S, C
            n = max(len(tok_cls), self.end_ids[-1] + 1)
            tok_cls = np.concatenate([tok_cls, np.full(n - len(tok_cls), -1, np.int64)])
            tok_cls[list(self.end_ids)] = eos_cls
            acc = np.flatnonzero(accepting)
            src = np.concatenate([src, acc, [end]])
            cls = np.concatenate([cls, np.full(len(acc) + 1, eos_cls)])
            dst = np.concatenate([dst, np.full(len(acc) + 1, end)])
            accepting = np.concatenate([accepting, [True]])
            S, C = S + 1, C + 1
            self.end_state = end
            # an end id that was also a text token (a stop token such as "\n") is text no more: drop
            # the edges of classes left without any token, so feasibility does not count on them
            members = np.bincount(tok_cls[tok_cls >= 0], minlength=C) > 0
            keep = members[cls]
            src, cls, dst = src[keep], cls[keep], dst[keep]
        order = np.lexsort((cls, src))
        src, cls, dst = src[order], cls[order], dst[order]
        # tokens that some class admits, and the token -> class map (a token's class may lose
        # members to the end ids; the class edges stay valid for the others)
        self.n_states, self.n_classes, self.initial = S, C, index.initial
        self.accepting_np = accepting
        self._tok_cls_np = tok_cls
        self._src_np, self._cls_np, self._dst_np = src, cls, dst
        self._key = src * C + cls  # sorted: (state, class) -> edge by binary search
        self._tok_ids_np = np.flatnonzero(tok_cls >= 0)
        by_cls = np.argsort(cls, kind="stable")
        ptr = np.searchsorted(cls[by_cls], np.arange(C + 1))
        self._cls_edges = [by_cls[ptr[c]:ptr[c + 1]] for c in range(C)]
        self._all = self._segments(np.arange(len(src)))
        self._by_cls: dict[int, _Segments] = {}
        self._dev: dict[tuple, tuple[torch.Tensor, torch.Tensor, np.ndarray]] = {}
        self._members: dict[tuple, torch.Tensor] = {}
        self._dist: np.ndarray | None = None
        self._exact: list[np.ndarray] = []  # no end ids: F[r] = states with an accepted path of exactly r
        self._period: tuple[int, int] | None = None
        self._trans: np.ndarray | None = None  # dense transitions (_dense_transitions)
        self._lock = threading.Lock()  # lazily filled tables (a constraint is shared by requests)

    # ---------------------------------------------------------------------------- basic queries
    def __repr__(self) -> str:
        return (f"Constraint({self.kind}, states={self.n_states}, classes={self.n_classes}, "
                f"edges={len(self._src_np)}, end_ids={self.end_ids})")

    @property
    def n_edges(self) -> int:
        return len(self._src_np)

    def start(self, max_tokens: int) -> ConstraintState:
        """The state of a request with ``max_tokens`` output positions (``max_new_tokens``)."""
        return ConstraintState(self.initial, int(max_tokens))

    def is_accepting(self, st: ConstraintState | int) -> bool:
        """Whether the text so far fully matches (END, after an end id, counts as accepting)."""
        q = st.state if isinstance(st, ConstraintState) else int(st)
        return bool(self.accepting_np[q])

    def can_end(self, st: ConstraintState | int) -> bool:
        """Whether end-of-generation (an end id, or the output simply stopping) is allowed here."""
        return self.is_accepting(st)

    def ended(self, st: ConstraintState | int) -> bool:
        """Whether an end id has been committed (only end ids may follow)."""
        q = st.state if isinstance(st, ConstraintState) else int(st)
        return q == self.end_state

    def next_state(self, q: int, token: int) -> int:
        """The state after ``token`` in state ``q``; -1 when the token is not allowed there."""
        if not 0 <= token < len(self._tok_cls_np) or q < 0:
            return -1
        c = self._tok_cls_np[token]
        if c < 0:
            return -1
        k = q * self.n_classes + c
        i = int(np.searchsorted(self._key, k))
        return int(self._dst_np[i]) if i < len(self._key) and self._key[i] == k else -1

    def allowed_tokens(self, st: ConstraintState | int) -> torch.Tensor:
        """Token ids allowed in a state (for inspection and tests; the DP never lists them)."""
        q = st.state if isinstance(st, ConstraintState) else int(st)
        lo, hi = np.searchsorted(self._key, [q * self.n_classes, (q + 1) * self.n_classes])
        classes = self._cls_np[lo:hi]
        return torch.from_numpy(self._tok_ids_np[np.isin(self._tok_cls_np[self._tok_ids_np], classes)])

    def walk(self, tokens, state: int | None = None) -> int:
        """The state after ``tokens`` (-1 once a token is not allowed)."""
        q = self.initial if state is None else state
        for t in (tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens):
            q = self.next_state(q, int(t))
            if q < 0:
                return -1
        return q

    def matches(self, tokens) -> bool:
        """Whether an output (token ids, end ids and what follows them excluded) fully matches."""
        ids = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
        ends = set(self.end_ids)
        for k, t in enumerate(ids):
            if t in ends:
                ids = ids[:k]
                break
        q = self.walk(ids)
        return q >= 0 and bool(self.accepting_np[q])

    def advance(self, st: ConstraintState, block_tokens) -> ConstraintState:
        """The state after a committed block (only its first ``st.remaining`` positions count:
        the output is cut at ``max_new_tokens``). Raises ConstraintError on a disallowed token."""
        toks = block_tokens.tolist() if isinstance(block_tokens, torch.Tensor) else list(block_tokens)
        n = min(len(toks), st.remaining)
        q = st.state
        for t in toks[:n]:
            nq = self.next_state(q, int(t))
            if nq < 0:
                raise ConstraintError(f"token {t} is not allowed in constraint state {q}")
            q = nq
        return ConstraintState(q, st.remaining - n)

    # ------------------------------------------------------------------------------ feasibility
    def min_tokens(self, st: ConstraintState | int) -> int | None:
        """Fewest further tokens to reach an accepting state (None: never)."""
        q = st.state if isinstance(st, ConstraintState) else int(st)
        d = self._distances()[q]
        return None if d < 0 else int(d)

    def feasible(self, st: ConstraintState) -> bool:
        """Whether a fully matching output still fits in ``st.remaining`` positions."""
        return bool(self.feasible_states(st.remaining)[st.state])

    def _distances(self) -> np.ndarray:
        with self._lock:
            if self._dist is None:
                self._dist = self._compute_distances()
            return self._dist

    def _compute_distances(self) -> np.ndarray:
        """Fewest tokens from each state to an accepting one (-1: none), by backward BFS."""
        # backward: edges dst -> src, from the accepting states
        return bfs_levels(self.n_states, self._dst_np, self._src_np, np.flatnonzero(self.accepting_np))

    def feasible_states(self, r: int) -> np.ndarray:
        """bool [S]: states from which a fully matching output fits in exactly ``r`` more
        positions (with end ids: at most ``r``, since END pads)."""
        if self.end_ids:
            d = self._distances()
            return (d >= 0) & (d <= r)
        with self._lock:
            return self._exact_states(r)

    def _exact_states(self, r: int) -> np.ndarray:
        # no end ids: every position is text, so the length must be exactly r (the sets F[r]
        # are eventually periodic; stored until the first repeat)
        if self._period is not None:
            s, p = self._period
            return self._exact[r] if r < s else self._exact[s + (r - s) % p]
        if not self._exact:
            self._exact.append(self.accepting_np.copy())
            self._seen = {np.packbits(self._exact[0]).tobytes(): 0}
        while len(self._exact) <= r:
            prev = self._exact[-1]
            nxt = np.bincount(self._src_np, weights=prev[self._dst_np].astype(np.float64),
                              minlength=self.n_states) > 0
            k = np.packbits(nxt).tobytes()
            if k in self._seen:
                s = self._seen[k]
                self._period = (s, len(self._exact) - s)
                return self._exact_states(r)
            self._seen[k] = len(self._exact)
            self._exact.append(nxt)
        return self._exact[r]

    # ----------------------------------------------------------------------------------- the DP
    def _segments(self, edge_ids: np.ndarray) -> _Segments:
        """Edges grouped by destination state (for segment max over incoming edges)."""
        order = edge_ids[np.argsort(self._dst_np[edge_ids], kind="stable")]
        d = self._dst_np[order]
        starts = np.flatnonzero(np.concatenate([[True], d[1:] != d[:-1]])) if d.size else np.zeros(0, np.int64)
        nodes = d[starts]
        seg_of = np.full(self.n_states, -1, dtype=np.int64)
        seg_of[nodes] = np.arange(len(nodes))
        ends = np.concatenate([starts[1:], [d.size]]).astype(np.int64)
        return _Segments(order, self._src_np[order], self._cls_np[order], starts, ends, nodes, seg_of)

    def _class_segments(self, c: int) -> _Segments:
        seg = self._by_cls.get(c)
        if seg is None:
            seg = self._by_cls[c] = self._segments(self._cls_edges[c])
        return seg

    def _device_tables(self, dev: torch.device, V: int) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
        key = (str(dev), V)
        t = self._dev.get(key)
        if t is None:
            keep = self._tok_ids_np < V
            ids, cls = self._tok_ids_np[keep], self._tok_cls_np[self._tok_ids_np[keep]]
            has = np.zeros(self.n_classes, dtype=bool)
            has[cls] = True
            t = self._dev[key] = (torch.from_numpy(ids).to(dev), torch.from_numpy(cls).to(dev), has)
        return t

    def class_scores(self, scores: torch.Tensor) -> np.ndarray:
        """scores [n, V] -> the best score of each token class [n, C] (fp64, CPU); -inf for a
        class with no token below V or whose tokens all score -inf (NaN counts as -inf)."""
        ids, cls, _ = self._device_tables(scores.device, scores.shape[-1])
        sub = torch.nan_to_num(scores.index_select(1, ids), nan=NEG_INF)
        n = scores.shape[0]
        cmax = torch.full((n, self.n_classes), NEG_INF, dtype=sub.dtype, device=sub.device)
        cmax = cmax.scatter_reduce(1, cls.unsqueeze(0).expand(n, -1), sub, "amax", include_self=True)
        return cmax.double().cpu().numpy()

    def _class_members(self, dev: torch.device, V: int, c: int) -> torch.Tensor:
        key = (str(dev), V, c)
        m = self._members.get(key)
        if m is None:
            toks = self._tok_ids_np[self._tok_cls_np[self._tok_ids_np] == c]
            m = self._members[key] = torch.from_numpy(toks[toks < V]).to(dev)
        return m

    def block_path(self, st: ConstraintState, block_tokens, masked, scores: torch.Tensor) -> torch.Tensor:
        """The highest-scoring completion of the current block that keeps the output viable.

        ``block_tokens`` [L] (masked positions hold anything), ``masked`` [L] bool, ``scores``
        [n_masked, V]: per masked position (in block order) an additive score per token, e.g. its
        log-probability (Gumbel-perturbed to sample). Returns the token for each masked position
        [n_masked] (long, on CPU). The path maximises the sum of scores over the masked positions
        among the assignments in which every fixed position keeps its token and the text is a
        prefix of a matching output that fits in the positions left. Scores of -inf (filtered
        tokens) are avoided whenever any path avoids them, but they never make a constraint
        unsatisfiable. Positions past ``st.remaining`` (cut off by max_new_tokens) are free:
        their plain argmax. Raises :class:`NoCompletion` when no assignment works.
        """
        toks = torch.as_tensor(block_tokens).long().cpu().numpy()
        mask = torch.as_tensor(masked).bool().cpu().numpy()
        L = len(toks)
        if mask.shape != (L,) or scores.dim() != 2 or scores.shape[0] != int(mask.sum()):
            raise ValueError(f"block_path: {L} positions, {int(mask.sum())} masked, scores {tuple(scores.shape)}")
        Lc = min(L, st.remaining)
        tail = st.remaining - Lc
        row_of = np.cumsum(mask) - 1
        dev, Vw = scores.device, scores.shape[-1]
        out = torch.empty(scores.shape[0], dtype=torch.long)
        free = np.flatnonzero(mask[Lc:]) + Lc
        if free.size:
            rows = torch.from_numpy(row_of[free])
            out[rows] = scores.index_select(0, rows.to(dev)).argmax(-1).cpu()
        if Lc == 0:
            return out
        crow = np.flatnonzero(mask[:Lc])
        if crow.size:
            if crow.size == scores.shape[0]:  # every masked position is constrained (the usual case)
                cmax = self.class_scores(scores)
            else:
                cmax = self.class_scores(scores.index_select(0, torch.from_numpy(row_of[crow]).to(dev)))
            has = self._device_tables(dev, Vw)[2]
            cmax = np.where(np.isneginf(cmax), _FLOOR * (Lc + 2), np.maximum(cmax, _FLOOR))
            cmax[:, ~has] = NEG_INF
        S = self.n_states
        V = np.full(S, NEG_INF)
        V[st.state] = 0.0
        vals: list[np.ndarray] = []
        segs: list[_Segments] = []
        k = 0
        for i in range(Lc):
            if mask[i]:
                seg = self._all
                val = V[seg.src] + cmax[k][seg.cls]
                k += 1
            else:
                t = int(toks[i])
                c = self._tok_cls_np[t] if 0 <= t < len(self._tok_cls_np) else -1
                if c < 0:
                    raise NoCompletion(f"fixed token {t} at block position {i} is not allowed by the constraint")
                seg = self._class_segments(int(c))
                val = V[seg.src]
            V = np.full(S, NEG_INF)
            if val.size:
                V[seg.nodes] = np.maximum.reduceat(val, seg.starts)
            vals.append(val)
            segs.append(seg)
        final = np.where(self.feasible_states(tail), V, NEG_INF)
        q = int(final.argmax())
        if not np.isfinite(final[q]):
            raise NoCompletion(self._why(st, Lc, tail))
        path_cls = np.empty(Lc, dtype=np.int64)
        for i in range(Lc - 1, -1, -1):
            seg, val = segs[i], vals[i]
            j = int(seg.seg_of[q])
            a = int(seg.starts[j])
            e = a + int(val[a:int(seg.ends[j])].argmax())
            path_cls[i] = seg.cls[e]
            q = int(seg.src[e])
        # the best token of each chosen class, per position (one gather per distinct class)
        pc = path_cls[crow]
        for c in np.unique(pc).tolist():
            sel = np.flatnonzero(pc == c)
            members = self._class_members(dev, Vw, c)
            rows = torch.from_numpy(row_of[crow[sel]])
            sub = scores[rows.to(dev)[:, None], members[None, :]]
            best = torch.nan_to_num(sub, nan=NEG_INF).argmax(-1)
            out[rows] = members[best].cpu()
        return out

    def allowed_mass(self, st: ConstraintState, block_tokens, masked, probs: torch.Tensor) -> torch.Tensor:
        """For a block whose masked positions are filled with a viable path (``block_tokens``
        [L], ``masked`` [L] bool, ``probs`` [n_masked, V] the model's probabilities in block
        order): the probability mass of the tokens the automaton allows at each masked position,
        in the state the path reaches just before it [n_masked] (fp64, on ``probs``' device).
        Positions past ``st.remaining`` (free) get 1. Divide a path token's probability by it to
        get its probability given the constraint."""
        toks = torch.as_tensor(block_tokens).long().cpu().tolist()
        mask = torch.as_tensor(masked).bool().cpu().numpy()
        n = probs.shape[0]
        out = torch.ones(n, dtype=torch.float64, device=probs.device)
        Lc = min(len(toks), st.remaining)
        crow = np.flatnonzero(mask[:Lc])
        if crow.size == 0:
            return out
        trans = self._dense_transitions()
        tc = self._tok_cls_np
        states = np.empty(Lc, dtype=np.int64)
        q = st.state
        for i in range(Lc):
            states[i] = q
            if q < 0:
                continue
            if trans is None:
                q = self.next_state(q, toks[i])
            else:
                k = tc[toks[i]] if 0 <= toks[i] < len(tc) else -1
                q = int(trans[q, k]) if k >= 0 else -1
        ids, cls, _ = self._device_tables(probs.device, probs.shape[-1])
        row_of = np.cumsum(mask) - 1
        rows = torch.from_numpy(row_of[crow]).to(probs.device)
        sub = probs.index_select(0, rows).to(torch.float64).index_select(1, ids)
        cmass = torch.zeros(len(crow), self.n_classes, dtype=torch.float64, device=probs.device)
        cmass.scatter_add_(1, cls.unsqueeze(0).expand(len(crow), -1), sub)
        qs = states[crow]
        if trans is not None:
            allowed = (trans[np.maximum(qs, 0)] >= 0) & (qs >= 0)[:, None]
        else:
            allowed = np.zeros((len(crow), self.n_classes), dtype=bool)
            for j, qi in enumerate(qs.tolist()):
                if qi >= 0:
                    lo, hi = np.searchsorted(self._key, [qi * self.n_classes, (qi + 1) * self.n_classes])
                    allowed[j, self._cls_np[lo:hi]] = True
        mass = (cmass * torch.from_numpy(allowed).to(probs.device)).sum(-1)
        out[rows] = mass
        return out

    DENSE_LIMIT = 4_000_000  # states x classes up to which a dense transition table is kept

    def _dense_transitions(self) -> np.ndarray | None:
        """[S, C] next state (-1: no edge) when small enough, else None (built once, lazily)."""
        if self.n_states * self.n_classes > self.DENSE_LIMIT:
            return None
        with self._lock:
            if self._trans is None:
                t = np.full((self.n_states, self.n_classes), -1, dtype=np.int64)
                t[self._src_np, self._cls_np] = self._dst_np
                self._trans = t
            return self._trans

    def _why(self, st: ConstraintState, Lc: int, tail: int) -> str:
        if not self.feasible(st):
            need = self.min_tokens(st)
            if need is None:
                return "no output matching the constraint can follow the committed text"
            return (f"no output matching the constraint fits in the {st.remaining} positions left "
                    f"(at least {need} tokens needed)")
        return "the tokens already fixed in this block admit no output matching the constraint"
