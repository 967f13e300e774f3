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
from bicache_sgl.server.chat import normalize_messages, render_chat
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
)
from bicache_sgl.server.protocol import APIError, LogprobOptions
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
    job = ChatJob(state=state, sub=sub, items=items, object_type="chat.completion", rid=f"chatcmpl-{new_rid()}",
                  want_lp=want_lp, continuous_usage=continuous_usage(body))
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
            yield job.chunk(i, {"content": delta}, lps=job.logprobs_for(meta, sent_lp[i]), ev=ev)
            sent[i] = len(text)
            sent_lp[i] = max(sent_lp[i], n_out)
        if ev.finished:
            finals[i] = ev
            if (err := abort_error(ev)) is not None:  # not a finish_reason on /v1: an error frame
                yield sse_error(err.message)
                continue
            reason, matched = finish(ev.finish_reason)
            yield job.chunk(i, {}, reason, matched, ev=ev)
    if job.sub.disconnected:
        return
    if want_usage and all(f is not None for f in finals):
        yield sse(job.envelope([], usage(items, finals), "chat.completion.chunk"))  # type: ignore[arg-type]
    yield SSE_DONE
