"""The engine: a background thread running steps, and the offline API (SGLang's ``sgl.Engine``).

A step is ``scheduler.schedule()`` (admit waiting requests; every running request plans its
sequences), ONE batched forward for all of them (``runner.forward``), ``scheduler.postprocess``
(commits, each request consumes its logits, audits, retirements); the engine then emits the
events. The engine itself is the thread, the inbox (submits, aborts, flushes) and the offline
API. ``submit``/``abort`` are thread-safe; the HTTP layer never blocks on a forward.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..config import DecodeDefaults, EngineConfig, SamplingParams
from ..io_struct import GenerateRequest, QueueFullError, RequestEvent
from ..models.tokenize import TextEncoder
from ..scheduler.request import Req
from ..scheduler.validate import ValidRequest
from .builder import EngineParts, build_parts, measurement_parts
from .model_runner import LoadedModel

log = logging.getLogger(__name__)

_DECODE_FIELDS = frozenset(f.name for f in dataclasses.fields(DecodeDefaults))


def build_config(config: EngineConfig | None = None, **kwargs: Any) -> EngineConfig:
    """EngineConfig from keyword arguments (decode defaults may be given flat, by their
    DecodeDefaults names)."""
    decode_kw = {k: kwargs.pop(k) for k in list(kwargs) if k in _DECODE_FIELDS}
    # None means "default" except for threshold, where None (or 0) means the fixed step schedule
    decode_kw = {k: v for k, v in decode_kw.items() if v is not None or k == "threshold"}
    cfg = config or EngineConfig()
    if kwargs:
        unknown = set(kwargs) - set(EngineConfig.__dataclass_fields__)
        if unknown:
            raise TypeError(f"unknown Engine argument(s): {', '.join(sorted(unknown))}")
        cfg = cfg.replace(**kwargs)
    if decode_kw:
        cfg = cfg.replace(decode=dataclasses.replace(cfg.decode, **decode_kw))
    return cfg


class Engine:
    """Offline engine in the shape of SGLang's ``sgl.Engine``; also the server's backend
    (it implements ``bicache_sgl.engine.interface.EngineClient``)."""

    in_process = True
    submit_returns_at_once = False  # submit takes the engine's lock, which a step may hold
    # a ValidRequest (validated in the server process against the limits it was sent) is taken as
    # it is: an EngineProcessClient in front of this engine validates and sends one-way
    accepts_valid_requests = True

    def __init__(self, model_path: str | None = None, *, config: EngineConfig | None = None, **kwargs: Any) -> None:
        if model_path is not None:
            kwargs["model_path"] = model_path
        self._adopt(build_parts(build_config(config, **kwargs), measure=measurement_stack))
        log.info("prefix cache: %s; %s", self.policy.describe(), self.memory.describe())

    @classmethod
    def from_parts(cls, parts: EngineParts) -> "Engine":
        """An engine over parts already built (``builder.measurement_parts``: a calibration's)."""
        eng = cls.__new__(cls)
        eng._adopt(parts)
        return eng

    def _adopt(self, parts: EngineParts) -> None:
        self.config, loaded = parts.config, parts.loaded
        self.model_path, self.model_config, self.tokenizer = loaded.model_path, loaded.model_config, loaded.tokenizer
        self.model, self.eos_ids, self.device = loaded.model, loaded.eos_ids, loaded.device
        self._encode = TextEncoder(self.tokenizer)
        self.context_length, self.profile, self.policy, self.audit = (parts.context_length, parts.profile,
                                                                      parts.policy, parts.audit)
        self.memory, self.pool, self.cache, self.runner = parts.memory, parts.pool, parts.cache, parts.runner
        self.requests, self.scheduler = parts.requests, parts.scheduler
        self._seed = self.config.seed  # the per-request seed counter (``_seed_request``)
        self._inbox: list[Req] = []
        self._aborts: set[str] = set()
        self._flushes: list[threading.Event] = []
        self._by_rid: dict[str, Req] = {}
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stop = False
        self._atexit_registered = False
        self.last_step_time = time.time()

    @property
    def n_layers(self) -> int:
        return self.model_config.n_layers

    @property
    def kv_budget(self) -> int:
        """The scheduler's private K/V budget over all running requests (positions)."""
        return self.scheduler.admission.kv_budget

    # --------------------------------------------------------------------------------- requests
    def submit(self, greq: GenerateRequest, on_event: Callable[[RequestEvent], None] | None = None) -> str:
        """Queue a request; ``on_event`` is called from the engine thread. Thread-safe."""
        return self.submit_many([greq], [on_event])[0]

    def submit_many(self, greqs: Sequence[GenerateRequest | ValidRequest],
                    on_events: Sequence[Callable[[RequestEvent], None] | None], *, start: bool = True) -> list[str]:
        """Queue several requests atomically (they become visible to the same step). ``start``
        False leaves the engine thread alone (``run_sync`` steps on the caller's thread)."""
        # validated here (a ValidRequest is trusted as it is); ValueError names what is wrong
        reqs = [self.requests.build(g, cb) for g, cb in zip(greqs, on_events)]
        with self._cv:
            limit = self.config.max_queued_requests
            if limit is not None and self._num_waiting() + len(reqs) > limit:
                raise QueueFullError(f"the request queue is full ({limit} waiting)")
            rids = [r.rid for r in reqs]
            clash = next((rid for i, rid in enumerate(rids) if rid in self._by_rid or rid in rids[:i]), None)
            if clash is not None:
                raise ValueError(f"request id {clash!r} is already in use")
            for req in reqs:
                self._seed_request(req)  # under the lock: submitters' threads share the counter
                self._by_rid[req.rid] = req
                self._inbox.append(req)
            self._cv.notify_all()
        if start:
            self.start()
        return rids

    def _seed_request(self, req: Req) -> None:
        """Every queued request advances the seed counter; one without ``sampling_params.seed``
        samples from the counter's value (so its seed depends only on its place in the arrivals)."""
        self._seed += 1
        if req.params.seed is None:
            req.reseed(self._seed)

    def run_sync(self, greqs: Sequence[GenerateRequest]) -> list[RequestEvent]:
        """The one run-to-completion loop: run requests (queued together: one admission round sees
        them all) on the calling thread, one ``step`` after another, and return each one's final
        event (for profilers, tools and a calibration's measurement engine, which must see the
        steps on their own thread). The engine thread must not be running."""
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError("run_sync needs an engine whose thread is not running")
        rids = self.submit_many(greqs, [None] * len(greqs), start=False)
        reqs = [self._by_rid[rid] for rid in rids]
        while self._inbox or self._flushes or self.has_work():
            if not self.step() and self.scheduler.waiting and not self._inbox:
                # nothing runs and nothing can be admitted
                raise RuntimeError(f"{len(self.scheduler.waiting)} request(s) do not fit this engine's K/V budget "
                                   f"({self.scheduler.admission.kv_budget} positions)")
        # every request has finished (a failure, at admission too, finishes it with its error)
        return [r.event() for r in reqs]

    def abort(self, rid: str) -> None:
        with self._cv:
            if rid in self._by_rid:
                self._aborts.add(rid)
                self._cv.notify_all()

    def abort_all(self) -> int:
        """Abort every queued and running request (SGLang's ``abort_all``)."""
        with self._cv:
            rids = set(self._by_rid)
            self._aborts |= rids
            self._cv.notify_all()
        return len(rids)

    # ------------------------------------------------------------------------------ engine loop
    def start(self) -> None:
        with self._cv:
            if self._thread is not None and self._thread.is_alive():
                return
            self._stop = False
            self._thread = threading.Thread(target=self._loop, name="bicache-engine", daemon=True)
            self._thread.start()
            if not self._atexit_registered:
                # A daemon thread still inside a torch op at interpreter exit aborts the process
                # ("terminate called without an active exception"): stop the loop first.
                ref = weakref.ref(self)

                def _stop_at_exit() -> None:
                    engine = ref()
                    if engine is not None:
                        engine.shutdown(timeout=5.0)
                atexit.register(_stop_at_exit)
                self._atexit_registered = True

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop; requests still in flight are answered with an abort."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        for req in list(self.running) + list(self.scheduler.waiting) + list(self._inbox):
            if not req.finished:
                req.fail("server shutting down")
                self._emit(req)
        self.running.clear()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._stop or self._inbox or self._aborts or self._flushes or self.has_work()):
                    self._cv.wait(timeout=1.0)
                if self._stop:
                    return
            try:
                self.step()
            except Exception:  # never let one bad step kill the server
                log.exception("engine step failed")

    @property
    def running(self) -> list[Req]:
        return self.scheduler.running

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> bool:
        """One step: take in what was submitted, aborted or flushed; ``scheduler.schedule()``
        (admit, every running request plans its sequences), ONE batched forward for all of them
        (``runner.forward``), ``scheduler.postprocess``; then emit the events (blocks that became
        final, finished requests). A request that failed at admission gets its final event at
        once (it is in no forward); a failed forward ends every request of the batch with the
        error. False when nothing was running (no forward)."""
        self._drain_inbox()
        batch = self.scheduler.schedule()
        if batch.failed:
            self._emit_all(batch.failed)
        if not self.scheduler.running:
            return False
        try:
            logits = self.runner.forward(batch.works)
        except Exception as e:
            log.exception("batched forward failed")
            emit = self.scheduler.fail_batch(batch, e)
        else:
            emit = self.scheduler.postprocess(batch, logits)
        self._emit_all(emit)
        self.last_step_time = time.time()
        return True

    def _emit_all(self, reqs: list[Req]) -> None:
        # a callback with a ``many`` method gets all of this round's events for it in one call
        # (the engine process's sender is then woken once per step, not once per event)
        batched: dict[int, tuple[Callable[[list[RequestEvent]], None], list[RequestEvent]]] = {}
        for req in reqs:
            if req.finished:
                self._by_rid.pop(req.rid, None)
            many = getattr(req.on_event, "many", None)
            if many is None:
                self._emit(req)
                continue
            try:
                ev = req.event()
            except Exception:
                log.exception("building the event of %s failed", req.rid)
                continue
            batched.setdefault(id(req.on_event), (many, []))[1].append(ev)
        for many, events in batched.values():
            try:
                many(events)
            except Exception:
                log.exception("event callback for %d events failed", len(events))

    def _drain_inbox(self) -> None:
        with self._cv:
            new, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, set()
            flushes, self._flushes = self._flushes, []
        if flushes:
            self.cache.flush()
            for ev in flushes:
                ev.set()
        for req in new:
            self.scheduler.add(req)
        for rid in aborts:
            req = self._by_rid.get(rid)
            if req is None or req.finished:
                continue
            req.fail("aborted by the client")
            if self.scheduler.remove_waiting(req):
                self.scheduler.finish_reasons["abort"] += 1
            else:
                self.scheduler.retire(req)
            self._emit_all([req])

    def _num_waiting(self) -> int:
        """Clients' requests waiting, in the engine's inbox or the scheduler's queue."""
        return self.scheduler.num_waiting() + len(self._inbox)

    def _emit(self, req: Req) -> None:
        if req.on_event is None:
            return
        try:
            req.on_event(req.event())
        except Exception:
            log.exception("event callback for %s failed", req.rid)

    # ----------------------------------------------------------------------------- offline API
    def generate(self, prompt: str | list[str] | None = None, sampling_params: dict | SamplingParams | None = None,
                 input_ids: list[int] | list[list[int]] | None = None, *, return_logprob: bool = False,
                 logprob_start_len: int = -1, top_logprobs_num: int = 0, return_text_in_logprobs: bool = False,
                 timeout: float | None = None) -> dict | list[dict]:
        """Blocking generation in SGLang's offline-engine shape (a dict, or a list for a list)."""
        params = sampling_params if isinstance(sampling_params, SamplingParams) else \
            SamplingParams.from_dict(sampling_params)
        if (prompt is None) == (input_ids is None):
            raise ValueError("pass exactly one of prompt and input_ids")
        if (prompt is not None and len(prompt) == 0) or (input_ids is not None and len(input_ids) == 0):
            raise ValueError("the prompt is empty")
        single = isinstance(prompt, str) or (input_ids is not None and isinstance(input_ids[0], int))
        if prompt is not None:
            id_lists = [self.encode(p) for p in ([prompt] if isinstance(prompt, str) else prompt)]
        else:
            id_lists = [list(input_ids)] if single else [list(x) for x in input_ids]
        greqs = [GenerateRequest(ids, params.replace(n=1), return_logprob=return_logprob,
                                 logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
                                 return_text_in_logprobs=return_text_in_logprobs)
                 for ids in id_lists for _ in range(params.n)]
        results: list[RequestEvent | None] = [None] * len(greqs)
        done = threading.Semaphore(0)

        def make_cb(i: int) -> Callable[[RequestEvent], None]:
            def cb(ev: RequestEvent) -> None:
                if ev.finished:
                    results[i] = ev
                    done.release()
            return cb

        self.submit_many(greqs, [make_cb(i) for i in range(len(greqs))])
        deadline = None if timeout is None else time.time() + timeout
        for _ in greqs:
            if not done.acquire(timeout=None if deadline is None else max(0.0, deadline - time.time())):
                raise TimeoutError("generation timed out")
        outs = []
        for ev in results:
            if ev.error:
                raise RuntimeError(ev.error)
            outs.append({"text": ev.text, "output_ids": ev.output_ids, "meta_info": ev.meta_info})
        return outs[0] if single and params.n == 1 else outs

    def encode(self, text: str) -> list[int]:
        """Prompt text -> ids, special tokens added (``tokenizer.encode``, models.tokenize)."""
        return self._encode(text)

    def flush_cache(self, timeout: float = 30.0) -> bool:
        """Drop every cached prefix not held by a running request (safe while requests run: the
        flush happens on the engine thread between two steps). Returns False on timeout."""
        done = threading.Event()
        with self._cv:
            self._flushes.append(done)
            self._cv.notify_all()
        self.start()
        return done.wait(timeout)

    def flush(self) -> None:
        """Drop every cached prefix now, on the calling thread (an engine nobody else steps, with
        no request running: a calibration's measurement engine)."""
        self.cache.flush()

    @property
    def stats(self) -> dict[str, int]:
        return self.scheduler.stats

    def get_stats(self) -> dict[str, Any]:
        st = self.stats
        total = st["computed_layer_tokens"] + st["skipped_layer_tokens"]
        return {
            "num_running_reqs": len(self.running),
            "num_waiting_reqs": self._num_waiting(),
            **st,
            "saved_compute_fraction": st["skipped_layer_tokens"] / total if total else 0.0,
            "finished_reqs_by_reason": dict(self.scheduler.finish_reasons),
            "reused_tokens_by_depth": {str(d): n for d, n in sorted(self.scheduler.reused_tokens_by_depth.items())},
            "prefix_cache_output_captures_total": self.scheduler.output_captures,
            "prefix_cache_mode": self.config.prefix_cache,
            "request_kv_budget_tokens": self.scheduler.admission.kv_budget,
            "request_kv_used_tokens": self.scheduler.admission.kv_in_use,
            "request_kv_bytes_per_token": self.memory.request_bytes_per_token,
            **self.cache.stats(),
            **(self.audit.stats() if self.audit is not None else {"bicache_audit_rate": 0.0}),
        }

    def check_integrity(self) -> None:
        """Cache invariants, and when idle: every request row is back in the pool (no leak)."""
        self.cache.check_integrity()
        if not self.has_work():
            rows = self.runner.pool.request_rows
            assert rows.num_free == rows.capacity, f"request rows leaked: {rows.capacity - rows.num_free}"

    def attach_loop(self, loop: Any) -> bool:
        return False  # events are delivered on the engine thread

    def watch(self, on_failure: Callable[[str], None]) -> None:
        """An engine in this process does not die apart from the server: nothing to watch."""

    def describe(self) -> str:
        return f"engine in the server process, {torch.get_num_threads()} torch threads"

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


def measurement_stack(cfg: EngineConfig, loaded: LoadedModel, *, max_running: int, max_prefix_cache_tokens: int,
                      max_total_tokens: int | None = None) -> Engine:
    """A calibration's measurement engine on the already loaded model (``builder.measurement_parts``:
    a ``naive`` cache, no audit, arrival-order admission), stepped on the caller's thread with
    ``run_sync`` (``bicache_sgl.calibration.driver.MeasureStack``). Raises ``MemoryError`` on CUDA
    when its pool and request K/V do not fit the free memory."""
    return Engine.from_parts(measurement_parts(cfg, loaded, max_running=max_running,
                                               max_prefix_cache_tokens=max_prefix_cache_tokens,
                                               max_total_tokens=max_total_tokens))
