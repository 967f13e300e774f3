"""The engine a checkpoint is served by, built in the calling process: the bidirectional
:class:`~bicache_sgl.engine.engine.Engine`, or for a block-diffusion checkpoint (LLaDA2.x, SDAR)
:class:`~bicache_sgl.blockdiff.client.BlockEngineClient`. Both implement ``EngineClient``; the
engine process (engine/process_child.py) builds its engine here, and so does ``launch_server
--engine-in-process``, so the two layouts serve the same engine for the same folder.

Besides ``EngineClient``, what the engine process reads of the engine it built: ``kv_budget``
(K/V positions; what a request larger than it is refused against), ``device``, and
``accepts_valid_requests`` (True: requests the server process validated are taken as they are, so
submissions are one-way; False: the engine validates every submission itself, so the server
process waits for its answer, and a bad request is still a synchronous ``ValueError``, a 400).
"""

from __future__ import annotations

from ..config import EngineConfig
from .interface import EngineClient


def build_local_engine(config: EngineConfig) -> EngineClient:
    """The engine ``config`` describes, in this process."""
    if config.model_path is not None:
        from ..blockdiff.client import BlockEngineClient, is_block_checkpoint
        from ..models.loader import resolve_model_path
        if is_block_checkpoint(resolve_model_path(config.model_path)):
            return BlockEngineClient(config)
    from .engine import Engine

    return Engine(config=config)
