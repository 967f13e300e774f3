"""What the OpenAI routes share: model names, request checks, the
native sampling params and engine items of a request, usage, finish reasons and the
:class:`Job` envelope. The routes are in :mod:`~bicache_sgl.server.openai_completions` and
:mod:`~bicache_sgl.server.openai_chat`, registered by :mod:`~bicache_sgl.server.openai_api`.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from bicache_sgl.io_struct import RequestEvent
from bicache_sgl.server.bridge import Submission
from bicache_sgl.server.fields import SAMPLING_PASSTHROUGH, FieldError, check_stream_options
from bicache_sgl.server.protocol import (
    APIError,
    Item,
    check_batch_size,
    engine_request,
    field_error,
    fit_to_context,
    is_int,
    parse_json_body,
    require_object,
    sampling_params_from,
)
from bicache_sgl.server.responses import raise_if_failed
from bicache_sgl.server.state import ServerState, get_state

MAX_TOP_LOGPROBS = 20
STREAM_HEADERS = {"Cache-Control": "no-cache"}


def model_card(state: ServerState) -> dict[str, Any]:
    return {"id": state.served_model_name, "object": "model", "created": state.created, "owned_by": "sglang",
            # root: the model folder (vLLM's meaning), where a client finds the tokenizer
            "root": state.model_path or state.served_model_name, "parent": None, "max_model_len": state.context_length}


def known_names(state: ServerState) -> set[str]:
    """Model names a request may use: the served name, the model path and its folder, ``default``."""
    names = {state.served_model_name, state.model_path, "default"}
    if state.model_path:
        names.add(os.path.basename(os.path.normpath(state.model_path)))
    return {n for n in names if n}


def check_model(state: ServerState, name: Any) -> None:
    if name is None or name == "":
        return
    if not isinstance(name, str):
        raise APIError("model must be a string", param="model")
    if name not in known_names(state):
        raise APIError(f"The model '{name}' does not exist; this server serves '{state.served_model_name}'.",
                       status=404, err_type="invalid_request_error", code="model_not_found", param="model")


def check_fields(check: Callable[[Mapping[str, Any]], None], body: Mapping[str, Any]) -> None:
    try:
        check(body)
    except FieldError as e:
        raise field_error(e) from None


async def read_body(request: Request, check: Callable[[Mapping[str, Any]], None]) -> tuple[ServerState, dict]:
    """The server state and an OpenAI route's JSON body, checked by the route's field check and
    for a model this server serves (every refusal is an APIError naming the field)."""
    state = get_state(request)
    body = require_object(parse_json_body(await request.body()))
    check_fields(check, body)
    check_model(state, body.get("model"))
    return state, body


JSON_OBJECT_SCHEMA = {"type": "object"}  # what SGLang's OpenAI routes send for json_object


def response_format_schema(rf: Any) -> dict | bool | None:
    """OpenAI ``response_format`` -> the JSON schema the output must follow (None: free text).

    ``{"type": "text"}``: none; ``{"type": "json_object"}``: any JSON object (as SGLang:
    ``{"type": "object"}``, a bounded nesting depth, docs/structured.md); ``{"type": "json_schema",
    "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``: that schema (``strict`` is
    accepted either way: the output always follows the schema). Anything else is a 400."""
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise APIError("response_format must be an object such as {\"type\": \"json_object\"}",
                       param="response_format")
    kind = rf.get("type")
    extra = set(rf) - {"type", "json_schema"}
    if extra:
        raise APIError(f"response_format.{sorted(extra)[0]} is not a field of response_format",
                       param="response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return dict(JSON_OBJECT_SCHEMA)
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise APIError("response_format.json_schema must be an object with a schema", param="response_format")
        unknown = set(js) - {"name", "schema", "strict", "description"}
        if unknown:
            raise APIError(f"response_format.json_schema.{sorted(unknown)[0]} is not a field of json_schema",
                           param="response_format")
        schema = js.get("schema")
        if not isinstance(schema, (dict, bool)):
            raise APIError("response_format.json_schema.schema is required (a JSON schema object)",
                           param="response_format")
        return schema
    if kind == "structural_tag":
        raise APIError("response_format structural_tag is not supported (tool-call grammars); use json_schema",
                       param="response_format")
    raise APIError(f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                   param="response_format")


def sampling_dict(body: dict, max_tokens: Any, default_max: int | None) -> dict[str, Any]:
    """The native sampling_params of an OpenAI request (only implemented keys get here)."""
    sp: dict[str, Any] = {k: body[k] for k in SAMPLING_PASSTHROUGH if body.get(k) is not None}
    schema = response_format_schema(body.get("response_format"))
    if schema is not None:
        other = next((k for k in ("json_schema", "regex") if sp.get(k) is not None), None)
        if other is not None:
            raise APIError(f"response_format and {other} cannot both be set: one constraint per request",
                           param="response_format")
        sp["json_schema"] = schema
    if max_tokens is not None:
        sp["max_new_tokens"] = max_tokens
    elif default_max is not None:
        sp["max_new_tokens"] = default_max
    if body.get("min_tokens") is not None:
        sp["min_new_tokens"] = body["min_tokens"]
    return sp


# native sampling-param names -> the OpenAI request field they come from
_V1_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "sampling_seed": "seed"}


def v1_param(message: str, sp: Mapping[str, Any]) -> str | None:
    """The /v1 request field an error message about ``sp`` (the native sampling params) is about:
    the field the message starts with, else the first one it mentions."""
    m = re.match(r"[A-Za-z_]+", message)
    fields = [(k, _V1_NAMES.get(k, k)) for k in sp]
    if m:
        for native, v1 in fields:
            if m.group(0) in (native, v1):
                return v1
    for native, v1 in fields:
        if re.search(rf"\b{native}\b", message):
            return v1
    return None


def v1_field_names(max_name: str = "max_tokens", prompt_name: str = "prompt") -> dict[str, str]:
    """The /v1 names of the engine's request fields that its refusals name (``Submission``):
    ``max_name`` is the request field that set the budget, ``prompt_name`` the one that holds
    the prompt's token ids."""
    return {"max_new_tokens": max_name, "input_ids": prompt_name, "min_new_tokens": "min_tokens"}


