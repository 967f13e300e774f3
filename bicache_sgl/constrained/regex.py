"""Regex front end: validation with clear messages, anchor stripping, a cheap size bound, and
``choices`` -> an alternation of escaped literals.

The DFA itself is built by outlines-core (Rust ``regex-automata``), whose error messages for a
malformed pattern are uninformative ("error building NFA"). So every pattern is first parsed by
Python's own regex parser: syntax errors come back with its message and position, features that
no DFA can express (backreferences, lookaround, word boundaries, anchors inside the pattern) are
refused by name, and counted repetitions are multiplied out to bound the automaton's size before
any native code runs (``a{1000}{1000}`` is refused here in microseconds; blow-ups the bound
cannot see, such as ``(a|b)*a(a|b){20}``, are caught by the build's time and memory limits).

The dialect is therefore the common subset of Python ``re`` and Rust ``regex``: literals, ``.``,
classes, repeats, groups, alternation, inline flags. ``\\d \\w \\s`` are ASCII (``[0-9]``,
``[0-9A-Za-z_]``, ``[ \\t\\n\\v\\f\\r]``) and their negations exclude the Unicode classes too
(see ``to_rust``), so every output matches under Python's ``re`` in Unicode and ASCII mode alike
(the Rust crate's Unicode tables are newer than Python's: U+11BF9 is a digit to one and not the
other). A pattern is always matched in full; a leading ``^`` / ``\\A`` and a trailing ``$`` /
``\\Z`` are accepted and dropped.
"""

from __future__ import annotations

import re
import warnings

try:  # Python >= 3.11
    import re._constants as _c
    import re._parser as _p
except ImportError:  # pragma: no cover - Python 3.10
    import sre_constants as _c  # type: ignore[no-redef]
    import sre_parse as _p  # type: ignore[no-redef]

from .errors import ConstraintError
from .estimate import dfa_states_of

# the builder's DFA (regex-automata, matches reported one byte late) has about twice the states of
# the subset count the estimate makes: 2^18 + 4 against 2^17 for (c|q)*c(c|q){17}
BUILDER_STATES_PER_SUBSET = 2

# characters that are special outside a class in Python re or Rust regex
_META = set("\\.+*?()|[]{}^$")


def escape(text: str) -> str:
    """A regex matching exactly ``text`` (valid in both Python ``re`` and Rust ``regex``)."""
    out = []
    for ch in text:
        if ch in _META:
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ch == "\r":
            out.append("\\r")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return "".join(out)


def choices_regex(choices) -> str:
    """``choices`` (a non-empty list of strings) -> an alternation of escaped literals."""
    if isinstance(choices, str) or not isinstance(choices, (list, tuple)) or not choices:
        raise ConstraintError("choices must be a non-empty list of strings")
    for c in choices:
        if not isinstance(c, str):
            raise ConstraintError(f"choices must be strings, got {type(c).__name__}: {c!r}")
    uniq = list(dict.fromkeys(choices))
    return "(?:" + "|".join(escape(c) for c in uniq) + ")"


_NOT_REGULAR = {
    "GROUPREF": "backreferences",
    "GROUPREF_EXISTS": "conditional groups",
    "ASSERT": "lookahead/lookbehind assertions",
    "ASSERT_NOT": "negative lookahead/lookbehind assertions",
    "ATOMIC_GROUP": "atomic groups",
    "POSSESSIVE_REPEAT": "possessive repeats",
}


def _op(code) -> str:
    return str(code)


def _weight(items, limit: int) -> int:
    """Positions of the pattern with counted repeats multiplied out (an NFA size estimate);
    raises on non-regular features. Stops counting once past ``limit``."""
    total = 0
    for op, av in items:
        name = _op(op)
        if name in _NOT_REGULAR:
            raise ConstraintError(f"invalid regex: {_NOT_REGULAR[name]} are not supported (not regular)")
        if name == "AT":
            what = {"AT_BOUNDARY": "word boundaries (\\b)", "AT_NON_BOUNDARY": "word boundaries (\\B)"}.get(
                _op(av), "anchors (^, $, \\A, \\Z) inside the pattern")
            raise ConstraintError(f"invalid regex: {what} are not supported; the whole output must match")
        if name in ("MAX_REPEAT", "MIN_REPEAT"):
            lo, hi, sub = av
            copies = (lo + 1) if hi == _c.MAXREPEAT else max(hi, 1)
            total += copies * _weight(sub, limit)
        elif name == "SUBPATTERN":
            total += _weight(av[-1], limit)
        elif name == "BRANCH":
            total += sum(_weight(b, limit) for b in av[1])
        else:
            total += 1
        if total > limit:
            return total
    return total


