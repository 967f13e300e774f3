"""``/v1/chat/completions``: a conversation rendered with the chat template, streamed as the role,
content deltas and one finishing chunk per choice.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from bicache_sgl.io_struct import RequestEvent, new_rid
from bicache_sgl.server.chat import normalize_messages, render_chat, template_source
from bicache_sgl.server.fields import check_chat_body
from bicache_sgl.server.openai_common import (
    STREAM_HEADERS,
    Job,
    abort_error,
    check_bool,
    check_logprob_count,
    check_max_tokens,
    collect,
    continuous_usage,
    finish,
    include_usage,
    make_items,
    read_body,
    sampling_dict,
    token_text,
    usage,
    v1_field_names,
)
from bicache_sgl.server.openai_tools import ToolPlan, plan_tools
from bicache_sgl.server.protocol import APIError
from bicache_sgl.server.responses import SSE_DONE, ORJSONResponse, sse, sse_error, stream_text
from bicache_sgl.server.state import ServerState


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


@dataclass
class ChatJob(Job):
    want_lp: bool = False
    tools: ToolPlan | None = None  # tools / tool_choice (openai_tools.py); None: no tools

    @property
    def buffered(self) -> bool:
        """Tool calls are answered whole at the end (a diffusion LM does not write left to right
        anyway): no content deltas before the finish."""
        return self.tools is not None and self.tools.mode != "none"

    def answer(self, text: str, reason: str | None) -> tuple[str | None, list | None, str | None]:
        """(content, tool_calls, finish_reason) of a finished choice."""
        t = self.tools
        if t is None or t.mode == "none":
            return text, None, reason
        if t.mode == "forced":
            if reason != "stop":  # cut short ("length"): no call to report
                return text, None, reason
            return None, t.calls(text), "tool_calls"
        content, calls = t.auto_split(text)
        return (content, calls, "tool_calls") if calls else (text, None, reason)

    def logprobs_for(self, meta: dict, start: int) -> dict[str, Any] | None:
        if not self.want_lp:
            return None
        out = (meta.get("output_token_logprobs") or [])[start:]
        tops = meta.get("output_top_logprobs")
        return chat_logprobs(self.state, out, tops[start:] if tops else None)

    def chunk(self, i: int, delta: dict, reason: str | None = None, matched: Any = None,
              lps: dict | None = None, ev: RequestEvent | None = None) -> bytes:
        # every delta carries SGLang's four keys, null when empty (clients read delta.reasoning_content)
        delta = {"role": None, "content": None, "reasoning_content": None, "tool_calls": None, **delta}
        return sse(self.envelope([{"index": i, "delta": delta, "logprobs": lps, "finish_reason": reason,
                                   "matched_stop": matched}], self.chunk_usage(i, ev), "chat.completion.chunk"))


async def chat_completions(request: Request) -> Response:
    state, body = await read_body(request, check_chat_body)
    messages = normalize_messages(body.get("messages"))
    cont = check_bool(body, "continue_final_message")
    check_bool(body, "separate_reasoning")
    check_bool(body, "stream_reasoning")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise APIError("chat_template_kwargs must be an object", param="chat_template_kwargs")
    tools = plan_tools(body, template_source(state.tokenizer, state.chat_template))
    prompt_text = render_chat(state.tokenizer, messages, state.chat_template, continue_final_message=cont,
                              extra_kwargs=kwargs, tools=tools.template_tools if tools else None)
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
    if tools is not None and tools.mode != "none" and want_lp:
        raise APIError("logprobs are not returned together with tool calls; send tool_choice \"none\" or leave "
                       "logprobs out", param="logprobs")
    if tools is not None and tools.schema is not None:
        other = next((k for k in ("response_format", "json_schema", "regex") if body.get(k) is not None
                      and body.get(k) != {"type": "text"}), None)
        if other is not None:
            raise APIError(f"tool_choice forces a tool call, generated under its own JSON-schema constraint; {other} "
                           "cannot be set too", param="tool_choice")
        sp["json_schema"] = tools.schema
    items = make_items(state, [ids], sp, max_tokens is not None, return_logprob=want_lp, top_logprobs_num=top,
                       return_text_in_logprobs=want_lp)
    max_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    sub = state.new_submission(items, v1_field_names(max_name, "messages"))
    job = ChatJob(state=state, sub=sub, items=items, object_type="chat.completion", rid=f"chatcmpl-{new_rid()}",
                  want_lp=want_lp, continuous_usage=continuous_usage(body), tools=tools)
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
        content, calls, reason = job.answer(ev.text or "", reason)
        choices.append({"index": i,
                        "message": {"role": "assistant", "content": content, "reasoning_content": None,
                                    "tool_calls": calls},
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
        if job.buffered:
            delta = ""  # answered whole at the finish (ChatJob.buffered)
        if delta or (job.want_lp and n_out > sent_lp[i]):
            yield job.chunk(i, {"content": delta}, lps=job.logprobs_for(meta, sent_lp[i]), ev=ev)
            sent[i] = len(text)
            sent_lp[i] = max(sent_lp[i], n_out)
        if ev.finished:
            finals[i] = ev
            if (err := abort_error(ev)) is not None:  # not a finish_reason on /v1: an error frame
                yield sse_error(err.message)
                continue
            reason, matched = finish(ev.finish_reason)
            if job.buffered:
                content, calls, reason = job.answer(ev.text or "", reason)
                if content:
                    yield job.chunk(i, {"content": content}, ev=ev)
                if calls:
                    yield job.chunk(i, {"tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]}, ev=ev)
                    matched = None
            yield job.chunk(i, {}, reason, matched, ev=ev)
    if job.sub.disconnected:
        return
    if want_usage and all(f is not None for f in finals):
        yield sse(job.envelope([], usage(items, finals), "chat.completion.chunk"))  # type: ignore[arg-type]
    yield SSE_DONE
