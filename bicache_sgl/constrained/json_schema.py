"""JSON schema -> regex (the outlines approach, written for this package). One compiler over
the supported keywords, a little over 400 lines on purpose (the keywords share its recursion).

Whitespace policy (fixed): no whitespace except one optional space after ``:`` and after ``,``
(so both ``{"a":1,"b":2}`` and ``{"a": 1, "b": 2}``, json.dumps' default style, are allowed); no
newlines or indentation. Objects list their properties in schema order: required ones always,
optional ones may be left out; properties the schema does not list are never generated (the
output still validates whatever ``additionalProperties`` says).

Supported: ``type`` (string, integer, number, boolean, null, object, array, or a list of them),
``enum``, ``const``, ``properties``, ``required``, ``additionalProperties`` (a schema, for objects
without ``properties``), ``items``, ``prefixItems``, ``minItems``, ``maxItems``, ``minLength``,
``maxLength``, ``pattern`` (matched against the whole string content, anchors dropped),
``format`` (date-time, date, time, uuid), integer ``minimum`` / ``maximum`` /
``exclusiveMinimum`` / ``exclusiveMaximum`` (exact digit-range regexes), number ``minimum: 0``,
``anyOf`` / ``oneOf`` (alternation: oneOf's exclusivity is not enforced), ``allOf`` with one
subschema, local ``$ref`` (``#/$defs/...``, ``#/definitions/...``, ``#``; recursion is unrolled
to ``max_depth`` containers and then refused). Annotations (title, description, default,
examples, ``$schema``, ...) and unknown keywords are ignored. Any other JSON-schema validation
keyword raises :class:`ConstraintError` naming it.

``{}`` / ``true`` (any value) and the OpenAI ``{"type": "json_object"}`` (any object) need a
bounded nesting depth: :data:`ANY_DEPTH` containers (default 2: an object whose values may be
objects or arrays of scalars). Each level multiplies the automaton's size (about x4 states, and
the index build time with it; depth 3 over a 32k vocabulary took 12 s to index).
"""

from __future__ import annotations

import json
import math
from typing import Any

from .errors import ConstraintError
from .regex import escape

WS_ITEM = ", ?"  # between array items and object members
WS_KEY = ": ?"  # between a key and its value
STRING_CHAR = r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u(?:[0-9a-cA-Ce-fE-F][0-9a-fA-F]{3}|[dD][0-7][0-9a-fA-F]{2}))'
STRING = f'"{STRING_CHAR}*"'
INTEGER = r"-?(?:0|[1-9][0-9]*)"
NUMBER = r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
NONNEG_NUMBER = r"(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
BOOLEAN = "(?:true|false)"
NULL = "null"
ANY_DEPTH = 2
MAX_DEPTH = 8

_DATE = r"[0-9]{4}-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12][0-9]|3[01])"
_TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]+)?(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
FORMATS = {
    "date": _DATE,
    "time": _TIME,
    "date-time": f"{_DATE}T{_TIME}",
    "uuid": r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
}

ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment", "$defs",
               "definitions", "deprecated", "readOnly", "writeOnly", "$anchor", "contentEncoding",
               "contentMediaType", "discriminator"}
HANDLED = {"type", "enum", "const", "properties", "required", "additionalProperties", "items", "prefixItems",
           "minItems", "maxItems", "minLength", "maxLength", "pattern", "format", "minimum", "maximum",
           "exclusiveMinimum", "exclusiveMaximum", "anyOf", "oneOf", "allOf", "$ref"}
UNSUPPORTED = {"not", "if", "then", "else", "patternProperties", "propertyNames", "dependentRequired",
               "dependentSchemas", "dependencies", "unevaluatedProperties", "unevaluatedItems", "contains",
               "minContains", "maxContains", "uniqueItems", "minProperties", "maxProperties", "multipleOf",
               "$dynamicRef", "$recursiveRef", "additionalItems"}
TYPES = ("string", "integer", "number", "boolean", "null", "object", "array")


def _alt(parts: list[str]) -> str:
    parts = list(dict.fromkeys(parts))
    return parts[0] if len(parts) == 1 else "(?:" + "|".join(parts) + ")"


