"""bicache-sgl: an SGLang-style serving runtime for diffusion language models (LLaDA, Dream) with
bicache shared-prefix KV reuse."""

from .config import DecodeDefaults, EngineConfig, SamplingParams
from .engine.engine import Engine
from .io_struct import GenerateRequest, QueueFullError, RequestEvent

__all__ = [
    "DecodeDefaults",
    "Engine",
    "EngineConfig",
    "GenerateRequest",
    "QueueFullError",
    "RequestEvent",
    "Runtime",
    "SamplingParams",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "Runtime":  # imports sglang; only when asked for
        from .runtime import Runtime
        return Runtime
    raise AttributeError(name)