def make_items(state: ServerState, id_lists: list[list[int]], sp: dict, explicit_max: bool,
               **fields: Any) -> list[Item]:
    """One engine item per prompt and sample (prompt-major); a budget left to its default is
    shortened to fit the context (the engine checks the context at submit: its refusal names
    the /v1 field, ``v1_field_names``). ``fields``: the other ``GenerateRequest`` fields of
    every item (the logprob knobs)."""
    try:
        params, _ = sampling_params_from(sp, state.default_sampling, max_n=state.args.max_n)
    except APIError as e:
        # there is no "sampling_params" field on /v1: name the request field the message is about
        e.param = v1_param(str(e), sp) if e.param in (None, "sampling_params", "max_new_tokens") else e.param
        raise
    check_batch_size(len(id_lists) * params.n, state.args.max_batch_size,
                     "sequences (prompts x n)" if params.n > 1 else "prompts")
    items = []
    for pi, ids in enumerate(id_lists):
        p = fit_to_context(len(ids), params, explicit_max, state.context_length, state.args.decode.block_length)
        base = p.replace(n=1) if p.n > 1 else p
        for j in range(p.n):
            items.append(Item(engine_request(ids, base, **fields), prompt_index=pi, sample_index=j))
    return items


def check_logprob_count(v: Any, name: str) -> int:
    if not is_int(v) or v < 0 or v > MAX_TOP_LOGPROBS:
        raise APIError(f"{name} must be an integer in [0, {MAX_TOP_LOGPROBS}], got {v!r}", param=name)
    return v


def check_bool(body: dict, key: str) -> bool:
    v = body.get(key)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise APIError(f"{key} must be a boolean, got {v!r}", param=key)
    return v


def check_max_tokens(v: Any, name: str) -> None:
    if v is not None and (not is_int(v) or v < 0):
        raise APIError(f"{name} must be an integer >= 0, got {v!r}", param=name)


def _stream_option(body: dict, key: str) -> bool:
    so = body.get("stream_options")
    if so is None:
        return False
    if not isinstance(so, dict):
        raise APIError("stream_options must be an object", param="stream_options")
    check_fields(check_stream_options, so)
    v = so.get(key)
    if v is not None and not isinstance(v, bool):
        raise APIError(f"stream_options.{key} must be a boolean, got {v!r}", param=f"stream_options.{key}")
    return bool(v)


def include_usage(body: dict) -> bool:
    """``stream_options.include_usage``: one last chunk with the whole request's usage."""
    return _stream_option(body, "include_usage")