def literal(value: Any) -> str:
    """A regex for one JSON value, written compactly (what json.loads reads back as ``value``)."""
    return escape(json.dumps(value, ensure_ascii=False, separators=(",", ":")))


def _repeat(item: str, lo: int, hi: int | None) -> str:
    """``lo..hi`` comma-separated ``item`` (hi None: unbounded)."""
    if hi is not None and hi < lo:
        raise ConstraintError(f"minItems {lo} > maxItems {hi}")
    if hi == 0:
        return ""
    sep = f"(?:{WS_ITEM}{item})"
    if lo == 0:
        rest = f"{sep}*" if hi is None else (f"{sep}{{0,{hi - 1}}}" if hi > 1 else "")
        return f"(?:{item}{rest})?"
    rest = f"{sep}{{{lo - 1},}}" if hi is None else (f"{sep}{{{lo - 1},{hi - 1}}}" if hi > 1 else "")
    return f"{item}{rest}"


# ------------------------------------------------------------------------- integer ranges
def _same_len(lo: str, hi: str) -> list[str]:
    """Patterns for the digit strings of one length between lo and hi (inclusive)."""
    n = len(lo)
    if lo == hi:
        return [lo]
    if n == 1:
        return [f"[{lo}-{hi}]"]
    if lo[1:] == "0" * (n - 1) and hi[1:] == "9" * (n - 1):
        head = lo[0] if lo[0] == hi[0] else f"[{lo[0]}-{hi[0]}]"
        return [f"{head}[0-9]{{{n - 1}}}"]
    if lo[0] == hi[0]:
        return [lo[0] + p for p in _same_len(lo[1:], hi[1:])]
    parts = _same_len(lo, lo[0] + "9" * (n - 1))
    a, b = int(lo[0]) + 1, int(hi[0]) - 1
    if a <= b:
        head = str(a) if a == b else f"[{a}-{b}]"
        parts.append(f"{head}[0-9]{{{n - 1}}}")
    parts += _same_len(hi[0] + "0" * (n - 1), hi)
    return parts


def _nonneg_range(lo: int, hi: int | None) -> list[str]:
    """Patterns (no leading zeros) for lo <= x <= hi, x >= 0 (hi None: unbounded)."""
    parts: list[str] = []
    top = len(str(hi)) if hi is not None else len(str(lo))
    for d in range(len(str(lo)), top + 1):
        a = max(lo, 10 ** (d - 1) if d > 1 else 0)
        b = 10 ** d - 1 if hi is None else min(hi, 10 ** d - 1)
        if a <= b:
            parts += _same_len(str(a), str(b))
    if hi is None:
        parts.append(f"[1-9][0-9]{{{len(str(lo))},}}")
    return parts


def integer_range(lo: int | None, hi: int | None) -> str:
    """A regex for the integers in [lo, hi] (None: unbounded), JSON-style (no leading zeros)."""
    if lo is not None and hi is not None and lo > hi:
        raise ConstraintError(f"integer range is empty: minimum {lo} > maximum {hi}")
    parts: list[str] = []
    if hi is None or hi >= 0:  # the non-negative part
        parts += _nonneg_range(max(lo, 0) if lo is not None else 0, hi)
    if lo is None or lo < 0:  # the negative part: -x with max(1, -hi) <= x <= -lo
        a = 1 if hi is None or hi >= 0 else -hi
        b = None if lo is None else -lo
        parts += ["-" + p for p in _nonneg_range(a, b)] if b is None or a <= b else []
    return _alt(parts)


