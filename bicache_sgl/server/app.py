"""The FastAPI application: SGLang's native routes, auth, errors, health and readiness.

``create_app(engine, args)`` wires an already-built :class:`bicache_sgl.Engine` to HTTP; the
OpenAI routes live in :mod:`bicache_sgl.server.openai_api`. The engine runs in its own thread;
handlers only ``submit`` and then await events (see :mod:`bicache_sgl.server.bridge`).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from contextlib import asynccontextmanager
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response, StreamingResponse

from bicache_sgl.server.args import ServerArgs
from bicache_sgl.server.bridge import Submission
from bicache_sgl.server.chat import load_chat_template
from bicache_sgl.server.metrics import Metrics
from bicache_sgl.server.protocol import APIError, GenerateInput, Item, parse_generate, parse_json_body

logger = logging.getLogger("bicache_sgl.server")

READY_MESSAGE = "The server is fired up and ready to roll!"
OPEN_PATHS = ("/health", "/health_generate", "/ready", "/metrics")
LOGPROB_KEYS = ("input_token_logprobs", "output_token_logprobs", "input_top_logprobs", "output_top_logprobs",
                "input_token_ids_logprobs", "output_token_ids_logprobs")
WARMUP_PROMPT = "The capital city of France is"


def _default(o: Any) -> Any:
    if hasattr(o, "tolist"):
        return o.tolist()
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, (set, tuple)):
        return list(o)
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def dumps(obj: Any) -> bytes:
    return orjson.dumps(obj, default=_default, option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS)


class ORJSONResponse(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return dumps(content)


def sse(obj: Any) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


class ServerState:
    """What every handler needs: the engine, the args, tokenizer helpers and counters."""

    def __init__(self, engine: Any, args: ServerArgs):
        self.engine = engine
        self.args = args
        self.tokenizer = engine.tokenizer
        self.model_path = str(getattr(engine, "model_path", None) or args.model_path or "")
        self.tokenizer_path = args.tokenizer_path or self.model_path
        self.served_model_name = (args.served_model_name or getattr(engine, "served_model_name", None)
                                  or self.model_path)
        self.context_length = getattr(engine, "context_length", None) or args.context_length
        mc = getattr(engine, "model_config", None)
        self.model_config = mc
        self.vocab_size = getattr(mc, "vocab_size", None)
        self.chat_template = load_chat_template(args.chat_template)
        self.default_sampling = args.default_sampling_params()
        self.metrics = Metrics(self.served_model_name)
        self.ready = False
        self.draining = False  # shutting down: new requests get 503, running ones finish or are aborted
        self.created = int(time.time())
        self.last_probe_ok = 0.0

    # -- tokenizer -------------------------------------------------------------------------
    def tokenize(self, text: str) -> list[int]:
        """Prompt text -> ids, special tokens added as the model expects (SGLang does the same)."""
        return list(self.tokenizer.encode(text))

    def tokenize_rendered(self, text: str) -> list[int]:
        """A chat-template output: its special tokens are already in the text."""
        bos = getattr(self.tokenizer, "bos_token", None)
        add = not (bos and text.startswith(bos))
        return list(self.tokenizer.encode(text, add_special_tokens=add))

    def decode_token(self, tid: int) -> str:
        return self.tokenizer.decode([tid])

    # -- accounting --------------------------------------------------------------------------
    def record_finish(self, item: Item, ev: Any, elapsed: float, ttft: float | None = None) -> None:
        meta = dict(getattr(ev, "meta_info", None) or {})
        meta.setdefault("completion_tokens", len(ev.output_ids or []))
        meta.setdefault("finish_reason", ev.finish_reason)
        self.metrics.on_finish(len(item.input_ids), meta, elapsed, ttft)

    def new_submission(self, items: list[Item]) -> Submission:
        sub = Submission(self.engine, items)

        def on_finish(i: int, ev: Any, elapsed: float) -> None:
            self.record_finish(sub.items[i], ev, elapsed, sub.first_output[i])

        sub._on_finish = on_finish
        return sub

    async def engine_stats(self) -> dict[str, Any]:
        get = getattr(self.engine, "get_stats", None)
        if get is None:
            return {}
        try:
            return dict(await asyncio.to_thread(get) or {})
        except Exception:  # noqa: BLE001
            logger.exception("engine.get_stats() failed")
            return {}

    async def internal_state(self) -> dict[str, Any]:
        snap = self.metrics.snapshot()
        state: dict[str, Any] = {
            "avg_spec_accept_length": self.metrics.avg_tokens_per_forward,
            "last_gen_throughput": self.metrics.gen_throughput(),
            "num_requests_total": snap["num_requests_total"],
            "prompt_tokens_total": snap["prompt_tokens_total"],
            "generation_tokens_total": snap["generation_tokens_total"],
            "cached_tokens_total": snap["cached_tokens_total"],
            "token_cache_hit_rate": snap["cache_hit_rate"],
            "forward_passes_total": snap["forward_passes_total"],
            "prefix_cache": self.args.effective_prefix_cache(),
        }
        state.update(await self.engine_stats())
        return state

    async def engine_busy(self) -> int:
        """Requests the engine is running or has queued."""
        st = await self.engine_stats()
        return int(st.get("num_running_reqs", 0) or 0) + int(st.get("num_waiting_reqs", 0) or 0)

    async def drain(self, timeout: float) -> None:
        """Graceful shutdown (SIGTERM/SIGINT), called before uvicorn closes the connections: new
        requests get 503 from now on; running and queued requests get ``timeout`` seconds to
        finish; whatever is still in the engine then is aborted ("server shutting down"), so
        every client still gets an answer (a 503 error, or a stream that ends with an abort
        finish_reason and [DONE]) instead of a cut connection."""
        self.draining = True
        self.ready = False
        deadline = time.monotonic() + timeout
        busy = await self.engine_busy()
        while busy and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            busy = await self.engine_busy()
        if busy:
            logger.warning("shutting down: aborting %d request(s) still running after %.1f s", busy, timeout)
        else:
            logger.info("shutting down: no request in flight")
        shutdown = getattr(self.engine, "shutdown", None)
        if shutdown is not None:
            try:
                await asyncio.to_thread(shutdown)  # fails what is left, each with an event
            except Exception:  # noqa: BLE001
                logger.exception("engine shutdown failed")

    def check_not_aborted_by_shutdown(self, finals: list[Any]) -> None:
        """Non-streaming answers for requests the shutdown aborted are a 503, not a 200."""
        if not self.draining:
            return
        for f in finals:
            fr = getattr(f, "finish_reason", None)
            if isinstance(fr, dict) and fr.get("type") == "abort":
                raise APIError("the server is shutting down; the request was aborted before it finished",
                               status=503)

    def model_info(self) -> dict[str, Any]:
        mc = self.model_config
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.tokenizer_path,
            "served_model_name": self.served_model_name,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": getattr(mc, "arch", None),
            "context_length": self.context_length,
            "vocab_size": self.vocab_size,
            "mask_token_id": getattr(mc, "mask_token_id", None),
            "eos_token_ids": list(getattr(mc, "eos_token_ids", None) or []),
            "n_layers": getattr(mc, "n_layers", None),
        }


# ---------------------------------------------------------------------------------------------
# native /generate output
# ---------------------------------------------------------------------------------------------

def build_meta(state: ServerState, item: Item, ev: Any, sub: Submission, i: int) -> dict[str, Any]:
    """SGLang's ``meta_info`` for one event (final or intermediate)."""
    out_ids = list(ev.output_ids or [])
    meta: dict[str, Any] = {
        "id": sub.rids[i] or item.rid,
        "finish_reason": None,
        "prompt_tokens": len(item.input_ids),
        "completion_tokens": len(out_ids),
        "cached_tokens": 0,
        "e2e_latency": time.perf_counter() - sub.start,
    }
    engine_meta = dict(getattr(ev, "meta_info", None) or {})
    meta.update({k: v for k, v in engine_meta.items() if v is not None or k not in meta})
    if ev.finished:
        meta["finish_reason"] = ev.finish_reason if ev.finish_reason is not None else engine_meta.get("finish_reason")
        meta.setdefault("e2e_latency", time.perf_counter() - sub.start)
    else:
        meta["finish_reason"] = None
        meta["completion_tokens"] = len(out_ids)
    if item.logprob.return_logprob:
        if "output_token_logprobs" in meta:
            meta["output_token_logprobs_length"] = len(meta["output_token_logprobs"] or [])
    else:
        for k in LOGPROB_KEYS:
            meta.pop(k, None)
    return meta


