"""Constrained decoding for masked diffusion LMs: regex, JSON schema, JSON object and choices.

Generation is semi-autoregressive: blocks are committed left to right, so the automaton state at
the start of the current block is known. Inside the block, at every denoising step, a dynamic
program over (position, DFA state) finds the highest-scoring assignment of the whole block, in
which each still-masked position may take any allowed token and each unmasked one keeps its
token, such that the text stays a prefix of a matching output that still fits in the positions
left (the DINGO construction, NeurIPS 2025). Unmasking only tokens of that path keeps the
invariant "some completion exists", so every finished output fully matches.

API (pure logic and torch on logits; no engine / scheduler / server imports)::

    from bicache_sgl.constrained import compile_constraint, constrained_decide, NoCompletion

    c = compile_constraint("regex", r"[A-Z]{3}", tokenizer, end_ids=eos_ids)   # cached
    #   kinds: "regex" (str), "json_schema" (dict | JSON str | bool), "json_object" (spec unused),
    #          "choices" (list[str]); "ebnf" raises ConstraintError (not supported)
    st = c.start(max_new_tokens)           # ConstraintState(state, remaining); c.feasible(st)
    # each denoising step of the current block (block_tokens [L], masked [L] bool,
    # scores [n_masked, V] e.g. log-probs, Gumbel-perturbed to sample):
    path = c.block_path(st, block_tokens, masked, scores)   # [n_masked] token ids, or NoCompletion
    #   ... unmask only positions whose token is the path's (constrained_decide does it all:
    #   a drop-in for bicache_sgl.decoding.decide that returns the path as x0)
    st = c.advance(st, block_tokens)       # after the block is committed
    c.can_end(st); c.is_accepting(st); c.ended(st); c.matches(output_ids)

Errors: :class:`ConstraintError` (invalid / unsupported / too complex: a 400, with the regex
parser's message, the JSON-schema keyword, or the limit), :class:`NoCompletion` (no matching
output fits in the remaining positions: finish the request with a reason saying so).

Compilation (regex -> DFA -> token index over the tokenizer's vocabulary) uses outlines-core in
a worker process with time and memory limits (:class:`Limits`); results, failures included, are
cached per (constraint, tokenizer, end ids, limits). See docs/structured.md.
"""

from __future__ import annotations

import json
import sys
import threading
from collections import OrderedDict
from typing import Any

import torch

from . import index
from .constraint import Constraint, ConstraintState
from .errors import ConstraintError, NoCompletion
from .index import Limits, build_index, cache_info, shutdown_worker
from .json_schema import check_schema_size, json_object_regex, schema_to_regex
from .regex import choices_regex, escape, prepare_regex
from .vocab import TokenTable, token_table

__all__ = [
    "KINDS",
    "Constraint",
    "ConstraintError",
    "ConstraintState",
    "Limits",
    "NoCompletion",
    "TokenTable",
    "cache_info",
    "choices_regex",
    "compile_constraint",
    "constrained_decide",
    "constraint_regex",
    "escape",
    "schema_to_regex",
    "shutdown_worker",
    "token_table",
]

KINDS = ("regex", "json_schema", "json_object", "choices")

_CACHE: OrderedDict[tuple, Constraint | ConstraintError] = OrderedDict()
_LOCK = threading.Lock()
CACHE_SIZE = index.CACHE_SIZE  # entries (BICACHE_SGL_CONSTRAINT_CACHE_ENTRIES, docs/reliability.md)
CACHE_EDGES = index.CACHE_EDGES  # class edges held by cached constraints, together (..._CACHE_EDGES)


def constraint_regex(kind: str, spec: Any) -> str:
    """The regex a constraint stands for (before validation)."""
    if kind == "regex":
        if not isinstance(spec, str):
            raise ConstraintError(f"regex must be a string, got {type(spec).__name__}")
        return spec
    if kind == "json_schema":
        return schema_to_regex(spec)
    if kind == "json_object":
        return json_object_regex()
    if kind == "choices":
        return choices_regex(spec)
    if kind == "ebnf":
        raise ConstraintError("ebnf grammars are not supported (use regex or json_schema)")
    raise ConstraintError(f"unknown constraint kind {kind!r} (expected one of {', '.join(KINDS)})")


def _spec_key(kind: str, spec: Any) -> str:
    if kind == "json_object":
        return ""
    try:
        return json.dumps(spec, ensure_ascii=False)  # property order matters: not sorted
    except (TypeError, ValueError):
        return repr(spec)


