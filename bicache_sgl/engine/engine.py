"""The engine: loads the model, owns the prefix cache, and runs continuous batching.

Every ``step()`` is ONE batched model forward for all running requests (each at its own
block/step, each with its own bicache depth). New requests join between steps; finished ones
leave at once. A background thread runs steps while there is work; ``submit``/``abort`` are
thread-safe and the HTTP layer never blocks on a forward.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from typing import Any, Callable, Sequence

import numpy as np
import torch

from radix import NullRadixTree, RadixTree

from ..attention import create_backend
from ..bicache.policy import choose_depth
from ..bicache.profile import find_profile
from ..config import DecodeDefaults, EngineConfig, SamplingParams
from ..kv_cache.prefix_cache import PrefixCache
from ..kv_cache.pool import PrefixPool, bytes_per_token
from ..models.loader import load_model, load_tokenizer, resolve_model_path
from ..io_struct import GenerateRequest, QueueFullError, RequestEvent
from ..models.forward_batch import Capture, ForwardBatch, SeqKV
from ..scheduler.request import DecodePlan, Req
from ..scheduler.scheduler import Scheduler

log = logging.getLogger(__name__)

_DECODE_FIELDS = ("block_length", "steps_per_block", "threshold", "remasking", "cache_mode", "refresh_interval")


def build_config(config: EngineConfig | None = None, **kwargs: Any) -> EngineConfig:
    """EngineConfig from keyword arguments (decode defaults may be given flat)."""
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
        cfg = cfg.replace(decode=DecodeDefaults(**{**cfg.decode.__dict__, **decode_kw}))
    return cfg


def _pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available")
    return dev


class Engine:
    """Offline engine in the shape of SGLang's ``sgl.Engine``; also the server's backend."""

    def __init__(self, model_path: str | None = None, *, config: EngineConfig | None = None, **kwargs: Any) -> None:
        if model_path is not None:
            kwargs["model_path"] = model_path
        self.config = cfg = build_config(config, **kwargs)
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        self.device = _pick_device(cfg.device)
        self.model_path = resolve_model_path(cfg.model_path)
        self.model, self.model_config = load_model(self.model_path, cfg.dtype, self.device)
        self.dtype = next(self.model.parameters()).dtype
        self.tokenizer = load_tokenizer(cfg.tokenizer_path or self.model_path, cfg.chat_template)
        self.attn = create_backend(cfg.attention_backend, self.device)
        mc = self.model_config
        self.context_length = min(cfg.context_length or mc.max_position_embeddings, mc.max_position_embeddings)
        eos = set(mc.eos_token_ids)
        for t in ("<|eot_id|>", "<|endoftext|>", "<|im_end|>"):
            tid = self.tokenizer.convert_tokens_to_ids(t) if t in self.tokenizer.get_vocab() else None
            if tid is not None:
                eos.add(int(tid))
        if self.tokenizer.eos_token_id is not None:
            eos.add(int(self.tokenizer.eos_token_id))
        self.eos_ids = tuple(sorted(eos))
        self.profile = None
        self.cache = self._build_prefix_cache()
        self.scheduler = Scheduler(cfg.max_running_requests, prefix_aware=self.cache.enabled)
        self.running: list[Req] = []
        self._inbox: list[Req] = []
        self._aborts: set[str] = set()
        self._flushes: list[threading.Event] = []
        self._by_rid: dict[str, Req] = {}
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stop = False
        self._atexit_registered = False
        self._seed_counter = cfg.random_seed
        self.stats_forwards = 0
        self.stats_computed = 0
        self.stats_skipped = 0
        self.stats_finished = 0
        self.stats_generated_tokens = 0
        self.last_step_time = time.time()

    # ------------------------------------------------------------------------------ prefix cache
    def _build_prefix_cache(self) -> PrefixCache:
        cfg, mc = self.config, self.model_config
        kind, fixed = cfg.prefix_cache_kind
        if kind == "off":
            return PrefixCache.null()
        if kind == "bicache":
            self.profile = find_profile(self.model_path, cfg.bicache_profile, mc.n_layers)
            if self.profile is None:
                log.warning("no bicache profile for %s (bicache_profile.json beside the model or "
                            "--bicache-profile): safe depth b = 0, so prefixes are matched but never reused. "
                            "Run python -m bicache_sgl.calibrate to make one.", self.model_path)
            depth = self.profile.max_depth if self.profile else 0
        elif kind == "naive":
            depth = mc.n_layers
        else:
            depth = min(int(fixed), mc.n_layers)
        capacity = self._pool_capacity(depth)
        pool = PrefixPool(mc, depth, capacity, self.dtype, self.device)
        log.info("prefix cache: mode %s, depth %d, %d tokens, %.1f MiB (%d bytes/token)", cfg.prefix_cache, depth,
                 capacity, pool.nbytes / 2**20, pool.bytes_per_token)
        return PrefixCache(RadixTree(), pool)

    def _pool_capacity(self, depth: int) -> int:
        cfg = self.config
        if cfg.max_prefix_cache_tokens is not None:
            return cfg.max_prefix_cache_tokens
        per = max(1, bytes_per_token(self.model_config, depth, self.dtype))
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            frac = cfg.mem_fraction_static or 0.3
            return max(1024, int(free * frac) // per)
        # CPU: a 2 GiB default budget, at most 65536 tokens
        return int(min(65536, max(1024, (2 << 30) // per)))

    # --------------------------------------------------------------------------------- requests
    def validate(self, greq: GenerateRequest) -> None:
        """Raise ValueError naming what is wrong with a request."""
        ids = greq.input_ids
        if not ids:
            raise ValueError("the prompt is empty")
        V = self.model_config.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or t < 0 or t >= V]
        if bad:
            raise ValueError(f"token id {bad[0]!r} is outside the vocabulary [0, {V})")
        plan = DecodePlan.resolve(greq.params, self.config.decode)
        if len(ids) + plan.gen_len > self.context_length:
            raise ValueError(f"prompt ({len(ids)} tokens) plus generation region ({plan.gen_len} positions, "
                             f"max_new_tokens rounded up to whole blocks) exceeds the context length "
                             f"{self.context_length}")
        bad = [t for t in greq.params.stop_token_ids if t >= V]  # would index past the logits
        if bad:
            raise ValueError(f"stop_token_ids: token id {bad[0]} is outside the vocabulary [0, {V})")
        if greq.return_logprob and greq.logprob_start_len >= len(ids):
            raise ValueError(f"logprob_start_len ({greq.logprob_start_len}) must be < the prompt length ({len(ids)})")
        if greq.top_logprobs_num < 0:
            raise ValueError("top_logprobs_num must be >= 0")
        if greq.bicache_depth is not None and not 0 <= greq.bicache_depth <= self.model_config.n_layers:
            raise ValueError(f"bicache_depth must be in [0, {self.model_config.n_layers}]")

    def submit(self, greq: GenerateRequest, on_event: Callable[[RequestEvent], None] | None = None) -> str:
        """Queue a request; ``on_event`` is called from the engine thread. Thread-safe."""
        return self.submit_many([greq], [on_event])[0]

    def submit_many(self, greqs: Sequence[GenerateRequest],
                    on_events: Sequence[Callable[[RequestEvent], None] | None]) -> list[str]:
        """Queue several requests atomically (they become visible to the same step)."""
        for g in greqs:
            self.validate(g)
        with self._cv:
            if self.config.max_queued_requests is not None and \
                    len(self.scheduler.waiting) + len(self._inbox) + len(greqs) > self.config.max_queued_requests:
                raise QueueFullError(f"the request queue is full ({self.config.max_queued_requests} waiting)")
            reqs = []
            for g, cb in zip(greqs, on_events):
                self._seed_counter += 1
                req = Req(g, DecodePlan.resolve(g.params, self.config.decode), mask_id=self.model_config.mask_token_id,
                          eos_ids=self.eos_ids, logit_shift=self.model_config.logit_shift, tokenizer=self.tokenizer,
                          on_event=cb, seed=self._seed_counter)
                if req.rid in self._by_rid or any(r.rid == req.rid for r in reqs):
                    raise ValueError(f"request id {req.rid!r} is already in use")
                reqs.append(req)
            for req in reqs:
                self._by_rid[req.rid] = req
                self._inbox.append(req)
            self._cv.notify_all()
        self.start()
        return [r.rid for r in reqs]

    def abort(self, rid: str) -> None:
        with self._cv:
            if rid in self._by_rid:
                self._aborts.add(rid)
                self._cv.notify_all()

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
                atexit.register(lambda: (lambda e: e is not None and e.shutdown(timeout=5.0))(ref()))
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

    def has_work(self) -> bool:
        return bool(self.running or self.scheduler.waiting)

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
            req.aborted = True
            if self.scheduler.remove(req):
                req.fail("aborted by the client")
                self._emit(req)
            elif req in self.running:
                req.fail("aborted by the client")
                self._retire(req)

    def step(self) -> bool:
        """Admit, run ONE batched forward for all running requests, retire finished ones."""
        self._drain_inbox()
        self._admit()
        if not self.running:
            return False
        L = self.model_config.n_layers
        works, owners = [], []
        for req in self.running:
            try:
                ws = req.plan_step(L)
            except Exception as e:
                log.exception("request %s failed while planning", req.rid)
                req.fail(f"internal error: {type(e).__name__}: {e}", "error")
                continue
            works.extend(ws)
            owners.append((req, len(ws)))
        live = [(r, n) for r, n in owners if not r.finished]
        try:
            fb = ForwardBatch(works, self.device).build(L)
            logits = self.model.forward_batch(fb, self.attn, self.cache.pool)
        except Exception as e:
            log.exception("batched forward failed")
            for r, _ in live:
                r.fail(f"internal error in the forward pass: {type(e).__name__}: {e}", "error")
            self._release_captures([r for r, _ in live])
            self._retire_finished()
            return True
        self.stats_forwards += 1
        wi = 0
        for req, n in owners:
            parts = []
            for j in range(n):
                a, b = fb.logit_indptr[wi + j], fb.logit_indptr[wi + j + 1]
                parts.append(logits[a:b])
            wi += n
            if req.finished:
                continue
            if req.capture is not None:
                self._insert(req)
            try:
                block_done = req.apply(parts, L)
            except Exception as e:
                log.exception("request %s failed", req.rid)
                req.fail(f"internal error: {type(e).__name__}: {e}", "error")
                continue
            if block_done and not req.finished:
                self._emit(req)
        self._retire_finished()
        self.last_step_time = time.time()
        return True

    def _admit(self) -> None:
        if not self.scheduler.waiting:
            return
        cache = self.cache
        picked = self.scheduler.select(len(self.running), lambda r: cache.tree.match_prefix(
            r.prompt[:max(r.prompt_len - 1, 0)]).length if cache.enabled else 0)
        for req in picked:
            try:
                self._admit_one(req)
            except Exception as e:
                log.exception("admitting request %s failed", req.rid)
                if req.handle is not None:
                    cache.unlock(req.handle)
                    req.handle = None
                self._release_captures([req])
                req.fail(f"internal error: {type(e).__name__}: {e}", "error")
                self._emit(req)
                self._by_rid.pop(req.rid, None)
                continue
            self.running.append(req)

    @staticmethod
    def _capture_slots(req: Req) -> np.ndarray:
        return req.capture.slots.cpu().numpy() if req.capture is not None else np.zeros(0, dtype=np.int64)

    def _admit_one(self, req: Req) -> None:
        mc, cache = self.model_config, self.cache
        kv_shape = (mc.n_layers, req.seq_len if req.kind == "generate" else req.prompt_len, mc.n_kv_heads, mc.head_dim)
        req.kv = SeqKV.allocate(*kv_shape[:2], mc.n_kv_heads, mc.head_dim, self.dtype, self.device)
        if req.kind == "score" or (req.greq.return_logprob and req.greq.logprob_start_len >= 0):
            req._score_kv = SeqKV.allocate(mc.n_layers, req.prompt_len, mc.n_kv_heads, mc.head_dim, self.dtype,
                                           self.device)
        if req.kind == "generate" and req.params.cfg_scale > 0:
            x_un = req.x.clone()
            x_un[:req.prompt_len] = mc.mask_token_id
            req.uncond = (x_un, SeqKV.allocate(mc.n_layers, req.seq_len, mc.n_kv_heads, mc.head_dim, self.dtype,
                                               self.device))
        if not cache.enabled:
            return
        # The last prompt token is always recomputed (as in SGLang): the reused prefix ends before it.
        m = cache.match(req.prompt[:req.prompt_len - 1])
        cache.lock(m.handle)
        req.handle, req.match_values = m.handle, np.asarray(m.values, dtype=np.int64)
        kind, fixed = self.config.prefix_cache_kind
        if req.greq.bicache_depth is not None:
            kind, fixed = "fixed", req.greq.bicache_depth
        if req.kind == "generate":
            req.choice = choose_depth(kind, fixed, self.profile, mc.n_layers, m.segments, m.length, req.seq_len)
        else:
            req.choice = choose_depth("off", None, None, mc.n_layers, m.segments, m.length, req.seq_len)
        d, p = req.choice.depth, req.choice.prefix
        if d > 0 and p > 0:
            # Copy the reused state into the request's private buffers: the request never reads
            # the pool again, so eviction or a depth upgrade cannot change its output.
            slots = cache.pool.slots_tensor(req.match_values[:p])
            k, v = cache.pool.read_kv(d, slots)
            req.kv.k[:d, :p] = k
            req.kv.v[:d, :p] = v
            if d < mc.n_layers:
                req.resume_h = cache.pool.read_h(d, slots).clone()
        new = req.prompt_len - m.length
        if new > 0 and cache.depth >= 0:
            slots = cache.alloc(new)
            if slots is not None:
                req.capture = Capture(np.arange(m.length, req.prompt_len, dtype=np.int64),
                                      cache.pool.slots_tensor(slots), cache.depth)

    def _insert(self, req: Req) -> None:
        slots = self._capture_slots(req)
        req.capture = None
        try:
            self.cache.insert(req.prompt, req.match_values, slots)
        except Exception:
            log.exception("prefix cache insert failed for %s; continuing without caching it", req.rid)
            self.cache.release(slots)

    def _release_captures(self, reqs: Sequence[Req]) -> None:
        for r in reqs:
            if r.capture is not None:
                self.cache.release(self._capture_slots(r))
                r.capture = None

    def _retire_finished(self) -> None:
        for req in [r for r in self.running if r.finished]:
            self._retire(req)

    def _retire(self, req: Req) -> None:
        if req in self.running:
            self.running.remove(req)
        self._release_captures([req])
        if req.handle is not None:
            self.cache.unlock(req.handle)
            req.handle = None
        req.kv = req.uncond = req._score_kv = None
        req.resume_h = None
        self.stats_finished += 1
        self.stats_generated_tokens += len(req.out_ids)
        self.stats_computed += req.computed_layer_tokens
        self.stats_skipped += req.skipped_layer_tokens
        self._by_rid.pop(req.rid, None)
        self._emit(req)

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
        single = isinstance(prompt, str) or (input_ids is not None and input_ids and isinstance(input_ids[0], int))
        if prompt is not None:
            prompts = [prompt] if isinstance(prompt, str) else list(prompt)
            id_lists = [self.encode(p) for p in prompts]
        else:
            id_lists = [list(input_ids)] if single else [list(x) for x in input_ids]
        greqs = [GenerateRequest(ids, params.replace(n=1), return_logprob=return_logprob,
                                 logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
                                 return_text_in_logprobs=return_text_in_logprobs)
                 for ids in id_lists for _ in range(params.n)]
        for g in greqs:
            self.validate(g)
        results: list[RequestEvent | None] = [None] * len(greqs)
        done = threading.Semaphore(0)

        def make_cb(i: int):
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
        return list(self.tokenizer.encode(text))

    def flush_cache(self, timeout: float = 30.0) -> bool:
        """Drop every cached prefix not held by a running request (safe while requests run: the
        flush happens on the engine thread between two steps). Returns False on timeout."""
        done = threading.Event()
        with self._cv:
            self._flushes.append(done)
            self._cv.notify_all()
        self.start()
        return done.wait(timeout)

    def get_stats(self) -> dict[str, Any]:
        total = self.stats_computed + self.stats_skipped
        return {
            "num_running_reqs": len(self.running),
            "num_waiting_reqs": len(self.scheduler.waiting) + len(self._inbox),
            "num_finished_reqs": self.stats_finished,
            "num_forward_passes": self.stats_forwards,
            "generated_tokens": self.stats_generated_tokens,
            "computed_layer_tokens": self.stats_computed,
            "skipped_layer_tokens": self.stats_skipped,
            "saved_compute_fraction": self.stats_skipped / total if total else 0.0,
            "prefix_cache_mode": self.config.prefix_cache,
            **self.cache.stats(),
        }

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
