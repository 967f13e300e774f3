"""The FastAPI application: ``create_app(engine, args)`` wires an engine to the routes.

The routes are module-level handlers in :mod:`bicache_sgl.server.native_api` (SGLang's native
API) and :mod:`bicache_sgl.server.openai_api` (the OpenAI API); they reach the shared
:class:`~bicache_sgl.server.state.ServerState` through ``request.app.state.server``. This module
only adds the middleware, the error handlers, the routers and the startup/shutdown hooks. The
engine runs in its own process (or thread, ``--engine-in-process``); handlers only ``submit``
and then await events (see :mod:`bicache_sgl.server.bridge`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import orjson
from fastapi import APIRouter, FastAPI, Request
from fastapi.routing import APIRoute
from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.routing import Route

from bicache_sgl.engine.interface import EngineClient
from bicache_sgl.engine.process import EngineDeadError
from bicache_sgl.server import native_api, openai_api
from bicache_sgl.server.args import ServerArgs
from bicache_sgl.server.middleware import CLIENT_CLOSED, AuthAndCount
from bicache_sgl.server.protocol import APIError
from bicache_sgl.server.responses import ORJSONResponse, error_response
from bicache_sgl.server.state import ServerState

logger = logging.getLogger("bicache_sgl.server")

READY_MESSAGE = "The server is fired up and ready to roll!"
WARMUP_PROMPT = "The capital city of France is"
SOCKET_READY_TIMEOUT_S = 120.0  # for the HTTP socket to answer before the warmup request (the engine
# process has its own start-up limit: engine/process.py STARTUP_TIMEOUT_S)
WARMUP_TIMEOUT_S = 600.0


def create_app(engine: EngineClient, args: ServerArgs) -> FastAPI:
    """The app serving ``engine`` with ``args``. Nothing runs until the app starts: then a
    thread sends SGLang's warmup request and logs the ready line; on exit the engine stops."""
    state = ServerState(engine, args)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # an engine in another process: events reach their request on the loop without a thread hop
        engine.attach_loop(asyncio.get_running_loop())
        threading.Thread(target=warmup_and_announce, args=(state,), name="bicache-warmup", daemon=True).start()
        try:
            yield
        finally:
            state.ready = False
            await state.shutdown_engine()

    app = FastAPI(title="bicache-sgl", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    app.add_middleware(AuthAndCount, state=state)
    app.add_exception_handler(APIError, api_error_handler)
    app.add_exception_handler(EngineDeadError, engine_dead_handler)
    app.add_exception_handler(ClientDisconnect, client_gone_handler)
    app.add_exception_handler(Exception, unexpected_error_handler)
    add_routes(app, native_api.router, openai_api.router)
    return app


# The generation routes: matched first, and served as plain Starlette routes. Their handlers take
# only the Request and return a Response, so FastAPI's per-request wrapper (dependency solving,
# an exit stack, response checks) would do nothing for them but cost time on every request.
GENERATION_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")


def add_routes(app: FastAPI, *routers: APIRouter) -> None:
    """Register the routers' handlers as the app's own routes. Unlike ``include_router`` (which
    newer FastAPI versions keep as one nested entry), this keeps ``app.routes`` a flat list of
    paths, which the per-route /metrics labels and the route-enumerating auth tests read. The
    routes of :data:`GENERATION_PATHS` come first, as plain Starlette routes."""
    routes = [r for router in routers for r in router.routes]
    for route in routes:
        assert isinstance(route, APIRoute), route
    for route in routes:
        if route.path in GENERATION_PATHS:
            app.router.routes.append(Route(route.path, route.endpoint, methods=sorted(route.methods), name=route.name))
    for route in routes:
        if route.path not in GENERATION_PATHS:
            app.add_api_route(route.path, route.endpoint, methods=sorted(route.methods), name=route.name)


async def api_error_handler(request: Request, exc: Exception) -> ORJSONResponse:
    assert isinstance(exc, APIError)  # registered for APIError only
    return error_response(request.url.path, exc)


async def engine_dead_handler(request: Request, exc: Exception) -> ORJSONResponse:
    """The engine process is gone: every route that needs it answers 503 (so does /health)."""
    return error_response(request.url.path, APIError(f"the engine is not running: {exc}", status=503))


async def client_gone_handler(request: Request, exc: Exception) -> Response:
    """The client hung up before its request was read or answered: an abort, not a server error
    (logged at info; 499 in /metrics, and nobody reads the answer)."""
    logger.info("client went away during %s", request.url.path)
    return Response(status_code=CLIENT_CLOSED)


async def unexpected_error_handler(request: Request, exc: Exception) -> ORJSONResponse:
    logger.exception("unexpected error on %s", request.url.path)
    return error_response(request.url.path, APIError(f"internal error: {type(exc).__name__}: {exc}", status=500,
                                                     err_type="InternalServerError"))


def warmup_and_announce(state: ServerState) -> None:
    """Wait for the socket, send SGLang's warmup request, then log the ready line once. A server
    that cannot come up or whose warmup fails stops itself (SIGTERM) instead of hanging unready."""
    args = state.args
    url = args.url
    headers = {"Content-Type": "application/json"}
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    deadline = time.time() + SOCKET_READY_TIMEOUT_S
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
            with urllib.request.urlopen(req, timeout=WARMUP_TIMEOUT_S) as r:
                r.read()
        except Exception as e:  # any failure means the server must not report ready
            logger.error("warmup request failed (%s); shutting down", e)
            os.kill(os.getpid(), signal.SIGTERM)
            return
    state.ready = True
    logger.info("%s URL: %s", READY_MESSAGE, url)
