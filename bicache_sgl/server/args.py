"""Command-line flags of ``bicache-sgl-server`` (SGLang's common flags plus the diffusion knobs).

Every flag this parser knows is either used or refuses a value it cannot honour (``--tp-size 2``
is a startup error, not a silent single-device run). SGLang harnesses also pass flags that only
tune SGLang's own machinery (``--cuda-graph-bs``, ``--grammar-backend`` ...); flags this parser
does not know are accepted with a warning naming them and listed in ``ignored_args`` of
/get_server_info (``parse_known_args``), so such a harness can launch this server unchanged.

Each setting is declared once: ``ServerArgs`` extends ``EngineConfig`` (whose ``decode`` holds the
DecodeDefaults), every field carries its default and help string, and :func:`build_parser` makes a
``--name-with-dashes`` flag of each (bicache_sgl/flags.py). Only SGLang's spellings that are not
settings here (``--tp-size``, ``--remasking`` = ``--dllm-algorithm``, ...) are written out below,
in ``_COMPAT_FLAGS``, and translated in :func:`parse_args`.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bicache_sgl.attention import ALIASES as ATTENTION_ALIASES
from bicache_sgl.attention import available_backends
from bicache_sgl.config import (
    ALGORITHMS,
    DEFAULT_MAX_N,
    REMASKING,
    DecodeDefaults,
    EngineConfig,
    canonical_algorithm,
    check,
    is_int,
    parse_context_length,
)
from bicache_sgl.flags import add_flags, flag_fields, flag_values, option

__all__ = ["LOG_LEVELS", "ServerArgs", "build_parser", "parse_args", "parse_context_length", "redact_unknown",
           "split_router_flags"]

logger = logging.getLogger(__name__)

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
DEFAULT_MAX_REQUEST_BYTES = 32 << 20
# sglang-router's --policy choices (0.3.2) for --router-policy; the launcher sets the router's own
# --host/--port/--worker-urls/--policy, so those cannot come through --router-NAME
ROUTER_POLICIES = ("cache_aware", "round_robin", "random", "power_of_two", "manual")
_ROUTER_OWNED_FLAGS = ("--host", "--port", "--worker-urls", "--policy")


@dataclass(frozen=True)
class ServerArgs(EngineConfig):
    """Everything the HTTP server and the engine it owns need: the EngineConfig fields (inherited,
    each a flag) plus the server's own below. Field names follow SGLang's ``ServerArgs``; every
    field with a flag is ``--name-with-dashes`` (bicache_sgl/flags.py)."""

    host: str = option("127.0.0.1", "Address the HTTP server listens on.")
    port: int = option(30000, "Port the HTTP server listens on.")
    served_model_name: str | None = option(
        None, "Model name reported on /v1/models and in every OpenAI answer; requests may name it, the model path "
              "or its folder (default: the model path; the bundled models: a short name, see BUNDLED_NAMES).")
    api_key: str | None = option(
        None, "Require 'Authorization: Bearer KEY' on every route except /health*, /ready and /metrics.")
    admin_api_key: str | None = option(
        None, "Admin key (SGLang's): once set, /abort_request, /flush_cache and the profiling routes accept only "
              "this key, not --api-key (docs/server.md, Authentication).")
    log_level: str = option("info", "Log level of the server and engine processes.", parse=str.lower,
                            choices=LOG_LEVELS)
    incremental_streaming_output: bool = option(
        False, "Stream deltas instead of SGLang's default cumulative text/output_ids.")
    skip_server_warmup: bool = option(False, "Do not send the warmup request before reporting ready.")
    # /metrics is always served; --enable-metrics is accepted for SGLang's command lines (_COMPAT_FLAGS)
    enable_metrics: bool = option(True, "Always on: /metrics is always served.", cli=False)
    engine_in_process: bool = option(
        False, "Run the engine as a thread of the HTTP server process instead of in its own process (debugging; "
               "the engine's step then shares the GIL with the HTTP work).")
    # request limits and shutdown
    max_request_bytes: int = option(DEFAULT_MAX_REQUEST_BYTES,
                                    "Largest request body accepted; larger ones get 413 (default 32 MiB).")
    max_batch_size: int = option(1024, "Most sequences (prompts x n) one request may create; more get 400.")
    max_n: int = option(DEFAULT_MAX_N, "Largest n (samples per prompt); larger get 400.")
    graceful_shutdown_timeout: float = option(
        5.0, "On SIGTERM/SIGINT: seconds running requests get to finish before they are aborted (each still gets "
             "an answer); new requests get 503 meanwhile.")
    disable_radix_cache: bool = option(False, "Same as --prefix-cache off.")
    # a server-wide default merged under each request's sampling_params (default_sampling_params)
    steps: int | None = option(None, "Total denoising steps per request (an alternative to --steps-per-block); "
                                     "requests override it with sampling_params.steps.")
    # data parallelism (--dp-size N > 1: N workers behind sglang-router, bicache_sgl/router.py)
    dp_size: int = option(
        1, "Data parallelism: N > 1 starts N server workers on loopback ports and sglang-router in front of them "
           "on --host/--port (needs the 'router' extra; docs/scaleout.md).",
        flags=("--dp-size", "--data-parallel-size"))
    router_policy: str = option(
        "cache_aware", "With --dp-size > 1: the router's load-balancing policy. Any other --router-NAME [VALUE] flag "
                       "is passed to sglang-router as --NAME [VALUE] (e.g. --router-cache-threshold 0.5).",
        choices=ROUTER_POLICIES)
    router_extra_args: tuple[str, ...] = option((), "The --router-NAME [V] flags, passed to the router as --NAME [V].",
                                                cli=False)
    dp_max_restarts: int = option(
        3, "With --dp-size > 1: how many times each worker is restarted after it dies (0: report and serve with "
           "the others).")
    # informational: the flags we did not understand
    ignored_args: tuple[str, ...] = option((), "Unknown flags, accepted with a warning.", cli=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        check(is_int(self.port) and 0 <= self.port < 1 << 16, f"port must be in [0, 65535], got {self.port!r}")
        check(self.log_level in LOG_LEVELS, f"log_level must be one of {LOG_LEVELS}, got {self.log_level!r}")
        for name, lo in (("max_request_bytes", 1), ("max_batch_size", 1), ("max_n", 1), ("steps", 1),
                         ("dp_size", 1), ("dp_max_restarts", 0)):
            v = getattr(self, name)
            check((v is None and name == "steps") or (is_int(v) and v >= lo), f"{name} must be >= {lo}, got {v!r}")
        check(isinstance(self.graceful_shutdown_timeout, (int, float))
              and 0 <= self.graceful_shutdown_timeout < float("inf"),
              f"graceful_shutdown_timeout must be a number of seconds >= 0, got {self.graceful_shutdown_timeout!r}")
        check(self.router_policy in ROUTER_POLICIES,
              f"router_policy must be one of {ROUTER_POLICIES}, got {self.router_policy!r}")

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
        """The EngineConfig these flags describe (the inherited fields; the chat template resolved to
        its text). Raises ValueError on inconsistent values."""
        kw = {f.name: getattr(self, f.name) for f in dataclasses.fields(EngineConfig)}
        kw.update(prefix_cache=self.effective_prefix_cache(), chat_template=_resolved_template(self.chat_template))
        return EngineConfig(**kw)

    def default_sampling_params(self) -> dict[str, Any]:
        """Server-wide defaults merged under each request's sampling_params (request wins)."""
        out: dict[str, Any] = {}
        if self.steps is not None:
            out["steps"] = self.steps
        return out

    def public_dict(self) -> dict[str, Any]:
        """The args as JSON for /get_server_info (flat, as SGLang's), with the API key never shown."""
        d = dataclasses.asdict(self)
        d.update(d.pop("decode"))
        d["api_key"] = "<redacted>" if self.api_key else None
        d["admin_api_key"] = "<redacted>" if self.admin_api_key else None
        d["ignored_args"] = list(self.ignored_args)
        d["router_extra_args"] = redact_unknown(self.router_extra_args)
        d["prefix_cache"] = self.effective_prefix_cache()
        return d


