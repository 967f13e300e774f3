"""The engine in its own process (SGLang's layout): the HTTP server and the tokenizer stay in the
main process, the scheduler + model run in a child, and the two talk over ZMQ.

Why: in one process the HTTP event loop, the tokenizer, the JSON encoding and the engine's step
share one GIL, and the engine's OpenMP threads compete with the server threads for the same cores.
In a child process the engine's loop never waits on HTTP work, and each process gets its own
thread budget (:func:`default_engine_threads`).

Wire protocol (pickled tuples, two PUSH/PULL pairs over ``ipc://``, both bound by the parent):

parent -> child:
  ``("submit", [GenerateRequest], reply_id | None, [(regex, limits, IndexData)])`` (the constraint
  indexes the parent built validating them, so the child does not build them again; the child
  queues submissions on a small thread pool, off its message loop), ``("abort", rid)``,
  ``("flush", reply_id, timeout)``, ``("stats", reply_id)``, ``("shutdown", timeout)``
child -> parent:
  ``("ready", info)`` | ``("startup_error", exception)``, ``("events", [RequestEvent])`` (batched),
  ``("reply", reply_id, value, exception | None)``, ``("bye",)``

:class:`EngineProcessClient` (parent side) implements ``EngineClient``: requests are validated in the
parent with the engine's own rules (``RequestFactory`` + the K/V budget the child reports), so a bad
request is a synchronous ``ValueError`` and ``submit`` is a one-way send (no round trip). Only with
``max_queued_requests`` set does a submission wait for the child's answer (the queue length lives
there), so a full queue is still a synchronous ``QueueFullError``. Events come back on a receiver
thread that calls the registered ``on_event`` callbacks. The per-token texts of logprob entries
(``return_text_in_logprobs``) are decoded here, not on the engine's loop; the engine only sends
ids. The child pickles its events on a sender thread, so its step only pays for a queue put.

Failure handling: the child leaves the parent's process group (a Ctrl-C or a ``kill -TERM -PGID``
reaches the server, which drains and then stops the engine, instead of killing the engine under
running requests), ignores SIGINT, and exits as soon as the parent dies (a watchdog on the
parent's sentinel), so no engine is orphaned. If the child dies, every request in flight finishes
with an error event naming the exit code, later calls raise :class:`EngineDeadError`, and
``on_failure`` (set by the server: /health then answers 503) is called once.
"""

from __future__ import annotations

import atexit
import dataclasses
import itertools
import logging
import multiprocessing
import os
import pickle
import queue
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import zmq

from ..config import EngineConfig
from ..constrained import token_table
from ..constrained.index import Limits
from ..constrained.index import seed as seed_index
from ..io_struct import GenerateRequest, QueueFullError, RequestEvent
from ..runtime import available_cpus, describe_exit

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0
STATS_TIMEOUT_S = 10.0
SUBMIT_WORKERS = 2  # engine-process threads that queue submitted requests (building their constraints)
LOG_FORMAT = "[%(asctime)s] %(levelname)s %(name)s: %(message)s"


class EngineDeadError(RuntimeError):
    """The engine process is not running (it died, or the client was shut down)."""


# ------------------------------------------------------------------------------------------ threads
def default_engine_threads(cpus: int | None = None) -> int | None:
    """torch CPU threads for the engine when ``--num-threads`` is not given: every CPU but one
    (that one is left to the HTTP server, the tokenizer and the engine's own Python side), never
    more than torch's own default (physical cores), at least 1. ``None`` when ``OMP_NUM_THREADS``
    is set: that is the user's choice and torch already follows it. Measured in
    docs/performance.md ("Process layout and threads")."""
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    n = available_cpus() if cpus is None else cpus
    import torch

    return max(1, min(n - 1, torch.get_num_threads()))


# --------------------------------------------------------------------------------------- messages
def _dumps(msg: Any) -> bytes:
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


