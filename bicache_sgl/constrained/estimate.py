"""How many states a regex's DFA will have, estimated in the server process before any build.

A DFA can be exponentially larger than its regex: ``(a|b)*a(a|b){20}`` must remember the last 21
characters (2^21 states). outlines-core builds such a DFA in full before the index can refuse it
(``max_states``), which took 3 s for 2^18 states and 30 s for 2^21 on the reference machine, on a
build worker that no other constraint could use meanwhile. This module finds those up front.

How: a Glushkov automaton (one position per character atom, counted repeats unrolled) over the
character classes the pattern distinguishes, determinized by subset construction with a budget
(:data:`EXACT_BUDGET` states; the whole estimate, probes included, stops after
:data:`WORK_BUDGET` steps or :data:`MAX_POSITIONS` positions: under a second of Python on a
loaded machine, usually milliseconds, and "unknown" past that). A pattern whose DFA fits the budget
is measured exactly (up to the byte-level details of the real builder). One that does not is
probed for exponential growth: each counted repeat ``{n}`` with ``n`` over :data:`PROBE_FROM` (the
first eight) is
cut to ``k`` = 6..9 (the others to at most 9), and when the state count multiplies by at least
:data:`EXPONENTIAL_RATIO` per step, the count at the real ``n`` is extrapolated from it. What
neither finds (a large DFA without a counted repeat behind it) is left to the build's own limits.

The estimate works on Python's parse of the pattern (``re._parser``) as validated by
:func:`bicache_sgl.constrained.regex.prepare_regex`; ``\\d \\w \\s`` are read as their ASCII
sets (as the builder sees them, ``regex.to_rust``), case-insensitivity is ignored (an estimate).
"""

from __future__ import annotations

import itertools
import re
import warnings

try:  # Python >= 3.11
    import re._constants as _c
    import re._parser as _p
except ImportError:  # pragma: no cover - Python 3.10
    import sre_constants as _c  # type: ignore[no-redef]
    import sre_parse as _p  # type: ignore[no-redef]

__all__ = ["EXACT_BUDGET", "EXPONENTIAL_RATIO", "MAX_POSITIONS", "PROBE_FROM", "WORK_BUDGET", "dfa_states",
           "dfa_states_of"]


class _OverBudget(Exception):
    """The count would cost more than WORK_BUDGET steps: the estimate gives up (unknown)."""

EXACT_BUDGET = 4096  # DFA states counted exactly before switching to the growth probe
WORK_BUDGET = 1_000_000  # follow edges and subset steps of one whole estimate, probes included (<~1 s)
MAX_POSITIONS = 20_000  # character atoms after unrolling; more: unknown (the bitsets get too wide)
PROBE_FROM = 9  # counted repeats above this are probed at 6, 7, 8, 9
EXPONENTIAL_RATIO = 1.5  # states x this (or more) per extra repetition: exponential growth
_PROBE_KS = (6, 7, 8, 9)
_MAX_CP = 0x10FFFF

_ASCII = {
    "CATEGORY_DIGIT": [(48, 57)],
    "CATEGORY_WORD": [(48, 57), (65, 90), (95, 95), (97, 122)],
    "CATEGORY_SPACE": [(9, 13), (32, 32)],
}


