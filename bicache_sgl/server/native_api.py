"""SGLang's native routes: ``/generate``, info, health, cache, metrics, abort.

Every handler is a module-level function on :data:`router`; it reaches the shared
:class:`~bicache_sgl.server.state.ServerState` through ``request.app.state.server``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response, StreamingResponse

from bicache_sgl.config import SamplingParams
from bicache_sgl.io_struct import RequestEvent
from bicache_sgl.server.auth import AuthLevel, auth_level
from bicache_sgl.server.bridge import Submission
from bicache_sgl.server.protocol import (
    APIError,
    GenerateInput,
    Item,
    engine_request,
    parse_generate,
    parse_json_body,
    require_object,
)
from bicache_sgl.server.responses import (
    SSE_DONE,
    SSE_HEADERS,
    ORJSONResponse,
    raise_if_failed,
    sse,
    sse_error,
    stream_text,
)
from bicache_sgl.server.state import ServerState, get_state

logger = logging.getLogger("bicache_sgl.server")

router = APIRouter()

LOGPROB_KEYS = ("input_token_logprobs", "output_token_logprobs", "input_top_logprobs", "output_top_logprobs",
                "input_token_ids_logprobs", "output_token_ids_logprobs")
MAX_FLUSH_TIMEOUT_S = 600.0
HEALTH_PROBE_TIMEOUT_S = 20.0
RECENT_WORK_S = 2.0  # /health_generate answers from a request that finished this recently


# ---------------------------------------------------------------------------------------------
# health and info
# ---------------------------------------------------------------------------------------------

@router.get("/health")
@router.get("/ready")
async def health(request: Request) -> Response:
    """200 once the warmup request went through, 503 before (and while shutting down)."""
    return Response(status_code=200 if get_state(request).ready else 503)


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    """A one-token generation through the engine (skipped if a request just finished)."""
    state = get_state(request)
    if not state.ready:
        return Response(status_code=503)
    if time.time() - max(state.metrics.last_finish, state.last_probe_ok) < RECENT_WORK_S:
        return Response(status_code=200)  # the engine just finished work: it is alive
    ok = await probe(state, timeout=HEALTH_PROBE_TIMEOUT_S)
    if ok:
        state.last_probe_ok = time.time()
    return Response(status_code=200 if ok else 503)


@router.get("/get_model_info")
@router.get("/model_info")
async def model_info(request: Request) -> ORJSONResponse:
    return ORJSONResponse(get_state(request).model_info())


@router.get("/get_server_info")
@router.get("/server_info")
async def server_info(request: Request) -> ORJSONResponse:
    """The server args (API key redacted) and ``internal_states: [{...}]``, as SGLang's."""
    from bicache_sgl.server import __version__

    state = get_state(request)
    info = state.args.public_dict()
    internal = await state.internal_state()
    info.update({
        "version": __version__,
        "model_path": state.model_path,
        "served_model_name": state.served_model_name,
        "context_length": state.context_length,
        "internal_states": [internal],
    })
    # a block-diffusion engine decodes with the checkpoint's block length and schedule unless a
    # flag overrides it: the top-level decode fields say what it runs, not the flags' defaults
    decoding = internal.get("decoding")
    if isinstance(decoding, dict):
        info.update({k: decoding[k] for k in ("block_length", "threshold", "steps_per_block") if k in decoding})
    return ORJSONResponse(info)


@router.get("/metrics")
async def metrics(request: Request) -> PlainTextResponse:
    state = get_state(request)
    text = state.metrics.render(await state.engine_stats())
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")


# ---------------------------------------------------------------------------------------------
# cache and request control
# ---------------------------------------------------------------------------------------------