def _portable_error(e: BaseException) -> BaseException:
    """``e`` if it survives pickling, else a RuntimeError with its type and message."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # any unpicklable exception is reported by name
        return RuntimeError(f"{type(e).__name__}: {e}")


# ----------------------------------------------------------------------------------- child side
def _watch_parent() -> None:
    """Exit at once when the parent process dies (no orphaned engine holding memory and cores)."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        from multiprocessing.connection import wait

        wait([parent.sentinel])
        log.warning("the server process exited; the engine process stops")
        os._exit(1)

    threading.Thread(target=watch, name="bicache-parent-watch", daemon=True).start()


def _sender(ctx: zmq.Context, address: str, out: queue.SimpleQueue) -> None:
    """Owns the child's PUSH socket. Drains ``out``; consecutive events go as one message.
    ``None`` ends it (after everything queued before it was sent)."""
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 5000)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.connect(address)
    try:
        stop = False
        while not stop:
            items = [out.get()]
            while True:
                try:
                    items.append(out.get_nowait())
                except queue.Empty:
                    break
            events: list[RequestEvent] = []
            for it in items:
                if isinstance(it, RequestEvent):
                    events.append(it)
                    continue
                if events:
                    sock.send(_dumps(("events", events)))
                    events = []
                if it is None:
                    stop = True
                    break
                sock.send(_dumps(it))
            if events:
                sock.send(_dumps(("events", events)))
    finally:
        sock.close()