def _complement(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out, lo = [], 0
    for a, b in sorted(ranges):
        if a > lo:
            out.append((lo, a - 1))
        lo = max(lo, b + 1)
    if lo <= _MAX_CP:
        out.append((lo, _MAX_CP))
    return out


def _category(name: str) -> list[tuple[int, int]]:
    if name.startswith("CATEGORY_NOT_"):
        return _complement(_ASCII.get("CATEGORY_" + name[len("CATEGORY_NOT_"):], []))
    return _ASCII.get(name, [])


def _charset(op: str, av, dotall: bool) -> list[tuple[int, int]]:
    if op == "LITERAL":
        return [(av, av)]
    if op == "NOT_LITERAL":
        return _complement([(av, av)])
    if op == "ANY":
        return [(0, _MAX_CP)] if dotall else _complement([(10, 10)])
    # IN: a set
    ranges: list[tuple[int, int]] = []
    negate = False
    for sop, sav in av:
        sname = str(sop)
        if sname == "NEGATE":
            negate = True
        elif sname == "LITERAL":
            ranges.append((sav, sav))
        elif sname == "RANGE":
            ranges.append(tuple(sav))
        elif sname == "CATEGORY":
            ranges += _category(str(sav))
    return _complement(ranges) if negate else ranges


class _Glushkov:
    """Positions (one per character atom), their character sets and follow sets."""

    def __init__(self, dotall: bool, clip: dict[int, int], work: int) -> None:
        self.dotall = dotall
        self.clip = clip  # id of a counted repeat's node -> the count to use instead of its own
        self.sets: list[list[tuple[int, int]]] = []
        self.follow: list[set[int]] = []
        self.work = work  # steps already spent by this estimate

    def _link(self, last: set[int], first: set[int]) -> None:
        self.work += len(last) * len(first)
        if self.work > WORK_BUDGET:  # quadratic follow sets (long chains of optional parts)
            raise _OverBudget
        for p in last:
            self.follow[p] |= first

    def _new(self, ranges: list[tuple[int, int]]) -> int:
        if len(self.sets) >= MAX_POSITIONS:
            raise _OverBudget
        self.sets.append(ranges)
        self.follow.append(set())
        return len(self.sets) - 1

    def _then(self, acc: tuple[bool, set[int], set[int]], part: tuple[bool, set[int], set[int]]
              ) -> tuple[bool, set[int], set[int]]:
        """(nullable, first, last) of ``acc`` followed by ``part``, adding the follow edges from
        acc's last positions to part's first ones (``acc``'s first set is extended in place)."""
        nullable, first, last = acc
        n2, f2, l2 = part
        self._link(last, f2)
        if nullable:
            first |= f2
        return nullable and n2, first, (last | l2) if n2 else set(l2)

    def seq(self, items) -> tuple[bool, set[int], set[int]]:
        """(nullable, first, last) of a sequence, adding its follow edges."""
        acc: tuple[bool, set[int], set[int]] = (True, set(), set())
        for op, av in items:
            acc = self._then(acc, self.node(op, av))
        return acc

    def node(self, op, av) -> tuple[bool, set[int], set[int]]:
        name = str(op)
        if name in ("LITERAL", "NOT_LITERAL", "ANY", "IN"):
            p = self._new(_charset(name, av, self.dotall))
            return False, {p}, {p}
        if name == "SUBPATTERN":
            return self.seq(av[-1])
        if name == "BRANCH":
            nullable, first, last = False, set(), set()
            for alt in av[1]:
                n2, f2, l2 = self.seq(alt)
                nullable, first, last = nullable or n2, first | f2, last | l2
            return nullable, first, last
        if name in ("MAX_REPEAT", "MIN_REPEAT"):
            lo, hi, sub = av
            unbounded = hi == _c.MAXREPEAT
            if not unbounded and id(av) in self.clip:
                k = self.clip[id(av)]
                lo, hi = min(lo, k), min(hi, k)
            # X{lo,hi} = lo copies then hi - lo optional ones (X?X? accepts what (X(X)?)? does);
            # X{lo,} = max(lo, 1) copies, the last looping on itself (optional when lo == 0)
            copies = max(lo, 1) if unbounded else hi
            acc: tuple[bool, set[int], set[int]] = (True, set(), set())
            for i in range(copies):
                n2, f2, l2 = self.seq(sub)
                if unbounded and i == copies - 1:
                    self._link(l2, f2)
                acc = self._then(acc, (n2 or i >= lo, f2, l2))
            return acc
        return True, set(), set()  # AT and the like: no character


def _count(items, dotall: bool, clip: dict[int, int], budget: int, spent: list[int]) -> int:
    """DFA states (the start state included) by subset construction; budget + 1 when over.
    ``spent[0]``: the estimate's steps so far (shared by its counts; raises _OverBudget past
    WORK_BUDGET)."""
    g = _Glushkov(dotall, clip, spent[0])
    _, first, _ = g.seq(items)
    # the character classes: the intervals between every boundary of every position's set
    cuts = {0, _MAX_CP + 1}
    for ranges in g.sets:
        for a, b in ranges:
            cuts.add(a)
            cuts.add(b + 1)
    bounds = sorted(cuts)
    index = {b: i for i, b in enumerate(bounds)}
    classes_of: list[list[int]] = []
    work = g.work
    for ranges in g.sets:
        cls: list[int] = []
        for a, b in ranges:
            cls.extend(range(index[a], index[b + 1]))
        work += len(cls)
        if work > WORK_BUDGET:
            raise _OverBudget
        classes_of.append(cls)
    follow_mask = [sum(1 << q for q in f) for f in g.follow]
    start = sum(1 << p for p in first)
    seen = {start}
    todo = [start]
    while todo:
        state = todo.pop()
        nxt: dict[int, int] = {}
        s = state
        while s:
            low = s & -s
            p = low.bit_length() - 1
            s ^= low
            work += 1 + len(classes_of[p])
            if work > WORK_BUDGET:
                raise _OverBudget
            fm = follow_mask[p]
            for c in classes_of[p]:
                nxt[c] = nxt.get(c, 0) | fm
        for target in set(nxt.values()):
            if target and target not in seen:
                seen.add(target)
                if len(seen) > budget:
                    spent[0] = work
                    return budget + 1
                todo.append(target)
    spent[0] = work
    return len(seen)


def _counted(items, out: list) -> None:
    """Every counted repeat node's ``av`` (lo, hi, sub) with a finite bound over PROBE_FROM."""
    for op, av in items:
        name = str(op)
        if name in ("MAX_REPEAT", "MIN_REPEAT"):
            if av[1] != _c.MAXREPEAT and max(av[0], av[1]) > PROBE_FROM:
                out.append(av)
            _counted(av[2], out)
        elif name == "SUBPATTERN":
            _counted(av[-1], out)
        elif name == "BRANCH":
            for alt in av[1]:
                _counted(alt, out)


def dfa_states(pattern: str) -> tuple[int, bool]:
    """:func:`dfa_states_of` for a pattern string (parsed here)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        parsed = _p.parse(pattern)
    flags = getattr(getattr(parsed, "state", None), "flags", 0)
    return dfa_states_of(list(parsed), bool(flags & re.DOTALL))


def dfa_states_of(items: list, dotall: bool) -> tuple[int, bool]:
    """``(states, exact)`` for a parsed pattern (``re._parser`` items): the DFA's state count
    when it fits :data:`EXACT_BUDGET` (exact), else an exponential extrapolation from the probes
    (not exact), else ``(EXACT_BUDGET + 1, False)``: more than the budget, or more work than
    :data:`WORK_BUDGET` to tell, growth unknown."""
    spent = [0]
    try:
        n = _count(items, dotall, {}, EXACT_BUDGET, spent)
        if n <= EXACT_BUDGET:
            return n, True
    except _OverBudget:
        pass
    except RecursionError:
        return EXACT_BUDGET + 1, False
    try:
        repeats: list = []
        _counted(items, repeats)
        best = 0.0
        for target in repeats[:8]:
            others = {id(av): PROBE_FROM for av in repeats if av is not target}
            counts = []
            for k in _PROBE_KS:
                try:
                    c = _count(items, dotall, {**others, id(target): k}, EXACT_BUDGET, spent)
                except _OverBudget:
                    break
                if c > EXACT_BUDGET:
                    break
                counts.append(c)
            if len(counts) < len(_PROBE_KS):
                continue
            ratios = [b / a for a, b in itertools.pairwise(counts)]
            if min(ratios) < EXPONENTIAL_RATIO:
                continue
            real = max(target[0], target[1])
            best = max(best, counts[-1] * ratios[-1] ** (real - _PROBE_KS[-1]))
    except (RecursionError, _OverBudget):
        return EXACT_BUDGET + 1, False
    if best > EXACT_BUDGET:
        return int(min(best, 1e18)), False
    return EXACT_BUDGET + 1, False
