"""The ASGI middleware in front of every route: API and admin keys (bicache_sgl/server/auth.py),
shutdown 503, body size limit, and per-route status counts for /metrics."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from bicache_sgl.server.auth import OPEN_PREFIXES, AuthLevel, decide, presented_key, route_levels
from bicache_sgl.server.protocol import APIError
from bicache_sgl.server.responses import dumps, error_body
from bicache_sgl.server.state import ServerState

OPEN_PATHS = OPEN_PREFIXES  # never need a key: probes and scrapers have none

Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


class AuthAndCount:
    """Pure ASGI middleware (no response buffering, streams untouched): the key checks and
    per-route status counts for /metrics."""

    def __init__(self, app: Any, state: ServerState):
        self.app = app
        self.state = state
        self._routes: set[str] | None = None
        self._levels: dict[str, AuthLevel] | None = None

    def _app_routes(self, scope: dict) -> list:
        app = scope.get("app")
        return app.router.routes if app is not None else []

    def _route_label(self, scope: dict) -> str:
        # a bounded label set: unknown paths are "other", so scanners cannot grow /metrics
        if self._routes is None:
            self._routes = {r.path for r in self._app_routes(scope) if "{" not in r.path}
        path = scope.get("path", "")
        if path.startswith("/v1/models/"):
            return "/v1/models/{model_id}"
        return path if path in self._routes else "other"

    def _auth_status(self, scope: dict) -> int | None:
        """None when the request may go on, else 401/403 (bicache_sgl/server/auth.py). Every route
        with a level above NORMAL has a fixed path, so the level is a dict lookup; any other path
        (parametrised /v1/models/{id}, unknown paths that end in 404) is NORMAL."""
        args = self.state.args
        if not args.api_key and not args.admin_api_key:
            return None
        if self._levels is None:
            self._levels = route_levels(self._app_routes(scope))
        path = scope.get("path", "")
        return decide(self._levels.get(path, AuthLevel.NORMAL), path=path, method=scope.get("method", ""),
                      given=presented_key(scope.get("headers", [])), api_key=args.api_key,
                      admin_api_key=args.admin_api_key)

    async def _reject(self, scope: dict, send: Send, err: APIError, receive: Receive | None = None) -> None:
        # SGLang's bodies for the key checks: {"error": "Unauthorized"} / {"error": "Forbidden"}
        body = dumps({"error": "Forbidden"} if err.status == 403 else error_body(scope.get("path", ""), err))
        if receive is not None:
            # read the body the client is still sending (up to the size limit) before answering:
            # closing a socket with unread bytes makes the kernel reset it, and the client sees a
            # connection reset instead of this answer
            await _drain(receive, self.state.args.max_request_bytes)
        # the connection cannot carry another request (the body may be unread past the limit, and
        # a malformed chunked body would make h11 fail on it): close it after this answer
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        await send({"type": "http.response.start", "status": err.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        self.state.metrics.on_http(self._route_label(scope), err.status)

    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        refused = self._auth_status(scope)
        if refused is not None:
            await self._reject(scope, send, APIError("Unauthorized" if refused == 401 else "Forbidden", status=refused),
                               receive)
            return
        if self.state.draining and not path.startswith(OPEN_PATHS):
            await self._reject(scope, send, APIError("the server is shutting down", status=503), receive)
            return
        limit = self.state.args.max_request_bytes
        if limit:
            declared = _content_length(scope)
            if declared is not None and declared > limit:
                await self._reject(scope, send, _too_large(declared, limit))
                return
            receive = _limited_receive(receive, limit)
        status: list[int | None] = [None]
        gone = [False]  # the client hung up (a disconnect is the client's doing, not a server error)
        async def receive_and_note() -> dict:  # wraps the size-limited receive when a limit is set
            message = await receive()
            if message.get("type") == "http.disconnect":
                gone[0] = True
            return message

        async def send_and_note(message: dict) -> None:
            if message.get("type") == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive_and_note, send_and_note)
        finally:
            code = status[0] if status[0] is not None else (CLIENT_CLOSED if gone[0] else 500)
            self.state.metrics.on_http(self._route_label(scope), code)


CLIENT_CLOSED = 499  # nginx's "client closed request": counted in /metrics for a request nobody waited for


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


async def _drain(receive: Receive, limit: int | None, timeout: float = 5.0) -> None:
    """Read and drop a request's body: until its end, ``limit`` bytes (0 or None: no limit beyond
    16 MiB), a disconnect, or ``timeout`` seconds (a client that stops sending is not waited for)."""
    cap = limit or 16 * 1024 * 1024
    seen = 0

    async def loop() -> None:
        nonlocal seen
        while seen <= cap:
            message = await receive()
            if message.get("type") != "http.request":
                return
            seen += len(message.get("body", b""))
            if not message.get("more_body", False):
                return

    try:
        await asyncio.wait_for(loop(), timeout)
    except (TimeoutError, asyncio.TimeoutError):
        pass


def _limited_receive(receive: Receive, limit: int) -> Receive:
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
