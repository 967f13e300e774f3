"""Response helpers shared by the native and the OpenAI routes: JSON encoding, SSE frames, error
bodies and the text a stream may send before a request finished.

This module sits below both route modules (it imports nothing from them), so neither route module
needs the other.
"""

from __future__ import annotations

from typing import Any

import orjson
from fastapi.responses import Response

from bicache_sgl.io_struct import RequestEvent
from bicache_sgl.server.protocol import APIError, Item

SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _default(o: Any) -> Any:
    # numpy / torch scalars and arrays reach the answer through the engine's meta_info
    if hasattr(o, "tolist"):
        return o.tolist()
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, (set, tuple)):
        return list(o)
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def dumps(obj: Any) -> bytes:
    """JSON bytes (orjson; numpy values and non-string keys allowed)."""
    return orjson.dumps(obj, default=_default, option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS)


class ORJSONResponse(Response):
    """A JSON response encoded with :func:`dumps`."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return dumps(content)


def sse(obj: Any) -> bytes:
    """One server-sent-events frame."""
    return b"data: " + dumps(obj) + b"\n\n"


def sse_error(message: str, **extra: Any) -> bytes:
    """An in-band error frame (the status line of a stream is already sent)."""
    return sse({"error": {"message": message, "type": "InternalServerError", "code": 500}, **extra})


def error_body(path: str, err: APIError) -> dict[str, Any]:
    """The JSON body of an error: SGLang's shape on native routes, OpenAI's (with ``param``) on /v1."""
    if err.status == 401:
        return {"error": "Unauthorized"}
    if path.startswith("/v1/"):
        return {"error": {"message": err.message, "type": err.err_type, "param": err.param, "code": err.code}}
    return {"error": {"message": err.message, "type": err.err_type, "code": err.code}}


def error_response(path: str, err: APIError) -> ORJSONResponse:
    return ORJSONResponse(error_body(path, err), status_code=err.status)


def raise_if_failed(finals: list[RequestEvent]) -> None:
    """A finished request that failed inside the engine is a 500 for a non-streaming answer."""
    for f in finals:
        if f.error:
            raise APIError(f"generation failed: {f.error}", status=500, err_type="InternalServerError")


def stream_text(item: Item, ev: RequestEvent) -> str:
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
