"""The one place where the asyncio HTTP layer meets the engine's events.

``engine.submit(req, on_event)`` returns at once; ``on_event`` runs on the event loop itself
when the engine is in its own process (the default: the app has the engine client read its pipe
on the loop, ``EngineProcessClient.attach_loop``), else on another thread (the engine thread with
``--engine-in-process``, the client's receiver thread before the app started, a worker decoding
logprob texts), from where it only hands the event to the loop (``loop.call_soon_threadsafe``),
so neither side ever blocks the other. One :class:`Submission`
(one asyncio.Queue) serves all engine requests of one HTTP request (a batch, ``n`` samples).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from concurrent.futures import Executor

from bicache_sgl.engine.interface import EngineClient
from bicache_sgl.io_struct import QueueFullError, RequestEvent
from bicache_sgl.server.protocol import APIError, Item

logger = logging.getLogger(__name__)


class Submission:
    """Engine requests submitted for one HTTP request; events arrive as (index, RequestEvent)."""

    def __init__(self, engine: EngineClient, items: Sequence[Item],
                 on_finish: Callable[[Item, RequestEvent, float, float | None], None] | None = None,
                 executor: Executor | None = None, inline: bool = False,
                 field_names: Mapping[str, str] | None = None):
        self.engine = engine
        # the route's name of an engine field an engine refusal names (/v1: max_new_tokens is
        # max_tokens or max_completion_tokens, input_ids is prompt)
        self.field_names = field_names or {}
        self.executor = executor  # where submit() runs (None: the loop's default pool)
        # submit on the loop itself: only for an engine whose submit never waits (a one-way send
        # after a pure validation), where the hop to a worker thread and back would cost more
        # than the submission (at concurrency 1 that hop is a large share of the server's cost)
        self.inline = inline
        self.items = list(items)
        self.rids: list[str | None] = [None] * len(self.items)
        self.finished = [False] * len(self.items)
        # events not yet taken by events(), and its wait when there were none (a plain future woken
        # by the next event or a timer: no task and no asyncio.wait per event)
        self._events: collections.deque[tuple[int, RequestEvent]] = collections.deque()
        self._waiter: asyncio.Future | None = None
        self.start = time.perf_counter()
        self.first_output: list[float | None] = [None] * len(self.items)
        self._on_finish = on_finish
        self._cancelled = False
        self.disconnected = False  # the client went away (everything was aborted)

    # -- submit / abort -------------------------------------------------------------------
    async def submit(self) -> None:
        """Submit every item (on a worker thread: the engine may hold its lock for a forward).
        Bad input -> APIError(400, naming the field the engine's refusal names), full queue ->
        APIError(503); on any failure, or if the
        HTTP request is cancelled meanwhile, the items already submitted are aborted."""
        loop = asyncio.get_running_loop()
        push = self._push
        loop_thread = threading.get_ident()

        def make_cb(i: int):
            def on_event(ev: RequestEvent) -> None:  # never blocks
                if threading.get_ident() == loop_thread:  # the loop reads the engine's pipe itself
                    push((i, ev))
                    return
                try:  # another thread: hand over
                    loop.call_soon_threadsafe(push, (i, ev))
                except RuntimeError:  # loop closed (server shutting down)
                    pass
            return on_event

        reqs = [item.req for item in self.items]  # typed and with their rids since parsing

        def submit_all() -> None:
            if len(reqs) > 1:
                # atomic: a batch (select's choices, n samples) joins the same engine step
                rids = self.engine.submit_many(reqs, [make_cb(i) for i in range(len(reqs))])
                for i, rid in enumerate(rids):
                    self.rids[i] = rid
                if self._cancelled:
                    for i, rid in enumerate(rids):
                        self.finished[i] = True
                        self.engine.abort(rid)
                return
            for i, req in enumerate(reqs):
                if self._cancelled:
                    return
                rid = self.engine.submit(req, make_cb(i))
                self.rids[i] = rid
                if self._cancelled:  # the HTTP request went away while we were submitting
                    self.finished[i] = True
                    self.engine.abort(rid)

        try:
            if self.inline:
                submit_all()
            else:
                await loop.run_in_executor(self.executor, submit_all)
        except asyncio.CancelledError:
            self._cancelled = True
            self.abort()
            raise
        except Exception as e:  # mapped to a client answer below
            self.abort()
            if isinstance(e, QueueFullError):
                raise APIError(f"the server is overloaded: {e}" if str(e) else "the request queue is full",
                               status=503) from None
            if isinstance(e, (ValueError, TypeError)):
                param = getattr(e, "param", None)  # an InvalidRequest's field
                raise APIError(str(e), param=self.field_names.get(param, param)) from None
            raise

    def abort(self) -> None:
        """Abort every unfinished engine request (idempotent, never raises, never blocks the loop)."""
        rids = []
        for i, rid in enumerate(self.rids):
            if rid is not None and not self.finished[i]:
                rids.append(rid)
                self.finished[i] = True
        _wake_from_any_thread(self._waiter)  # a waiting events() sees that everything finished
        if not rids:
            return

        def do_abort() -> None:
            for rid in rids:
                try:
                    self.engine.abort(rid)
                except Exception:
                    logger.exception("abort(%s) failed", rid)

        try:
            asyncio.get_running_loop().run_in_executor(None, do_abort)
        except RuntimeError:  # no loop (shutdown): abort inline
            do_abort()

    @property
    def done(self) -> bool:
        return all(self.finished)

    # -- events ---------------------------------------------------------------------------
    def _push(self, item: tuple[int, RequestEvent]) -> None:
        """An engine event, on the loop thread."""
        self._events.append(item)
        _wake(self._waiter)

    async def _wait(self, loop: asyncio.AbstractEventLoop, timeout: float) -> None:
        """Until the next event, an abort, or ``timeout`` seconds."""
        fut = self._waiter = loop.create_future()
        timer = loop.call_later(timeout, _wake, fut)
        try:
            await fut
        finally:
            timer.cancel()
            self._waiter = None

    async def events(self, is_disconnected: Callable[[], Awaitable[bool]] | None = None,
                     poll_s: float = 0.5) -> AsyncIterator[tuple[int, RequestEvent]]:
        """Yield (index, event) until every item finished. Every ``poll_s`` seconds (whether
        events arrive or not) it asks ``is_disconnected`` and aborts everything when the client
        went away."""
        loop = asyncio.get_running_loop()
        pending = self._events
        last_check = time.monotonic()
        try:
            while not self.done:
                if not pending:
                    await self._wait(loop, poll_s)
                now_m = time.monotonic()
                if is_disconnected is not None and (not pending or now_m - last_check >= poll_s):
                    last_check = now_m
                    if await is_disconnected():
                        logger.info("client disconnected; aborting %s", [r for r in self.rids if r])
                        self.disconnected = True
                        self.abort()
                        return
                if not pending:  # timed out (or aborted: the loop condition ends it)
                    continue
                i, ev = pending.popleft()
                if self.finished[i]:
                    continue
                now = time.perf_counter()
                if self.first_output[i] is None and (ev.output_ids or ev.finished):
                    self.first_output[i] = now - self.start
                if ev.finished:
                    self.finished[i] = True
                    if self._on_finish is not None:
                        try:
                            self._on_finish(self.items[i], ev, now - self.start, self.first_output[i])
                        except Exception:
                            logger.exception("metrics hook failed")
                yield i, ev
        finally:
            # generator closed early (stream cancelled, client gone, error): free the engine side
            if not self.done:
                self.abort()


def _wake(fut: asyncio.Future | None) -> None:
    if fut is not None and not fut.done():
        fut.set_result(None)


def _wake_from_any_thread(fut: asyncio.Future | None) -> None:
    """_wake on the future's own loop (abort may run where no loop runs, e.g. at shutdown)."""
    if fut is None or fut.done():
        return
    loop = fut.get_loop()
    try:
        here = asyncio.get_running_loop()
    except RuntimeError:
        here = None
    if here is loop:
        _wake(fut)
        return
    try:
        loop.call_soon_threadsafe(_wake, fut)
    except RuntimeError:  # that loop is closed: nobody waits any more
        pass
