"""The transport to an engine in its own process: the child (engine/process_child.py), one duplex
pipe to it (a Unix socket pair; the messages: engine/wire.py), round trips with their replies,
and the reading of the pipe: on a receiver thread, or, after :meth:`EngineChannel.attach_loop`,
on the HTTP app's event loop (the pipe is one more reader of the loop: an event reaches its
request without a thread hop). The requests' side (validation, the pending table, logprob texts,
``EngineClient``) is :class:`bicache_sgl.engine.process.EngineProcessClient`.

If the child dies, every round trip in flight fails with :class:`EngineDeadError`, later calls
raise it, and ``on_end(message, error=True)`` is called once (the client then fails its requests);
a goodbye or a shutdown ends the channel with ``error=False``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import pickle
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

from ..config import EngineConfig
from ..io_struct import RequestEvent
from ..procinfo import describe_exit
from .process_child import engine_main
from .wire import EngineDeadError, dumps

log = logging.getLogger(__name__)


class _Reply:
    def __init__(self) -> None:
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None


class EngineChannel:
    """The child process and the pipe to it. The constructor starts the child and returns when its
    model is loaded (``info``: what the child reported), or raises what the child raised while
    loading. ``on_events(events)`` gets each batch of events the child sends (on the receiver
    thread, or on the loop); ``on_end(message, error)`` is called when the channel ends (the child
    died: ``error`` True; a goodbye or shutdown: False). Thread-safe: senders hold one lock."""

    def __init__(self, config: EngineConfig, *, log_level: str, startup_timeout: float,
                 on_events: Callable[[list[RequestEvent]], None], on_end: Callable[[str, bool], None]) -> None:
        self._on_events, self._on_end = on_events, on_end
        self._lock = threading.Lock()  # sends on the pipe, the reply table
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
        mp = multiprocessing.get_context("spawn")
        # one socket pair both ways: a message is one send/recv syscall pair, with no broker or I/O
        # thread in between (each wakeup on the way costs latency on a loaded machine); the
        # receiver thread (or the loop, after attach_loop) reads it, senders hold self._lock
        self._conn: Connection
        self._conn, child_conn = mp.Pipe(duplex=True)
        self.process = mp.Process(target=engine_main, args=(config, child_conn, log_level),
                                  name="bicache-engine", daemon=True)
        try:
            self.process.start()
            child_conn.close()  # the child has its own copy: reads here see EOF once it exits
            self.info: dict[str, Any] = self._wait_ready(startup_timeout)
        except BaseException:
            self._close(kill=True)
            self._close_wake()
            raise
        self._receiver = threading.Thread(target=self._receive, name="bicache-engine-events", daemon=True)
        self._receiver.start()

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

    # ------------------------------------------------------------------------------------ sends
    def send(self, msg: tuple) -> None:
        """Send one message (fire and forget)."""
        with self._lock:
            self._send(msg)

    def send_if_open(self, msg: tuple) -> None:
        """Send one message unless the engine is gone or shut down (an abort)."""
        with self._lock:
            if self._dead is None and not self._closed:
                self._send(msg)

    def open_reply(self) -> tuple[int, _Reply]:
        """A reply slot for a message that asks for an answer (its id goes in the message)."""
        reply = _Reply()
        with self._lock:
            reply_id = next(self._reply_ids)
            self._replies[reply_id] = reply
        return reply_id, reply

    def call(self, kind: str, timeout: float, what: str, *args: Any) -> Any:
        """A round trip: send ``(kind, reply_id, *args)`` and wait for the answer."""
        reply = _Reply()
        with self._lock:
            self.check_alive()
            reply_id = next(self._reply_ids)
            self._replies[reply_id] = reply
            self._send((kind, reply_id, *args))
        return self.await_reply(reply, timeout, what, reply_id)

    def _send(self, msg: tuple) -> None:
        """Send one message (the caller holds self._lock). A child that is gone cannot take it:
        that is not the sender's error to report, the receiver thread sees the exit and fails
        every pending request and round trip (this one included)."""
        try:
            self._conn.send_bytes(dumps(msg))
        except (OSError, ValueError):  # broken pipe, or the pipe was closed at shutdown
            log.debug("engine process pipe closed; %r not sent", msg[0])

    def await_reply(self, reply: _Reply, timeout: float, what: str, reply_id: int | None = None) -> Any:
        if not reply.done.wait(timeout):
            with self._lock:
                if reply_id is not None:
                    self._replies.pop(reply_id, None)
            raise TimeoutError(f"the engine process did not answer {what} within {timeout:.0f} s")
        if reply.error is not None:
            raise reply.error
        return reply.value

    def check_alive(self) -> None:
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
        made on the loop thread: it waits for an answer only the loop reads. False (nothing
        changed) when the engine is already gone or shut down."""
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

    def _dispatch(self, msg: tuple) -> bool:
        """Handle one message from the child; True when it said goodbye."""
        kind = msg[0]
        if kind == "events":
            self._on_events(msg[1])
        elif kind == "reply":
            with self._lock:
                reply = self._replies.pop(msg[1], None)
            if reply is not None:
                reply.value, reply.error = msg[2], msg[3]
                reply.done.set()
        elif kind == "bye":
            self.end("server shutting down", error=False)
            return True
        return False

    def _engine_died(self, exitcode: int | None, message: str | None = None) -> None:
        with self._lock:
            closing = self._closed
        if closing:  # exited after shutdown() was asked for (e.g. it timed out waiting for bye)
            self.end("server shutting down", error=False)
            return
        msg = message or (f"the engine process (pid {self.process.pid}) exited unexpectedly "
                          f"({describe_exit(exitcode, 'exit code unknown')}); the server cannot generate until "
                          "it is restarted")
        log.error("%s", msg)
        self._dead = msg
        self.end(msg, error=True)

    def end(self, message: str, *, error: bool) -> None:
        """Every round trip in flight fails; the client is told (``on_end``)."""
        with self._lock:
            replies, self._replies = self._replies, {}
        for reply in replies.values():
            reply.error = EngineDeadError(message)
            reply.done.set()
        try:
            self._on_end(message, error)
        except Exception:
            log.exception("on_end hook failed")

    # --------------------------------------------------------------------------------- shutdown
    @property
    def dead_message(self) -> str | None:
        """Why the engine process is gone (None while it runs)."""
        return self._dead

    @property
    def alive(self) -> bool:
        return self._dead is None and not self._closed and self.process.is_alive()

    def shutdown(self, timeout: float = 10.0) -> bool:
        """Ask the child to stop, wait for it (and for the loop to read what it sent last), then
        close the pipe. Idempotent; the caller then ends what is still pending (:meth:`end`)."""
        with self._lock:
            if self._closed:
                return False
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
        self._close_wake()
        return True

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