def compile_constraint(kind: str, spec: Any, tokenizer, *, end_ids=None, limits: Limits | None = None) -> Constraint:
    """Compile (or fetch from the cache) a constraint for ``tokenizer``.

    ``end_ids``: the ids that end the output (the model's EOS ids, plus stop_token_ids): they are
    allowed only in accepting states. Default: the tokenizer's eos_token_id. Pass ``()`` when the
    request ignores EOS (every position is then text and the match must end exactly at the last
    output position). Blocks the caller while building (a thread pool is the place for it in a
    server): cached builds take microseconds, fresh ones milliseconds to seconds, bounded by
    ``limits``.
    """
    limits = limits or Limits()
    table = token_table(tokenizer)
    if end_ids is None:
        eos = getattr(tokenizer, "eos_token_id", None)
        end_ids = () if eos is None else (int(eos),)
    ends = tuple(sorted({int(i) for i in end_ids}))
    key = (kind, _spec_key(kind, spec), table.fingerprint, ends, limits)
    with _LOCK:
        hit = _CACHE.get(key)
        if hit is not None:
            _CACHE.move_to_end(key)
            if isinstance(hit, ConstraintError):  # refused before: refused again at once
                raise ConstraintError(str(hit))
            return hit
    try:
        if kind == "json_schema":
            check_schema_size(spec, max_nodes=limits.max_schema_nodes, max_properties=limits.max_schema_properties)
        regex = prepare_regex(constraint_regex(kind, spec), max_positions=limits.max_regex_positions,
                              max_states=limits.max_states)
    except RecursionError:  # a schema or regex nested past what the parsers recurse through
        err = ConstraintError(f"{kind} too large: it nests more deeply than the server's parsers allow "
                              f"(Python recursion limit {sys.getrecursionlimit()}); flatten it")
        _remember(key, err)
        raise err from None
    except ConstraintError as e:  # refused up front (no build worker was used): remembered
        _remember(key, e)
        raise
    try:
        c = Constraint(kind, regex, build_index(regex, table, limits), ends)
    except RecursionError:
        raise ConstraintError(f"{kind} too large: it nests more deeply than the server's parsers allow "
                              f"(Python recursion limit {sys.getrecursionlimit()}); flatten it") from None
    _remember(key, c)
    return c


def _remember(key: tuple, value: Constraint | ConstraintError) -> None:
    """Cache a compiled constraint or an up-front refusal (LRU, bounded by CACHE_SIZE entries and
    CACHE_EDGES class edges; refusals hold no edges)."""
    with _LOCK:
        _CACHE[key] = value
        while len(_CACHE) > CACHE_SIZE or (len(_CACHE) > 1 and sum(
                x.n_edges for x in _CACHE.values() if isinstance(x, Constraint)) > CACHE_EDGES):
            _CACHE.popitem(last=False)


def constrained_decide(c: Constraint, st: ConstraintState, block_tokens: torch.Tensor, masked: torch.Tensor,
                       logits: torch.Tensor, *, temperature: float, top_k: int, top_p: float, remasking: str,
                       generator: torch.Generator | None, min_p: float = 0.0,
                       conditional: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`bicache_sgl.decoding.decide` under a constraint: for the masked positions' logits
    [n, V] (block order) -> (tokens [n], confidence [n] fp64, logprob [n] fp32), where the tokens
    are the constrained path (so every position agrees with it and ``select_transfer`` may unmask
    any of them). Sampling (temperature > 0) perturbs the tempered log-probabilities with Gumbel
    noise before the DP. Raises :class:`NoCompletion`.

    Confidence (``low_confidence``): with ``conditional`` (the default) the path token's
    probability given the constraint, p(token) / p(tokens the automaton allows there, in the
    state the path reaches before that position), so a position the constraint forces (a JSON
    key, a brace) is certain and passes a threshold at once; otherwise the model's own p(token).
    The logprob is always the model's own."""
    from ..decoding import filter_logits

    logits = filter_logits(logits, top_k, top_p, min_p)
    logp = torch.log_softmax(logits.to(torch.float64), dim=-1)
    if temperature > 0:
        u = torch.rand(logp.shape, dtype=torch.float64, generator=generator, device=logp.device)
        scores = torch.log_softmax(logits.to(torch.float64) / temperature, dim=-1) - torch.log(-torch.log(u))
    else:
        scores = logp
    x0 = c.block_path(st, block_tokens, masked, scores).to(logits.device)
    chosen = logp.gather(-1, x0[:, None])[:, 0]
    if remasking == "low_confidence":
        conf = chosen.exp()
        if conditional:
            filled = torch.as_tensor(block_tokens).clone().cpu()
            filled[torch.as_tensor(masked).bool().cpu()] = x0.cpu()
            mass = c.allowed_mass(st, filled, masked, logp.exp())
            conf = torch.where(mass > 0, conf / mass.clamp_min(1e-300), conf).clamp(max=1.0)
    elif remasking == "random":
        conf = torch.rand(x0.shape, dtype=torch.float64, generator=generator, device=logits.device)
    else:
        raise ValueError(f"unknown remasking {remasking!r}")
    return x0, conf, chosen.float()
