"""Command-line flags of ``bicache-sgl-server`` (SGLang's common flags plus the diffusion knobs).

Every flag this parser knows is either used or refuses a value it cannot honour (``--tp-size 2``
is a startup error, not a silent single-device run). SGLang harnesses also pass flags that only
tune SGLang's own machinery (``--cuda-graph-bs``, ``--grammar-backend`` ...); flags this parser
does not know are accepted with a warning naming them and listed in ``ignored_args`` of
/get_server_info (``parse_known_args``), so such a harness can launch this server unchanged.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bicache_sgl.config import (
    ALGORITHMS,
    CACHE_MODES,
    DTYPES,
    REMASKING,
    STEP_ROWS,
    DecodeDefaults,
    EngineConfig,
    canonical_algorithm,
    parse_prefix_cache_mode,
)
from bicache_sgl.server.protocol import DEFAULT_MAX_N

logger = logging.getLogger(__name__)

ATTENTION_BACKENDS = ("torch", "flashinfer")
# SGLang's backend names we map onto ours instead of refusing to start.
_ATTENTION_ALIASES = {"torch_native": "torch", "sdpa": "torch"}
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
DEFAULT_MAX_REQUEST_BYTES = 32 << 20
# sglang-router's --policy choices (0.3.2) for --router-policy; the launcher sets the router's own
# --host/--port/--worker-urls/--policy, so those cannot come through --router-NAME
ROUTER_POLICIES = ("cache_aware", "round_robin", "random", "power_of_two", "manual")
_ROUTER_OWNED_FLAGS = ("--host", "--port", "--worker-urls", "--policy")


@dataclass
class ServerArgs:
    """Everything the HTTP server and the engine it owns need. Field names follow SGLang."""

    model_path: str | None = None
    tokenizer_path: str | None = None
    host: str = "127.0.0.1"
    port: int = 30000
    dtype: str = "auto"
    device: str = "auto"
    attention_backend: str = "torch"
    max_running_requests: int = 16
    max_queued_requests: int | None = None
    context_length: int | None = None
    mem_fraction_static: float | None = None
    disable_radix_cache: bool = False
    served_model_name: str | None = None
    api_key: str | None = None
    random_seed: int | None = None
    log_level: str = "info"
    chat_template: str | None = None
    incremental_streaming_output: bool = False
    skip_server_warmup: bool = False
    enable_metrics: bool = True  # /metrics is always served; the flag is accepted for SGLang parity
    num_threads: int | None = None  # the engine's torch threads (None: every CPU but one, see launch_server)
    engine_in_process: bool = False  # debugging: the engine as a thread of the server process
    # request limits and shutdown
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_batch_size: int = 1024
    max_n: int = DEFAULT_MAX_N
    graceful_shutdown_timeout: float = 5.0
    # prefix cache (bicache)
    prefix_cache: str = "bicache"
    bicache_profile: str | None = None
    calibration_budget_s: float = 40.0
    calibration_data: str | None = None
    max_prefix_cache_tokens: int | None = None
    max_total_tokens: int | None = None  # budget of the running requests' private K/V positions
    bicache_audit_rate: float = 0.02
    bicache_audit_min_agreement: float = 0.9
    bicache_audit_probation: int | None = None
    cache_output: bool = False
    # diffusion decoding defaults (a request's sampling_params override them)
    block_length: int = 32
    steps_per_block: int | None = None
    steps: int | None = None  # total denoising steps per request (default for sampling_params.steps)
    threshold: float | None = 0.9
    remasking: str = "low_confidence"
    cache_mode: str = "dual"
    refresh_interval: int = 0
    step_rows: str = "block"
    # unmasking algorithm and Dream's knobs; None: the checkpoint's generation_config.json, else
    # the built-in (remasking, eps 1e-3, alg_temp 0). --remasking given explicitly sets it too
    dllm_algorithm: str | None = None
    dllm_eps: float | None = None
    dllm_alg_temp: float | None = None
    # data parallelism (--dp-size N > 1: N workers behind sglang-router, bicache_sgl/router.py)
    dp_size: int = 1
    router_policy: str = "cache_aware"
    router_extra_args: tuple[str, ...] = ()  # --router-NAME [V] flags, passed to the router as --NAME [V]
    dp_max_restarts: int = 3
    # informational: the flags we did not understand
    ignored_args: tuple[str, ...] = ()

    @property
    def url(self) -> str:
        host = self.host
        if host in ("0.0.0.0", ""):
            host = "127.0.0.1"
        elif host == "::":
            host = "::1"
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    def effective_prefix_cache(self) -> str:
        return "off" if self.disable_radix_cache else self.prefix_cache

    def engine_config(self) -> EngineConfig:
        """The EngineConfig these flags describe. Raises ValueError on inconsistent values."""
        decode = DecodeDefaults(
            block_length=self.block_length,
            steps_per_block=self.steps_per_block,
            threshold=self.threshold,
            remasking=self.remasking,
            cache_mode=self.cache_mode,
            refresh_interval=self.refresh_interval,
            step_rows=self.step_rows,
            algorithm=self.dllm_algorithm,
            eps=self.dllm_eps,
            alg_temp=self.dllm_alg_temp,
        )
        kw: dict[str, Any] = {
            "model_path": self.model_path,
            "tokenizer_path": self.tokenizer_path,
            "dtype": self.dtype,
            "device": self.device,
            "attention_backend": self.attention_backend,
            "max_running_requests": self.max_running_requests,
            "max_queued_requests": self.max_queued_requests,
            "context_length": self.context_length,
            "prefix_cache": self.effective_prefix_cache(),
            "max_prefix_cache_tokens": self.max_prefix_cache_tokens,
            "max_total_tokens": self.max_total_tokens,
            "bicache_audit_rate": self.bicache_audit_rate,
            "bicache_audit_min_agreement": self.bicache_audit_min_agreement,
            "bicache_audit_probation": self.bicache_audit_probation,
            "cache_output": self.cache_output,
            "mem_fraction_static": self.mem_fraction_static,
            "bicache_profile": self.bicache_profile,
            "calibration_budget_s": self.calibration_budget_s,
            "calibration_data": self.calibration_data,
            "decode": decode,
            "chat_template": _resolved_template(self.chat_template),
            "num_threads": self.num_threads,
        }
        if self.random_seed is not None:
            kw["random_seed"] = self.random_seed
        return EngineConfig(**kw)

    def default_sampling_params(self) -> dict[str, Any]:
        """Server-wide defaults merged under each request's sampling_params (request wins)."""
        out: dict[str, Any] = {}
        if self.steps is not None:
            out["steps"] = self.steps
        return out

    def public_dict(self) -> dict[str, Any]:
        """The args as JSON for /get_server_info, with the API key never shown."""
        d = dataclasses.asdict(self)
        d["api_key"] = "<redacted>" if self.api_key else None
        d["ignored_args"] = list(self.ignored_args)
        d["router_extra_args"] = redact_unknown(self.router_extra_args)
        d["prefix_cache"] = self.effective_prefix_cache()
        return d


