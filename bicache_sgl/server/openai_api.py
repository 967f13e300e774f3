"""OpenAI-compatible routes: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``.

They reuse the native request machinery (:class:`~bicache_sgl.server.protocol.Item`,
:class:`~bicache_sgl.server.bridge.Submission`); only the request and response shapes differ.
Every handler is a module-level function on :data:`router` and reaches the shared
:class:`~bicache_sgl.server.state.ServerState` through ``request.app.state.server``. Which request
fields are implemented, and which are refused with a 400 naming them, is decided in
:mod:`bicache_sgl.server.fields`.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from bicache_sgl.io_struct import RequestEvent
from bicache_sgl.server.bridge import Submission
from bicache_sgl.server.chat import normalize_messages, render_chat
from bicache_sgl.server.fields import (
    SAMPLING_PASSTHROUGH,
    FieldError,
    check_chat_body,
    check_completion_body,
    check_stream_options,
)
from bicache_sgl.server.protocol import (
    APIError,
    Item,
    LogprobOptions,
    check_batch_size,
    check_length,
    check_token_ids,
    engine_request,
    field_error,
    is_int,
    parse_json_body,
    require_object,
    sampling_params_from,
)
from bicache_sgl.server.responses import SSE_DONE, ORJSONResponse, raise_if_failed, sse, sse_error, stream_text
from bicache_sgl.server.state import ServerState, get_state

router = APIRouter()

MAX_TOP_LOGPROBS = 20
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
STREAM_HEADERS = {"Cache-Control": "no-cache"}


# ---------------------------------------------------------------------------------------------
# models
# ---------------------------------------------------------------------------------------------

def model_card(state: ServerState) -> dict[str, Any]:
    return {"id": state.served_model_name, "object": "model", "created": state.created, "owned_by": "sglang",
            "root": state.served_model_name, "parent": None, "max_model_len": state.context_length}


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


@router.get("/v1/models")
async def list_models(request: Request) -> ORJSONResponse:
    return ORJSONResponse({"object": "list", "data": [model_card(get_state(request))]})


@router.get("/v1/models/{model_id:path}")
async def get_model(request: Request, model_id: str) -> ORJSONResponse:
    state = get_state(request)
    check_model(state, model_id)
    return ORJSONResponse(model_card(state))


# ---------------------------------------------------------------------------------------------
# request helpers
# ---------------------------------------------------------------------------------------------

def check_fields(check: Callable[[Mapping[str, Any]], None], body: Mapping[str, Any]) -> None:
    try:
        check(body)
    except FieldError as e:
        raise field_error(e) from None


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


def make_items(state: ServerState, id_lists: list[list[int]], sp: dict, explicit_max: bool,
               lp: LogprobOptions) -> list[Item]:
    """One engine item per prompt and sample (prompt-major), each checked against the context."""
    try:
        params, _ = sampling_params_from(sp, state.default_sampling, max_n=state.args.max_n)
    except APIError as e:
        e.param = None  # the message names the field; there is no "sampling_params" field on /v1
        raise
    check_batch_size(len(id_lists) * params.n, state.args.max_batch_size,
                     "sequences (prompts x n)" if params.n > 1 else "prompts")
    items = []
    for pi, ids in enumerate(id_lists):
        p = check_length(len(ids), params, explicit_max, state.context_length, state.args.block_length)
        base = p.replace(n=1) if p.n > 1 else p
        for j in range(p.n):
            items.append(Item(engine_request(ids, base, lp), prompt_index=pi, sample_index=j))
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


def include_usage(body: dict) -> bool:
    so = body.get("stream_options")
    if so is None:
        return False
    if not isinstance(so, dict):
        raise APIError("stream_options must be an object", param="stream_options")
    check_fields(check_stream_options, so)
    return bool(so.get("include_usage"))


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


def finish(fr: Any) -> tuple[str | None, Any]:
    """SGLang finish_reason dict -> (OpenAI finish_reason, matched_stop)."""
    if not isinstance(fr, dict):
        return None, None
    kind = fr.get("type")
    if kind == "stop":
        return "stop", fr.get("matched")
    if kind == "length":
        return "length", None
    return kind, None


def token_text(state: ServerState, entry: list) -> str:
    t = entry[2] if len(entry) > 2 else None
    return t if isinstance(t, str) else state.decode_token(int(entry[1]))


def completion_logprobs(state: ServerState, entries: list, tops: list | None, offset0: int) -> dict[str, Any]:
    tokens, lps, top_out, offsets = [], [], [], []
    off = offset0
    for k, e in enumerate(entries):
        t = token_text(state, e)
        tokens.append(t)
        lps.append(e[0])
        offsets.append(off)
        off += len(t)
        top = tops[k] if tops is not None and k < len(tops) else None
        top_out.append({token_text(state, x): x[0] for x in top} if top else None)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": top_out, "text_offset": offsets}


def chat_logprobs(state: ServerState, entries: list, tops: list | None) -> dict[str, Any]:
    content = []
    for k, e in enumerate(entries):
        t = token_text(state, e)
        top = tops[k] if tops is not None and k < len(tops) else None
        content.append({
            "token": t, "bytes": list(t.encode("utf-8")), "logprob": e[0],
            "top_logprobs": [{"token": token_text(state, x), "bytes": list(token_text(state, x).encode("utf-8")),
                              "logprob": x[0]} for x in (top or [])],
        })
    return {"content": content}


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

    @property
    def model(self) -> str:
        return self.state.served_model_name

    def envelope(self, choices: list[dict], usage_: dict | None, obj: str | None = None) -> dict[str, Any]:
        return {"id": self.rid, "object": obj or self.object_type, "created": self.created, "model": self.model,
                "choices": choices, "usage": usage_}


# ---------------------------------------------------------------------------------------------
# /v1/completions
# ---------------------------------------------------------------------------------------------

def completion_prompts(state: ServerState, prompt: Any) -> tuple[list[str | None], list[list[int]]]:
    """``prompt`` (str, [str], [int] or [[int]]) -> (texts or None per prompt, token ids per prompt)."""
    if isinstance(prompt, str):
        if not prompt:
            raise APIError("prompt is empty", param="prompt")
        texts: list[str | None] = [prompt]
        id_lists = [state.tokenize(prompt)]
    elif isinstance(prompt, list) and prompt:
        if not all(is_int(p) for p in prompt):  # a list of prompts: bounded before tokenizing
            check_batch_size(len(prompt), state.args.max_batch_size)
        if all(isinstance(p, str) for p in prompt):
            if any(p == "" for p in prompt):
                raise APIError("prompt contains an empty string", param="prompt")
            texts = list(prompt)
            id_lists = [state.tokenize(p) for p in prompt]
        elif all(is_int(p) for p in prompt):
            id_lists = [check_token_ids(prompt, state.vocab_size, "prompt")]
            texts = [None]
        elif all(isinstance(p, list) for p in prompt):
            id_lists = [check_token_ids(p, state.vocab_size, "prompt") for p in prompt]
            texts = [None] * len(prompt)
        else:
            raise APIError("prompt must be a string, a list of strings, a list of token ids or a list of "
                           "lists of token ids", param="prompt")
    else:
        raise APIError("prompt must be a non-empty string or list", param="prompt")
    if any(not ids for ids in id_lists):
        raise APIError("the prompt tokenizes to nothing", param="prompt")
    return texts, id_lists


SCORE_CHUNK = 256  # left-to-right scoring requests submitted to the engine at once


async def left_to_right_logprobs(state: ServerState, request: Request, targets: list[tuple[list[int], int]],
                                 top: int) -> list[tuple[list, list | None]] | None:
    """``log p(ids[i] | ids[:i])`` for each ``(ids, i)``, with positions ``i..`` of ``ids`` masked:
    the native input logprob of position ``i`` at ``logprob_start_len = i`` (docs/server.md,
    "Logprobs for a diffusion model"), one prefill-only scoring request each. -> ``(entry, top
    entries)`` per target, or None when the client went away."""
    params, _ = sampling_params_from({"max_new_tokens": 0, "temperature": 0}, state.default_sampling,
                                     max_n=state.args.max_n)
    out: list[tuple[list, list | None]] = []
    for lo in range(0, len(targets), SCORE_CHUNK):
        items = [Item(engine_request(ids, params, LogprobOptions(return_logprob=True, logprob_start_len=i,
                                                                 top_logprobs_num=top, return_text_in_logprobs=True)),
                      log_metrics=False)
                 for ids, i in targets[lo:lo + SCORE_CHUNK]]
        sub = state.new_submission(items)
        await sub.submit()
        finals = await collect(state, sub, request)
        if finals is None:
            return None
        for ev in finals:
            meta = ev.meta_info or {}
            out.append((meta["input_token_logprobs"][0], (meta.get("input_top_logprobs") or [None])[0]))
    return out


async def echo_prompt_logprobs(state: ServerState, request: Request, id_lists: list[list[int]],
                               top: int) -> list[tuple[list, list]] | None:
    """Echo logprobs of every prompt, left to right (OpenAI's meaning, which lm-eval's
    loglikelihood requests rely on): entry ``i`` is ``log p(token_i | tokens before it)``, the
    first is null. -> (entries, tops) per prompt, or None when the client went away."""
    targets = [(ids, i) for ids in id_lists for i in range(1, len(ids))]
    scored = await left_to_right_logprobs(state, request, targets, top)
    if scored is None:
        return None
    res, k = [], 0
    for ids in id_lists:
        entries: list = [[None, ids[0], state.decode_token(ids[0])]]
        tops: list = [None]
        for e, t in scored[k:k + len(ids) - 1]:
            entries.append(e)
            tops.append(t)
        k += len(ids) - 1
        res.append((entries, tops))
    return res


def stopped_on_token(ev: RequestEvent) -> int | None:
    """The end token (EOS or a stop_token_ids entry) a generation stopped on, if any."""
    fr = ev.finish_reason if isinstance(ev.finish_reason, dict) else (ev.meta_info or {}).get("finish_reason")
    if isinstance(fr, dict) and fr.get("type") == "stop" and is_int(fr.get("matched")):
        return int(fr["matched"])
    return None


@dataclass
class CompletionJob(Job):
    texts: list[str] = field(default_factory=list)  # prompt text per prompt (for echo)
    echo: bool = False
    logprobs: int | None = None
    # echo + logprobs: each prompt's left-to-right (entries, tops), from echo_prompt_logprobs
    prompt_lp: list[tuple[list, list]] = field(default_factory=list)

    @property
    def scoring(self) -> bool:
        """echo + logprobs: the prompt is scored left to right, and a generation that stopped on
        an end token reports that token (an entry and a completion token), as SGLang does."""
        return self.echo and self.logprobs is not None

    async def end_entries(self, request: Request, picks: list[tuple[Item, RequestEvent]]) -> list | None:
        """For each (item, final event): the end token's left-to-right (entry, tops), or None."""
        want = [(k, it.input_ids + list(ev.output_ids or []), tok) for k, (it, ev) in enumerate(picks)
                if self.scoring and (tok := stopped_on_token(ev)) is not None]
        res: list = [None] * len(picks)
        if not want:
            return res
        scored = await left_to_right_logprobs(self.state, request, [(ids + [tok], len(ids)) for _, ids, tok in want],
                                              self.logprobs or 0)
        if scored is None:
            return None
        for (k, _, _), e in zip(want, scored):
            res[k] = e
        return res

    def logprobs_for(self, meta: dict, start_out: int, prompt_index: int | None,
                     end: tuple[list, list | None] | None = None) -> dict[str, Any] | None:
        """OpenAI ``logprobs`` of output entries from ``start_out`` (after the prompt's, for echo;
        then the end token's)."""
        if self.logprobs is None:
            return None
        entries: list = []
        tops: list = []
        if prompt_index is not None:
            inp, inp_tops = self.prompt_lp[prompt_index]
            entries += inp
            tops += inp_tops
        out = (meta.get("output_token_logprobs") or [])[start_out:]
        out_tops = meta.get("output_top_logprobs")
        entries += out
        tops += out_tops[start_out:] if out_tops else [None] * len(out)
        if end is not None:
            entries.append(end[0])
            tops.append(end[1])
        return completion_logprobs(self.state, entries, tops, 0)

    def usage(self, finals: list[RequestEvent]) -> dict[str, int]:
        u = usage(self.items, finals)
        if self.scoring:  # the end tokens reported as entries are counted, as SGLang counts them
            extra = sum(stopped_on_token(f) is not None for f in finals)
            u["completion_tokens"] += extra
            u["total_tokens"] += extra
        return u


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    state = get_state(request)
    body = require_object(parse_json_body(await request.body()))
    check_fields(check_completion_body, body)
    check_model(state, body.get("model"))
    texts, id_lists = completion_prompts(state, body.get("prompt"))
    max_tokens = body.get("max_tokens")
    check_max_tokens(max_tokens, "max_tokens")
    echo = check_bool(body, "echo")
    stream = check_bool(body, "stream")
    want_usage = include_usage(body)
    logprobs = body.get("logprobs")
    if logprobs is not None:
        logprobs = check_logprob_count(logprobs, "logprobs")
    sp = sampling_dict(body, max_tokens, DEFAULT_COMPLETION_MAX_TOKENS)
    # echo prompt logprobs come from left-to-right scoring (echo_prompt_logprobs), not from the
    # generation request (whose input logprobs mask the whole range together)
    lp = LogprobOptions(return_logprob=logprobs is not None, logprob_start_len=-1,
                        top_logprobs_num=logprobs or 0, return_text_in_logprobs=logprobs is not None)
    # max_tokens always counts as given: OpenAI's default (16) is a real limit, never shortened
    items = make_items(state, id_lists, sp, True, lp)
    sub = state.new_submission(items)
    job = CompletionJob(state=state, sub=sub, items=items, object_type="text_completion",
                        rid=f"cmpl-{uuid.uuid4().hex}",
                        texts=[p if p is not None else state.tokenizer.decode(ids) for p, ids in zip(texts, id_lists)],
                        echo=echo, logprobs=logprobs)
    if job.scoring:
        prompt_lp = await echo_prompt_logprobs(state, request, id_lists, logprobs or 0)
        if prompt_lp is None:
            return ORJSONResponse({}, status_code=499)
        job.prompt_lp = prompt_lp
    await sub.submit()
    if stream:
        return StreamingResponse(completion_stream(job, request, want_usage), media_type="text/event-stream",
                                 headers=STREAM_HEADERS)
    finals = await collect(state, sub, request)
    if finals is None:
        return ORJSONResponse({}, status_code=499)
    ends = await job.end_entries(request, list(zip(items, finals)))
    if ends is None:
        return ORJSONResponse({}, status_code=499)
    choices = []
    for i, (item, ev) in enumerate(zip(items, finals)):
        meta = dict(ev.meta_info or {})
        reason, matched = finish(ev.finish_reason or meta.get("finish_reason"))
        prefix = job.texts[item.prompt_index] if echo else ""
        lps = job.logprobs_for(meta, 0, item.prompt_index if echo else None, ends[i])
        choices.append({"index": i, "text": prefix + (ev.text or ""), "logprobs": lps,
                        "finish_reason": reason, "matched_stop": matched})
    return ORJSONResponse(job.envelope(choices, job.usage(finals)))