# ---------------------------------------------------------------------------------- compiler
class _Compiler:
    def __init__(self, root: Any, any_depth: int, max_depth: int) -> None:
        self.root, self.any_depth, self.max_depth = root, any_depth, max_depth

    def any_value(self, depth: int) -> str:
        scalars = [STRING, NUMBER, BOOLEAN, NULL]
        if depth <= 0:
            return _alt(scalars)
        inner = self.any_value(depth - 1)
        return _alt(scalars + [self.any_object(depth), f"\\[{_repeat(inner, 0, None)}\\]"])

    def any_object(self, depth: int) -> str:
        inner = self.any_value(depth - 1)
        return f"\\{{{_repeat(STRING + WS_KEY + inner, 0, None)}\\}}"

    def resolve(self, ref: str) -> Any:
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise ConstraintError(f"unsupported keyword '$ref': only local references (#/...) are supported, "
                                  f"got {ref!r}")
        node = self.root
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                raise ConstraintError(f"invalid JSON schema: $ref {ref!r} does not resolve")
        return node

    def compile(self, s: Any, depth: int) -> str:
        if depth > self.max_depth:
            raise ConstraintError(f"JSON schema nests deeper than {self.max_depth} levels "
                                  "(a recursive $ref?); not supported")
        if s is True:
            return self.any_value(self.any_depth)
        if s is False:
            raise ConstraintError("JSON schema 'false' admits no value")
        if not isinstance(s, dict):
            raise ConstraintError(f"invalid JSON schema: expected an object or boolean, got {type(s).__name__}")
        for k in s:
            if k in UNSUPPORTED:
                if k == "uniqueItems" and s[k] is False:
                    continue
                raise ConstraintError(f"unsupported JSON-schema keyword '{k}'")
        if "$ref" in s:
            rest = {k: v for k, v in s.items() if k != "$ref" and k not in ANNOTATIONS}
            if rest:
                raise ConstraintError(f"unsupported JSON-schema keyword '{sorted(rest)[0]}' next to '$ref'")
            return self.compile(self.resolve(s["$ref"]), depth + 1)
        if "const" in s:
            return literal(s["const"])
        if "enum" in s:
            if not isinstance(s["enum"], list) or not s["enum"]:
                raise ConstraintError("invalid JSON schema: 'enum' must be a non-empty array")
            return _alt([literal(v) for v in s["enum"]])
        for key in ("anyOf", "oneOf"):
            if key in s:
                subs = s[key]
                if not isinstance(subs, list) or not subs:
                    raise ConstraintError(f"invalid JSON schema: '{key}' must be a non-empty array")
                base = {k: v for k, v in s.items() if k != key}
                return _alt([self.compile(_merge(base, sub), depth) for sub in subs])
        if "allOf" in s:
            subs = s["allOf"]
            if not isinstance(subs, list) or len(subs) != 1:
                raise ConstraintError("unsupported JSON-schema keyword 'allOf' (only a single subschema)")
            base = {k: v for k, v in s.items() if k != "allOf"}
            return self.compile(_merge(base, subs[0]), depth)
        t = s.get("type")
        if t is None:
            if "properties" in s or "required" in s or "additionalProperties" in s:
                t = "object"
            elif "items" in s or "prefixItems" in s:
                t = "array"
            elif any(k in s for k in ("minLength", "maxLength", "pattern", "format")):
                t = "string"
            else:
                return self.any_value(self.any_depth)
        if isinstance(t, list):
            if not t:
                raise ConstraintError("invalid JSON schema: 'type' is an empty list")
            return _alt([self.compile({**s, "type": x}, depth) for x in t])
        if t not in TYPES:
            raise ConstraintError(f"invalid JSON schema: unknown type {t!r}")
        return getattr(self, "t_" + t)(s, depth)

    # ------------------------------------------------------------------------------ types
    def t_null(self, s, depth) -> str:
        return NULL

    def t_boolean(self, s, depth) -> str:
        return BOOLEAN

    def t_string(self, s, depth) -> str:
        lo = _nonneg_int(s, "minLength", 0)
        hi = _nonneg_int(s, "maxLength", None)
        if hi is not None and hi < lo:
            raise ConstraintError(f"invalid JSON schema: minLength {lo} > maxLength {hi}")
        if "format" in s:
            fmt = s["format"]
            if fmt not in FORMATS:
                raise ConstraintError(f"unsupported JSON-schema keyword 'format' value {fmt!r} "
                                      f"(supported: {', '.join(sorted(FORMATS))})")
            if "pattern" in s or "minLength" in s or "maxLength" in s:
                raise ConstraintError("unsupported JSON-schema keyword 'format' together with "
                                      "'pattern'/'minLength'/'maxLength'")
            return f'"{FORMATS[fmt]}"'
        if "pattern" in s:
            pat = s["pattern"]
            if not isinstance(pat, str):
                raise ConstraintError("invalid JSON schema: 'pattern' must be a string")
            if "minLength" in s or "maxLength" in s:
                raise ConstraintError("unsupported JSON-schema keyword 'pattern' together with minLength/maxLength")
            if pat.startswith("^"):
                pat = pat[1:]
            if pat.endswith("$") and not pat.endswith("\\$"):
                pat = pat[:-1]
            return f'"(?:{pat})"'
        if hi is None:
            rep = "*" if lo == 0 else f"{{{lo},}}"
        else:
            rep = f"{{{lo},{hi}}}"
        return f'"{STRING_CHAR}{rep}"'

    def t_integer(self, s, depth) -> str:
        lo, hi = _bounds(s, integer=True)
        if lo is None and hi is None:
            return INTEGER
        return integer_range(lo, hi)

    def t_number(self, s, depth) -> str:
        for k in ("maximum", "exclusiveMaximum", "exclusiveMinimum"):
            if k in s:
                raise ConstraintError(f"unsupported JSON-schema keyword '{k}' for type number "
                                      "(only 'minimum': 0 is supported; use type integer for ranges)")
        if "minimum" in s:
            if s["minimum"] != 0 or isinstance(s["minimum"], bool):
                raise ConstraintError("unsupported JSON-schema keyword 'minimum' for type number "
                                      "(only 'minimum': 0 is supported; use type integer for ranges)")
            return NONNEG_NUMBER
        return NUMBER

    def t_array(self, s, depth) -> str:
        lo = _nonneg_int(s, "minItems", 0)
        hi = _nonneg_int(s, "maxItems", None)
        items = s.get("items", True)
        if "prefixItems" in s:
            pre = s["prefixItems"]
            if not isinstance(pre, list):
                raise ConstraintError("invalid JSON schema: 'prefixItems' must be an array")
            if items is not False or lo > len(pre) or "minItems" in s or "maxItems" in s:
                raise ConstraintError("unsupported JSON-schema keyword 'prefixItems' (only a fixed tuple: "
                                      "with items: false and no minItems/maxItems)")
            body = WS_ITEM.join(self.compile(p, depth + 1) for p in pre)
            return f"\\[{body}\\]"
        if items is False:
            if lo > 0:
                raise ConstraintError("invalid JSON schema: items false with minItems > 0")
            return "\\[\\]"
        item = self.any_value(self.any_depth - 1) if items is True else self.compile(items, depth + 1)
        return f"\\[{_repeat(item, lo, hi)}\\]"

    def t_object(self, s, depth) -> str:
        props = s.get("properties") or {}
        if not isinstance(props, dict):
            raise ConstraintError("invalid JSON schema: 'properties' must be an object")
        required = s.get("required") or []
        if not isinstance(required, list):
            raise ConstraintError("invalid JSON schema: 'required' must be an array")
        missing = [r for r in required if r not in props]
        if missing:
            extra = s.get("additionalProperties", True)
            if extra is False:
                raise ConstraintError(f"invalid JSON schema: required property {missing[0]!r} is not allowed "
                                      "(additionalProperties is false)")
            props = {**props, **{m: (extra if isinstance(extra, dict) else True) for m in missing}}
        if not props:
            extra = s.get("additionalProperties", True)
            if extra is False:
                return "\\{\\}"
            value = self.any_value(self.any_depth - 1) if extra is True else self.compile(extra, depth + 1)
            return f"\\{{{_repeat(STRING + WS_KEY + value, 0, None)}\\}}"
        members = []
        for name, sub in props.items():
            members.append((literal(name) + WS_KEY + self.compile(sub, depth + 1), name in required))
        return "\\{" + _members(members) + "\\}"