def _resolved_template(spec: str | None) -> str | None:
    from bicache_sgl.server.chat import load_chat_template

    return load_chat_template(spec)


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmM]i?)?\s*$")


def parse_context_length(value: str) -> int:
    """``4096``, ``32k`` (x1000), ``1Ki`` (x1024), ``1M``/``1Mi``."""
    m = _SIZE_RE.match(str(value))
    if not m:
        raise argparse.ArgumentTypeError(f"invalid context length {value!r}")
    num, unit = float(m.group(1)), (m.group(2) or "")
    mult = {"": 1, "k": 1000, "K": 1000, "ki": 1024, "Ki": 1024, "kI": 1024, "KI": 1024,
            "m": 1000**2, "M": 1000**2, "mi": 1024**2, "Mi": 1024**2}.get(unit)
    if mult is None:
        raise argparse.ArgumentTypeError(f"invalid context length {value!r}")
    return int(num * mult)


def _threshold(value: str) -> float | None:
    if str(value).lower() in ("none", "off", "null"):
        return None
    try:
        v = float(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"threshold must be a number in [0, 1] or 'none', got {value!r}") from e
    if not 0 <= v <= 1:
        raise argparse.ArgumentTypeError(f"threshold must be in [0, 1], got {value!r}")
    return v


def _prefix_cache(value: str) -> str:
    try:
        parse_prefix_cache_mode(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bicache-sgl-server",
        description="SGLang-compatible HTTP server for diffusion language models (bicache prefix caching).",
        allow_abbrev=False,
    )
    g = p.add_argument_group("model")
    g.add_argument("--model-path", "--model", dest="model_path", default=None,
                   help="Model folder (LLaDA/Dream checkpoint). Omit for the bundled default model.")
    g.add_argument("--tokenizer-path", default=None, help="Tokenizer folder (default: the model path).")
    g.add_argument("--dtype", default="auto", choices=DTYPES)
    g.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    g.add_argument("--attention-backend", default="torch",
                   help="torch (SDPA, any device) | flashinfer (CUDA). Other SGLang names fall back to torch.")
    g.add_argument("--context-length", type=parse_context_length, default=None,
                   help="Maximum prompt + generation length (default: from the model config). Accepts 32k, 1Ki.")
    g.add_argument("--served-model-name", default=None, help="Model name reported on /v1/models (default: model path).")
    g.add_argument("--chat-template", default=None,
                   help="Chat template for /v1/chat/completions: a Jinja file, a Jinja string, or a built-in name "
                        "(chatml, llama-3, default). Default: the tokenizer's template, else a plain one.")
    g.add_argument("--random-seed", type=int, default=None)
    g.add_argument("--num-threads", type=int, default=None,
                   help="torch CPU threads of the engine (default: every CPU but one, at most torch's own default; "
                        "OMP_NUM_THREADS, when set, is followed instead). The HTTP server process uses 1.")

    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=30000)
    g.add_argument("--api-key", default=None,
                   help="Require 'Authorization: Bearer KEY' on every route except /health*, /ready and /metrics.")
    g.add_argument("--log-level", default="info", type=str.lower, choices=LOG_LEVELS)
    g.add_argument("--incremental-streaming-output", action="store_true",
                   help="Stream deltas instead of SGLang's default cumulative text/output_ids.")
    g.add_argument("--skip-server-warmup", action="store_true")
    g.add_argument("--engine-in-process", action="store_true",
                   help="Run the engine as a thread of the HTTP server process instead of in its own process "
                        "(debugging; the engine's step then shares the GIL with the HTTP work).")
    g.add_argument("--enable-metrics", action="store_true", help="Accepted for SGLang parity; /metrics is always on.")
    g.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help="Largest request body accepted; larger ones get 413 (default 32 MiB).")
    g.add_argument("--max-batch-size", type=int, default=1024,
                   help="Most sequences (prompts x n) one request may create; more get 400.")
    g.add_argument("--max-n", type=int, default=DEFAULT_MAX_N, help="Largest n (samples per prompt); larger get 400.")
    g.add_argument("--graceful-shutdown-timeout", type=float, default=5.0,
                   help="On SIGTERM/SIGINT: seconds running requests get to finish before they are aborted "
                        "(each still gets an answer); new requests get 503 meanwhile.")

    g = p.add_argument_group("scheduling and memory")
    g.add_argument("--max-running-requests", type=int, default=16,
                   help="Requests decoded together in one batched forward.")
    g.add_argument("--max-queued-requests", type=int, default=None,
                   help="Waiting requests beyond this are refused with 503 (default: unbounded).")
    g.add_argument("--mem-fraction-static", type=float, default=None)
    g.add_argument("--disable-radix-cache", action="store_true", help="Same as --prefix-cache off.")
    g.add_argument("--prefix-cache", type=_prefix_cache, default="bicache",
                   help="Shared-prefix KV cache: off | naive | bicache | fixed:N (N leading layers).")
    g.add_argument("--bicache-profile", default=None,
                   help="The r -> depth profile for bicache: a JSON file, 'auto' (calibrate at start-up within "
                        "--calibration-budget-s and cache the result on disk, keyed by the checkpoint), or 'none' "
                        "(no reuse). Default: bicache_profile.json beside the model, else auto.")
    g.add_argument("--calibration-budget-s", type=float, default=40.0,
                   help="Wall-clock budget of the start-up calibration ('auto' profile); buckets not measured in "
                        "time get depth 0.")
    g.add_argument("--calibration-data", default=None,
                   help="Prompts for the start-up calibration (the calibrate CLI's jsonl/txt formats); default: "
                        "prompts synthesised from the tokenizer.")
    g.add_argument("--max-prefix-cache-tokens", type=int, default=None,
                   help="Token budget of the shared prefix pool (LRU eviction beyond it).")
    g.add_argument("--max-total-tokens", type=int, default=None,
                   help="Budget of K/V positions over all running requests; requests wait for room "
                        "(default: derived from memory).")
    g.add_argument("--bicache-audit-rate", type=float, default=0.02,
                   help="Fraction of prefix-reusing requests whose first forward is also run without reuse; a "
                        "profile bucket whose reuse disagrees is lowered (0 turns the audit off).")
    g.add_argument("--bicache-audit-min-agreement", type=float, default=0.9,
                   help="Top-1 agreement at the masked positions below which the audit lowers a bucket.")
    g.add_argument("--bicache-audit-probation", type=int, default=None,
                   help="Consecutive agreeing audits a profile bucket needs before its depth is trusted; until "
                        "then every reusing request in it is audited and answered from its exact forward. "
                        "Default: 16 for a first-run (auto-calibrated) profile, 0 for a shipped or given one.")
    g.add_argument("--cache-output", action="store_true",
                   help="Multi-turn reuse: insert each finished request's prompt + answer into the prefix cache "
                        "(one extra prefill-only forward per request), so the next turn also reuses the answer. "
                        "Off by default: see docs/prefix_cache.md for when it pays.")

    g = p.add_argument_group("diffusion decoding defaults (requests may override in sampling_params)")
    g.add_argument("--block-length", type=int, default=32)
    g.add_argument("--steps-per-block", type=int, default=None,
                   help="Denoising steps per block (default: one per token, or fewer with --threshold).")
    g.add_argument("--steps", type=int, default=None, help="Total denoising steps per request (alternative).")
    g.add_argument("--threshold", type=_threshold, default=0.9,
                   help="Confidence threshold for parallel unmasking (Fast-dLLM); 'none' = fixed schedule.")
    g.add_argument("--remasking", default=None, choices=REMASKING,
                   help="LLaDA's algorithms (default low_confidence); --dllm-algorithm names all of them.")
    g.add_argument("--cache-mode", default="dual", choices=CACHE_MODES,
                   help="In-request KV cache: none | prefix | dual (Fast-dLLM).")
    g.add_argument("--refresh-interval", type=int, default=0,
                   help="Steps between in-request cache refreshes (0 = at block starts only).")
    g.add_argument("--step-rows", default="block", choices=STEP_ROWS,
                   help="Rows a dual-cache block step computes: 'block' = every position of the block (exact "
                        "Fast-dLLM dual cache); 'active' = only the positions still masked plus those unmasked "
                        "by the previous forward, whose K/V are then kept (fewer rows per step, approximate; "
                        "docs/performance.md).")

    g = p.add_argument_group("SGLang compatibility")
    g.add_argument("--tp-size", "--tensor-parallel-size", type=int, default=1,
                   help="Only 1: tensor parallelism is not implemented (a larger value is a startup error).")
    g.add_argument("--dp-size", "--data-parallel-size", type=int, default=1,
                   help="Data parallelism: N > 1 starts N server workers on loopback ports and sglang-router "
                        "in front of them on --host/--port (needs the 'router' extra; docs/scaleout.md).")
    g.add_argument("--router-policy", default="cache_aware", choices=ROUTER_POLICIES,
                   help="With --dp-size > 1: the router's load-balancing policy. Any other --router-NAME [VALUE] "
                        "flag is passed to sglang-router as --NAME [VALUE] (e.g. --router-cache-threshold 0.5).")
    g.add_argument("--dp-max-restarts", type=int, default=3,
                   help="With --dp-size > 1: how many times each worker is restarted after it dies (0: report "
                        "and serve with the others).")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="Accepted for SGLang's command lines. The model code is part of this package; nothing "
                        "from the checkpoint folder is ever executed, with or without the flag.")
    g.add_argument("--dllm-algorithm", default=None,
                   help=f"Unmasking algorithm, for LLaDA and Dream alike: {', '.join(ALGORITHMS)} (SGLang's "
                        "LowConfidence = low_confidence). Default: the checkpoint's generation_config.json 'alg', "
                        "else low_confidence. Requests override it with sampling_params.dllm_algorithm.")
    g.add_argument("--dllm-eps", type=float, default=None,
                   help="Dream's schedule: the last timestep (default: generation_config.json, else 1e-3).")
    g.add_argument("--dllm-alg-temp", type=float, default=None,
                   help="Dream's algorithms: sample the positions to unmask with softmax(confidence / T) instead "
                        "of taking the most confident (default: generation_config.json, else 0).")
    g.add_argument("--dllm-algorithm-config", default=None,
                   help="Not implemented (a startup error if given): set --block-length, --threshold, "
                        "--steps-per-block instead.")
    return p


