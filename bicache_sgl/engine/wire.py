"""What crosses between the server process and the engine process (engine/process.py is the
server side, engine/process_child.py the engine side).

Wire protocol (pickled tuples, one message per ``send_bytes`` on a duplex ``multiprocessing``
pipe, a Unix socket pair made by the parent before it starts the child):

parent -> child:
  ``("submit", [ValidRequest], reply_id | None, [(regex, limits, IndexData)])``: requests the
  parent validated (``scheduler/validate.py``), which the child trusts, and the constraint
  indexes the parent built checking them, so the child does not build them again (it queues
  submissions on a small thread pool, off its message loop); ``("abort", rid)``,
  ``("flush", reply_id, timeout)``, ``("stats", reply_id)``, ``("shutdown", timeout)``
child -> parent:
  ``("ready", info)`` | ``("startup_error", exception)``, ``("events", [RequestEvent])`` (batched),
  ``("reply", reply_id, value, exception | None)``, ``("bye",)``
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable
from typing import Any

from ..io_struct import RequestEvent

LOG_FORMAT = "[%(asctime)s] %(levelname)s %(name)s: %(message)s"


class EngineDeadError(RuntimeError):
    """The engine process is not running (it died, or the client was shut down)."""


def dumps(msg: Any) -> bytes:
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


def portable_error(e: BaseException) -> BaseException:
    """``e`` if it survives pickling, else a RuntimeError with its type and message."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # any unpicklable exception is reported by name
        return RuntimeError(f"{type(e).__name__}: {e}")


def failed_event(rid: str, message: str, *, prompt_tokens: int, since: float, error: bool = True) -> RequestEvent:
    """The final event of a request that ended outside the engine's step (refused after it was
    sent, or its engine process died). Its meta_info has the fields every final event carries
    (``Req.meta_info``), so the server never fills any in; ``since``: its perf_counter at submit."""
    reason = {"type": "abort", "message": message}
    meta = {"id": rid, "finish_reason": reason, "prompt_tokens": prompt_tokens, "completion_tokens": 0,
            "cached_tokens": 0, "e2e_latency": time.perf_counter() - since}
    return RequestEvent(rid, "", [], True, reason, meta, message if error else None)


def fill_logprob_texts(meta: dict[str, Any], decode: Callable[[int], str]) -> None:
    """Fill the text of ``[logprob, token_id, text]`` entries (the engine sends None), in place."""
    cache: dict[int, str] = {}

    def text(tid: int) -> str:
        s = cache.get(tid)
        if s is None:
            s = cache[tid] = decode(tid)
        return s

    def fill(entries: Any) -> Any:
        if not isinstance(entries, list):
            return entries
        return [[e[0], e[1], text(e[1]) if e[2] is None else e[2]]
                if isinstance(e, list) and len(e) == 3 and isinstance(e[1], int) else e for e in entries]

    for key in ("input_token_logprobs", "output_token_logprobs"):
        if key in meta:
            meta[key] = fill(meta[key])
    for key in ("input_top_logprobs", "output_top_logprobs"):
        if isinstance(meta.get(key), list):
            meta[key] = [fill(x) for x in meta[key]]
