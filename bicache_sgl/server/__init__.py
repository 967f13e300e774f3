"""SGLang-compatible HTTP server (native ``/generate`` API and the OpenAI API) over the engine."""

from __future__ import annotations

from typing import TYPE_CHECKING

try:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as _version

    try:
        __version__ = _version("bicache-sgl")
    except PackageNotFoundError:
        __version__ = "0.1.0"
except Exception:
    __version__ = "0.1.0"

from bicache_sgl.server.args import ServerArgs, build_parser, parse_args
from bicache_sgl.server.protocol import APIError

if TYPE_CHECKING:
    from fastapi import FastAPI

    from bicache_sgl.engine.interface import EngineClient


def create_app(engine: EngineClient, args: ServerArgs) -> FastAPI:
    """The FastAPI app serving ``engine`` (imported lazily: FastAPI is only needed here)."""
    from bicache_sgl.server.app import create_app as _create

    return _create(engine, args)


__all__ = ["APIError", "ServerArgs", "__version__", "build_parser", "create_app", "parse_args"]