def stream_text(item: Item, ev: Any) -> str:
    """Text that is safe to send before the request finished: never a trailing partial UTF-8
    character, never the start of a stop string (the engine trims a matched stop string, so
    sending its first characters early would make the streamed text shrink later)."""
    text = ev.text or ""
    if ev.finished:
        return text
    text = text.rstrip("\ufffd")
    hold = 0
    for stop in item.params.stop:
        for k in range(min(len(stop) - 1, len(text)), hold, -1):
            if text.endswith(stop[:k]):
                hold = k
                break
    return text[:len(text) - hold] if hold else text


def final_output(state: ServerState, item: Item, ev: Any, sub: Submission, i: int) -> dict[str, Any]:
    return {"text": ev.text or "", "output_ids": list(ev.output_ids or []), "meta_info": build_meta(state, item, ev, sub, i)}


async def native_stream(state: ServerState, gi: GenerateInput, sub: Submission, request: Request):
    incremental = state.args.incremental_streaming_output
    n = len(gi.items)
    sent_text = [0] * n
    sent_ids = [0] * n
    sent_lp: list[dict[str, int]] = [dict() for _ in range(n)]
    try:
        async for i, ev in sub.events(request.is_disconnected):
            if getattr(ev, "error", None):
                yield sse({"error": {"message": str(ev.error), "type": "InternalServerError", "code": 500},
                           **({"index": i} if gi.batch else {})})
                continue
            item = gi.items[i]
            text = stream_text(item, ev)
            ids = list(ev.output_ids or [])
            if incremental:
                chunk_text = text[sent_text[i]:]
                chunk_ids = ids[sent_ids[i]:]
                if not ev.finished and not chunk_text and not chunk_ids:
                    continue
                meta = build_meta(state, item, ev, sub, i)
                for k in LOGPROB_KEYS:
                    v = meta.get(k)
                    if isinstance(v, list):
                        start = sent_lp[i].get(k, 0)
                        meta[k] = v[start:]
                        sent_lp[i][k] = len(v)
                sent_text[i], sent_ids[i] = len(text), len(ids)
                chunk = {"text": chunk_text, "output_ids": chunk_ids, "meta_info": meta}
            else:
                chunk = {"text": text, "output_ids": ids, "meta_info": build_meta(state, item, ev, sub, i)}
            if gi.batch:
                chunk["index"] = i
            yield sse(chunk)
        if not sub.disconnected:
            yield SSE_DONE
    except asyncio.CancelledError:
        sub.abort()
        raise
    except Exception as e:  # noqa: BLE001 - the status line is gone; report in-band
        logger.exception("streaming failed")
        sub.abort()
        yield sse({"error": {"message": f"internal error: {type(e).__name__}: {e}", "type": "InternalServerError",
                             "code": 500}})
        yield SSE_DONE


