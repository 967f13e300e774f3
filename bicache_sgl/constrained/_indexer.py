"""Regex -> token-level transition index (outlines-core), pruned and compressed into token classes.

Self-contained (numpy and outlines-core only, no package-relative imports): it is imported by
the package for in-process builds and also run as a script, as the sandboxed build worker that
``bicache_sgl.constrained.index`` spawns so that a pathological regex can be stopped by a time
limit and an address-space limit (native code cannot be interrupted from a thread).

Worker protocol (stdin -> stdout): frames of an 8-byte little-endian length and a pickle.
Requests: ``("vocab", key, tokens)`` stores a token table; ``("build", key, regex, limits)``
answers ``("ok", result)`` or ``("error", message)``.
"""

from __future__ import annotations

import os
import pickle
import struct
import sys

import numpy as np

SENTINEL = "\U0010FFFF".encode()  # a noncharacter: appended to every regex (see build)


def bfs_levels(n: int, src: np.ndarray, dst: np.ndarray, seeds: np.ndarray) -> np.ndarray:
    """Fewest edges src -> dst from any of ``seeds`` to each state (int64 [n], -1: unreachable).

    Breadth-first over a CSR view of the edge list, a whole frontier per numpy step (the edge
    lists reach millions of entries: no Python loop per edge or state)."""
    dist = np.full(n, -1, dtype=np.int64)
    frontier = np.unique(np.asarray(seeds, dtype=np.int64))
    dist[frontier] = 0
    order = np.argsort(src, kind="stable")
    s_sorted, d_sorted = src[order], dst[order]
    ptr = np.searchsorted(s_sorted, np.arange(n + 1))
    level = 0
    while frontier.size:
        level += 1
        lo, hi = ptr[frontier], ptr[frontier + 1]
        cnt = hi - lo
        if cnt.sum() == 0:
            break
        idx = np.repeat(lo - np.cumsum(cnt) + cnt, cnt) + np.arange(cnt.sum())
        nxt = np.unique(d_sorted[idx])
        nxt = nxt[dist[nxt] < 0]
        dist[nxt] = level
        frontier = nxt
    return dist


def _live(n: int, src: np.ndarray, dst: np.ndarray, seeds: np.ndarray) -> np.ndarray:
    """States reachable from ``seeds`` along edges src -> dst (bool [n])."""
    return bfs_levels(n, src, dst, seeds) >= 0


