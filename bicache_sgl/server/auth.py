"""Who may call which route: SGLang's three auth levels for ``--api-key`` and ``--admin-api-key``.

Each route handler may carry a level (:func:`auth_level`; unmarked handlers are NORMAL). The
middleware (bicache_sgl/server/middleware.py) resolves the level of the request's route and asks
:func:`decide`, a pure function of the level, the two configured keys and the key the client sent:

=============== ================ =================== ================== ================
level           no keys          ``--api-key`` only  admin key only     both keys
=============== ================ =================== ================== ================
NORMAL          open             API key             open               API key
ADMIN_OPTIONAL  open             API key             admin key          admin key only
ADMIN_FORCE     403              403                 admin key          admin key only
=============== ================ =================== ================== ================

(SGLang's ``decide_request_auth`` in ``sglang/srt/utils/auth.py``, same semantics.) Health,
readiness and metrics (:data:`OPEN_PREFIXES`) are always open so probes and scrapers need no
secret; an OPTIONS request (a CORS preflight) is never refused here. A wrong or missing key is
401 ``{"error": "Unauthorized"}``; an ADMIN_FORCE route on a server without an admin key is 403
``{"error": "Forbidden"}``, whatever the client sends. Keys are compared in constant time.
"""

from __future__ import annotations

import enum
import hmac
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

__all__ = ["OPEN_PREFIXES", "AuthLevel", "auth_level", "decide", "presented_key", "route_levels"]

# never need a key (SGLang's auth.py matches the same prefixes): probes and scrapers have no key
OPEN_PREFIXES = ("/health", "/ready", "/metrics")

F = TypeVar("F", bound=Callable[..., Any])


class AuthLevel(str, enum.Enum):
    """A route's auth level (SGLang's names and values)."""

    NORMAL = "normal"
    ADMIN_OPTIONAL = "admin_optional"
    ADMIN_FORCE = "admin_force"


_ATTR = "_auth_level"


def auth_level(level: AuthLevel) -> Callable[[F], F]:
    """Mark a route handler with ``level`` (read by :func:`route_levels`). The handler is returned
    unchanged, so the mark survives whichever route decorator registers it."""

    def mark(func: F) -> F:
        setattr(func, _ATTR, level)
        return func

    return mark


def level_of(endpoint: Any) -> AuthLevel:
    level = getattr(endpoint, _ATTR, None)
    return level if isinstance(level, AuthLevel) else AuthLevel.NORMAL


def route_levels(routes: Iterable[Any]) -> dict[str, AuthLevel]:
    """``path -> level`` of the app's routes (``route.path``, ``route.endpoint``). A path served
    by several handlers (GET and POST, say) takes the strictest of their levels."""
    order = (AuthLevel.NORMAL, AuthLevel.ADMIN_OPTIONAL, AuthLevel.ADMIN_FORCE)
    out: dict[str, AuthLevel] = {}
    for r in routes:
        path = getattr(r, "path", None)
        if path is None:
            continue
        level = level_of(getattr(r, "endpoint", None))
        if path not in out or order.index(level) > order.index(out[path]):
            out[path] = level
    return out


def presented_key(headers: Iterable[tuple[bytes, bytes]]) -> bytes:
    """The key the client sent: ``Authorization: Bearer KEY``, else ``X-API-Key: KEY``; b"" if none."""
    auth = b""
    x_api_key = b""
    for k, v in headers:
        name = k.lower()
        if name == b"authorization":
            auth = v
        elif name == b"x-api-key":
            x_api_key = v
    if auth[:7].lower() == b"bearer ":
        return auth[7:].strip()
    return x_api_key.strip()


def _matches(given: bytes, key: str) -> bool:
    # compare_digest on bytes of any length: the time depends on the length, never on the content
    return bool(given) and hmac.compare_digest(given, key.encode("utf-8"))


def decide(level: AuthLevel, *, path: str, method: str, given: bytes, api_key: str | None,
           admin_api_key: str | None) -> int | None:
    """``None`` to let the request through, else the status to refuse it with (401 or 403)."""
    if method == "OPTIONS" or path.startswith(OPEN_PREFIXES):
        return None
    if level is AuthLevel.ADMIN_FORCE:
        if not admin_api_key:
            return 403  # no admin key configured: nobody may call it
        return None if _matches(given, admin_api_key) else 401
    if level is AuthLevel.ADMIN_OPTIONAL:
        # the admin key, when set, is the only key accepted here: the API key every client holds is not
        key = admin_api_key or api_key
        return None if not key or _matches(given, key) else 401
    # NORMAL: the API key when set (an admin key alone leaves these routes open, as in SGLang)
    return None if not api_key or _matches(given, api_key) else 401
