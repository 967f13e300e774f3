"""What callers submit to the engine and what they receive back (SGLang's io_struct).

Plain dataclasses with no torch, imported by the server, the scheduler and the engine alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .config import SamplingParams


class QueueFullError(RuntimeError):
    """The waiting queue is at --max-queued-requests."""


@dataclass
class GenerateRequest:
    input_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    rid: str | None = None
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    # Force the bicache depth for this request (calibration and experiments); still capped by
    # the depth the matched prefix holds. None: the engine's --prefix-cache policy decides.
    bicache_depth: int | None = None


@dataclass
class RequestEvent:
    rid: str
    text: str
    output_ids: list[int]
    finished: bool
    finish_reason: dict | None = None
    meta_info: dict = field(default_factory=dict)
    error: str | None = None
