"""The engine process's side of engine/process.py (the server process's side is
:class:`~bicache_sgl.engine.process.EngineProcessClient`; the messages are in engine/wire.py).

:func:`engine_main` loads the engine the checkpoint is served by (engine/local.py: the
bidirectional :class:`~bicache_sgl.engine.engine.Engine`, or the block-diffusion engine of a
LLaDA2.x / SDAR folder), reports ``ready`` (or the startup error), then serves the parent's
messages: submissions are queued on a small thread
pool (seeding the constraint indexes the parent built, so none is built twice), aborts that
arrive while their request is still being queued are applied right after (a submission with
nothing to build is queued on the message loop itself), events go back through one sender
thread (the engine's step only pays for a queue put).

Failure handling: the child leaves the parent's process group (a Ctrl-C or a ``kill -TERM -PGID``
reaches the server, which drains and then stops the engine, instead of killing the engine under
running requests), ignores SIGINT, and exits as soon as the parent dies (a watchdog on the
parent's sentinel), so no engine is orphaned.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

from ..config import EngineConfig
from ..constrained import token_table
from ..constrained.index import seed as seed_index
from ..io_struct import GenerateRequest, RequestEvent
from ..procinfo import available_cpus
from ..scheduler.validate import ValidRequest
from .wire import LOG_FORMAT, dumps, failed_event, portable_error

log = logging.getLogger(__name__)

SUBMIT_WORKERS = 2  # engine-process threads that queue submitted requests (building their constraints)


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


def _sender(conn: Connection, out: queue.SimpleQueue) -> None:
    """The only writer of the pipe to the parent. Drains ``out``; consecutive events go as one
    message. ``None`` ends it (after everything queued before it was sent). A parent that is gone
    ends it too (the parent watchdog then exits the process)."""
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
                if isinstance(it, list):  # one engine step's events (_EventSink.many)
                    events.extend(it)
                    continue
                if events:
                    conn.send_bytes(dumps(("events", events)))
                    events = []
                if it is None:
                    stop = True
                    break
                conn.send_bytes(dumps(it))
            if events:
                conn.send_bytes(dumps(("events", events)))
    except OSError:  # the parent closed its end (it exited or gave up on this process)
        log.debug("the pipe to the server process closed")


def _greq(item: ValidRequest | GenerateRequest) -> GenerateRequest:
    """The request of a submitted item: a ValidRequest (an engine that accepts them) or, for an
    engine that validates every submission itself, the GenerateRequest as the client sent it."""
    return item.greq if isinstance(item, ValidRequest) else item


class _EventSink:
    """Every request's event callback: events go to the sender's queue, a step's events as one
    list (``Engine`` calls ``many`` once per step), so the sender thread is woken once per step;
    each wake costs the engine thread a thread switch on a loaded machine."""

    def __init__(self, out: queue.SimpleQueue) -> None:
        self._out = out

    def __call__(self, event: RequestEvent) -> None:
        self._out.put(event)

    def many(self, events: list[RequestEvent]) -> None:
        self._out.put(events)


def engine_main(config: EngineConfig, conn: Connection, log_level: str) -> None:
    """Entry point of the engine process (multiprocessing, spawn)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the server's to handle (it drains first)
    try:
        os.setpgrp()  # out of the server's process group: group signals reach the server only
    except OSError:
        pass
    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO), format=LOG_FORMAT,
                        stream=sys.stderr, force=True)
    _watch_parent()
    out: queue.SimpleQueue = queue.SimpleQueue()
    sender = threading.Thread(target=_sender, args=(conn, out), name="bicache-engine-sender", daemon=True)
    sender.start()

    def finish(code: int) -> None:
        out.put(None)
        sender.join(10.0)  # what was written is in the pipe: the parent reads it after this exits
        conn.close()
        sys.exit(code)

    try:
        from .local import build_local_engine

        engine = build_local_engine(config)
    except BaseException as e:  # reported to the parent, which prints it
        log.debug("engine construction failed", exc_info=True)
        out.put(("startup_error", portable_error(e)))
        finish(1)
        return
    import torch

    info = {
        "pid": os.getpid(),
        "model_path": engine.model_path,
        "model_config": engine.model_config,
        "context_length": engine.context_length,
        "eos_ids": tuple(engine.eos_ids),
        "kv_budget": engine.kv_budget,
        "accepts_valid_requests": engine.accepts_valid_requests,
        "config": engine.config,
        "num_threads": torch.get_num_threads(),
        "device": str(engine.device),
    }
    out.put(("ready", info))
    log.info("engine process %d ready (torch threads: %d, device: %s)", os.getpid(), info["num_threads"],
             info["device"])
    callbacks = [_EventSink(out)]  # one callback for every request: events go to the sender as they are

    def in_thread(fn: Callable[[], Any], reply_id: int) -> None:
        def run() -> None:
            try:
                out.put(("reply", reply_id, fn(), None))
            except Exception as e:  # sent back to the caller
                out.put(("reply", reply_id, None, portable_error(e)))
        threading.Thread(target=run, name="bicache-engine-call", daemon=True).start()

    submit_pool = ThreadPoolExecutor(SUBMIT_WORKERS, thread_name_prefix="bicache-submit")
    submitting: set[str] = set()  # rids whose submit runs in the pool
    early_aborts: set[str] = set()  # aborts that arrived before their request was queued
    submitting_lock = threading.Lock()

    def submit(valid: list[ValidRequest | GenerateRequest], reply_id: int | None, seeds: list) -> None:
        try:
            for regex, limits, data in seeds:
                seed_index(regex, token_table(engine.tokenizer), limits, data)
            # trusted as validated (RequestFactory.build takes a ValidRequest as it is); what only
            # this process knows is still checked here: the queue limit, rids already running
            engine.submit_many(valid, callbacks * len(valid))
        except Exception as e:  # answered either way
            if reply_id is not None:
                out.put(("reply", reply_id, None, portable_error(e)))
            else:
                now = time.perf_counter()
                for v in valid:
                    out.put(failed_event(v.rid, f"the engine refused the request: {e}",
                                         prompt_tokens=len(_greq(v).input_ids), since=now))
        else:
            if reply_id is not None:
                out.put(("reply", reply_id, True, None))
        finally:
            with submitting_lock:
                late = [v.rid for v in valid if v.rid in early_aborts]
                for v in valid:
                    submitting.discard(v.rid)
                    early_aborts.discard(v.rid)
            for rid in late:
                engine.abort(rid)

    while True:
        try:
            raw = conn.recv_bytes()
        except (EOFError, OSError):  # the parent closed its end without a shutdown message
            log.warning("the server process closed the pipe; the engine process stops")
            engine.shutdown(timeout=1.0)
            finish(1)
            return
        msg = pickle.loads(raw)
        kind = msg[0]
        if kind == "submit":
            valid, reply_id, seeds = msg[1], msg[2], msg[3]
            with submitting_lock:
                submitting.update(v.rid for v in valid)
            if seeds or any(_greq(v).params.constraint is not None for v in valid):
                # off the message loop (a constraint may still take seconds to build here), in a
                # small pool: aborts, stats and flushes keep being answered meanwhile
                submit_pool.submit(submit, valid, reply_id, seeds)
            else:
                # nothing to build: queueing is a few dict/list operations, cheaper here than the
                # hop to a pool thread (which at concurrency 1 costs more than the submission)
                submit(valid, reply_id, seeds)
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
                out.put(("reply", msg[1], None, portable_error(e)))
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
