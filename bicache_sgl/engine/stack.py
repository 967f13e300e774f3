"""The serving stack on a loaded model: memory plan, pool, cache manager, model runner, request
factory and scheduler, and one step over them (schedule, ONE batched forward, postprocess).

The ``Engine`` builds one for serving. A calibration builds another on the SAME loaded model
(``measurement_stack``: the weights are never loaded twice) and runs requests through it on its
own thread with ``run``; the calibration package (below the engine) only sees that duck-typed
interface (``bicache_sgl.calibration.driver.MeasureStack``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..bicache.audit import DepthAudit
from ..bicache.policy import DepthPolicy, make_policy
from ..config import EngineConfig
from ..io_struct import GenerateRequest, RequestEvent
from ..kv_cache.manager import CacheManager, make_cache_manager
from ..kv_cache.memory import GiB, MemoryPlan, plan_memory
from ..kv_cache.pool import KVPool
from ..models.config import ModelConfig
from ..scheduler.factory import RequestFactory
from ..scheduler.request import Req
from ..scheduler.scheduler import Admission, Scheduler
from .model_runner import LoadedModel, ModelRunner

log = logging.getLogger(__name__)

# CUDA: what a measurement stack leaves free beyond its pool and request K/V (activations, workspace)
MEASURE_HEADROOM_BYTES = 1 * GiB


def context_length_of(cfg: EngineConfig, mc: ModelConfig) -> int:
    """The served context: ``cfg.context_length`` capped by the model's positions."""
    mpe = mc.max_position_embeddings
    return min(cfg.context_length or mpe, mpe)


def plan_for(cfg: EngineConfig, mc: ModelConfig, dtype: torch.dtype, device: torch.device, max_depth: int, *,
             free_bytes: int | None = None) -> MemoryPlan:
    """Pool and request K/V sizes for nodes of at most ``max_depth`` layers of ``mc`` in ``dtype``
    on ``device`` under ``cfg``'s flags (kv_cache/memory.py); the request budget is capped at twice
    the running requests' context. The one sizing call: every stack, and the self-test's memory
    rows (``free_bytes``: CUDA's free memory once the weights are loaded; read now when None)."""
    return plan_memory(mc, dtype, device, max_depth, max_prefix_cache_tokens=cfg.max_prefix_cache_tokens,
                       max_total_tokens=cfg.max_total_tokens, mem_fraction_static=cfg.mem_fraction_static,
                       free_bytes=free_bytes, max_positions=2 * cfg.max_running_requests * context_length_of(cfg, mc))


@dataclass
class Stack:
    """One model runner with its pool, cache manager, request factory and scheduler. Not
    thread-safe: one thread steps it (the engine thread, or a calibration's caller)."""

    loaded: LoadedModel
    memory: MemoryPlan
    pool: KVPool
    cache: CacheManager
    runner: ModelRunner
    requests: RequestFactory
    scheduler: Scheduler
    seed: int = 0  # the per-request seed counter (``seed_request``), starting at EngineConfig.seed

    @property
    def model(self) -> torch.nn.Module:
        return self.loaded.model

    @property
    def model_config(self):
        return self.loaded.model_config

    @property
    def n_layers(self) -> int:
        return self.loaded.model_config.n_layers

    def seed_request(self, req: Req) -> None:
        """Every queued request advances the seed counter; one without ``sampling_params.seed``
        samples from the counter's value (so its seed depends only on its place in the arrivals)."""
        self.seed += 1
        if req.params.seed is None:
            req.reseed(self.seed)

    def step(self) -> list[Req] | None:
        """Schedule, ONE batched forward for every running request, postprocess. Returns the
        requests to emit an event for, or None when nothing was running (no forward). A failed
        forward ends every request of the batch with the error (they are returned, to emit)."""
        batch = self.scheduler.schedule()
        if not self.scheduler.running:
            return None
        try:
            logits = self.runner.forward(batch.works)
        except Exception as e:
            log.exception("batched forward failed")
            return self.scheduler.fail_batch(batch, e)
        return self.scheduler.postprocess(batch, logits)

    def run(self, greqs: Sequence[GenerateRequest]) -> list[RequestEvent]:
        """Run requests to completion on the calling thread (queued together: one admission
        round sees them all) and return each one's final event. Only for a stack nobody else
        steps (a calibration's)."""
        reqs = [self.requests.build(g, None) for g in greqs]
        for req in reqs:
            self.seed_request(req)
            self.scheduler.add(req)
        while self.scheduler.has_work():
            if self.step() is None and self.scheduler.waiting:  # nothing runs and nothing can be admitted
                raise RuntimeError(f"{len(self.scheduler.waiting)} request(s) do not fit this stack's K/V budget "
                                   f"({self.scheduler.admission.kv_budget} positions)")
        # every request has finished (a failure, at admission too, finishes it with its error)
        return [r.event() for r in reqs]

    def flush(self) -> None:
        """Drop every cached prefix (no request may be running)."""
        self.cache.flush()


