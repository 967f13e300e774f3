"""``/v1/completions``: text or token prompts, ``echo``, ``logprobs`` (left-to-right scoring of
the prompt for echo, as lm-eval's loglikelihood requests need), streaming with usage.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from bicache_sgl.io_struct import RequestEvent, new_rid
from bicache_sgl.server.fields import check_completion_body
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
from bicache_sgl.server.protocol import (
    APIError,
    Item,
    check_batch_size,
    check_token_ids,
    engine_request,
    is_int,
    sampling_params_from,
)
from bicache_sgl.server.responses import SSE_DONE, ORJSONResponse, sse, sse_error, stream_text
from bicache_sgl.server.state import ServerState

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


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
            id_lists = [check_token_ids(prompt, "prompt")]
            texts = [None]
        elif all(isinstance(p, list) for p in prompt):
            id_lists = [check_token_ids(p, "prompt") for p in prompt]
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
        items = [Item(engine_request(ids, params, return_logprob=True, logprob_start_len=i, top_logprobs_num=top,
                                     return_text_in_logprobs=True), log_metrics=False)
                 for ids, i in targets[lo:lo + SCORE_CHUNK]]
        sub = state.new_submission(items, v1_field_names())
        await sub.submit()
        finals = await collect(state, sub, request)
        if finals is None:
            return None
        for ev in finals:
            meta = ev.meta_info or {}
            got = meta.get("input_token_logprobs") or []
            if not got:  # aborted before its forward (abort_all, the scheduler): no logprob to report
                raise ScoringAborted(ev.finish_reason or meta.get("finish_reason"))
            out.append((got[0], (meta.get("input_top_logprobs") or [None])[0]))
    return out


class ScoringAborted(Exception):
    """A left-to-right scoring request ended without its logprob (an abort by an admin's
    ``abort_all``): the completion is answered as aborted, never with a made-up logprob."""

    def __init__(self, finish_reason: Any) -> None:
        super().__init__("scoring request aborted")
        self.finish_reason = finish_reason if isinstance(finish_reason, dict) else {"type": "abort"}


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
    texts: list[str] = field(default_factory=list)  # prompt text per prompt (for echo; "" for ids without echo)
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


async def completions(request: Request) -> Response:
    state, body = await read_body(request, check_completion_body)
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
    # max_tokens always counts as given: OpenAI's default (16) is a real limit, never shortened
    items = make_items(state, id_lists, sp, True, return_logprob=logprobs is not None,
                       top_logprobs_num=logprobs or 0, return_text_in_logprobs=logprobs is not None)
    sub = state.new_submission(items, v1_field_names())
    job = CompletionJob(state=state, sub=sub, items=items, object_type="text_completion",
                        rid=f"cmpl-{new_rid()}",
                        # only echo shows a prompt's text: token-id prompts are decoded only then
                        texts=[p if p is not None else state.tokenizer.decode(ids) if echo else ""
                               for p, ids in zip(texts, id_lists)],
                        echo=echo, logprobs=logprobs, continuous_usage=continuous_usage(body))
    if job.scoring:
        try:
            prompt_lp = await echo_prompt_logprobs(state, request, id_lists, logprobs or 0)
        except ScoringAborted as e:  # answered as any aborted request is: 200, finish_reason abort
            return aborted_completion(job, e.finish_reason, stream)
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
    try:
        ends = await job.end_entries(request, list(zip(items, finals)))
    except ScoringAborted as e:
        return aborted_completion(job, e.finish_reason, False)
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


def aborted_completion(job: CompletionJob, finish_reason: dict, stream: bool) -> Response:
    """The answer to a completion whose prompt scoring was aborted (nothing was generated): each
    choice echoes its prompt with ``finish_reason`` ``abort`` and no logprobs, as a plain answer
    or as one stream."""
    reason, matched = finish(finish_reason)
    choices = [{"index": i, "text": job.texts[item.prompt_index] if job.echo else "", "logprobs": None,
                "finish_reason": reason, "matched_stop": matched} for i, item in enumerate(job.items)]
    prompt = sum(len(item.input_ids) for item in job.items)
    use = {"prompt_tokens": prompt, "completion_tokens": 0, "total_tokens": prompt}
    if not stream:
        return ORJSONResponse(job.envelope(choices, use))

    async def frames() -> AsyncIterator[bytes]:
        yield sse(job.envelope(choices, None))
        yield SSE_DONE

    return StreamingResponse(frames(), media_type="text/event-stream", headers=STREAM_HEADERS)


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
                try:
                    got = await job.end_entries(request, [(item, ev)])
                except ScoringAborted as e:  # the end token's entry is missing: the choice ends as aborted
                    ev = replace(ev, finish_reason=e.finish_reason)
                    got = [None]
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
            if (err := abort_error(ev)) is not None:  # not a finish_reason on /v1: an error frame
                yield sse_error(err.message)
                continue
        yield sse(job.envelope([{"index": i, "text": delta, "logprobs": lps, "finish_reason": reason,
                                 "matched_stop": matched}], job.chunk_usage(i, ev)))
    if job.sub.disconnected:
        return
    if want_usage and all(f is not None for f in finals):
        yield sse(job.envelope([], job.usage(finals)))  # type: ignore[arg-type]  # all set (checked)
    yield SSE_DONE