# The bundled models' short served names (asset folder -> name). A client that needs the tokenizer
# (sglang.bench_serving, guidellm) finds the folder in /v1/models' "root" or /get_model_info.
BUNDLED_NAMES = {"default_model": "bicache-default", "context_model": "bicache-context"}


def default_served_model_name(model_path: str) -> str:
    """SGLang's rule: the model path, unless ``--served-model-name`` is given; a bundled model
    (bicache_sgl/assets/<folder>) is served under its short name instead of an absolute path."""
    from pathlib import Path

    assets = Path(__file__).resolve().parent.parent / "assets"
    try:
        p = Path(model_path).resolve()
    except (OSError, RuntimeError):
        return model_path
    if p.parent == assets and p.name in BUNDLED_NAMES:
        return BUNDLED_NAMES[p.name]
    return model_path


def _resolved_template(spec: str | None) -> str | None:
    from bicache_sgl.server.chat import load_chat_template

    return load_chat_template(spec)


def _attention_help() -> str:
    aliases = ", ".join(f"{a} = {b}" for a, b in ATTENTION_ALIASES.items())
    return (f"Attention kernels, one of the attention registry's backends (bicache_sgl/attention): "
            f"{' | '.join(available_backends())}. SGLang's names: {aliases}; any other name falls back to torch "
            "with a warning.")


