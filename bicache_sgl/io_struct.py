"""What callers submit to the engine and what they receive back (SGLang's io_struct).

Plain dataclasses with no torch, imported by the server, the scheduler and the engine alike.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from .config import SamplingParams


class QueueFullError(RuntimeError):
    """The waiting queue is at --max-queued-requests."""


class InvalidRequest(ValueError):
    """A request the engine refuses (``bicache_sgl.scheduler.validate``, the block-diffusion
    client). ``param``: the request field it is about (the server's 400 names it), None when no
    one field is. It pickles with ``param`` (an engine process sends it back as it is)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def new_rid() -> str:
    """A fresh request id: the one place one is minted (a request built without one gets it)."""
    return uuid.uuid4().hex


def span_depth(meta_info: dict) -> int:
    """The depth a request's reused span was read at (``meta_info["reused_tokens_by_depth"]``'s
    deepest entry), 0 when it reused nothing. ``bicache_depth`` is the depth MOST of the match was
    served at, so a short span under a long match reports 0 there; measurements that ask "at what
    depth was the span reused" read this."""
    by_depth = meta_info.get("reused_tokens_by_depth")
    if by_depth is None:  # a report from before the split (or a block model's): one span, one depth
        return int(meta_info.get("bicache_depth") or 0)
    return max((int(d) for d, n in by_depth.items() if n), default=0)


@dataclass
class GenerateRequest:
    """One engine request, typed; validated once against the engine's limits
    (``bicache_sgl.scheduler.validate``) before it runs."""

    input_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    rid: str = field(default_factory=new_rid)
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
