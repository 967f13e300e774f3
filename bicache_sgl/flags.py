"""Command-line flags built from the configuration dataclasses (bicache_sgl/config.py,
bicache_sgl/server/args.py): each setting is declared once, as a dataclass field whose metadata
carries its help text, and every CLI that exposes it (the server, ``python -m bicache_sgl``, the
benchmarks) gets the same flag, default and validation from here.

A field declared with :func:`option` becomes ``--field-name`` (dest ``field_name``); a field whose
default is a dataclass (``EngineConfig.decode``) is flattened: its fields are flags of their own.
Stdlib only (no project imports), so every layer may use it.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any

_MISSING: Any = dataclasses.MISSING


def option(default: Any = _MISSING, help: str = "", *, default_factory: Any = _MISSING,
           flags: tuple[str, ...] = (), parse: Callable[[str], Any] | None = None,
           choices: Iterable[Any] | None = None, cli: bool = True, metavar: str | None = None) -> Any:
    """A dataclass field with its CLI description. ``flags``: the option strings (default
    ``--name-with-dashes``); ``parse``: str -> value (a ValueError becomes argparse's error with
    its message); ``cli=False``: not a flag (derived or internal)."""
    if not help:
        raise ValueError("option: every setting needs a help string")
    meta = {"help": help, "flags": tuple(flags), "parse": parse,
            "choices": tuple(choices) if choices is not None else None, "cli": cli, "metavar": metavar}
    if default_factory is not _MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def flag_fields(cls: type, *, only: Iterable[str] | None = None,
                skip: Iterable[str] = ()) -> list[dataclasses.Field]:
    """The fields of ``cls`` that are flags, nested dataclass fields flattened (depth first)."""
    keep = set(only) if only is not None else None
    out: list[dataclasses.Field] = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip or not f.metadata.get("cli", True):
            continue
        sub = hints[f.name]
        if dataclasses.is_dataclass(sub):
            out.extend(flag_fields(sub, only=only, skip=skip))
        elif keep is None or f.name in keep:
            out.append(f)
    return out


def _scalar_type(hint: Any) -> Any:
    """``int | None`` -> int; ``str`` -> str."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


def _argparse_type(parse: Callable[[str], Any], name: str) -> Callable[[str], Any]:
    def convert(value: str) -> Any:
        try:
            return parse(value)
        except ValueError as e:  # argparse would print only "invalid <name> value"
            raise argparse.ArgumentTypeError(str(e)) from None
    convert.__name__ = name
    return convert


def _default_of(f: dataclasses.Field) -> Any:
    if f.default is not _MISSING:
        return f.default
    if f.default_factory is not _MISSING:
        return f.default_factory()
    raise TypeError(f"field {f.name} has no default; a flag needs one")


def add_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type, *,
              only: Iterable[str] | None = None, skip: Iterable[str] = (),
              defaults: Mapping[str, Any] | None = None, helps: Mapping[str, str] | None = None,
              rename: Mapping[str, str] | None = None) -> None:
    """Add a flag for each field of ``cls`` (see :func:`flag_fields`). ``defaults`` / ``helps``:
    per-field replacements for a CLI whose default differs (a benchmark's ``--prefix-cache off``)
    or whose help names what the config layer cannot import (the attention registry). ``rename``:
    field -> flag name (and dest) for a CLI where the field's own name means something else (the
    calibrate CLI's ``--threshold`` is its K/V cosine, the decoding threshold is
    ``--decode-threshold``)."""
    defaults, helps, rename = defaults or {}, helps or {}, rename or {}
    hints: dict[str, Any] = {}
    for klass in _dataclasses_in(cls):
        hints.update(typing.get_type_hints(klass))
    for f in flag_fields(cls, only=only, skip=skip):
        m = f.metadata
        default = defaults.get(f.name, _default_of(f))
        dest = rename.get(f.name, f.name)
        kw: dict[str, Any] = {"dest": dest, "default": default}
        text = helps.get(f.name, m.get("help") or "")
        typ = _scalar_type(hints[f.name])
        if typ is bool:
            if default is not False:
                raise TypeError(f"{cls.__name__}.{f.name}: a boolean flag must default to False")
            kw["action"] = "store_true"
        else:
            if m.get("parse") is not None:
                kw["type"] = _argparse_type(m["parse"], f.name)
            elif typ in (int, float):
                kw["type"] = typ
            if m.get("choices") is not None:
                kw["choices"] = m["choices"]
            if m.get("metavar"):
                kw["metavar"] = m["metavar"]
            if default is not None and not any(w in text.lower() for w in ("default:", "(default", "default ")):
                text = f"{text} (default: %(default)s)"
        kw["help"] = text.replace("%", "%%").replace("%%(default)s", "%(default)s")
        if f.name in rename:
            names: tuple[str, ...] = ("--" + dest.replace("_", "-"),)
        else:
            names = m.get("flags") or ("--" + f.name.replace("_", "-"),)
        parser.add_argument(*names, **kw)


def _dataclasses_in(cls: type) -> list[type]:
    """``cls`` and the dataclasses nested in its fields."""
    out = [cls]
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out.extend(_dataclasses_in(hints[f.name]))
    return out


def flag_values(ns: argparse.Namespace, cls: type, **given: Any) -> dict[str, Any]:
    """Keyword arguments for ``cls`` from parsed flags: each field with a flag in ``ns`` (nested
    dataclass fields rebuilt from their flat flags), ``given`` winning; fields without a flag keep
    their defaults."""
    hints = typing.get_type_hints(cls)
    kw: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in given:
            kw[f.name] = given[f.name]
        elif dataclasses.is_dataclass(hints[f.name]):
            kw[f.name] = hints[f.name](**flag_values(ns, hints[f.name], **given))
        elif f.metadata.get("cli", True) and hasattr(ns, f.name):
            kw[f.name] = getattr(ns, f.name)
    return kw
