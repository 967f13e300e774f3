"""Builds a request's engine-side state (:class:`~bicache_sgl.scheduler.request.Req`) from what a
caller submitted, validating it first (``scheduler.validate``) unless it was validated at the edge,
and compiles its output constraint."""

from __future__ import annotations

from collections.abc import Callable

from ..bicache.segments import SegmentBoundaries
from ..config import DecodeDefaults, SamplingParams
from ..constrained import Constraint, ConstraintError, compile_constraint
from ..io_struct import GenerateRequest, RequestEvent
from ..models.config import ModelConfig
from .request import Req
from .validate import RequestLimits, ValidRequest, validate_request


class RequestFactory:
    """Validates submitted requests against the model and builds their state (once per request)."""

    def __init__(self, model_config: ModelConfig, tokenizer, eos_ids: tuple[int, ...], decode: DecodeDefaults,
                 context_length: int, kv_budget: int | None = None, segments: SegmentBoundaries | None = None) -> None:
        self.mc, self.tokenizer, self.eos_ids = model_config, tokenizer, eos_ids
        self.segments = segments  # the prefix span's boundary tokens (None: the span is not cut)
        self.decode, self.context_length = decode, context_length
        self.kv_budget = kv_budget  # the scheduler's whole private-K/V budget (positions); None: unchecked
        self.limits = RequestLimits.of(model_config, decode, context_length, kv_budget)
        # the checkpoint's generation_config.json defaults (below the request and the server)
        self.generation = self.limits.generation

    def build(self, greq: GenerateRequest | ValidRequest, on_event: Callable[[RequestEvent], None] | None, *,
              internal: bool = False) -> Req:
        """Raise ValueError naming what is wrong, else the request's state. A :class:`ValidRequest`
        (validated at the edge, scheduler/validate.py) is trusted as it is. ``internal``: the
        engine's own work (an output capture)."""
        v = greq if isinstance(greq, ValidRequest) else validate_request(greq, self.limits)
        mc = self.mc
        return Req(v.greq, v.plan, mask_id=mc.mask_token_id, eos_ids=self.eos_ids, logit_shift=mc.logit_shift,
                   tokenizer=self.tokenizer, on_event=on_event, seed=0, constraint=self.constraint(v.greq.params),
                   internal=internal, segments=self.segments)

    def constraint(self, p: SamplingParams) -> Constraint | None:
        """The request's compiled output constraint (:func:`request_constraint`)."""
        return request_constraint(p, self.tokenizer, self.eos_ids)


def request_constraint(p: SamplingParams, tokenizer, eos_ids: tuple[int, ...]) -> Constraint | None:
    """Compile a request's output constraint (cached per constraint and end ids; a fresh build
    takes milliseconds to seconds, bounded by the core's limits, so callers run this off any
    event loop). ``eos_ids``: the model's end ids. Raises ValueError (ConstraintError) with the
    parser's message. Used by the bidirectional engine and by the block engine's client."""
    spec = p.constraint
    if spec is None:
        return None
    kind, value = spec
    # the ids that end the output, allowed only after a complete match: EOS (not with
    # ignore_eos) and stop_token_ids. With none (ignore_eos, no stop ids) every position is
    # output and the match has to fill them all
    end_ids = (() if p.ignore_eos else tuple(eos_ids)) + tuple(p.stop_token_ids)
    try:
        return compile_constraint(kind, value, tokenizer, end_ids=end_ids)
    except ConstraintError as e:
        msg = str(e)
        raise ConstraintError(msg if msg.startswith(kind) else f"{kind}: {msg}") from None
