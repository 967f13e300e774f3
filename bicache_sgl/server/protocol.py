"""Parsing and validation of SGLang's native ``/generate`` request.

Everything here is pure (no engine thread, no I/O): a request body becomes a list of
:class:`Item` (one per engine request, ``n`` already expanded), each holding the typed
:class:`~bicache_sgl.io_struct.GenerateRequest` (its rid included) that is submitted as it is, or
an :class:`APIError` carrying the 4xx status and message. ``null`` always means "default". Which
fields are implemented and which are refused is decided in :mod:`bicache_sgl.server.fields`.

Only what is HTTP's is checked here: JSON shapes and types, the server's own limits (``--max-n``,
``--max-batch-size``), defaults (a budget the client left out is shortened to fit the context).
The engine's rules (vocabulary, context, K/V budget, constraint) are checked once, by the engine
client at submit (``bicache_sgl.scheduler.validate``, the offline ``Engine`` the same); its
refusal names the field (``InvalidRequest.param``) and the submission answers a 400 with it
(``server/bridge.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from bicache_sgl.config import DEFAULT_MAX_N, SamplingParams, is_int
from bicache_sgl.io_struct import GenerateRequest
from bicache_sgl.server.fields import FieldError, check_generate_body


class APIError(Exception):
    """An error answered to the client as JSON with ``status`` (always 4xx/503 for bad input)."""

    def __init__(self, message: str, status: int = 400, err_type: str | None = None, code: Any = None,
                 param: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.err_type = err_type or _DEFAULT_TYPES.get(status, "BadRequestError")
        self.code = code if code is not None else status
        self.param = param


_DEFAULT_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                  413: "RequestTooLargeError", 422: "UnprocessableEntityError", 503: "ServiceUnavailableError",
                  500: "InternalServerError", 501: "NotImplementedError"}


def parse_json_body(body: bytes, *, allow_empty: bool = False) -> Any:
    """Bytes -> JSON value; invalid UTF-8 or JSON -> APIError(400)."""
    if not body or not body.strip():
        if allow_empty:
            return None
        raise APIError("request body is empty; expected a JSON object")
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as e:
        try:
            body.decode("utf-8")
        except UnicodeDecodeError:
            raise APIError("request body is not valid UTF-8") from None
        raise APIError(f"malformed JSON: {e}") from None


def field_error(e: FieldError) -> APIError:
    """A refused or unknown request field -> 400 naming it."""
    return APIError(str(e), param=e.param)


def require_object(obj: Any) -> dict:
    if not isinstance(obj, dict):
        raise APIError("request body must be a JSON object")
    return obj


def check_token_ids(ids: Any, what: str = "input_ids") -> list[int]:
    """A JSON list of integers (the vocabulary range is the engine's rule: ``check_prompt_ids``)."""
    if not isinstance(ids, list):
        raise APIError(f"{what} must be a list of integers")
    if not ids:
        raise APIError(f"{what} is empty")
    for t in ids:
        if not is_int(t):
            raise APIError(f"{what} must contain only integers, got {t!r}")
    return ids


def check_text(t: Any, what: str = "text") -> str:
    if not isinstance(t, str):
        raise APIError(f"{what} must be a string or a list of strings, got {type(t).__name__}")
    if t == "":
        raise APIError(f"{what} is empty")
    return t


SEED_RANGE = (-(2**63), 2**64)  # what torch.Generator.manual_seed accepts


def sampling_params_from(d: Any, defaults: Mapping[str, Any] | None = None, *,
                         max_n: int = DEFAULT_MAX_N) -> tuple[SamplingParams, bool]:
    """SGLang ``sampling_params`` dict -> (SamplingParams, max_new_tokens explicitly given).

    ``defaults`` (the server's) fill keys the request leaves out or sets to null; ``max_n`` is
    the server's ``--max-n``.
    """
    if d is None:
        d = {}
    if not isinstance(d, dict):
        raise APIError("sampling_params must be a JSON object")
    merged = dict(defaults or {})
    merged.update({k: v for k, v in d.items() if v is not None})
    explicit = any(merged.get(k) is not None for k in ("max_new_tokens", "max_tokens", "gen_length"))
    for k in ("max_new_tokens", "max_tokens", "gen_length"):
        v = merged.get(k)
        if v is not None and is_int(v) and v < 0:
            raise APIError(f"max_new_tokens must be >= 0, got {v}", param="max_new_tokens")
    try:
        params = SamplingParams.from_dict(merged)
    except (ValueError, TypeError) as e:  # names the field (unknown, refused or a bad value)
        raise APIError(str(e), param="sampling_params") from None
    # checked on the parsed values: JSON integers past 64 bits, and 1e15, arrive as floats and
    # become ints only in from_dict (an unchecked n = 1e15 would expand into 1e15 requests)
    if params.n > max_n:
        raise APIError(f"n must be <= {max_n} (the server's --max-n), got {params.n}", param="n")
    if params.seed is not None and not SEED_RANGE[0] <= params.seed < SEED_RANGE[1]:
        raise APIError(f"seed must be an integer in [-2**63, 2**64), got {params.seed}", param="seed")
    return params, explicit


def engine_request(ids: list[int], params: SamplingParams, *, rid: str | None = None, **fields: Any) -> GenerateRequest:
    """The typed engine request of one parsed prompt (``rid`` None: the request mints its own);
    ``fields``: the other ``GenerateRequest`` fields, by their names (the logprob knobs,
    ``bicache_depth``), declared once there."""
    named = {} if rid is None else {"rid": rid}
    return GenerateRequest(list(ids), params, **named, **fields)


@dataclass
class Item:
    """One engine request as the HTTP layer holds it: the typed request and where its answer goes."""

    req: GenerateRequest
    prompt_index: int = 0  # which prompt of the batch
    sample_index: int = 0  # which of the n samples
    log_metrics: bool = True  # counted in /metrics and /server_info (SGLang's log_metrics)

    @property
    def input_ids(self) -> list[int]:
        return self.req.input_ids

    @property
    def params(self) -> SamplingParams:
        return self.req.params

    @property
    def rid(self) -> str:
        return self.req.rid


def _per_prompt(value: Any, n_prompts: int, name: str, batch: bool) -> list[Any]:
    """A scalar applies to every prompt; a list (batch requests only) gives one value per prompt."""
    if batch and isinstance(value, list):
        if len(value) != n_prompts:
            raise APIError(f"{name} has {len(value)} entries but the batch has {n_prompts} prompts")
        return list(value)
    return [value] * n_prompts


def _logprob_options(return_logprob: Any, start: Any, top: Any, text_in: Any) -> tuple[bool, Any, int, bool]:
    if return_logprob is None:
        return_logprob = False
    if not isinstance(return_logprob, bool):
        raise APIError(f"return_logprob must be a boolean, got {return_logprob!r}", param="return_logprob")
    if start is not None and not is_int(start):
        raise APIError(f"logprob_start_len must be an integer, got {start!r}", param="logprob_start_len")
    if top is None:
        top = 0
    if not is_int(top) or top < 0:
        raise APIError(f"top_logprobs_num must be an integer >= 0, got {top!r}", param="top_logprobs_num")
    if top > 100:
        raise APIError(f"top_logprobs_num must be <= 100, got {top}", param="top_logprobs_num")
    if text_in is None:
        text_in = False
    if not isinstance(text_in, bool):
        raise APIError(f"return_text_in_logprobs must be a boolean, got {text_in!r}")
    return return_logprob, start, top, text_in


def resolve_logprob_start(start: int | None, return_logprob: bool, max_new_tokens: int, prompt_len: int) -> int:
    """The engine's ``logprob_start_len`` for one prompt.

    ``-1`` means no input logprobs. Left out (null) on a prefill-only likelihood request
    (``max_new_tokens == 0`` with ``return_logprob``) means every position (0): SGLang's
    ``unconditional_likelihood_normalized`` choice method sends exactly that and needs them.
    """
    if start is None:
        return 0 if (return_logprob and max_new_tokens == 0) else -1
    if start < -1:
        raise APIError(f"logprob_start_len must be >= -1, got {start}", param="logprob_start_len")
    if start > prompt_len:
        raise APIError(f"logprob_start_len ({start}) is larger than the prompt ({prompt_len} tokens)",
                       param="logprob_start_len")
    return start


def fit_to_context(prompt_len: int, params: SamplingParams, explicit_max: bool, context_length: int | None,
                   block_length: int | None = None) -> SamplingParams:
    """A budget the client left to its default is shortened to fit the context: to whole blocks,
    or, when less than one block is left, to what is left (the engine cuts the last block short).
    A budget the client gave, and a prompt that leaves no room, are left as they are: the engine
    refuses them (``scheduler.validate.check_context``, a 400 naming the field). ``min_new_tokens``
    is left as it is too: the engine judges it against the budget returned here
    (``check_min_new_tokens``: larger is a 400 naming it, never silently lowered)."""
    if context_length is None or explicit_max:
        return params
    room = context_length - prompt_len
    if room <= 0 or params.max_new_tokens <= room:
        return params
    block = params.block_length or block_length
    if block and room >= block:  # whole blocks where one fits; else the one short block that fits
        room = room // block * block
    return params.replace(max_new_tokens=room)


@dataclass
class GenerateInput:
    items: list[Item]
    batch: bool  # the answer is a JSON array (list prompt or n > 1)
    stream: bool


def check_batch_size(n_sequences: int, max_batch_size: int | None, what: str = "prompts") -> None:
    """One HTTP request may create at most ``--max-batch-size`` engine requests."""
    if max_batch_size is not None and n_sequences > max_batch_size:
        raise APIError(f"the request has {n_sequences} {what}; the server accepts at most {max_batch_size} per "
                       f"request (--max-batch-size)", param="batch")


def parse_generate(body: Any, tokenize, *, context_length: int | None,
                   default_sampling: Mapping[str, Any] | None = None, block_length: int | None = None,
                   max_batch_size: int | None = None, max_n: int = DEFAULT_MAX_N) -> GenerateInput:
    """Validate a ``/generate`` body and expand it into engine items (prompt-major, then sample).
    ``max_batch_size`` bounds the number of prompts x samples, checked before tokenizing."""
    obj = require_object(body)
    try:
        check_generate_body(obj)
    except FieldError as e:
        raise field_error(e) from None
    text, input_ids = obj.get("text"), obj.get("input_ids")
    if text is not None and input_ids is not None:
        raise APIError("send either text or input_ids, not both")
    if text is None and input_ids is None:
        raise APIError("one of text or input_ids is required")
    if text is not None:
        batch = isinstance(text, list)
        if batch:
            if not text:
                raise APIError("text is an empty list")
            prompts = [check_text(t) for t in text]
        else:
            prompts = [check_text(text)]
        id_lists = None
    else:
        if not isinstance(input_ids, list) or not input_ids:
            raise APIError("input_ids must be a non-empty list of integers or of lists of integers")
        batch = isinstance(input_ids[0], list)
        if batch:
            id_lists = [check_token_ids(x) for x in input_ids]
        else:
            id_lists = [check_token_ids(input_ids)]
        prompts = None
    n_prompts = len(prompts if prompts is not None else id_lists)
    check_batch_size(n_prompts, max_batch_size)

    stream = obj.get("stream") or False
    if not isinstance(stream, bool):
        raise APIError(f"stream must be a boolean, got {stream!r}")

    sp_list = _per_prompt(obj.get("sampling_params"), n_prompts, "sampling_params", batch)
    rl_list = _per_prompt(obj.get("return_logprob"), n_prompts, "return_logprob", batch)
    ls_list = _per_prompt(obj.get("logprob_start_len"), n_prompts, "logprob_start_len", batch)
    tl_list = _per_prompt(obj.get("top_logprobs_num"), n_prompts, "top_logprobs_num", batch)
    tx_list = _per_prompt(obj.get("return_text_in_logprobs"), n_prompts, "return_text_in_logprobs", batch)
    depth_list = _per_prompt(obj.get("bicache_depth"), n_prompts, "bicache_depth", batch)
    log_list = _per_prompt(obj.get("log_metrics"), n_prompts, "log_metrics", batch)
    for v in log_list:
        if v is not None and not isinstance(v, bool):
            raise APIError(f"log_metrics must be a boolean, got {v!r}", param="log_metrics")
    for d in depth_list:
        if d is not None and (not is_int(d) or d < 0):
            raise APIError(f"bicache_depth must be an integer >= 0, got {d!r}", param="bicache_depth")
    rid = obj.get("rid")
    rid_list = _per_prompt(rid, n_prompts, "rid", batch)
    for r in rid_list:
        if r is not None and not isinstance(r, str):
            raise APIError("rid must be a string (or a list of strings for a batch)")

    items: list[Item] = []
    any_n = False
    parsed = [sampling_params_from(sp_list[i], default_sampling, max_n=max_n) for i in range(n_prompts)]
    if n_prompts > 1 or parsed[0][0].n > 1:  # bounded before anything is tokenized or expanded
        check_batch_size(sum(p.n for p, _ in parsed), max_batch_size, "sequences (prompts x n)")
    for i in range(n_prompts):
        params, explicit = parsed[i]
        ids = tokenize(prompts[i]) if prompts is not None else id_lists[i]
        if not ids:
            raise APIError("the prompt tokenizes to nothing")
        params = fit_to_context(len(ids), params, explicit, context_length, block_length)
        rl, start, top, text_in = _logprob_options(rl_list[i], ls_list[i], tl_list[i], tx_list[i])
        start = resolve_logprob_start(start, rl, params.max_new_tokens, len(ids))
        n = params.n
        any_n = any_n or n > 1
        base = params.replace(n=1) if n > 1 else params
        for j in range(n):
            r = rid_list[i]
            if r is not None and n > 1:
                r = f"{r}-{j}"
            req = engine_request(ids, base, rid=r or None, bicache_depth=depth_list[i], return_logprob=rl,
                                 logprob_start_len=start, top_logprobs_num=top, return_text_in_logprobs=text_in)
            items.append(Item(req, prompt_index=i, sample_index=j, log_metrics=log_list[i] is not False))
    return GenerateInput(items=items, batch=batch or any_n, stream=stream)