# Perl classes for the Rust engine, chosen so that every output also matches under Python's re,
# in both its Unicode (default) and ASCII modes: a positive class becomes its ASCII part (a subset
# of both), a negated one the complement of both the ASCII and the Unicode class (Rust's Unicode
# tables are newer than Python's and only ever add digits and letters, so this is a subset too).
# Inside a negated set [^...] the roles swap (the set's complement must stay small).
_PERL = {
    "d": ("[0-9]", r"[0-9\p{Nd}]"),
    "w": ("[0-9A-Za-z_]", r"[\w\p{L}\p{N}]"),
    "s": (r"[\t\n\x0B\f\r ]", r"[\s\x1C-\x1F]"),
    "D": (r"[^0-9\p{Nd}]", "[^0-9]"),
    "W": (r"[^\w\p{L}\p{N}]", "[^0-9A-Za-z_]"),
    "S": (r"[^\s\x1C-\x1F]", r"[^\t\n\x0B\f\r ]"),
}


def to_rust(pattern: str) -> str:
    r"""A Python-validated pattern in the Rust crate's syntax, with the semantics above:
    ``\d \w \s`` (and negations) as explicit sets, and the characters that are literal in a
    Python set but operators in a Rust one (``[``, ``&&``, ``~~``) escaped."""
    out = []
    i, n = 0, len(pattern)
    in_set = negated = False
    first = 0  # index of the first member of the current set (a ']' there is literal)
    while i < n:
        ch = pattern[i]
        if ch == "\\" and i + 1 < n:
            e = pattern[i + 1]
            out.append(_PERL[e][1 if (in_set and negated) else 0] if e in _PERL else ch + e)
            i += 2
            continue
        if in_set:
            if ch == "]" and i > first:
                in_set = False
                out.append(ch)
            elif ch in "[]&~":  # ']' here is a literal first member
                out.append("\\" + ch)
            else:
                out.append(ch)
            i += 1
            continue
        if ch == "[":
            in_set = True
            negated = pattern.startswith("^", i + 1)
            first = i + 2 if negated else i + 1
            out.append("[^" if negated else "[")
            i = first
            continue
        out.append(ch)
        i += 1
    return "".join(out)


def prepare_regex(pattern: str, *, max_positions: int, max_states: int | None = None) -> str:
    """Validate ``pattern`` and return the form handed to the DFA builder (top-level anchors
    dropped). Raises :class:`ConstraintError` with the parser's message, or naming the limit:
    ``max_positions`` (counted repeats multiplied out) and, when given, ``max_states`` against
    the DFA size estimated up front (``estimate.py``: exponential growth found by probing the
    counted repeats), so a regex the builder would refuse after seconds is refused here at once."""
    if not isinstance(pattern, str):
        raise ConstraintError(f"regex must be a string, got {type(pattern).__name__}")
    try:
        with warnings.catch_warnings():  # FutureWarning "possible nested set" etc.: handled by to_rust
            warnings.simplefilter("ignore")
            parsed = _p.parse(pattern)
    except re.error as e:
        raise ConstraintError(f"invalid regex: {e}") from None
    except (RecursionError, OverflowError) as e:
        raise ConstraintError(f"invalid regex: {e}") from None
    flags = getattr(getattr(parsed, "state", None), "flags", 0)
    if flags & re.VERBOSE:
        raise ConstraintError("invalid regex: verbose mode (?x) is not supported")
    items = list(parsed)
    start = 0
    end = len(pattern)
    if (items and _op(items[0][0]) == "AT" and _op(items[0][1]) in ("AT_BEGINNING", "AT_BEGINNING_STRING")
            and pattern.startswith(("^", "\\A"))):
        items = items[1:]
        start = 2 if pattern.startswith("\\A") else 1
    if (items and _op(items[-1][0]) == "AT" and _op(items[-1][1]) in ("AT_END", "AT_END_STRING")
            and pattern.endswith(("$", "\\Z"))):
        items = items[:-1]
        end -= 2 if pattern.endswith("\\Z") else 1
    try:
        n = _weight(items, max_positions)
    except RecursionError:
        raise ConstraintError("regex too complex: nesting too deep") from None
    if n > max_positions:
        raise ConstraintError(f"regex too complex: counted repetitions expand to more than {max_positions} "
                              "positions")
    if max_states is not None:
        try:
            states, exact = dfa_states_of(items, bool(flags & re.DOTALL))
        except Exception:  # an estimate must never turn a valid pattern into a server error: the build decides
            states, exact = 0, True
        estimate = states if exact else states * BUILDER_STATES_PER_SUBSET
        if not exact and estimate > max_states:
            raise ConstraintError(f"regex too complex: its automaton would have about {estimate:.3g} states (limit "
                                  f"{max_states}, estimated before building: a counted repeat inside or after an "
                                  "unbounded one doubles the states with each repetition)")
    return to_rust(pattern[start:end])
