"""The engine in its own process (SGLang's layout): the HTTP server and the tokenizer stay in the
main process, the scheduler + model run in a child (engine/process_child.py), and the two talk over
one duplex pipe (a Unix socket pair; the messages: engine/wire.py).

Why: in one process the HTTP event loop, the tokenizer, the JSON encoding and the engine's step
share one GIL, and the engine's OpenMP threads compete with the server threads for the same cores.
In a child process the engine's loop never waits on HTTP work, and each process gets its own
thread budget (:func:`default_engine_threads`).

:class:`EngineProcessClient` (parent side) implements ``EngineClient``. Each request is validated
once, here, by the pure ``validate_request`` against the limits the child reports (its model, its
context length, its K/V budget) plus the cached constraint check, so a bad request is a
synchronous ``ValueError``; the child trusts the :class:`ValidRequest` it is sent, and ``submit``
is a one-way send (no round trip). Only with ``max_queued_requests`` set does a submission wait
for the child's answer (the queue length lives there), so a full queue is still a synchronous
``QueueFullError``. Events come back on a receiver thread that calls the registered ``on_event``
callbacks, or, once the HTTP app has called :meth:`EngineProcessClient.attach_loop`, on its event
loop (the pipe is one more reader of the loop: an event reaches its request without a thread
hop). The per-token texts of logprob entries (``return_text_in_logprobs``) are decoded here,
not on the engine's loop; the engine only sends ids.

If the child dies, every request in flight finishes with an error event naming the exit code,
later calls raise :class:`EngineDeadError`, and ``on_failure`` (set by the server: /health then
answers 503) is called once.

(About 560 lines: the client is one object whose startup, submissions, round trips, receiver
(thread or loop) and shutdown share one lock, one pending table and one pipe; the child's side and
the messages are in their own modules.)
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import itertools
import logging
import multiprocessing
import os
import pickle
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection, wait
from typing import Any

from ..config import EngineConfig
from ..constrained.index import Limits
from ..io_struct import GenerateRequest, QueueFullError, RequestEvent
from ..runtime import describe_exit
from ..scheduler.validate import ValidRequest, validate_request
from .process_child import default_engine_threads, engine_main
from .wire import EngineDeadError, dumps, failed_event, fill_logprob_texts

__all__ = ["EngineDeadError", "EngineProcessClient", "default_engine_threads"]

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0
STATS_TIMEOUT_S = 10.0


# ---------------------------------------------------------------------------------- parent side
@dataclasses.dataclass
class _Pending:
    on_event: Callable[[RequestEvent], None] | None
    wants_text: bool  # return_text_in_logprobs: decode the logprob entries' tokens here
    prompt_tokens: int  # for the final event if the engine process dies under it
    since: float  # perf_counter at submit


class _Reply:
    def __init__(self) -> None:
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None


class EngineProcessClient:
    """``EngineClient`` for an :class:`~bicache_sgl.engine.engine.Engine` running in a child process.

    The constructor starts the child and returns when its model is loaded (or raises what the
    child raised while loading). ``on_failure(message)`` is called once, on the receiver thread,
    if the child dies while the client is not shut down.
    """

    def __init__(self, config: EngineConfig | None = None, *, log_level: str = "info",
                 startup_timeout: float = STARTUP_TIMEOUT_S,
                 on_failure: Callable[[str], None] | None = None) -> None:
        self.on_failure = on_failure
        self._lock = threading.Lock()  # sends on the pipe, the pending tables
        self._pending: dict[str, _Pending] = {}
        self._replies: dict[int, _Reply] = {}
        self._reply_ids = itertools.count(1)
        self._closed = False
        self._dead: str | None = None
        self._receiver: threading.Thread | None = None
        # attach_loop(): the event loop reads the pipe instead of the receiver thread
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reading_on_loop = False
        self._handed_over = False  # the receiver thread stopped for the handover (not for an exit)
        self._handover = False  # tells the receiver thread to stop reading (before its next message)
        self._wake_r, self._wake_w = os.pipe()  # wakes the receiver thread's wait for the handover
        self._wake_fds: tuple[int, ...] = (self._wake_r, self._wake_w)
        self._loop_thread: int | None = None
        self._loop_done = threading.Event()  # the loop read "bye" or end-of-file (or stopped reading)
        self._text_pool: ThreadPoolExecutor | None = None  # logprob texts, decoded off the loop
        cfg = config or EngineConfig()
        mp = multiprocessing.get_context("spawn")
        # one socket pair both ways: a message is one send/recv syscall pair, with no broker or I/O
        # thread in between (each wakeup on the way costs latency on a loaded machine); the
        # receiver thread (or the loop, after attach_loop) reads it, senders hold self._lock
        self._conn: Connection
        self._conn, child_conn = mp.Pipe(duplex=True)
        self.process = mp.Process(target=engine_main, args=(cfg, child_conn, log_level),
                                  name="bicache-engine", daemon=True)
        try:
            self.process.start()
            child_conn.close()  # the child has its own copy: reads here see EOF once it exits
            info = self._wait_ready(startup_timeout)
            self._setup(info)
        except BaseException:
            self._close(kill=True)
            self._close_wake()
            raise
        self._receiver = threading.Thread(target=self._receive, name="bicache-engine-events", daemon=True)
        self._receiver.start()
        ref = weakref.ref(self)

        def _stop_at_exit() -> None:
            client = ref()
            if client is not None:
                client.shutdown(timeout=5.0)
        self._atexit = _stop_at_exit
        atexit.register(_stop_at_exit)

    # ---------------------------------------------------------------------------------- startup
    def _wait_ready(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"the engine process did not load the model within {timeout:.0f} s")
            ready = wait([self._conn, self.process.sentinel], min(left, 1.0))
            if self._conn in ready:
                try:
                    msg = pickle.loads(self._conn.recv_bytes())
                except (EOFError, OSError):  # the child closed its end: it is exiting
                    self.process.join(5.0)
                    raise RuntimeError(f"the engine process exited while loading the model "
                                       f"({describe_exit(self.process.exitcode, 'exit code unknown')})") from None
                if msg[0] == "ready":
                    return msg[1]
                if msg[0] == "startup_error":
                    raise msg[1]
                continue
            if self.process.sentinel in ready or not self.process.is_alive():
                self.process.join(1.0)
                raise RuntimeError(f"the engine process exited while loading the model "
                                   f"({describe_exit(self.process.exitcode, 'exit code unknown')})")

    def _setup(self, info: dict[str, Any]) -> None:
        from ..models.loader import load_tokenizer
        from ..scheduler.factory import RequestFactory

        self.pid: int = info["pid"]
        self.config: EngineConfig = info["config"]
        self.model_config = info["model_config"]
        self.model_path: str = info["model_path"]
        self.context_length: int = info["context_length"]
        self.eos_ids: tuple[int, ...] = info["eos_ids"]
        self.kv_budget: int = info["kv_budget"]
        self.num_threads: int = info["num_threads"]
        self.device: str = info["device"]
        self.tokenizer = load_tokenizer(self.config.tokenizer_path or self.model_path, self.config.chat_template)
        self._factory = RequestFactory(self.model_config, self.tokenizer, self.eos_ids, self.config.decode,
                                       self.context_length, kv_budget=self.kv_budget)

    # --------------------------------------------------------------------------------- requests
    @property
    def submit_returns_at_once(self) -> bool:
        """True when ``submit`` never waits on the engine process (no ``max_queued_requests``:
        a pure validation and a one-way send), so a caller may submit on its event loop. A
        request with a constraint may still build it while validating (cached after the first)."""
        return self.config.max_queued_requests is None

    def _validated(self, greq: GenerateRequest) -> tuple[ValidRequest, list]:
        """Validate once (pure) and check the constraint (cached build, off the caller's loop):
        the request as it is sent and the constraint index ((regex, limits, IndexData)) the
        engine process then takes instead of building it again."""
        v = validate_request(greq, self._factory.limits)
        c = self._factory.constraint(v.greq.params)
        return v, [] if c is None else [(c.regex, Limits(), c.index)]

    def submit(self, greq: GenerateRequest, on_event: Callable[[RequestEvent], None] | None = None) -> str:
        return self.submit_many([greq], [on_event])[0]

    def submit_many(self, greqs: Sequence[GenerateRequest],
                    on_events: Sequence[Callable[[RequestEvent], None] | None]) -> list[str]:
        self._check_alive()
        sent: list[ValidRequest] = []
        seeds: list = []
        for g in greqs:
            v, built = self._validated(g)
            seeds += built
            # the texts of logprob entries are decoded here (receiver thread), not on the engine's loop
            sent.append(dataclasses.replace(v, greq=dataclasses.replace(v.greq, return_text_in_logprobs=False)))
        rids = [v.rid for v in sent]
        wait_reply = self.config.max_queued_requests is not None
        reply = _Reply() if wait_reply else None
        now = time.perf_counter()
        with self._lock:
            self._check_alive()
            clash = next((r for i, r in enumerate(rids) if r in self._pending or r in rids[:i]), None)
            if clash is not None:
                raise ValueError(f"request id {clash!r} is already in use")
            for g, cb in zip(greqs, on_events):
                self._pending[g.rid] = _Pending(cb, bool(g.return_logprob and g.return_text_in_logprobs),
                                                len(g.input_ids), now)
            reply_id = None
            if reply is not None:
                reply_id = next(self._reply_ids)
                self._replies[reply_id] = reply
            self._send(("submit", sent, reply_id, seeds))
        if reply is not None:
            try:
                self._await(reply, STATS_TIMEOUT_S, "submitting the request", reply_id)
            except BaseException:
                with self._lock:
                    for r in rids:
                        self._pending.pop(r, None)
                if not isinstance(reply.error, (ValueError, QueueFullError)):
                    for r in rids:  # timed out: it may have been queued after all
                        self.abort(r)
                raise
        return rids

    def abort(self, rid: str) -> None:
        with self._lock:
            if self._dead is None and not self._closed:
                self._send(("abort", rid))

    def abort_all(self) -> int:
        """Abort every request this client has in flight (each then ends with an abort event)."""
        with self._lock:
            rids = list(self._pending)
        for rid in rids:
            self.abort(rid)
        return len(rids)

    def flush_cache(self, timeout: float = 30.0) -> bool:
        try:
            return bool(self._call(("flush", None, timeout), timeout + STATS_TIMEOUT_S, "flush_cache"))
        except TimeoutError:
            return False

    def get_stats(self) -> dict[str, Any]:
        """The engine's counters (a round trip), plus ``engine_pid`` (the process to profile)."""
        return {"engine_pid": self.pid, **self._call(("stats", None), STATS_TIMEOUT_S, "get_stats")}

    # ------------------------------------------------------------------------------ round trips
    def _call(self, msg: tuple, timeout: float, what: str) -> Any:
        reply = _Reply()
        with self._lock:
            self._check_alive()
            reply_id = next(self._reply_ids)
            self._replies[reply_id] = reply
            self._send((msg[0], reply_id, *msg[2:]))
        return self._await(reply, timeout, what, reply_id)

    def _send(self, msg: tuple) -> None:
        """Send one message (the caller holds self._lock). A child that is gone cannot take it:
        that is not the sender's error to report, the receiver thread sees the exit and fails
        every pending request and round trip (this one included)."""
        try:
            self._conn.send_bytes(dumps(msg))
        except (OSError, ValueError):  # broken pipe, or the pipe was closed at shutdown
            log.debug("engine process pipe closed; %r not sent", msg[0])

    def _await(self, reply: _Reply, timeout: float, what: str, reply_id: int | None = None) -> Any:
        if not reply.done.wait(timeout):
            with self._lock:
                if reply_id is not None:
                    self._replies.pop(reply_id, None)
            raise TimeoutError(f"the engine process did not answer {what} within {timeout:.0f} s")
        if reply.error is not None:
            raise reply.error
        return reply.value

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if self._closed:
            raise EngineDeadError("the engine is shut down")

    # --------------------------------------------------------------------------------- receiver
    def _receive(self) -> None:
        conn = self._conn
        try:
            while True:
                ready = wait([conn, self.process.sentinel, self._wake_r], 1.0)
                if self._handover:  # attach_loop(): the loop reads from here on (conn stays open)
                    self._handed_over = True
                    return
                if conn in ready:
                    try:
                        raw = conn.recv_bytes()
                    except (EOFError, OSError):  # the child's end closed: it exited (or is exiting)
                        self.process.join(5.0)
                        self._engine_died(self.process.exitcode)
                        return
                    if self._dispatch(pickle.loads(raw)):
                        return
                    continue
                if self.process.sentinel in ready or not self.process.is_alive():
                    # what the child wrote just before it exited is still in the pipe
                    while conn.poll(0.2):
                        try:
                            raw = conn.recv_bytes()
                        except (EOFError, OSError):
                            break
                        if self._dispatch(pickle.loads(raw)):
                            return
                    self.process.join(1.0)
                    self._engine_died(self.process.exitcode)
                    return
        except Exception:  # never expected; the requests must still be answered
            log.exception("the engine event receiver failed")
            self._engine_died(None, "the server lost its connection to the engine process")
        finally:
            if not self._handover:
                with self._lock:
                    conn.close()

    # ------------------------------------------------------------------------ reading on a loop
    def attach_loop(self, loop: asyncio.AbstractEventLoop) -> bool:
        """Read the engine's messages on ``loop`` from now on, instead of on the receiver thread
        (call on the loop's thread, e.g. at application startup). An event then reaches its
        ``on_event`` on the loop thread, without a hop from the receiver thread and the wakeup
        of the loop that follows (about 0.1 ms per request at concurrency 1). A round trip
        (``get_stats``, ``flush_cache``, a submission that waits for its answer) must then not be
        made on the loop thread: it waits for an answer only the loop reads. The logprob texts
        of ``return_text_in_logprobs`` are still decoded off the loop (one worker thread, in
        order). False (nothing changed) when the engine is already gone or shut down."""
        with self._lock:
            if self._dead is not None or self._closed or self._receiver is None or self._loop is not None:
                return False
            self._loop = loop
            self._handover = True
        os.write(self._wake_w, b"x")
        self._receiver.join()  # it finishes the message it is handling, then returns
        if not self._handed_over:  # it stopped for the engine's exit or a goodbye: nothing to read
            with self._lock:
                self._conn.close()
            return False
        self._loop_thread = threading.get_ident()
        self._receiver = None
        self._text_pool = ThreadPoolExecutor(1, thread_name_prefix="bicache-logprob-text")
        self._reading_on_loop = True
        loop.add_reader(self._conn.fileno(), self._on_readable)
        loop.add_reader(self.process.sentinel, self._on_exit)
        # uvloop (libuv's uv_poll_init) switches a watched descriptor to non-blocking mode; this
        # pipe's messages are written and read whole by blocking calls (a write that would block
        # half-way must wait, not fail), and libuv only polls it, so put blocking mode back
        os.set_blocking(self._conn.fileno(), True)
        return True

    def _on_readable(self) -> None:
        """One message from the engine (loop thread; the reader is level-triggered: it runs again
        while more are waiting)."""
        if not self._reading_on_loop:
            return
        try:
            raw = self._conn.recv_bytes()
        except (EOFError, OSError):  # the child's end closed: it exited (or is exiting)
            self._detach()
            self._died_off_loop()
            return
        try:
            if self._dispatch(pickle.loads(raw)):
                self._detach()
        except Exception:  # never expected; the requests must still be answered
            log.exception("reading the engine's events failed")
            self._detach()
            self._died_off_loop("the server lost its connection to the engine process")

    def _on_exit(self) -> None:
        """The child exited: what it wrote before is still read (end-of-file follows it); if the
        pipe stays open (a descendant holds the child's end), the exit is reported after 0.5 s."""
        if self._loop is None:
            return
        self._loop.remove_reader(self.process.sentinel)

        def late() -> None:
            if self._reading_on_loop:
                self._detach()
                self._died_off_loop()
        self._loop.call_later(0.5, late)

    def _died_off_loop(self, message: str | None = None) -> None:
        """_engine_died on a thread: it joins the process and calls every pending callback."""
        def run() -> None:
            self.process.join(5.0)
            self._engine_died(self.process.exitcode, message)
            self._loop_done.set()
        threading.Thread(target=run, name="bicache-engine-exit", daemon=True).start()

    def _detach(self) -> None:
        """Stop reading on the loop and close the pipe (loop thread)."""
        if not self._reading_on_loop:
            return
        self._reading_on_loop = False
        loop = self._loop
        assert loop is not None
        for fd in (self._conn.fileno(), self.process.sentinel):
            try:
                loop.remove_reader(fd)
            except (ValueError, OSError):  # already closed or removed
                pass
        with self._lock:
            self._conn.close()
        self._loop_done.set()

    def _deliver_with_text(self, p: _Pending, ev: RequestEvent) -> None:
        fill_logprob_texts(ev.meta_info, self._decode_token)
        self._deliver(p, ev)

    @staticmethod
    def _deliver(p: _Pending, ev: RequestEvent) -> None:
        if p.on_event is not None:
            try:
                p.on_event(ev)
            except Exception:
                log.exception("event callback for %s failed", ev.rid)

    def _dispatch(self, msg: tuple) -> bool:
        """Handle one message from the child; True when it said goodbye."""
        kind = msg[0]
        if kind == "events":
            for ev in msg[1]:
                with self._lock:
                    p = self._pending.get(ev.rid)
                    if p is not None and ev.finished:
                        del self._pending[ev.rid]
                if p is None:
                    continue
                if p.wants_text and ev.meta_info:
                    if self._text_pool is not None:  # on the loop: decode on the worker (keeps order)
                        self._text_pool.submit(self._deliver_with_text, p, ev)
                        continue
                    fill_logprob_texts(ev.meta_info, self._decode_token)
                self._deliver(p, ev)
        elif kind == "reply":
            with self._lock:
                reply = self._replies.pop(msg[1], None)
            if reply is not None:
                reply.value, reply.error = msg[2], msg[3]
                reply.done.set()
        elif kind == "bye":
            self._fail_all("server shutting down", error=False)
            return True
        return False

    def _decode_token(self, tid: int) -> str:
        return self.tokenizer.decode([tid])

    def _engine_died(self, exitcode: int | None, message: str | None = None) -> None:
        with self._lock:
            closing = self._closed
        if closing:  # exited after shutdown() was asked for (e.g. it timed out waiting for bye)
            self._fail_all("server shutting down", error=False)
            return
        msg = message or (f"the engine process (pid {self.process.pid}) exited unexpectedly "
                          f"({describe_exit(exitcode, 'exit code unknown')}); the server cannot generate until "
                          "it is restarted")
        log.error("%s", msg)
        self._dead = msg
        self._fail_all(msg, error=True)
        if self.on_failure is not None:
            try:
                self.on_failure(msg)
            except Exception:
                log.exception("on_failure hook failed")

    def _fail_all(self, message: str, *, error: bool) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
            replies, self._replies = self._replies, {}
        for rid, p in pending.items():
            if p.on_event is not None:
                try:
                    p.on_event(failed_event(rid, message, prompt_tokens=p.prompt_tokens, since=p.since, error=error))
                except Exception:
                    log.exception("event callback for %s failed", rid)
        for reply in replies.values():
            reply.error = EngineDeadError(message)
            reply.done.set()

    # ------------------------------------------------------------------------- EngineClient extras
    in_process = False

    def watch(self, on_failure: Callable[[str], None]) -> None:
        """``on_failure(message)`` once when the engine process dies (now, if it already has)."""
        self.on_failure = on_failure
        if not self.alive:
            on_failure(self._dead or "the engine process exited during startup")

    def describe(self) -> str:
        return (f"engine process pid {self.pid} with {self.num_threads} torch threads; "
                "server process: 1")

    # --------------------------------------------------------------------------------- shutdown
    @property
    def alive(self) -> bool:
        return self._dead is None and not self._closed and self.process.is_alive()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine; requests in flight finish with an abort. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._dead is None:
                self._send(("shutdown", timeout))
        self.process.join(timeout + 5.0)
        loop = self._loop
        if (loop is not None and self._reading_on_loop and loop.is_running()
                and threading.get_ident() != self._loop_thread):
            self._loop_done.wait(5.0)  # the loop reads what the engine sent before it exited
        self._close(kill=True)
        if self._receiver is not None:
            self._receiver.join(5.0)
        if self._text_pool is not None:
            self._text_pool.shutdown(wait=True)  # events with logprob texts are delivered first
        self._fail_all("server shutting down", error=False)
        self._close_wake()
        try:
            atexit.unregister(self._atexit)
        except AttributeError:  # the constructor failed before registering
            pass

    def _close(self, kill: bool) -> None:
        if kill and self.process.is_alive():
            self.process.terminate()
            self.process.join(5.0)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(5.0)
        with self._lock:
            self._closed = True
            # else the receiver thread closes the pipe when it ends, or the loop reading it does
            # (a pipe closed under the loop's reader would be a closed descriptor in its poll set)
            reader = self._receiver is not None or self._reading_on_loop
            if not reader:
                self._conn.close()
        loop = self._loop
        if reader and self._receiver is None and loop is not None:
            try:
                loop.call_soon_threadsafe(self._detach)
            except RuntimeError:  # the loop is closed: nobody reads the pipe any more
                self._reading_on_loop = False
                self._conn.close()

    def _close_wake(self) -> None:
        fds, self._wake_fds = self._wake_fds, ()
        for fd in fds:
            os.close(fd)

    def __enter__(self) -> EngineProcessClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