def _members(members: list[tuple[str, bool]]) -> str:
    """Properties in order: required always, optional maybe; commas only between present ones."""
    # after(i): members i.. once something has been written (each is ", m" or optional)
    def after(i: int) -> str:
        return "".join(f"{WS_ITEM}{m}" if req else f"(?:{WS_ITEM}{m})?" for m, req in members[i:])

    # first(i): members i.. when nothing has been written yet
    def first(i: int) -> str:
        if i == len(members):
            return ""
        m, req = members[i]
        if req:
            return m + after(i + 1)
        rest = first(i + 1)
        alts = [m + after(i + 1)] + ([rest] if rest else [])
        s = "(?:" + "|".join(alts) + ")"
        if not rest and not any(r for _, r in members[i + 1:]):
            s += "?"
        return s

    return first(0)


def _merge(base: dict, sub: Any) -> Any:
    """``base``'s keywords with a subschema of anyOf/oneOf/allOf (the subschema wins)."""
    if not isinstance(sub, dict):
        return sub if not base else (base if sub is True else sub)
    rest = {k: v for k, v in base.items() if k not in ANNOTATIONS}
    return {**rest, **sub} if rest else sub


def _nonneg_int(s: dict, key: str, default):
    if key not in s:
        return default
    v = s[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or v != int(v):
        raise ConstraintError(f"invalid JSON schema: '{key}' must be a non-negative integer, got {v!r}")
    return int(v)


def _bounds(s: dict, integer: bool) -> tuple[int | None, int | None]:
    lo = hi = None
    for key in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
        if key not in s:
            continue
        v = s[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ConstraintError(f"invalid JSON schema: '{key}' must be a number, got {v!r}")
        if key == "minimum":
            b = math.ceil(v)
            lo = b if lo is None else max(lo, b)
        elif key == "exclusiveMinimum":
            b = math.floor(v) + 1
            lo = b if lo is None else max(lo, b)
        elif key == "maximum":
            b = math.floor(v)
            hi = b if hi is None else min(hi, b)
        else:
            b = math.ceil(v) - 1
            hi = b if hi is None else min(hi, b)
    return lo, hi


def schema_to_regex(schema: Any, *, any_depth: int = ANY_DEPTH, max_depth: int = MAX_DEPTH) -> str:
    """A regex whose full matches are JSON texts valid under ``schema`` (a dict, a bool, or a JSON
    string). Raises :class:`ConstraintError` for invalid JSON, an invalid schema (the validator's
    message when ``jsonschema`` is installed) or an unsupported keyword (named)."""
    if isinstance(schema, (str, bytes)):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise ConstraintError(f"invalid JSON schema: not valid JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise ConstraintError(f"invalid JSON schema: expected an object, got {type(schema).__name__}")
    try:
        import jsonschema
    except ImportError:  # pragma: no cover - jsonschema is a dependency
        jsonschema = None
    if jsonschema is not None:
        try:
            jsonschema.validators.validator_for(schema).check_schema(schema)
        except jsonschema.exceptions.SchemaError as e:
            raise ConstraintError(f"invalid JSON schema: {e.message}") from None
    return _Compiler(schema, any_depth, max_depth).compile(schema, 0)


def json_object_regex(depth: int = ANY_DEPTH) -> str:
    """Any JSON object, containers nested at most ``depth`` deep (the top object counts)."""
    if depth < 1:
        raise ConstraintError("json_object depth must be >= 1")
    return _Compiler(True, depth, MAX_DEPTH).any_object(depth)


def check_schema_size(schema: Any, *, max_nodes: int, max_properties: int) -> None:
    """Refuse a schema too large to compile in reasonable time, before compiling it: more than
    ``max_nodes`` JSON values in all (subschemas, property names, enum and const values), or an
    object schema with more than ``max_properties`` properties (each optional property nests the
    member regex one level deeper: 1000 of them overran the parsers' recursion after 0.5 s, 100
    took 5.7 s to build into a 60,000-state automaton). Walks iteratively (no recursion limit).
    A malformed schema passes here and is refused by :func:`schema_to_regex` with its reason."""
    if isinstance(schema, (str, bytes)):
        try:
            schema = json.loads(schema)
        except ValueError:
            return
    count = 0
    stack = [schema]
    while stack:
        node = stack.pop()
        count += 1
        if count > max_nodes:
            raise ConstraintError(f"JSON schema too large: more than {max_nodes} values (subschemas, property names, "
                                  f"enum and const values; limit max_schema_nodes, checked before building)")
        if isinstance(node, dict):
            props = node.get("properties")
            if isinstance(props, dict) and len(props) > max_properties:
                raise ConstraintError(f"JSON schema too large: an object schema has {len(props)} properties (limit "
                                      f"{max_properties} per object, max_schema_properties, checked before building)")
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