_SECRET_WORDS = ("key", "token", "secret", "password", "auth")


def redact_unknown(unknown: Sequence[str]) -> list[str]:
    """Unknown flags as they may be logged: the value of anything that looks like a secret
    (``--api_key X``, ``--hf-token=X``) is replaced."""
    out: list[str] = []
    hide_next = False
    for a in unknown:
        if hide_next and not a.startswith("--"):
            out.append("<redacted>")
            hide_next = False
            continue
        hide_next = False
        if a.startswith("-") and any(w in a.lower() for w in _SECRET_WORDS):
            if "=" in a:
                a = a.split("=", 1)[0] + "=<redacted>"
            else:
                hide_next = True
        out.append(a)
    return out


def split_router_flags(unknown: Sequence[str]) -> tuple[list[str], list[str]]:
    """Unknown flags -> (the rest, the ``--router-NAME [VALUE...]`` ones as the router's ``--NAME
    [VALUE...]``). ``--router-*`` is how SGLang's ``sglang_router.launch_server`` passes flags
    to its router, so the same spelling works with ``--dp-size``."""
    rest: list[str] = []
    router: list[str] = []
    to_router = False
    for a in unknown:
        if a.startswith("--"):
            to_router = a.startswith("--router-") and len(a) > len("--router-")
            if to_router:
                a = "--" + a[len("--router-"):]
        (router if to_router else rest).append(a)
    return rest, router