# Flags of SGLang's command lines that are not settings here: each is accepted (and refuses a value
# it cannot honour, in parse_args) so an SGLang launch line starts this server unchanged.
_COMPAT_FLAGS: tuple[tuple[tuple[str, ...], dict[str, Any]], ...] = (
    (("--tp-size", "--tensor-parallel-size"),
     {"type": int, "default": 1,
      "help": "Only 1: tensor parallelism is not implemented (a larger value is a startup error)."}),
    (("--trust-remote-code",),
     {"action": "store_true",
      "help": "Accepted for SGLang's command lines. The model code is part of this package; nothing from the "
              "checkpoint folder is ever executed, with or without the flag."}),
    (("--enable-metrics",), {"action": "store_true", "help": "Accepted for SGLang parity; /metrics is always on."}),
    (("--remasking",),
     {"default": None, "choices": REMASKING,
      "help": "LLaDA's algorithms (default low_confidence): the same setting as --dllm-algorithm, which names "
              "all of them and wins when both are given."}),
)


START_HERE = """\
SGLang-compatible HTTP server for diffusion language models (LLaDA, Dream) with bicache
shared-prefix reuse. SGLang's native API and the OpenAI API on one port.

start here (the flags most users need; every flag is listed below):
  --model-path PATH|HUB_NAME   the model (default: the bundled toy model, served as bicache-default)
  --port 30000 --host 127.0.0.1
  --attention-backend flashinfer   on a GPU (pip install -e ".[cuda]")
  --context-length N           longest prompt + generation
  --max-running-requests N     requests decoded together (default 16)
  --mem-fraction-static F      GPU memory share for the prefix cache (default 0.3)
  --prefix-cache bicache|off   shared-prefix reuse (default bicache)
  --bicache-profile auto|none|FILE   the reuse-depth table (default: beside the model, else calibrated
                               at the first start and cached)
  --served-model-name NAME  --api-key KEY  --chat-template FILE|NAME

examples:
  bicache-sgl-server                     # the bundled model on http://127.0.0.1:30000
  bicache-sgl-server --model-path GSAI-ML/LLaDA-8B-Instruct --attention-backend flashinfer \\
      --context-length 4096 --port 30000

Unknown SGLang flags are accepted with a warning. Docs: docs/server.md.
"""


