"""Stateful property test: RadixTree against a trivial per-token reference model.

The reference keeps, for every cached prefix ``ids[:i+1]`` (a tuple), the slot, depth and LRU
time of token ``i``. It knows nothing about nodes or splits; the tree must agree with it after
every step. It also tracks slot conservation: every slot ever handed to the tree is, at any
time, either held by the tree or returned to the caller (once), never both.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from radix_support import depth_at, trim_candidates

from radix import RadixTree

Key = tuple[int, ...]

ids_st = st.lists(st.integers(0, 2), min_size=0, max_size=7)
depth_st = st.integers(0, 4)


def handle_end(tree: RadixTree, handle) -> tuple[Key, int]:
    """Tokens spelled by the path root -> handle, and the handle node's start offset."""
    parts = []
    node = handle
    while node is not tree._root:
        parts.append(node.key.tolist())
        node = node.parent
    parts.reverse()
    toks = tuple(t for p in parts for t in p)
    return toks, len(toks) - (len(parts[-1]) if parts else 0)


class RadixMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tree = RadixTree()
        self.ref: dict[Key, list[int]] = {}   # prefix -> [slot, depth, time]
        self.tick = 0                          # mirrors the tree's one tick per match/insert
        self.locks: Counter[Key] = Counter()   # locks taken per handle prefix
        self.handles: list[tuple[Key, object]] = []  # (prefix, handle) ever returned, len > 0
        self.dead: set[int] = set()            # indices into self.handles
        self.next_slot = 0
        self.given: set[int] = set()
        self.freed: set[int] = set()

    # ------------------------------------------------------------ helpers

    def give_back(self, arrays: list[np.ndarray]) -> list[int]:
        out: list[int] = []
        for a in arrays:
            assert a.dtype == np.int64 and a.ndim == 1 and a.size > 0
            out += a.tolist()
        assert len(out) == len(set(out)), f"slot returned twice in one call: {out}"
        for s in out:
            assert s in self.given, f"returned slot {s} was never given"
            assert s not in self.freed, f"slot {s} freed twice"
            self.freed.add(s)
        return out

    def locked_keys(self) -> set[Key]:
        out: set[Key] = set()
        for p, c in self.locks.items():
            if c > 0:
                out.update(p[:i] for i in range(1, len(p) + 1))
        return out

    def locks_below(self, p: Key) -> int:
        return sum(c for q, c in self.locks.items() if q[:len(p)] == p)

    def live_handles(self) -> list[int]:
        return [i for i in range(len(self.handles)) if i not in self.dead]

    def remember(self, p: Key, handle) -> None:
        if p:
            self.handles.append((p, handle))

    # ------------------------------------------------------------ rules

    @rule(ids=ids_st, depth=depth_st, reuse=st.lists(st.booleans(), max_size=7))
    def insert(self, ids: list[int], depth: int, reuse: list[bool]) -> None:
        vals: list[int] = []
        for i in range(len(ids)):
            key = tuple(ids[:i + 1])
            if key in self.ref and i < len(reuse) and reuse[i]:
                vals.append(self.ref[key][0])  # pass the tree's own slot back (engine style)
            else:
                vals.append(self.next_slot)
                self.given.add(self.next_slot)
                self.next_slot += 1
        self.tick += 1
        exp_taken, exp_free, prefix_len = [], [], 0
        for i, v in enumerate(vals):
            key = tuple(ids[:i + 1])
            ent = self.ref.get(key)
            if ent is None:
                self.ref[key] = [v, depth, self.tick]
                exp_taken.append(True)
                continue
            prefix_len = i + 1
            if ent[0] == v:  # cached tokens keep slot and depth (set_depth is the one upgrade)
                exp_taken.append(True)
            else:
                exp_free.append(v)
                exp_taken.append(False)
            ent[2] = self.tick
        r = self.tree.insert(ids, np.array(vals, dtype=np.int64), depth)
        assert r.prefix_len == prefix_len
        assert r.taken.dtype == bool and r.taken.tolist() == exp_taken
        got = self.give_back(r.to_free)
        assert sorted(got) == sorted(exp_free)
        assert handle_end(self.tree, r.handle)[0] == tuple(ids)
        self.remember(tuple(ids), r.handle)

    @rule(ids=ids_st)
    def match(self, ids: list[int]) -> None:
        self.tick += 1
        n = 0
        while n < len(ids) and tuple(ids[:n + 1]) in self.ref:
            n += 1
        m = self.tree.match_prefix(ids)
        assert m.length == n
        exp = [self.ref[tuple(ids[:i + 1])] for i in range(n)]
        assert m.values.dtype == np.int64 and m.values.tolist() == [e[0] for e in exp]
        # Expand segments to per-token depths and compare with the reference.
        ends = [e for e, _ in m.segments]
        assert ends == sorted(set(ends)) and (ends[-1] if ends else 0) == n
        per_tok: list[int] = []
        start = 0
        for end, d in m.segments:
            per_tok += [d] * (end - start)
            start = end
        assert per_tok == [e[1] for e in exp]
        for p in range(n + 1):
            assert depth_at(m, p) == (min(per_tok[:p]) if p else 0)
        if n == 0:
            assert m.handle is self.tree._root
        assert handle_end(self.tree, m.handle)[0] == tuple(ids[:n])
        for e in exp:
            e[2] = self.tick
        self.remember(tuple(ids[:n]), m.handle)

    @precondition(lambda self: self.live_handles())
    @rule(pick=st.integers(0, 10**6))
    def lock(self, pick: int) -> None:
        live = self.live_handles()
        p, h = self.handles[live[pick % len(live)]]
        self.tree.lock(h)
        self.locks[p] += 1

    @precondition(lambda self: self.live_handles())
    @rule(pick=st.integers(0, 10**6))
    def unlock(self, pick: int) -> None:
        live = self.live_handles()
        p, h = self.handles[live[pick % len(live)]]
        if self.locks[p] > 0:
            self.tree.unlock(h)
            self.locks[p] -= 1
        elif self.locks_below(p) == 0:
            try:
                self.tree.unlock(h)
            except RuntimeError:
                pass
            else:
                raise AssertionError("unlock of an unlocked node did not raise")
        # else: node is locked only through a descendant; unlocking it would be a caller bug.

    @precondition(lambda self: self.dead)
    @rule(pick=st.integers(0, 10**6))
    def lock_dead_handle_raises(self, pick: int) -> None:
        dead = sorted(self.dead)
        _, h = self.handles[dead[pick % len(dead)]]
        try:
            self.tree.lock(h)
        except ValueError:
            return
        raise AssertionError("locking a dead handle did not raise")

    @rule(num=st.integers(0, 12))
    def evict(self, num: int) -> None:
        locked = self.locked_keys()
        freed = self.tree.evict(num)
        got = self.give_back(freed)
        if got and num > 0:
            assert len(got) - len(freed[-1]) < num, "evicted past the target"
        if not got:
            assert num <= 0 or len(self.ref) == len(locked)
        slot_key = {v[0]: k for k, v in self.ref.items()}
        removed = {slot_key[s] for s in got}
        assert not (removed & locked), "evicted a locked token"
        max_t = max((self.ref[k][2] for k in removed), default=-1)
        for k in removed:
            del self.ref[k]
        for k in self.ref:
            assert len(k) == 1 or k[:-1] in self.ref, "reference lost prefix closure"
        if len(got) < num:
            assert len(self.ref) == len(locked), "stopped while unlocked tokens remain"
        # LRU: nothing left that could have been evicted is older than what was evicted.
        children = {k[:-1] for k in self.ref}
        for k, (_, _, t) in self.ref.items():
            if k not in children and k not in locked:
                assert t >= max_t, f"evicted t={max_t} while leaf {k} with t={t} remains"
        for i, (p, _) in enumerate(self.handles):
            if p in removed:
                self.dead.add(i)

    @precondition(lambda self: self.live_handles())
    @rule(pick=st.integers(0, 10**6), frac=st.floats(0, 1))
    def trim(self, pick: int, frac: float) -> None:
        live = self.live_handles()
        p, h = self.handles[live[pick % len(live)]]
        cur = self.ref[p][1]
        new = int(cur * frac)
        if self.locks_below(p) > 0 and new < cur:
            try:
                self.tree.set_depth(h, new)
            except RuntimeError:
                return
            raise AssertionError("trim of a locked node did not raise")
        _, start = handle_end(self.tree, h)
        self.tree.set_depth(h, new)
        for i in range(start + 1, len(p) + 1):
            self.ref[p[:i]][1] = new

    @precondition(lambda self: self.live_handles())
    @rule(pick=st.integers(0, 10**6), extra=st.integers(0, 3))
    def upgrade(self, pick: int, extra: int) -> None:
        """Raising a node's depth is allowed, locked or not."""
        live = self.live_handles()
        p, h = self.handles[live[pick % len(live)]]
        new = self.ref[p][1] + extra
        _, start = handle_end(self.tree, h)
        self.tree.set_depth(h, new)
        for i in range(start + 1, len(p) + 1):
            self.ref[p[:i]][1] = new

    @rule(floor=st.integers(0, 3), steps=st.integers(0, 12))
    def trim_pass(self, floor: int, steps: int) -> None:
        """trim_candidates: unlocked nodes deeper than the floor, coldest first, in passes."""
        from contextlib import closing
        locked = self.locked_keys()
        eligible = [n for n in self.tree.iter_nodes() if n.lock_ref == 0 and n.depth > floor]
        coldest = min(eligible, key=lambda n: (n.last_access, n.serial), default=None)
        with closing(trim_candidates(self.tree, floor)) as it:
            for k, node in enumerate(it):
                if k >= steps:
                    break
                toks, start = handle_end(self.tree, node)
                assert toks not in locked and node.depth > floor
                assert k > 0 or node is coldest, "the first candidate is not the coldest"
                new = max(floor, node.depth // 2)
                self.tree.set_depth(node, new)
                for i in range(start + 1, len(toks) + 1):
                    self.ref[toks[:i]][1] = new
            else:  # ran out: nothing unlocked is left deeper than the floor
                assert all(n.depth <= floor for n in self.tree.iter_nodes() if n.lock_ref == 0)

    @rule()
    def reset(self) -> None:
        if any(c > 0 for c in self.locks.values()):
            try:
                self.tree.reset()
            except RuntimeError:
                return
            raise AssertionError("reset with locks did not raise")
        got = self.give_back(self.tree.reset())
        assert sorted(got) == sorted(v[0] for v in self.ref.values())
        self.ref.clear()
        self.dead.update(range(len(self.handles)))

    # ------------------------------------------------------------ invariants

    @invariant()
    def agrees_with_reference(self) -> None:
        tree = self.tree
        tree.check_integrity()
        held = tree.all_values().tolist()
        assert len(held) == len(set(held)), "a slot is held twice"
        assert not (set(held) & self.freed), "a slot is both held and freed"
        assert set(held) | self.freed == self.given, "slot leaked"
        assert sorted(held) == sorted(v[0] for v in self.ref.values())
        locked = self.locked_keys()
        assert tree.total_size() == len(self.ref)
        assert tree.protected_size() == len(locked)
        assert tree.evictable_size() == len(self.ref) - len(locked)
        assert tree.total_layer_tokens() == sum(v[1] for v in self.ref.values())
        # Every node, token by token, matches the reference (slot, depth, LRU time).
        stack = [(tree._root, ())]
        seen = 0
        while stack:
            node, path = stack.pop()
            for child in node.children.values():
                cpath = path + tuple(child.key.tolist())
                for i in range(len(child.key)):
                    slot, depth, t = self.ref[cpath[:len(path) + i + 1]]
                    assert slot == int(child.value[i])
                    assert depth == child.depth
                    assert t == child.last_access
                    seen += 1
                stack.append((child, cpath))
        assert seen == len(self.ref)
        for i in self.live_handles():
            p, h = self.handles[i]
            assert h.alive and handle_end(tree, h)[0] == p, "handle moved"


RadixMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestRadixProperty = RadixMachine.TestCase
