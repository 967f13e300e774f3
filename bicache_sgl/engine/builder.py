"""Building an engine: ONE call (``build_parts``) from a validated ``EngineConfig`` to everything
the engine steps over: the loaded model, the bicache profile (a file, or calibrated now on this
very model), the depth policy and its audit, the memory plan, the pool (it owns the requests'
private K/V), the cache manager, the model runner, the request factory and the scheduler (it holds
the pool).

The ``Engine`` (engine.py) adopts the parts and is the one place that steps them (schedule, ONE
batched forward, postprocess) and runs requests to completion. A calibration's measurement engine
is built by ``measurement_parts`` on the SAME loaded model (the weights are never loaded twice); the
first-run profile is handed a ``measure`` factory for it (the calibration package, below the
engine, only sees that duck-typed interface: ``bicache_sgl.calibration.driver.MeasureStack``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..bicache.audit import DepthAudit
from ..bicache.policy import DepthPolicy, make_policy
from ..bicache.profile import BicacheProfile
from ..bicache.segments import SegmentBoundaries
from ..calibration.auto import resolve_profile
from ..config import DEFAULT_PROBATION, DEFAULT_PROBE_RATE, EngineConfig
from ..kv_cache.manager import CacheManager, make_cache_manager
from ..kv_cache.memory import GiB, MemoryPlan, plan_memory
from ..kv_cache.pool import KVPool
from ..models.config import ModelConfig
from ..models.families import family_decoding
from ..scheduler.factory import RequestFactory
from ..scheduler.scheduler import Admission, Scheduler
from .model_runner import LoadedModel, ModelRunner, load

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
    max_positions = 2 * cfg.max_running_requests * context_length_of(cfg, mc)
    return plan_memory(mc, dtype, device, max_depth, max_prefix_cache_tokens=cfg.max_prefix_cache_tokens,
                       max_total_tokens=cfg.max_total_tokens, mem_fraction_static=cfg.mem_fraction_static,
                       free_bytes=free_bytes, max_positions=max_positions)


@dataclass(frozen=True)
class EngineParts:
    """What an engine steps over, built by ``build_parts`` / ``measurement_parts``."""

    config: EngineConfig
    loaded: LoadedModel
    context_length: int
    profile: BicacheProfile | None
    policy: DepthPolicy
    memory: MemoryPlan
    pool: KVPool
    cache: CacheManager
    runner: ModelRunner
    requests: RequestFactory
    scheduler: Scheduler

    @property
    def audit(self) -> DepthAudit | None:
        return self.policy.audit


def build_parts(cfg: EngineConfig, *, measure: Callable[..., Any] | None = None) -> EngineParts:
    """Everything an engine for ``cfg`` steps over, in the order it depends on each other: the
    model, its profile, the policy, then the stack on them. ``measure(cfg, loaded, **sizes)``
    builds a calibration's measurement engine (used when the profile is ``auto`` and none is
    cached yet)."""
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    loaded = load(cfg)
    # --dllm-algorithm / --dllm-algorithm-config against what the checkpoint's family runs
    family_decoding(loaded.model_config).check_flags(cfg.decode.dllm_algorithm, cfg.decode.dllm_algorithm_config)
    # a file, or ("auto": the default without one beside the model) calibrated now on this very
    # model through a measurement engine (no second copy of the weights), cached on disk
    # (bicache_sgl/calibration/auto.py)
    profile = resolve_profile(cfg, loaded, None if measure is None else
                              (lambda **sizes: measure(cfg, loaded, **sizes)))
    first_run = profile is not None and "auto" in profile.extra
    probation = cfg.bicache_audit_probation
    if probation is None:  # a first-run profile was measured on synthesised prompts: trust is earned
        probation = DEFAULT_PROBATION if first_run else 0
    probe_rate = cfg.bicache_audit_probe_rate
    if probe_rate is None:  # no profile of the model's own: depth is earned on traffic (docs/prefix_cache.md)
        probe_rate = DEFAULT_PROBE_RATE if profile is None or first_run else 0.0
    policy = make_policy(cfg.prefix_cache, loaded.model_config.n_layers, profile, audit_rate=cfg.bicache_audit_rate,
                         audit_min_agreement=cfg.bicache_audit_min_agreement, seed=cfg.seed, probation=probation,
                         probe_rate=probe_rate, raise_bound=cfg.bicache_audit_raise_bound)
    if policy.without_profile:
        earned = policy.audit is not None and policy.audit.probing
        log.warning("no bicache profile for %s (bicache_profile.json beside the model or --bicache-profile): "
                    "safe depth b = 0, so prefixes are matched but %s. Run python -m bicache_sgl.calibrate to "
                    "make one.", loaded.model_path,
                    f"reused only at depths the audit's probes earn (--bicache-audit-probe-rate {probe_rate:g})"
                    if earned else "never reused")
    return _assemble(cfg, loaded, profile, policy)


def _assemble(cfg: EngineConfig, loaded: LoadedModel, profile: BicacheProfile | None, policy: DepthPolicy, *,
              prefix_aware: bool | None = None, memory: MemoryPlan | None = None) -> EngineParts:
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
    # the span cut's boundary tokens, read from the tokenizer once (bicache/segments.py); a
    # measurement stack is built with the same cfg, so calibration measures the runtime's span
    segments = SegmentBoundaries.from_tokenizer(loaded.tokenizer, loaded.eos_ids) \
        if cache.enabled and cfg.bicache_span_cut == "segment" else None
    requests = RequestFactory(mc, loaded.tokenizer, loaded.eos_ids, cfg.decode, ctx, kv_budget=admission.kv_budget,
                              segments=segments)
    scheduler = Scheduler(admission, cache, requests, pool, mc.n_layers, audit=policy.audit,
                          cache_output=cfg.cache_output, context_length=ctx)
    return EngineParts(cfg, loaded, ctx, profile, policy, memory, pool, cache, runner, requests, scheduler)


def measurement_parts(cfg: EngineConfig, loaded: LoadedModel, *, max_running: int, max_prefix_cache_tokens: int,
                      max_total_tokens: int | None = None) -> EngineParts:
    """A calibration's engine parts on the already loaded model: a ``naive`` cache (its nodes hold all L
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
    return _assemble(cfg, loaded, None, policy, prefix_aware=False, memory=memory)