def continuous_usage(body: dict) -> bool:
    """``stream_options.continuous_usage_stats`` (vLLM's extension, implemented by SGLang; guidellm
    sends it): every chunk of a choice carries that choice's usage so far."""
    return _stream_option(body, "continuous_usage_stats")


def usage(items: list[Item], finals: list[RequestEvent]) -> dict[str, int]:
    """Prompt tokens once per prompt (not per sample), completion tokens of every sample."""
    seen: set[int] = set()
    prompt = 0
    for it in items:
        if it.prompt_index not in seen:
            seen.add(it.prompt_index)
            prompt += len(it.input_ids)
    completion = sum(len(f.output_ids or []) for f in finals)
    # reasoning_tokens: SGLang always sends it (0 without a reasoning parser, as here)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "reasoning_tokens": 0}


def budget_abort(fr: Any) -> bool:
    """An abort because no output matching the request's constraint fits its max_new_tokens
    (scheduler/structured.py): on /v1 that is OpenAI's "length" (the budget cut the answer short;
    the SDK's ``parse`` then raises its LengthFinishReasonError)."""
    return (isinstance(fr, dict) and fr.get("type") == "abort"
            and "max_new_tokens" in str(fr.get("message") or ""))


def finish(fr: Any) -> tuple[str | None, Any]:
    """SGLang finish_reason dict -> (OpenAI finish_reason, matched_stop). Only OpenAI's values come
    out: an abort is "length" when the budget caused it; any other abort is an error
    (:func:`abort_error`), never a finish_reason."""
    if not isinstance(fr, dict):
        return None, None
    kind = fr.get("type")
    if kind == "stop":
        return "stop", fr.get("matched")
    if kind == "length" or budget_abort(fr):
        return "length", None
    return None, None


def abort_error(ev: RequestEvent) -> APIError | None:
    """The error answer for a request that finished aborted for a reason other than its budget
    (an unsatisfiable constraint: 400; aborted by /abort_request, shutdown or the engine: 503)."""
    fr = ev.finish_reason if isinstance(ev.finish_reason, dict) else (ev.meta_info or {}).get("finish_reason")
    if not isinstance(fr, dict) or fr.get("type") != "abort" or budget_abort(fr):
        return None
    msg = str(fr.get("message") or "aborted")
    if msg.startswith("the constraint matches no output"):
        return APIError(msg)
    return APIError(f"the request was aborted before it finished: {msg}", status=503)


def token_text(state: ServerState, entry: list) -> str:
    t = entry[2] if len(entry) > 2 else None
    return t if isinstance(t, str) else state.decode_token(int(entry[1]))


async def collect(state: ServerState, sub: Submission, request: Request) -> list[RequestEvent] | None:
    """Every final event, or None when the client went away."""
    finals: list[RequestEvent | None] = [None] * len(sub.items)
    async for i, ev in sub.events(request.is_disconnected):
        if ev.finished:
            finals[i] = ev
    if any(f is None for f in finals):
        return None
    done: list[RequestEvent] = finals  # type: ignore[assignment]  # every entry is set (checked above)
    raise_if_failed(done)
    state.check_not_aborted_by_shutdown(done)
    for f in done:
        if (err := abort_error(f)) is not None:
            raise err
    return done


@dataclass
class Job:
    """One accepted OpenAI request: what its answer needs besides the events."""

    state: ServerState
    sub: Submission
    items: list[Item]
    object_type: str  # "text_completion" | "chat.completion"
    rid: str
    created: int = field(default_factory=lambda: int(time.time()))
    continuous_usage: bool = False  # stream_options.continuous_usage_stats

    def chunk_usage(self, i: int, ev: RequestEvent | None) -> dict[str, int] | None:
        """Choice ``i``'s usage so far (its prompt, the tokens it generated up to ``ev``) for a
        stream chunk, when continuous_usage_stats asked for it (as SGLang computes it)."""
        if not self.continuous_usage:
            return None
        prompt = len(self.items[i].input_ids)
        completion = len(ev.output_ids or []) if ev is not None else 0
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "reasoning_tokens": 0}

    @property
    def model(self) -> str:
        return self.state.served_model_name

    def envelope(self, choices: list[dict], usage_: dict | None, obj: str | None = None) -> dict[str, Any]:
        return {"id": self.rid, "object": obj or self.object_type, "created": self.created, "model": self.model,
                "choices": choices, "usage": usage_}