def build_stack(cfg: EngineConfig, loaded: LoadedModel, policy: DepthPolicy, *, audit: DepthAudit | None = None,
                prefix_aware: bool | None = None, memory: MemoryPlan | None = None) -> Stack:
    """The stack ``cfg`` describes on ``loaded``, for ``policy``. ``prefix_aware`` (default: when
    the cache is on): admission defers requests that share an uncached prefix; ``memory``: a plan
    already made (else planned here from ``cfg``)."""
    mc = loaded.model_config
    ctx = context_length_of(cfg, mc)
    memory = memory or plan_for(cfg, mc, loaded.dtype, loaded.device, policy.max_node_depth)
    pool = KVPool(mc, memory.pool_tokens, memory.pool_rows, memory.request_rows, loaded.dtype, loaded.device)
    cache = make_cache_manager(policy, pool)
    runner = ModelRunner(loaded, cfg.attention_backend, pool)
    admission = Admission(cfg.max_running_requests, memory.request_tokens,
                          prefix_aware=cache.enabled if prefix_aware is None else prefix_aware)
    requests = RequestFactory(mc, loaded.tokenizer, loaded.eos_ids, cfg.decode, ctx, kv_budget=admission.kv_budget)
    scheduler = Scheduler(admission, cache, requests, runner.alloc_kv, runner.free_kv, pool.alloc_seq, mc.n_layers,
                          audit=audit, cache_output=cfg.cache_output, context_length=ctx)
    return Stack(loaded, memory, pool, cache, runner, requests, scheduler, seed=cfg.seed)


def measurement_stack(cfg: EngineConfig, loaded: LoadedModel, *, max_running: int, max_prefix_cache_tokens: int,
                      max_total_tokens: int | None = None) -> Stack:
    """A calibration's stack on the already loaded model: a ``naive`` cache (its nodes hold all L
    layers, so a request may reuse any depth 0..L it asks for with ``bicache_depth``), no audit,
    no output captures, requests admitted in arrival order (the L+1 requests of one measurement
    share their whole prompt and must each match exactly what the first request stored). Raises
    ``MemoryError`` on CUDA when its pool and request K/V do not fit the free memory."""
    cfg = cfg.replace(prefix_cache="naive", bicache_profile="none", bicache_audit_rate=0.0,
                      max_running_requests=max_running, max_queued_requests=None,
                      max_prefix_cache_tokens=max_prefix_cache_tokens, max_total_tokens=max_total_tokens,
                      cache_output=False)
    policy = make_policy(cfg.prefix_cache, loaded.model_config.n_layers)
    memory = plan_for(cfg, loaded.model_config, loaded.dtype, loaded.device, policy.max_node_depth)
    if loaded.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(loaded.device)
        need = memory.pool_bytes + memory.request_bytes + MEASURE_HEADROOM_BYTES
        if free < need:
            raise MemoryError(f"the calibration K/V needs about {need / GiB:.1f} GiB, {free / GiB:.1f} GiB are free")
    return build_stack(cfg, loaded, policy, prefix_aware=False, memory=memory)