# ---------------------------------------------------------------------------------------------
# app
# ---------------------------------------------------------------------------------------------

def _error_body(path: str, err: APIError) -> dict[str, Any]:
    if err.status == 401:
        return {"error": "Unauthorized"}
    if path.startswith("/v1/"):
        return {"error": {"message": err.message, "type": err.err_type, "param": err.param, "code": err.code}}
    return {"error": {"message": err.message, "type": err.err_type, "code": err.code}}


def error_response(path: str, err: APIError) -> ORJSONResponse:
    return ORJSONResponse(_error_body(path, err), status_code=err.status)


def create_app(engine: Any, args: ServerArgs) -> FastAPI:
    state = ServerState(engine, args)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        threading.Thread(target=_warmup_and_announce, args=(state,), name="bicache-warmup", daemon=True).start()
        try:
            yield
        finally:
            state.ready = False
            shutdown = getattr(engine, "shutdown", None)
            if shutdown is not None:
                try:
                    await asyncio.to_thread(shutdown)
                except Exception:  # noqa: BLE001
                    logger.exception("engine shutdown failed")

    app = FastAPI(title="bicache-sgl", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state

    app.add_middleware(AuthAndCount, state=state)

    @app.exception_handler(APIError)
    async def api_error_handler(request: Request, exc: APIError):
        return error_response(request.url.path, exc)

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, exc: Exception):
        logger.exception("unexpected error on %s", request.url.path)
        return error_response(request.url.path, APIError(f"internal error: {type(exc).__name__}: {exc}", status=500,
                                                         err_type="InternalServerError"))

    # -- health ---------------------------------------------------------------------------
    @app.get("/health")
    @app.get("/ready")
    async def health():
        return Response(status_code=200 if state.ready else 503)

    @app.get("/health_generate")
    async def health_generate():
        if not state.ready:
            return Response(status_code=503)
        if time.time() - max(state.metrics.last_finish, state.last_probe_ok) < 2.0:
            return Response(status_code=200)  # the engine just finished work: it is alive
        ok = await _probe(state, timeout=20.0)
        if ok:
            state.last_probe_ok = time.time()
        return Response(status_code=200 if ok else 503)

    # -- info -----------------------------------------------------------------------------
    @app.get("/get_model_info")
    @app.get("/model_info")
    async def model_info():
        return ORJSONResponse(state.model_info())

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def server_info():
        from bicache_sgl.server import __version__

        info = args.public_dict()
        info.update({
            "version": __version__,
            "model_path": state.model_path,
            "served_model_name": state.served_model_name,
            "context_length": state.context_length,
            "internal_states": [await state.internal_state()],
        })
        return ORJSONResponse(info)

    @app.get("/metrics")
    async def metrics():
        text = state.metrics.render(await state.engine_stats())
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    # -- cache ----------------------------------------------------------------------------
    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(request: Request):
        timeout = 0.0
        raw = request.query_params.get("timeout")
        if raw is not None:
            try:
                timeout = float(raw)
            except ValueError:
                raise APIError(f"timeout must be a number, got {raw!r}") from None
            if not math.isfinite(timeout) or timeout < 0:
                raise APIError(f"timeout must be a finite number of seconds >= 0, got {raw!r}")
            timeout = min(timeout, 600.0)
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

    # -- generation -----------------------------------------------------------------------
    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request):
        body = parse_json_body(await request.body())
        gi = parse_generate(body, state.tokenize, vocab_size=state.vocab_size, context_length=state.context_length,
                            default_sampling=state.default_sampling, block_length=args.block_length,
                            max_batch_size=args.max_batch_size, max_n=args.max_n)
        sub = state.new_submission(gi.items)
        await sub.submit()
        if gi.stream:
            return StreamingResponse(native_stream(state, gi, sub, request), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        finals: list[Any] = [None] * len(gi.items)
        async for i, ev in sub.events(request.is_disconnected):
            if ev.finished:
                finals[i] = ev
        if any(f is None for f in finals):  # client went away; nobody reads this
            return Response(status_code=499)
        for f in finals:
            if getattr(f, "error", None):
                raise APIError(f"generation failed: {f.error}", status=500, err_type="InternalServerError")
        state.check_not_aborted_by_shutdown(finals)
        outs = [final_output(state, gi.items[i], f, sub, i) for i, f in enumerate(finals)]
        return ORJSONResponse(outs if gi.batch else outs[0])

    @app.post("/abort_request")
    async def abort_request(request: Request):
        body = require_dict(parse_json_body(await request.body(), allow_empty=True) or {})
        rid = body.get("rid")
        if not isinstance(rid, str) or not rid:
            raise APIError("rid must be a non-empty string")
        await asyncio.to_thread(engine.abort, rid)
        return Response(status_code=200)

    @app.post("/concate_and_append_request")
    async def concate_and_append(request: Request):
        # SGLang's frontend already concatenated the text client-side; nothing to do here.
        await request.body()
        return ORJSONResponse({"success": True})

    @app.api_route("/start_profile", methods=["GET", "POST"])
    @app.api_route("/stop_profile", methods=["GET", "POST"])
    async def profile():
        return PlainTextResponse("Profiling is not supported by this server; request ignored.\n")

    from bicache_sgl.server.openai_api import register_openai_routes

    register_openai_routes(app, state)
    return app


class AuthAndCount:
    """Pure ASGI middleware (no response buffering, streams untouched): the API key check and
    per-route status counts for /metrics."""

    def __init__(self, app: Any, state: ServerState):
        self.app = app
        self.state = state
        self._routes: set[str] | None = None

    def _route_label(self, scope: dict) -> str:
        if self._routes is None:
            app = scope.get("app")
            routes = getattr(getattr(app, "router", None), "routes", []) if app is not None else []
            self._routes = {r.path for r in routes if "{" not in getattr(r, "path", "{")}
        path = scope.get("path", "")
        if path.startswith("/v1/models/"):
            return "/v1/models/{model_id}"
        return path if path in self._routes else "other"

    async def _reject(self, scope: dict, send: Any, err: APIError) -> None:
        body = dumps(_error_body(scope.get("path", ""), err))
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if err.status == 413:
            headers.append((b"connection", b"close"))  # the unread body makes the connection unusable
        await send({"type": "http.response.start", "status": err.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        self.state.metrics.on_http(self._route_label(scope), err.status)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        key = self.state.args.api_key
        if key and not path.startswith(OPEN_PATHS) and not _authorized(scope, key):
            await self._reject(scope, send, APIError("Unauthorized", status=401))
            return
        if self.state.draining and not path.startswith(OPEN_PATHS):
            await self._reject(scope, send, APIError("the server is shutting down", status=503))
            return
        limit = self.state.args.max_request_bytes
        if limit:
            declared = _content_length(scope)
            if declared is not None and declared > limit:
                await self._reject(scope, send, _too_large(declared, limit))
                return
            receive = _limited_receive(receive, limit)
        status = [500]

        async def send_and_note(message: dict) -> None:
            if message.get("type") == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            self.state.metrics.on_http(self._route_label(scope), status[0])


def _too_large(size: int | None, limit: int) -> APIError:
    got = f"{size} bytes" if size is not None else f"more than {limit} bytes"
    return APIError(f"the request body is {got}; this server accepts at most {limit} bytes (--max-request-bytes)",
                    status=413)


def _content_length(scope: dict) -> int | None:
    for k, v in scope.get("headers", []):
        if k.lower() == b"content-length":
            try:
                return int(v)
            except ValueError:
                return None
    return None


def _limited_receive(receive: Any, limit: int) -> Any:
    """``receive`` that fails with 413 once the body passes ``limit`` bytes (chunked uploads
    carry no Content-Length to check up front). The APIError surfaces from the handler's
    ``await request.body()`` and is answered by the APIError handler."""
    seen = [0]

    async def wrapped() -> dict:
        message = await receive()
        if message.get("type") == "http.request":
            seen[0] += len(message.get("body", b""))
            if seen[0] > limit:
                raise _too_large(None, limit)
        return message

    return wrapped


def require_dict(obj: Any) -> dict:
    if not isinstance(obj, dict):
        raise APIError("request body must be a JSON object")
    return obj


def _authorized(scope: dict, key: str) -> bool:
    headers = {k.lower(): v for k, v in scope.get("headers", [])}
    auth = headers.get(b"authorization", b"")
    if auth[:7].lower() == b"bearer ":
        given = auth[7:].strip()
    else:
        given = headers.get(b"x-api-key", b"").strip()
    return bool(given) and hmac.compare_digest(given, key.encode("utf-8"))


async def _probe(state: ServerState, timeout: float) -> bool:
    """A one-token generation through the engine, as SGLang's /health_generate does."""
    from bicache_sgl.config import SamplingParams
    from bicache_sgl.server.protocol import LogprobOptions

    ids = state.tokenize("Hi") or [0]
    item = Item(input_ids=ids, params=SamplingParams(max_new_tokens=1, temperature=0.0),
                logprob=LogprobOptions())
    sub = Submission(state.engine, [item])
    try:
        await sub.submit()
    except APIError:
        return False

    async def wait() -> bool:
        async for _, ev in sub.events():
            if ev.finished:
                return not getattr(ev, "error", None)
        return False

    try:
        return await asyncio.wait_for(wait(), timeout)
    except asyncio.TimeoutError:
        sub.abort()
        return False


def _warmup_and_announce(state: ServerState) -> None:
    """Wait for the socket, send SGLang's warmup request, then log the ready line once."""
    args = state.args
    url = args.url
    headers = {"Content-Type": "application/json"}
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    deadline = time.time() + 120
    while True:
        try:
            req = urllib.request.Request(url + "/get_model_info", headers=headers)
            with urllib.request.urlopen(req, timeout=5) as r:
                if r.status == 200:
                    break
        except (urllib.error.URLError, OSError):
            pass
        if time.time() > deadline:
            logger.error("the HTTP server did not come up at %s", url)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        time.sleep(0.05)
    if not args.skip_server_warmup:
        body = orjson.dumps({"text": WARMUP_PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 8}})
        try:
            req = urllib.request.Request(url + "/generate", data=body, headers=headers, method="POST")
            with urllib.request.urlopen(req, timeout=600) as r:
                r.read()
        except Exception as e:  # noqa: BLE001
            logger.error("warmup request failed (%s); shutting down", e)
            os.kill(os.getpid(), signal.SIGTERM)
            return
    state.ready = True
    logger.info("%s URL: %s", READY_MESSAGE, url)