async def completion_stream(job: CompletionJob, request: Request, want_usage: bool) -> AsyncIterator[bytes]:
    """Text deltas per choice; ``finish_reason`` on each choice's last chunk; usage last if asked."""
    items = job.items
    sent = [0] * len(items)
    sent_lp = [0] * len(items)
    started = [False] * len(items)
    finals: list[RequestEvent | None] = [None] * len(items)
    async for i, ev in job.sub.events(request.is_disconnected):
        if ev.error:
            yield sse_error(str(ev.error))
            continue
        item = items[i]
        text = stream_text(item, ev)
        delta = text[sent[i]:]
        first = not started[i]
        if job.echo and first:
            delta = job.texts[item.prompt_index] + delta
        if not delta and not ev.finished:
            continue
        meta = dict(ev.meta_info or {})
        n_out = len(meta.get("output_token_logprobs") or [])
        lps = None
        if job.logprobs is not None and (n_out > sent_lp[i] or (job.echo and first) or ev.finished):
            end = None
            if ev.finished and job.scoring:
                got = await job.end_entries(request, [(item, ev)])
                if got is None:
                    return
                end = got[0]
            lps = job.logprobs_for(meta, sent_lp[i], item.prompt_index if job.echo and first else None, end)
            sent_lp[i] = n_out
        reason, matched = finish(ev.finish_reason) if ev.finished else (None, None)
        sent[i] = len(text)
        started[i] = True
        if ev.finished:
            finals[i] = ev
        yield sse(job.envelope([{"index": i, "text": delta, "logprobs": lps, "finish_reason": reason,
                                 "matched_stop": matched}], None))
    if job.sub.disconnected:
        return
    if want_usage and all(f is not None for f in finals):
        yield sse(job.envelope([], job.usage(finals)))  # type: ignore[arg-type]  # all set (checked)
    yield SSE_DONE