def build_parser() -> argparse.ArgumentParser:
    """The server's flags: one per ServerArgs field (EngineConfig's, the decoding defaults', the
    server's own), built from the fields' help strings, plus SGLang's compatibility flags."""
    p = argparse.ArgumentParser(
        prog="bicache-sgl-server",
        usage="bicache-sgl-server [FLAGS]   (or: python -m bicache_sgl.launch_server [FLAGS])",
        description=START_HERE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    add_flags(p.add_argument_group("model, scheduling and prefix cache"), EngineConfig, skip=("decode",),
              helps={"attention_backend": _attention_help()})
    g = p.add_argument_group("diffusion decoding defaults (requests may override in sampling_params)")
    add_flags(g, DecodeDefaults)
    add_flags(g, ServerArgs, only=("steps",))
    add_flags(p.add_argument_group("server"), ServerArgs, skip=_ENGINE_NAMES | {"steps"})
    g = p.add_argument_group("SGLang compatibility")
    for flags, kw in _COMPAT_FLAGS:
        g.add_argument(*flags, **kw)
    return p


_ENGINE_NAMES = frozenset(f.name for f in dataclasses.fields(EngineConfig))


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


def _flag_message(msg: str) -> str:
    """A config error naming a field (``max_n must be >= 1``) as the flag that sets it."""
    name, sep, rest = msg.partition(" ")
    if sep and name in _FLAG_NAMES:
        return f"--{name.replace('_', '-')} {rest}"
    return msg


_FLAG_NAMES = frozenset(f.name for f in flag_fields(ServerArgs))


def parse_args(argv: Sequence[str] | None = None) -> ServerArgs:
    """Parse flags; unknown ones are kept in ``ignored_args`` and warned about. A bad value stops
    with argparse's error naming the flag."""
    parser = build_parser()
    ns, unknown = parser.parse_known_args(argv)
    unknown, router_extra = split_router_flags(unknown)
    unknown = redact_unknown(unknown)
    if unknown:
        logger.warning("ignoring unsupported SGLang flags: %s", " ".join(unknown))
    backend = ATTENTION_ALIASES.get(ns.attention_backend, ns.attention_backend)
    if backend not in available_backends():
        logger.warning("attention backend %r is not available here; using 'torch'", ns.attention_backend)
        backend = "torch"
    if ns.tp_size != 1:
        parser.error(f"--tp-size {ns.tp_size}: tensor parallelism is not implemented; use --tp-size 1")
    for flag in router_extra:
        if flag.split("=", 1)[0] in _ROUTER_OWNED_FLAGS:
            parser.error(f"--router-{flag[2:].split('=', 1)[0]} is set by the launcher: the router listens on "
                         "--host/--port, its workers are the --dp-size servers, and --router-policy picks the policy")
    if router_extra and ns.dp_size == 1:
        logger.warning("ignoring router flags without --dp-size > 1: %s", " ".join(redact_unknown(router_extra)))
    # --remasking is the LLaDA-only spelling of --dllm-algorithm (which wins); either, given, is a
    # server flag above the checkpoint's generation_config.json
    algorithm = ns.remasking
    if ns.dllm_algorithm:
        try:
            algorithm = canonical_algorithm(ns.dllm_algorithm)
        except ValueError:
            parser.error(f"--dllm-algorithm {ns.dllm_algorithm} is not implemented; valid: {', '.join(ALGORITHMS)} "
                         "(any case; SGLang's LowConfidence = low_confidence, JointThreshold = joint_threshold; which "
                         "of them a model runs is its family's: docs/server.md)")
    try:
        args = ServerArgs(**flag_values(ns, ServerArgs, attention_backend=backend, dllm_algorithm=algorithm,
                                        router_extra_args=tuple(router_extra), ignored_args=tuple(unknown)))
        args.engine_config()
    except ValueError as e:
        parser.error(_flag_message(str(e)))
    return args