@router.api_route("/flush_cache", methods=["GET", "POST"])
@auth_level(AuthLevel.ADMIN_OPTIONAL)
async def flush_cache(request: Request) -> PlainTextResponse:
    """Drop the cached prefixes; ``?timeout=S`` retries while requests are running. 200 or 400."""
    engine = get_state(request).engine
    timeout = 0.0
    raw = request.query_params.get("timeout")
    if raw is not None:
        try:
            timeout = float(raw)
        except ValueError:
            raise APIError(f"timeout must be a number, got {raw!r}") from None
        if not math.isfinite(timeout) or timeout < 0:
            raise APIError(f"timeout must be a finite number of seconds >= 0, got {raw!r}")
        timeout = min(timeout, MAX_FLUSH_TIMEOUT_S)
    deadline = time.monotonic() + timeout
    while True:
        ok = bool(await asyncio.to_thread(engine.flush_cache))
        if ok or time.monotonic() >= deadline:
            break
        await asyncio.sleep(0.1)
    if ok:
        return PlainTextResponse("Cache flushed.\nPlease check backend logs for more details. "
                                 "(When there are running or waiting requests, the operation will not be performed.)\n")
    return PlainTextResponse("Cache not flushed: requests are running or waiting.\n", status_code=400)


@router.post("/abort_request")
@auth_level(AuthLevel.ADMIN_OPTIONAL)  # by rid too, as SGLang: a client's own hang-up needs no route
async def abort_request(request: Request) -> Response:
    """SGLang's abort: ``{"rid": ...}`` for one request, ``{"abort_all": true}`` for every one in
    flight (each ends with finish_reason ``abort``)."""
    body = require_object(parse_json_body(await request.body(), allow_empty=True) or {})
    abort_all = body.get("abort_all", False)
    if not isinstance(abort_all, bool):
        raise APIError("abort_all must be a boolean", param="abort_all")
    if abort_all:
        await asyncio.to_thread(get_state(request).engine.abort_all)
        return Response(status_code=200)
    rid = body.get("rid")
    if not isinstance(rid, str) or not rid:
        raise APIError("rid must be a non-empty string (or pass abort_all: true)", param="rid")
    await asyncio.to_thread(get_state(request).engine.abort, rid)
    return Response(status_code=200)


@router.post("/concate_and_append_request")
async def concate_and_append(request: Request) -> ORJSONResponse:
    """SGLang's frontend calls this at ``fork(...).join(mode="concate_and_append")``. By then the
    client has already appended every fork's text to the joined state (``interpreter.py``,
    ``_execute_concatenate_and_append_kv_cache``), and its next ``/generate`` sends that whole
    text. The call only asks the server to splice the forks' KV caches together so that text is
    not encoded again; the answer does not depend on it. This server keeps no per-request KV
    after a request finishes (the shared prefix cache covers the common prompt prefix), so there
    is nothing to splice: answering 200 without doing anything is correct. The body is still
    checked so that a malformed call is not mistaken for a working one."""
    body = require_object(parse_json_body(await request.body()))
    src, dst = body.get("src_rids"), body.get("dst_rid")
    if not isinstance(src, list) or not all(isinstance(r, str) for r in src):
        raise APIError("src_rids must be a list of request ids", param="src_rids")
    if not isinstance(dst, str):
        raise APIError("dst_rid must be a request id", param="dst_rid")
    return ORJSONResponse({"success": True, "message": "nothing to splice: the joined text is sent in full by the "
                                                       "next /generate and served from the prefix cache"})


@router.api_route("/start_profile", methods=["GET", "POST"])
@router.api_route("/stop_profile", methods=["GET", "POST"])
@auth_level(AuthLevel.ADMIN_OPTIONAL)
async def profile(request: Request) -> Response:
    """Not implemented: answered 501 so a benchmark run with --profile fails visibly instead of
    reporting a trace that was never recorded."""
    raise APIError(f"{request.url.path} is not implemented: this server has no profiler; run the server under "
                   "an external profiler (e.g. py-spy, nsys) instead", status=501)


# ---------------------------------------------------------------------------------------------
# /generate
# ---------------------------------------------------------------------------------------------

