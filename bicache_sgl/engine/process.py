"""The engine in its own process (SGLang's layout): the HTTP server and the tokenizer stay in the
main process, the scheduler + model run in a child (engine/process_child.py), and the two talk over
one duplex pipe (a Unix socket pair; the messages: engine/wire.py).

Why: in one process the HTTP event loop, the tokenizer, the JSON encoding and the engine's step
share one GIL, and the engine's OpenMP threads compete with the server threads for the same cores.
In a child process the engine's loop never waits on HTTP work, and each process gets its own
thread budget (:func:`default_engine_threads`).

:class:`EngineProcessClient` (parent side) implements ``EngineClient``, for whichever engine the
child builds for the checkpoint (engine/local.py: the bidirectional engine, or the block-diffusion
engine of a LLaDA2.x / SDAR folder). For the bidirectional engine each request is validated once,
here, by the pure ``validate_request`` against the limits the child reports (its model, its
context length, its K/V budget) plus the cached constraint check, so a bad request is a
synchronous ``ValueError``; the child trusts the :class:`ValidRequest` it is sent, and ``submit``
is a one-way send (no round trip). A submission waits for the child's answer when the queue
length matters (``max_queued_requests`` set: it lives there, so a full queue is still a
synchronous ``QueueFullError``) or when the child's engine validates every submission itself
(the block engine: ``accepts_valid_requests`` False in what the child reports; its refusals come
back as the ``ValueError`` they are). Events come back on a receiver thread that calls the registered ``on_event``
callbacks, or, once the HTTP app has called :meth:`EngineProcessClient.attach_loop`, on its event
loop (the pipe is one more reader of the loop: an event reaches its request without a thread
hop). The per-token texts of logprob entries (``return_text_in_logprobs``) are decoded here,
not on the engine's loop; the engine only sends ids.

If the child dies, every request in flight finishes with an error event naming the exit code,
later calls raise :class:`EngineDeadError`, and ``on_failure`` (set by the server: /health then
answers 503) is called once.

This module is the client's API (validation, the pending requests, their events, logprob texts);
the transport (the child, the pipe, round trips, reading on a thread or on the loop, the child's
death) is engine/process_channel.py; the child's side and the messages are in their own modules.
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..config import EngineConfig
from ..constrained.index import Limits
from ..io_struct import GenerateRequest, QueueFullError, RequestEvent
from ..scheduler.validate import ValidRequest, reachable_stop_ids, validate_request
from .process_channel import EngineChannel
from .process_child import default_engine_threads
from .wire import EngineDeadError, failed_event, fill_logprob_texts

__all__ = ["EngineDeadError", "EngineProcessClient", "default_engine_threads"]

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0
STATS_TIMEOUT_S = 10.0


def _without_logprob_texts(v: ValidRequest | GenerateRequest) -> ValidRequest | GenerateRequest:
    """``v`` asking the engine for logprob entries without their token texts (decoded here)."""
    if isinstance(v, GenerateRequest):
        return dataclasses.replace(v, return_text_in_logprobs=False)
    return dataclasses.replace(v, greq=dataclasses.replace(v.greq, return_text_in_logprobs=False))


@dataclasses.dataclass
class _Pending:
    on_event: Callable[[RequestEvent], None] | None
    wants_text: bool  # return_text_in_logprobs: decode the logprob entries' tokens here
    prompt_tokens: int  # for the final event if the engine process dies under it
    since: float  # perf_counter at submit


class EngineProcessClient:
    """``EngineClient`` for an :class:`~bicache_sgl.engine.engine.Engine` running in a child process.

    The constructor starts the child and returns when its model is loaded (or raises what the
    child raised while loading). ``on_failure(message)`` is called once, on the receiver thread,
    if the child dies while the client is not shut down.
    """

    in_process = False

    def __init__(self, config: EngineConfig | None = None, *, log_level: str = "info",
                 startup_timeout: float = STARTUP_TIMEOUT_S,
                 on_failure: Callable[[str], None] | None = None) -> None:
        self.on_failure = on_failure
        self._lock = threading.Lock()  # the pending table (taken before the channel's lock, never after)
        self._pending: dict[str, _Pending] = {}
        self._text_pool: ThreadPoolExecutor | None = None  # logprob texts, decoded off the loop
        self._chan = EngineChannel(config or EngineConfig(), log_level=log_level, startup_timeout=startup_timeout,
                                   on_events=self._on_events, on_end=self._on_end)
        try:
            self._setup(self._chan.info)
        except BaseException:
            self._chan.shutdown(timeout=5.0)
            raise
        ref = weakref.ref(self)

        def _stop_at_exit() -> None:
            client = ref()
            if client is not None:
                client.shutdown(timeout=5.0)
        self._atexit = _stop_at_exit
        atexit.register(_stop_at_exit)

    @property
    def process(self) -> Any:
        """The engine's child process (``multiprocessing.Process``)."""
        return self._chan.process

    # ---------------------------------------------------------------------------------- startup
    def _setup(self, info: dict[str, Any]) -> None:
        """What the child reported once loaded; the tokenizer and the validation limits here."""
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
        # None: the engine validates each submission itself (the submission waits for its answer)
        self._factory: RequestFactory | None = None
        if info["accepts_valid_requests"]:
            self._factory = RequestFactory(self.model_config, self.tokenizer, self.eos_ids, self.config.decode,
                                           self.context_length, kv_budget=self.kv_budget)

    # --------------------------------------------------------------------------------- requests
    @property
    def submit_returns_at_once(self) -> bool:
        """True when ``submit`` never waits on the engine process (no ``max_queued_requests``,
        an engine that takes validated requests: a pure validation and a one-way send), so a
        caller may submit on its event loop. A request with a constraint may still build it while
        validating (cached after the first)."""
        return not self._waits_for_engine

    @property
    def _waits_for_engine(self) -> bool:
        """Whether a submission waits for the engine process's answer (module docstring)."""
        return self.config.max_queued_requests is not None or self._factory is None

    def _validated(self, greq: GenerateRequest) -> tuple[ValidRequest | GenerateRequest, list]:
        """Validate once (pure) and check the constraint (cached build, off the caller's loop):
        the request as it is sent and the constraint index ((regex, limits, IndexData)) the
        engine process then takes instead of building it again. An engine that validates each
        submission itself (the block engine) is sent the request as it is, with its constraint
        built here all the same: a build may take up to its time limit (30 s), longer than the
        submission's round trip may wait, and here it waits on nothing (the caller is off the
        event loop, a refused build is the ValueError the engine would raise, and the engine
        process's build is then a cache hit). Its end ids are the ones the engine compiles with
        (the model's EOS ids and the stop ids inside the vocabulary)."""
        if self._factory is None:
            if greq.params.constraint is None:
                return greq, []
            from ..scheduler.factory import request_constraint
            p = reachable_stop_ids(greq.params, self.model_config.vocab_size)
            c = request_constraint(p, self.tokenizer, self.eos_ids)
            return greq, [] if c is None else [(c.regex, Limits(), c.index)]
        v = validate_request(greq, self._factory.limits)
        c = self._factory.constraint(v.greq.params)
        return v, [] if c is None else [(c.regex, Limits(), c.index)]

    def submit(self, greq: GenerateRequest, on_event: Callable[[RequestEvent], None] | None = None) -> str:
        return self.submit_many([greq], [on_event])[0]

    def submit_many(self, greqs: Sequence[GenerateRequest],
                    on_events: Sequence[Callable[[RequestEvent], None] | None]) -> list[str]:
        self._chan.check_alive()
        sent: list[ValidRequest | GenerateRequest] = []
        seeds: list = []
        for g in greqs:
            v, built = self._validated(g)
            seeds += built
            # the texts of logprob entries are decoded here (receiver thread), not on the engine's loop
            sent.append(_without_logprob_texts(v))
        rids = [v.rid for v in sent]
        reply_id, reply = self._chan.open_reply() if self._waits_for_engine else (None, None)
        now = time.perf_counter()
        with self._lock:
            self._chan.check_alive()
            clash = next((r for i, r in enumerate(rids) if r in self._pending or r in rids[:i]), None)
            if clash is not None:
                raise ValueError(f"request id {clash!r} is already in use")
            for g, cb in zip(greqs, on_events):
                self._pending[g.rid] = _Pending(cb, bool(g.return_logprob and g.return_text_in_logprobs),
                                                len(g.input_ids), now)
            self._chan.send(("submit", sent, reply_id, seeds))
        if reply is not None:
            try:
                self._chan.await_reply(reply, STATS_TIMEOUT_S, "submitting the request", reply_id)
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
        self._chan.send_if_open(("abort", rid))

    def abort_all(self) -> int:
        """Abort every request this client has in flight (each then ends with an abort event)."""
        with self._lock:
            rids = list(self._pending)
        for rid in rids:
            self.abort(rid)
        return len(rids)

    def flush_cache(self, timeout: float = 30.0) -> bool:
        try:
            return bool(self._chan.call("flush", timeout + STATS_TIMEOUT_S, "flush_cache", timeout))
        except TimeoutError:
            return False

    def get_stats(self) -> dict[str, Any]:
        """The engine's counters (a round trip), plus ``engine_pid`` (the process to profile)."""
        return {"engine_pid": self.pid, **self._chan.call("stats", STATS_TIMEOUT_S, "get_stats")}

    # ------------------------------------------------------------------------------------ events
    def attach_loop(self, loop: asyncio.AbstractEventLoop) -> bool:
        """Read the engine's messages on ``loop`` from now on (``EngineChannel.attach_loop``: call
        on the loop's thread, e.g. at application startup; no round trip on that thread after
        it). The logprob texts of ``return_text_in_logprobs`` are still decoded off the loop (one
        worker thread, in order). False (nothing changed) when the engine is gone or shut down."""
        if not self._chan.attach_loop(loop):
            return False
        # events are read once the loop runs again (this is its thread): the pool is there first
        self._text_pool = ThreadPoolExecutor(1, thread_name_prefix="bicache-logprob-text")
        return True

    def _on_events(self, events: list[RequestEvent]) -> None:
        """One batch of events from the engine (receiver thread, or the loop)."""
        for ev in events:
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

    def _decode_token(self, tid: int) -> str:
        return self.tokenizer.decode([tid])

    def _on_end(self, message: str, error: bool) -> None:
        """The channel ended: every request in flight finishes; a death is reported once."""
        self._fail_all(message, error=error)
        if error and self.on_failure is not None:
            try:
                self.on_failure(message)
            except Exception:
                log.exception("on_failure hook failed")

    def _fail_all(self, message: str, *, error: bool) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
        for rid, p in pending.items():
            if p.on_event is not None:
                try:
                    p.on_event(failed_event(rid, message, prompt_tokens=p.prompt_tokens, since=p.since, error=error))
                except Exception:
                    log.exception("event callback for %s failed", rid)

    # ------------------------------------------------------------------------- EngineClient extras
    def watch(self, on_failure: Callable[[str], None]) -> None:
        """``on_failure(message)`` once when the engine process dies (now, if it already has)."""
        self.on_failure = on_failure
        if not self.alive:
            on_failure(self._chan.dead_message or "the engine process exited during startup")

    def describe(self) -> str:
        return (f"engine process pid {self.pid} with {self.num_threads} torch threads; "
                "server process: 1")

    # --------------------------------------------------------------------------------- shutdown
    @property
    def alive(self) -> bool:
        return self._chan.alive

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine; requests in flight finish with an abort. Idempotent."""
        if not self._chan.shutdown(timeout):
            return
        if self._text_pool is not None:
            self._text_pool.shutdown(wait=True)  # events with logprob texts are delivered first
        self._chan.end("server shutting down", error=False)
        try:
            atexit.unregister(self._atexit)
        except AttributeError:  # the constructor failed before registering
            pass

    def __enter__(self) -> EngineProcessClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