def build(tokens, regex: str, max_states: int, max_edges: int) -> dict:
    """Token-level index of ``regex`` over ``tokens`` (bytes or None per id).

    Returns states 0..S-1 (only states reachable from the start *and* from which an accepting
    state can be reached, both through real tokens), ``initial``, ``accepting`` [S], and the
    tokens grouped into classes of identical behaviour in every state: ``token_class`` [N]
    (-1: allowed nowhere) and the class edges ``src, cls, dst``. Raises ValueError with a message.
    """
    from outlines_core import Index, Vocabulary

    n_tok = len(tokens)
    by_bytes: dict[bytes, list[int]] = {}
    for i, b in enumerate(tokens):
        if b and SENTINEL not in b:
            by_bytes.setdefault(b, []).append(i)
    # every single byte as a virtual token (ids n_tok..n_tok+255): outlines-core refuses a regex
    # when some DFA state has no token out of it; with all bytes present none does, and the
    # virtual edges are dropped below (real-token reachability decides what is viable)
    for b in range(256):
        by_bytes.setdefault(bytes([b]), []).append(n_tok + b)
    sent = n_tok + 256
    by_bytes.setdefault(SENTINEL, []).append(sent)
    eos = n_tok + 257
    # outlines-core <= 0.2.14 drops a token whose walk ends one byte after a complete match
    # (regex-automata reports matches one byte late): "(ab)+" would never continue after "ab".
    # Matches of R + sentinel end only after the sentinel, which no real token contains, so no
    # walk over text ever ends in such a state; R accepts where the sentinel token leads to a
    # final state. (Also correct with a fixed outlines-core.)
    try:
        index = Index(f"(?:{regex})\\x{{10FFFF}}", Vocabulary(eos, by_bytes))
    except Exception as e:  # outlines-core raises ValueError / RuntimeError / panics
        raise ValueError(f"the DFA builder rejected the regex: {e}") from None
    trans = index.get_transitions()
    if len(trans) > max_states:
        raise ValueError(f"regex too complex: {len(trans)} DFA states (limit {max_states})")
    states = sorted(trans)
    remap = {s: k for k, s in enumerate(states)}
    finals_raw = set(index.get_final_states())
    srcs, toks, dsts = [], [], []
    acc = []
    n_edges = 0
    for s, out in trans.items():
        fin = out.get(sent)
        if fin is not None and fin in finals_raw:
            acc.append(remap[s])
        t = np.fromiter(out.keys(), dtype=np.int64, count=len(out))
        d = np.fromiter((remap.get(x, -1) for x in out.values()), dtype=np.int64, count=len(out))
        keep = (t < n_tok) & (d >= 0)
        t, d = t[keep], d[keep]
        n_edges += t.size
        if n_edges > max_edges:
            raise ValueError(f"regex too complex: more than {max_edges} token transitions (limit)")
        srcs.append(np.full(t.size, remap[s], dtype=np.int64))
        toks.append(t)
        dsts.append(d)
    del trans
    S = len(states)
    src = np.concatenate(srcs) if srcs else np.zeros(0, np.int64)
    tok = np.concatenate(toks) if toks else np.zeros(0, np.int64)
    dst = np.concatenate(dsts) if dsts else np.zeros(0, np.int64)
    init = remap[index.get_initial_state()]
    finals = np.array(sorted(acc), dtype=np.int64)
    fwd = _live(S, src, dst, np.array([init]))
    bwd = _live(S, dst, src, finals) if finals.size else np.zeros(S, dtype=bool)
    live = fwd & bwd
    if not live[init]:
        raise ValueError("no output matching the constraint can be written with this tokenizer's vocabulary")
    keep = live[src] & live[dst]
    src, tok, dst = src[keep], tok[keep], dst[keep]
    new_id = np.cumsum(live) - 1
    src, dst = new_id[src], new_id[dst]
    S = int(live.sum())
    accepting = np.zeros(S, dtype=bool)
    accepting[new_id[finals[live[finals]]]] = True
    # token classes: tokens with the same (state -> next state) map everywhere are interchangeable
    order = np.lexsort((src, tok))
    src, tok, dst = src[order], tok[order], dst[order]
    pairs = np.stack([src, dst], axis=1).astype(np.int32)
    bounds = np.flatnonzero(np.diff(tok)) + 1
    starts = np.concatenate([[0], bounds]) if tok.size else np.zeros(0, np.int64)
    ends = np.concatenate([bounds, [tok.size]]) if tok.size else np.zeros(0, np.int64)
    token_class = np.full(n_tok, -1, dtype=np.int32)
    sig_to_class: dict[bytes, int] = {}
    rep_ranges: list[tuple[int, int]] = []
    for a, b in zip(starts.tolist(), ends.tolist()):
        sig = pairs[a:b].tobytes()
        c = sig_to_class.get(sig)
        if c is None:
            c = sig_to_class[sig] = len(rep_ranges)
            rep_ranges.append((a, b))
        token_class[tok[a]] = c
    if rep_ranges:
        e_idx = np.concatenate([np.arange(a, b) for a, b in rep_ranges])
        e_cls = np.concatenate([np.full(b - a, c, dtype=np.int64) for c, (a, b) in enumerate(rep_ranges)])
    else:
        e_idx = np.zeros(0, np.int64)
        e_cls = np.zeros(0, np.int64)
    c_src, c_dst = src[e_idx], dst[e_idx]
    order = np.lexsort((e_cls, c_src))
    return {
        "n_states": S, "initial": int(new_id[init]), "accepting": accepting,
        "token_class": token_class, "n_classes": len(rep_ranges),
        "src": c_src[order].astype(np.int32), "cls": e_cls[order].astype(np.int32),
        "dst": c_dst[order].astype(np.int32), "token_edges": int(tok.size),
    }


# ------------------------------------------------------------------------------------ worker
def _read_exact(f, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = f.read(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return buf


def _send(f, obj) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    f.write(struct.pack("<Q", len(data)) + data)
    f.flush()


def _vm_bytes() -> int:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _set_memory_limit(budget: int) -> None:
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX
        return
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if budget > 0:
        want = _vm_bytes() + budget
        if hard != resource.RLIM_INFINITY:
            want = min(want, hard)
    else:
        want = hard
    try:
        resource.setrlimit(resource.RLIMIT_AS, (want, hard))
    except (ValueError, OSError):
        pass


def main() -> None:
    import outlines_core  # noqa: F401  - imported before the memory limit is set

    # frames go to the original stdout; anything native code prints goes to stderr instead
    proto = os.dup(1)
    os.dup2(2, 1)
    fin, fout = sys.stdin.buffer, os.fdopen(proto, "wb")
    vocabs: dict[str, list] = {}
    while True:
        try:
            (n,) = struct.unpack("<Q", _read_exact(fin, 8))
            msg = pickle.loads(_read_exact(fin, n))
        except EOFError:
            return
        if msg[0] == "vocab":
            _set_memory_limit(0)
            vocabs.clear()  # one table at a time keeps the worker small
            vocabs[msg[1]] = msg[2]
            _send(fout, ("ok", None))
        elif msg[0] == "build":
            _, key, regex, limits = msg
            if key not in vocabs:
                _send(fout, ("need_vocab", None))
                continue
            _set_memory_limit(int(limits["memory_bytes"]))
            out = None
            try:
                res = build(vocabs[key], regex, int(limits["max_states"]), int(limits["max_edges"]))
                out = ("ok", res)
            except MemoryError:
                out = ("error", "regex too complex: the DFA build ran out of its memory budget")
            except ValueError as e:
                out = ("error", str(e))
            res = None
            _set_memory_limit(0)
            _send(fout, out)


if __name__ == "__main__":
    main()
