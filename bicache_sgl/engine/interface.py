"""The engine as the server sees it: a typed interface, so the HTTP layer never probes the engine.

:class:`bicache_sgl.engine.engine.Engine` implements it in-process; a client that talks to an
engine in another process implements the same methods.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from ..config import EngineConfig
from ..io_struct import GenerateRequest, RequestEvent
from ..models.config import ModelConfig


@runtime_checkable
class EngineClient(Protocol):
    """What a front end (HTTP server, CLI, benchmarks) may use of an engine."""

    config: EngineConfig
    model_config: ModelConfig
    model_path: str  # resolved checkpoint folder
    context_length: int  # max prompt + generation region, in tokens
    tokenizer: Any  # a transformers tokenizer (encode / decode / chat template)
    eos_ids: tuple[int, ...]
    # the engine computes in this process; False: in a child process (the server process then keeps
    # one torch thread and leaves the other cores to the engine)
    in_process: bool
    # ``submit`` never waits on the engine (a pure validation and a one-way send): the server may
    # submit on its event loop instead of a worker thread
    submit_returns_at_once: bool

    def submit(self, greq: GenerateRequest, on_event: Callable[[RequestEvent], None] | None = None) -> str:
        """Validate (once: ``bicache_sgl.scheduler.validate``) and queue one request; returns its
        ``rid``. ``on_event`` runs on another thread for each block and at the end; every event's
        ``meta_info`` is whole (the engine builds it). An ``on_event`` that also has a ``many``
        method is given, instead, each step's events for it as one list (in order). Raises
        ValueError (bad input) or QueueFullError (queue or memory budget full)."""

    def submit_many(self, greqs: Sequence[GenerateRequest],
                    on_events: Sequence[Callable[[RequestEvent], None] | None]) -> list[str]:
        """Queue several requests atomically (they become visible to the same step)."""

    def abort(self, rid: str) -> None:
        """Abort a queued or running request (its final event carries finish_reason abort)."""

    def abort_all(self) -> int:
        """Abort every queued and running request; returns how many were asked to stop."""

    def flush_cache(self, timeout: float = 30.0) -> bool:
        """Drop every cached prefix not in use; False on timeout."""

    def get_stats(self) -> dict[str, Any]:
        """Counters for /get_server_info and /metrics (see docs/server.md)."""

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine; requests in flight finish with an abort."""

    def attach_loop(self, loop: asyncio.AbstractEventLoop) -> bool:
        """Deliver events on ``loop`` from now on (called on the loop's thread at application
        startup); False when this engine delivers them on its own thread instead."""

    def watch(self, on_failure: Callable[[str], None]) -> None:
        """Call ``on_failure(message)`` once when the engine dies apart from the server (at once if
        it already has); an engine that cannot (in this process) never calls it."""

    def describe(self) -> str:
        """Where the engine runs, for the server's "model loaded" line."""
