"""The engine a checkpoint is served by, built in the calling process: the bidirectional
:class:`~bicache_sgl.engine.engine.Engine`, or for a block-diffusion checkpoint (LLaDA2.x, SDAR)
:class:`~bicache_sgl.blockdiff.client.BlockEngineClient`. Both implement ``EngineClient``; the
engine process (engine/process_child.py) builds its engine here, and so does ``launch_server
--engine-in-process``, so the two layouts serve the same engine for the same folder.

Besides ``EngineClient``, what the engine process reads of the engine it built is
:class:`LocalEngine`.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from ..config import EngineConfig
from .interface import EngineClient


@runtime_checkable
class LocalEngine(EngineClient, Protocol):
    """An engine that computes in this process, as the engine process reports it to the server's."""

    kv_budget: int  # K/V positions it admits within (a request larger than it is refused)
    device: Any  # torch.device it computes on
    # True: requests the server process validated (ValidRequest) are taken as they are, so
    # submissions are one-way; False: it validates every submission itself, so the server process
    # waits for its answer (a bad request is still a synchronous ValueError: a 400)
    accepts_valid_requests: bool


def build_local_engine(config: EngineConfig) -> LocalEngine:
    """The engine ``config`` describes, in this process."""
    if config.model_path is not None:
        from ..blockdiff.client import BlockEngineClient, is_block_checkpoint
        from ..models.loader import resolve_model_path
        if is_block_checkpoint(resolve_model_path(config.model_path)):
            return BlockEngineClient(config)
    from .engine import Engine

    return Engine(config=config)