@router.api_route("/generate", methods=["POST", "PUT"])
async def generate(request: Request) -> Response:
    state = get_state(request)
    args = state.args
    body = parse_json_body(await request.body())
    gi = parse_generate(body, state.tokenize, context_length=state.context_length,
                        default_sampling=state.default_sampling, block_length=args.decode.block_length,
                        max_batch_size=args.max_batch_size, max_n=args.max_n)
    sub = state.new_submission(gi.items)
    await sub.submit()
    if gi.stream:
        return StreamingResponse(native_stream(state, gi, sub, request), media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    finals: list[RequestEvent | None] = [None] * len(gi.items)
    async for i, ev in sub.events(request.is_disconnected):
        if ev.finished:
            finals[i] = ev
    if any(f is None for f in finals):  # client went away; nobody reads this
        return Response(status_code=499)
    done: list[RequestEvent] = finals  # type: ignore[assignment]  # every entry is set (checked above)
    raise_if_failed(done)
    state.check_not_aborted_by_shutdown(done)
    outs = [final_output(f) for f in done]
    return ORJSONResponse(outs if gi.batch else outs[0])


def final_output(ev: RequestEvent) -> dict[str, Any]:
    """One request's answer; its ``meta_info`` is the engine's (the server adds nothing)."""
    return {"text": ev.text or "", "output_ids": list(ev.output_ids or []), "meta_info": dict(ev.meta_info)}


async def native_stream(state: ServerState, gi: GenerateInput, sub: Submission,
                        request: Request) -> AsyncIterator[bytes]:
    """SSE frames of a /generate stream: cumulative chunks (SGLang's default) or deltas with
    ``--incremental-streaming-output``; ``[DONE]`` at the end unless the client went away."""
    incremental = state.args.incremental_streaming_output
    n = len(gi.items)
    sent_text = [0] * n
    sent_ids = [0] * n
    sent_lp: list[dict[str, int]] = [{} for _ in range(n)]
    try:
        async for i, ev in sub.events(request.is_disconnected):
            if ev.error:
                yield sse_error(str(ev.error), **({"index": i} if gi.batch else {}))
                continue
            item = gi.items[i]
            text = stream_text(item, ev)
            ids = list(ev.output_ids or [])
            if incremental:
                chunk_text = text[sent_text[i]:]
                chunk_ids = ids[sent_ids[i]:]
                if not ev.finished and not chunk_text and not chunk_ids:
                    continue
                meta = dict(ev.meta_info)  # the engine's; only its logprob lists are cut to deltas
                for k in LOGPROB_KEYS:
                    v = meta.get(k)
                    if isinstance(v, list):
                        start = sent_lp[i].get(k, 0)
                        meta[k] = v[start:]
                        sent_lp[i][k] = len(v)
                sent_text[i], sent_ids[i] = len(text), len(ids)
                chunk = {"text": chunk_text, "output_ids": chunk_ids, "meta_info": meta}
            else:
                chunk = {"text": text, "output_ids": ids, "meta_info": dict(ev.meta_info)}
            if gi.batch:
                chunk["index"] = i
            yield sse(chunk)
        if not sub.disconnected:
            yield SSE_DONE
    except asyncio.CancelledError:
        sub.abort()
        raise
    except Exception as e:  # the status line is gone; report in-band
        logger.exception("streaming failed")
        sub.abort()
        yield sse_error(f"internal error: {type(e).__name__}: {e}")
        yield SSE_DONE


async def probe(state: ServerState, timeout: float) -> bool:
    """A one-token generation through the engine, as SGLang's /health_generate does (not
    counted in the metrics)."""
    ids = state.tokenize("Hi") or [0]
    item = Item(engine_request(ids, SamplingParams(max_new_tokens=1, temperature=0.0)), log_metrics=False)
    sub = Submission(state.engine, [item])
    try:
        await sub.submit()
    except APIError:
        return False

    async def wait() -> bool:
        async for _, ev in sub.events():
            if ev.finished:
                return not ev.error
        return False

    try:
        return await asyncio.wait_for(wait(), timeout)
    except asyncio.TimeoutError:
        sub.abort()
        return False