def engine_main(config: EngineConfig, req_address: str, event_address: str, log_level: str) -> None:
    """Entry point of the engine process (multiprocessing, spawn)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the server's to handle (it drains first)
    try:
        os.setpgrp()  # out of the server's process group: group signals reach the server only
    except OSError:
        pass
    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO), format=LOG_FORMAT,
                        stream=sys.stderr, force=True)
    _watch_parent()
    ctx = zmq.Context()
    out: queue.SimpleQueue = queue.SimpleQueue()
    sender = threading.Thread(target=_sender, args=(ctx, event_address, out), name="bicache-engine-sender",
                              daemon=True)
    sender.start()
    inbox = ctx.socket(zmq.PULL)
    inbox.setsockopt(zmq.LINGER, 0)
    inbox.connect(req_address)

    def finish(code: int) -> None:
        out.put(None)
        sender.join(10.0)
        inbox.close()
        ctx.term()
        sys.exit(code)

    try:
        from .engine import Engine

        engine = Engine(config=config)
    except BaseException as e:  # reported to the parent, which prints it
        log.debug("engine construction failed", exc_info=True)
        out.put(("startup_error", _portable_error(e)))
        finish(1)
        return
    import torch

    info = {
        "pid": os.getpid(),
        "model_path": engine.model_path,
        "model_config": engine.model_config,
        "context_length": engine.context_length,
        "eos_ids": tuple(engine.eos_ids),
        "kv_budget": engine.scheduler.admission.kv_budget,
        "config": engine.config,
        "num_threads": torch.get_num_threads(),
        "device": str(engine.device),
    }
    out.put(("ready", info))
    log.info("engine process %d ready (torch threads: %d, device: %s)", os.getpid(), info["num_threads"],
             info["device"])
    callbacks = [out.put]  # one callback for every request: the event goes to the sender as it is

    def in_thread(fn: Callable[[], Any], reply_id: int) -> None:
        def run() -> None:
            try:
                out.put(("reply", reply_id, fn(), None))
            except Exception as e:  # sent back to the caller
                out.put(("reply", reply_id, None, _portable_error(e)))
        threading.Thread(target=run, name="bicache-engine-call", daemon=True).start()

    submit_pool = ThreadPoolExecutor(SUBMIT_WORKERS, thread_name_prefix="bicache-submit")
    submitting: set[str] = set()  # rids whose submit runs in the pool
    early_aborts: set[str] = set()  # aborts that arrived before their request was queued
    submitting_lock = threading.Lock()

    def submit(greqs: list, reply_id: int | None, seeds: list) -> None:
        try:
            for regex, limits, data in seeds:
                seed_index(regex, token_table(engine.tokenizer), limits, data)
            engine.submit_many(greqs, callbacks * len(greqs))
        except Exception as e:  # the parent validated already; answered either way
            if reply_id is not None:
                out.put(("reply", reply_id, None, _portable_error(e)))
            else:
                for g in greqs:
                    out.put(_failed_event(g.rid or "", f"the engine refused the request: {e}"))
        else:
            if reply_id is not None:
                out.put(("reply", reply_id, True, None))
        finally:
            with submitting_lock:
                late = [g.rid for g in greqs if g.rid in early_aborts]
                for g in greqs:
                    submitting.discard(g.rid)
                    early_aborts.discard(g.rid)
            for rid in late:
                engine.abort(rid)

    while True:
        msg = pickle.loads(inbox.recv())
        kind = msg[0]
        if kind == "submit":
            # off the message loop (a constraint may still take seconds to build here), in a small
            # pool: aborts, stats and flushes keep being answered meanwhile
            greqs, reply_id, seeds = msg[1], msg[2], msg[3]
            with submitting_lock:
                submitting.update(g.rid for g in greqs)
            submit_pool.submit(submit, greqs, reply_id, seeds)
        elif kind == "abort":
            with submitting_lock:
                if msg[1] in submitting:  # its submit is still running: abort it right after
                    early_aborts.add(msg[1])
                    continue
            engine.abort(msg[1])
        elif kind == "stats":
            try:
                out.put(("reply", msg[1], engine.get_stats(), None))
            except Exception as e:
                out.put(("reply", msg[1], None, _portable_error(e)))
        elif kind == "flush":
            timeout = msg[2]
            in_thread(lambda t=timeout: engine.flush_cache(t), msg[1])
        elif kind == "shutdown":
            engine.shutdown(timeout=msg[1])  # in-flight requests get their abort events first
            out.put(("bye",))
            finish(0)
            return
        else:
            log.error("unknown message %r", kind)


def _failed_event(rid: str, message: str, *, error: bool = True) -> RequestEvent:
    return RequestEvent(rid, "", [], True, {"type": "abort", "message": message}, {"id": rid},
                        message if error else None)


# ---------------------------------------------------------------------------------- parent side
@dataclasses.dataclass
class _Pending:
    on_event: Callable[[RequestEvent], None] | None
    wants_text: bool  # return_text_in_logprobs: decode the logprob entries' tokens here


class _Reply:
    def __init__(self) -> None:
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None


def _ipc_dir() -> str:
    d = tempfile.mkdtemp(prefix="bicache-engine-")
    if len(d) > 80:  # ipc:// paths are limited to ~107 bytes
        shutil.rmtree(d, ignore_errors=True)
        d = tempfile.mkdtemp(prefix="bicache-", dir="/tmp")
    return d


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
        self._lock = threading.Lock()  # the request socket, the pending tables
        self._pending: dict[str, _Pending] = {}
        self._replies: dict[int, _Reply] = {}
        self._reply_ids = itertools.count(1)
        self._closed = False
        self._dead: str | None = None
        self._receiver: threading.Thread | None = None
        self._dir = _ipc_dir()
        req_address = f"ipc://{self._dir}/requests"
        event_address = f"ipc://{self._dir}/events"
        self._ctx = zmq.Context()
        self._req = self._ctx.socket(zmq.PUSH)
        self._req.setsockopt(zmq.LINGER, 0)
        self._req.setsockopt(zmq.SNDHWM, 0)
        self._req.bind(req_address)
        self._ev = self._ctx.socket(zmq.PULL)
        self._ev.setsockopt(zmq.LINGER, 0)
        self._ev.bind(event_address)
        cfg = config or EngineConfig()
        mp = multiprocessing.get_context("spawn")
        self.process = mp.Process(target=engine_main, args=(cfg, req_address, event_address, log_level),
                                  name="bicache-engine", daemon=True)
        try:
            self.process.start()
            info = self._wait_ready(startup_timeout)
            self._setup(info)
        except BaseException:
            self._close(kill=True)
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
        poller = zmq.Poller()
        poller.register(self._ev, zmq.POLLIN)
        poller.register(self.process.sentinel, zmq.POLLIN)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"the engine process did not load the model within {timeout:.0f} s")
            ready = dict(poller.poll(min(left, 1.0) * 1000))
            if self._ev in ready:
                msg = pickle.loads(self._ev.recv())
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
        from ..scheduler.request import RequestFactory

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
    def validate(self, greq: GenerateRequest) -> None:
        """The engine's own checks (``RequestFactory.build``, K/V budget included), run here."""
        self._factory.build(greq, None)

    def _validated(self, greq: GenerateRequest) -> list:
        """Validate, and return the constraint indexes this built ((regex, limits, IndexData)), which
        the engine process then takes instead of building them again."""
        req = self._factory.build(greq, None)
        c = req.constraint
        return [] if c is None else [(c.regex, Limits(), c.index)]

    def submit(self, greq: GenerateRequest, on_event: Callable[[RequestEvent], None] | None = None) -> str:
        return self.submit_many([greq], [on_event])[0]

    def submit_many(self, greqs: Sequence[GenerateRequest],
                    on_events: Sequence[Callable[[RequestEvent], None] | None]) -> list[str]:
        self._check_alive()
        sent: list[GenerateRequest] = []
        seeds: list = []
        for g in greqs:
            seeds += self._validated(g)
            # the texts of logprob entries are decoded here (receiver thread), not on the engine's loop
            sent.append(dataclasses.replace(g, rid=g.rid or uuid.uuid4().hex, return_text_in_logprobs=False))
        rids = [g.rid for g in sent]
        wait_reply = self.config.max_queued_requests is not None
        reply = _Reply() if wait_reply else None
        with self._lock:
            self._check_alive()
            clash = next((r for i, r in enumerate(rids) if r in self._pending or r in rids[:i]), None)
            if clash is not None:
                raise ValueError(f"request id {clash!r} is already in use")
            for g, orig, cb in zip(sent, greqs, on_events):
                self._pending[g.rid] = _Pending(cb, bool(orig.return_logprob and orig.return_text_in_logprobs))
            reply_id = None
            if reply is not None:
                reply_id = next(self._reply_ids)
                self._replies[reply_id] = reply
            self._req.send(_dumps(("submit", sent, reply_id, seeds)))
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
                self._req.send(_dumps(("abort", rid)))

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
            self._req.send(_dumps((msg[0], reply_id, *msg[2:])))
        return self._await(reply, timeout, what, reply_id)

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
        poller = zmq.Poller()
        poller.register(self._ev, zmq.POLLIN)
        poller.register(self.process.sentinel, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll(1000))
                if self._ev in ready:
                    while True:  # everything already queued, before looking at the process again
                        try:
                            raw = self._ev.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        if self._dispatch(pickle.loads(raw)):
                            return
                    continue
                if self.process.sentinel in ready or not self.process.is_alive():
                    # what the child sent just before it exited may still be on its way
                    while self._ev.poll(200):
                        if self._dispatch(pickle.loads(self._ev.recv())):
                            return
                    self.process.join(1.0)
                    self._engine_died(self.process.exitcode)
                    return
        except Exception:  # never expected; the requests must still be answered
            log.exception("the engine event receiver failed")
            self._engine_died(None, "the server lost its connection to the engine process")
        finally:
            self._ev.close()

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
                    self._add_logprob_texts(ev.meta_info)
                if p.on_event is not None:
                    try:
                        p.on_event(ev)
                    except Exception:
                        log.exception("event callback for %s failed", ev.rid)
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

    def _add_logprob_texts(self, meta: dict[str, Any]) -> None:
        """Fill the text of ``[logprob, token_id, text]`` entries (the engine sends None)."""
        cache: dict[int, str] = {}

        def text(tid: int) -> str:
            s = cache.get(tid)
            if s is None:
                s = cache[tid] = self.tokenizer.decode([tid])
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
                    p.on_event(_failed_event(rid, message, error=error))
                except Exception:
                    log.exception("event callback for %s failed", rid)
        for reply in replies.values():
            reply.error = EngineDeadError(message)
            reply.done.set()

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
                try:
                    self._req.send(_dumps(("shutdown", timeout)))
                except zmq.ZMQError:
                    pass
        self.process.join(timeout + 5.0)
        self._close(kill=True)
        if self._receiver is not None:
            self._receiver.join(5.0)
            if not self._receiver.is_alive():
                self._ctx.term()
        self._fail_all("server shutting down", error=False)
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
            self._req.close()
        if self._receiver is None:  # else the receiver thread closes its own socket
            self._ev.close()
            self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> EngineProcessClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