# ---------------------------------------------------------------------------------------------
# /v1/chat/completions
# ---------------------------------------------------------------------------------------------

@dataclass
class ChatJob(Job):
    want_lp: bool = False

    def logprobs_for(self, meta: dict, start: int) -> dict[str, Any] | None:
        if not self.want_lp:
            return None
        out = (meta.get("output_token_logprobs") or [])[start:]
        tops = meta.get("output_top_logprobs")
        return chat_logprobs(self.state, out, tops[start:] if tops else None)

    def chunk(self, i: int, delta: dict, reason: str | None = None, matched: Any = None,
              lps: dict | None = None) -> bytes:
        # every delta carries SGLang's four keys, null when empty (clients read delta.reasoning_content)
        delta = {"role": None, "content": None, "reasoning_content": None, "tool_calls": None, **delta}
        return sse(self.envelope([{"index": i, "delta": delta, "logprobs": lps, "finish_reason": reason,
                                   "matched_stop": matched}], None, "chat.completion.chunk"))


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    state = get_state(request)
    body = require_object(parse_json_body(await request.body()))
    check_fields(check_chat_body, body)
    check_model(state, body.get("model"))
    messages = normalize_messages(body.get("messages"))
    cont = check_bool(body, "continue_final_message")
    check_bool(body, "separate_reasoning")
    check_bool(body, "stream_reasoning")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise APIError("chat_template_kwargs must be an object", param="chat_template_kwargs")
    prompt_text = render_chat(state.tokenizer, messages, state.chat_template, continue_final_message=cont,
                              extra_kwargs=kwargs)
    ids = state.tokenize_rendered(prompt_text)
    if not ids:
        raise APIError("the rendered conversation is empty", param="messages")
    max_tokens = body.get("max_completion_tokens")
    check_max_tokens(max_tokens, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
        check_max_tokens(max_tokens, "max_tokens")
    want_lp = check_bool(body, "logprobs")
    top = body.get("top_logprobs")
    top = 0 if top is None else check_logprob_count(top, "top_logprobs")
    if top and not want_lp:
        raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
    stream = check_bool(body, "stream")
    want_usage = include_usage(body)
    sp = sampling_dict(body, max_tokens, None)
    lp = LogprobOptions(return_logprob=want_lp, logprob_start_len=-1, top_logprobs_num=top,
                        return_text_in_logprobs=want_lp)
    items = make_items(state, [ids], sp, max_tokens is not None, lp)
    sub = state.new_submission(items)
    job = ChatJob(state=state, sub=sub, items=items, object_type="chat.completion", rid=f"chatcmpl-{uuid.uuid4().hex}",
                  want_lp=want_lp)
    await sub.submit()
    if stream:
        return StreamingResponse(chat_stream(job, request, want_usage), media_type="text/event-stream",
                                 headers=STREAM_HEADERS)
    finals = await collect(state, sub, request)
    if finals is None:
        return ORJSONResponse({}, status_code=499)
    choices = []
    for i, ev in enumerate(finals):
        meta = dict(ev.meta_info or {})
        reason, matched = finish(ev.finish_reason or meta.get("finish_reason"))
        choices.append({"index": i,
                        "message": {"role": "assistant", "content": ev.text or "", "reasoning_content": None,
                                    "tool_calls": None},
                        "logprobs": job.logprobs_for(meta, 0), "finish_reason": reason, "matched_stop": matched})
    return ORJSONResponse(job.envelope(choices, usage(items, finals)))


async def chat_stream(job: ChatJob, request: Request, want_usage: bool) -> AsyncIterator[bytes]:
    """The role first, then content deltas, then exactly one chunk with ``finish_reason`` per choice."""
    items = job.items
    sent = [0] * len(items)
    sent_lp = [0] * len(items)
    finals: list[RequestEvent | None] = [None] * len(items)
    for i in range(len(items)):
        yield job.chunk(i, {"role": "assistant", "content": ""})
    async for i, ev in job.sub.events(request.is_disconnected):
        if ev.error:
            yield sse_error(str(ev.error))
            continue
        text = stream_text(items[i], ev)
        delta = text[sent[i]:]
        meta = dict(ev.meta_info or {})
        n_out = len(meta.get("output_token_logprobs") or [])
        if delta or (job.want_lp and n_out > sent_lp[i]):
            yield job.chunk(i, {"content": delta}, lps=job.logprobs_for(meta, sent_lp[i]))
            sent[i] = len(text)
            sent_lp[i] = max(sent_lp[i], n_out)
        if ev.finished:
            finals[i] = ev
            reason, matched = finish(ev.finish_reason)
            yield job.chunk(i, {}, reason, matched)
    if job.sub.disconnected:
        return
    if want_usage and all(f is not None for f in finals):
        yield sse(job.envelope([], usage(items, finals), "chat.completion.chunk"))  # type: ignore[arg-type]
    yield SSE_DONE
