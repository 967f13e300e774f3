"""``python -m bicache_sgl.launch_server`` / ``bicache-sgl-server``: start the HTTP server.

Flags follow SGLang's ``launch_server`` (``--model-path``, ``--port``, ``--api-key`` ...) plus
the diffusion and bicache knobs; run with ``--help`` for the list. Unknown SGLang flags are
accepted with a warning. Once the warmup request has gone through, the log shows
``The server is fired up and ready to roll! URL: http://HOST:PORT``.

Process layout (SGLang's): this process runs the HTTP server and the tokenizer with 1 torch
thread; the engine (scheduler + model) runs in a child process with the other CPUs' worth of
torch threads (:func:`bicache_sgl.engine.process.default_engine_threads`, or ``--num-threads``),
reached through :class:`bicache_sgl.engine.process.EngineProcessClient`. ``--engine-in-process``
runs the engine as a thread of this process instead (debugging).

``--dp-size N`` (N > 1) starts N such servers on loopback ports and ``sglang-router`` in front of
them on ``--host``/``--port`` instead (:mod:`bicache_sgl.router`, docs/scaleout.md).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from bicache_sgl.server.args import LOG_LEVELS, ServerArgs, parse_args

if TYPE_CHECKING:  # the engine package loads torch; the flags parse without it
    from bicache_sgl.engine.interface import EngineClient
    from bicache_sgl.server.state import ServerState

logger = logging.getLogger("bicache_sgl.server")


def setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format="[%(asctime)s] %(levelname)s %(name)s: %(message)s", stream=sys.stderr, force=True)


def build_engine(args: ServerArgs) -> EngineClient:
    """The engine these args describe (engine/local.py picks it for the checkpoint: the
    bidirectional engine, or the block-diffusion engine of a LLaDA2.x / SDAR folder): in a child
    process (default) or, with ``--engine-in-process``, in this one. Without ``--num-threads`` the
    engine gets :func:`~bicache_sgl.engine.process.default_engine_threads` torch threads."""
    from bicache_sgl.engine.process import EngineProcessClient, default_engine_threads

    cfg = args.engine_config()
    if cfg.num_threads is None:
        cfg = cfg.replace(num_threads=default_engine_threads())
    if args.engine_in_process:
        from bicache_sgl.engine.local import build_local_engine

        return build_local_engine(cfg)
    return EngineProcessClient(cfg, log_level=args.log_level)


def serve(args: ServerArgs, engine: EngineClient | None = None) -> None:
    """Build the engine (unless given), then serve until SIGINT/SIGTERM."""
    import uvicorn

    from bicache_sgl.server.app import create_app

    shown = {k: v for k, v in args.public_dict().items() if v not in (None, False, (), [])}
    logger.info("server args: %s", shown)
    if engine is None:
        try:
            engine = build_engine(args)
        except Exception as e:  # a clear line instead of a traceback for config errors
            logger.debug("engine construction failed", exc_info=True)
            logger.error("could not start the engine: %s: %s", type(e).__name__, e)
            raise SystemExit(1) from None
    import torch

    app = create_app(engine, args)
    state = app.state.server
    if not engine.in_process:
        torch.set_num_threads(1)  # this process parses, tokenizes and encodes; the other cores are the engine's
    engine.watch(state.engine_failed)  # /health answers 503 once an engine process is gone
    logger.info("model loaded: %s (%s)", engine.model_path, engine.describe())
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            access_log=args.log_level == "debug", timeout_keep_alive=5,
                            timeout_graceful_shutdown=5, log_config=None)
    draining_server(config, state, args.graceful_shutdown_timeout).run()


def draining_server(config: Any, state: ServerState, grace: float) -> Any:
    """uvicorn's Server with a drain step at the start of its shutdown (SIGTERM/SIGINT): stop
    accepting connections, give running requests ``grace`` seconds, abort the rest so each still
    gets an answer (``ServerState.drain``); only then does uvicorn close the connections.
    Without it, uvicorn cuts the streams still open after its own timeout and answers the other
    requests with a bare plain-text 500."""
    import asyncio

    import uvicorn

    class DrainingServer(uvicorn.Server):
        async def shutdown(self, sockets: Any = None) -> None:
            for server in getattr(self, "servers", []):
                server.close()  # stop accepting new connections first
            drain = asyncio.ensure_future(state.drain(grace))
            while not drain.done() and not self.force_exit:  # a second Ctrl+C skips the wait
                await asyncio.wait({drain}, timeout=0.1)
            if not drain.done():
                drain.cancel()
            await super().shutdown(sockets)

    return DrainingServer(config)


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    # logging before parsing, so the warning about unknown flags is shown
    level = "info"
    for i, a in enumerate(argv):
        if a == "--log-level" and i + 1 < len(argv):
            level = argv[i + 1].lower()
        elif a.startswith("--log-level="):
            level = a.split("=", 1)[1].lower()
    setup_logging(level if level in LOG_LEVELS else "info")
    args = parse_args(argv)
    if args.dp_size > 1:  # N workers behind sglang-router; this process only supervises them
        from bicache_sgl.router import launch_data_parallel

        raise SystemExit(launch_data_parallel(args, argv))
    serve(args)


if __name__ == "__main__":
    main()