def parse_args(argv: Sequence[str] | None = None) -> ServerArgs:
    """Parse flags; unknown ones are kept in ``ignored_args`` and warned about."""
    parser = build_parser()
    ns, unknown = parser.parse_known_args(argv)
    unknown, router_extra = split_router_flags(unknown)
    unknown = redact_unknown(unknown)
    if unknown:
        logger.warning("ignoring unsupported SGLang flags: %s", " ".join(unknown))
    backend = _ATTENTION_ALIASES.get(ns.attention_backend, ns.attention_backend)
    if backend not in ATTENTION_BACKENDS:
        logger.warning("attention backend %r is not available here; using 'torch'", ns.attention_backend)
        backend = "torch"
    if ns.tp_size != 1:
        parser.error(f"--tp-size {ns.tp_size}: tensor parallelism is not implemented; use --tp-size 1")
    if ns.dp_size < 1:
        parser.error(f"--dp-size must be >= 1, got {ns.dp_size}")
    if ns.dp_max_restarts < 0:
        parser.error(f"--dp-max-restarts must be >= 0, got {ns.dp_max_restarts}")
    for flag in router_extra:
        if flag.split("=", 1)[0] in _ROUTER_OWNED_FLAGS:
            parser.error(f"--router-{flag[2:].split('=', 1)[0]} is set by the launcher: the router listens on "
                         "--host/--port, its workers are the --dp-size servers, and --router-policy picks the policy")
    if router_extra and ns.dp_size == 1:
        logger.warning("ignoring router flags without --dp-size > 1: %s", " ".join(redact_unknown(router_extra)))
    if ns.dllm_algorithm_config is not None:
        parser.error("--dllm-algorithm-config is not implemented; set the decoding with --block-length, "
                     "--threshold and --steps-per-block instead")
    algorithm = ns.remasking  # an explicit --remasking is a server flag above generation_config.json
    if ns.dllm_algorithm:
        try:
            algorithm = canonical_algorithm(ns.dllm_algorithm)
        except ValueError:
            parser.error(f"--dllm-algorithm {ns.dllm_algorithm} is not implemented; valid: {', '.join(ALGORITHMS)} "
                         "(SGLang's LowConfidence = low_confidence)")
    remasking = algorithm if algorithm in REMASKING else (ns.remasking or "low_confidence")
    for name in ("max_running_requests", "block_length", "steps_per_block", "steps", "max_queued_requests",
                 "max_prefix_cache_tokens", "num_threads", "context_length", "max_request_bytes", "max_batch_size",
                 "max_n", "max_total_tokens"):
        v = getattr(ns, name)
        lo = 0 if name in ("max_queued_requests", "max_prefix_cache_tokens") else 1
        if v is not None and v < lo:
            parser.error(f"--{name.replace('_', '-')} must be >= {lo}, got {v}")
    if not 0 <= ns.graceful_shutdown_timeout < float("inf"):
        parser.error("--graceful-shutdown-timeout must be a number of seconds >= 0, "
                     f"got {ns.graceful_shutdown_timeout}")
    args = ServerArgs(
        model_path=ns.model_path,
        tokenizer_path=ns.tokenizer_path,
        host=ns.host,
        port=ns.port,
        dtype=ns.dtype,
        device=ns.device,
        attention_backend=backend,
        max_running_requests=ns.max_running_requests,
        max_queued_requests=ns.max_queued_requests,
        context_length=ns.context_length,
        mem_fraction_static=ns.mem_fraction_static,
        disable_radix_cache=ns.disable_radix_cache,
        served_model_name=ns.served_model_name,
        api_key=ns.api_key,
        random_seed=ns.random_seed,
        log_level=ns.log_level,
        chat_template=ns.chat_template,
        incremental_streaming_output=ns.incremental_streaming_output,
        skip_server_warmup=ns.skip_server_warmup,
        num_threads=ns.num_threads,
        engine_in_process=ns.engine_in_process,
        max_request_bytes=ns.max_request_bytes,
        max_batch_size=ns.max_batch_size,
        max_n=ns.max_n,
        graceful_shutdown_timeout=ns.graceful_shutdown_timeout,
        prefix_cache=ns.prefix_cache,
        bicache_profile=ns.bicache_profile,
        calibration_budget_s=ns.calibration_budget_s,
        calibration_data=ns.calibration_data,
        max_prefix_cache_tokens=ns.max_prefix_cache_tokens,
        max_total_tokens=ns.max_total_tokens,
        bicache_audit_rate=ns.bicache_audit_rate,
        bicache_audit_min_agreement=ns.bicache_audit_min_agreement,
        bicache_audit_probation=ns.bicache_audit_probation,
        cache_output=ns.cache_output,
        block_length=ns.block_length,
        steps_per_block=ns.steps_per_block,
        steps=ns.steps,
        threshold=ns.threshold,
        remasking=remasking,
        cache_mode=ns.cache_mode,
        refresh_interval=ns.refresh_interval,
        step_rows=ns.step_rows,
        dllm_algorithm=algorithm,
        dllm_eps=ns.dllm_eps,
        dllm_alg_temp=ns.dllm_alg_temp,
        dp_size=ns.dp_size,
        router_policy=ns.router_policy,
        router_extra_args=tuple(router_extra),
        dp_max_restarts=ns.dp_max_restarts,
        ignored_args=tuple(unknown),
    )
    try:
        args.engine_config()
    except ValueError as e:
        parser.error(str(e))
    return args
