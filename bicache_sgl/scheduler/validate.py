"""The request edge: what a :class:`GenerateRequest` resolves to and whether the loaded engine can
run it, checked ONCE (docs/architecture.md, "One request's path").

Pure and cheap: no tensor, no constraint compile (the caller compiles the constraint through the
cached build pool, ``RequestFactory.constraint``). The server process runs
:func:`validate_request` against the limits its engine process reported, and sends the
:class:`ValidRequest` on; the engine builds its ``Req`` from it without checking again.
``RequestFactory.build`` runs it for a plain ``GenerateRequest`` (the offline API, the engine in
the server process).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from ..config import DecodeDefaults, SamplingParams
from ..decoding.plan import ANY_FAMILY, MAX_DREAM_STEPS, DecodePlan, FamilyDecoding
from ..io_struct import GenerateRequest, InvalidRequest
from ..models.config import ModelConfig
from ..models.families import family_decoding
from ..models.loader import GenerationDefaults, generation_defaults

__all__ = ["MAX_DREAM_STEPS", "DecodePlan", "RequestLimits", "ValidRequest", "check_context", "check_min_new_tokens",
           "check_prompt_ids",
           "kv_lengths", "validate_request"]


@dataclass(frozen=True)
class RequestLimits:
    """What a request is checked against: the loaded model and the engine's settings."""

    vocab_size: int
    n_layers: int
    context_length: int  # max prompt + generation region, in tokens
    decode: DecodeDefaults  # the server's decode defaults
    generation: GenerationDefaults  # the checkpoint's generation_config.json defaults
    kv_budget: int | None = None  # the scheduler's whole private-K/V budget (positions); None: unchecked
    family: FamilyDecoding = ANY_FAMILY  # the checkpoint family's decoding (default and accepted algorithms)

    @classmethod
    def of(cls, mc: ModelConfig, decode: DecodeDefaults, context_length: int,
           kv_budget: int | None = None) -> RequestLimits:
        return cls(mc.vocab_size, mc.n_layers, context_length, decode, generation_defaults(mc), kv_budget,
                   family_decoding(mc))


@dataclass(frozen=True)
class ValidRequest:
    """A request that passed :func:`validate_request`: its params resolved (model defaults filled
    in, stop ids outside the vocabulary dropped) and its decode plan. The engine trusts it; treat
    ``greq`` as read-only from here on (the plan was derived from it)."""

    greq: GenerateRequest
    plan: DecodePlan
    kv_tokens: int  # private K/V positions (all layers) it holds while it runs

    @property
    def rid(self) -> str:
        return self.greq.rid


def kv_lengths(prompt_len: int, gen_len: int, cfg_scale: float, return_logprob: bool,
               logprob_start_len: int) -> list[int]:
    """Positions of each private K/V buffer a request needs: the sequence itself, its
    classifier-free-guidance shadow, its likelihood probe (prefill-only with logprobs: a score)."""
    generate = gen_len > 0
    n = [prompt_len + gen_len if generate else prompt_len]
    if generate and cfg_scale > 0:
        n.append(prompt_len + gen_len)
    if (not generate and return_logprob) or (return_logprob and logprob_start_len >= 0):
        n.append(prompt_len)
    return n


def check_logprob_start(start: int, prompt_len: int) -> None:
    """Input logprobs start inside the prompt (the rule for a request that returns logprobs)."""
    if start >= prompt_len:
        raise InvalidRequest(f"logprob_start_len ({start}) must be < the prompt length ({prompt_len})",
                             "logprob_start_len")


def check_logprob_fields(greq: GenerateRequest) -> None:
    """The logprob knobs of a request (both engines): a start inside the prompt, k >= 0."""
    if greq.return_logprob:
        check_logprob_start(greq.logprob_start_len, len(greq.input_ids))
    if greq.top_logprobs_num < 0:
        raise InvalidRequest("top_logprobs_num must be >= 0", "top_logprobs_num")


def check_logit_bias(logit_bias: Sequence[tuple[int, float]], vocab_size: int) -> None:
    """Every biased token id is in the vocabulary (both engines)."""
    bad = [t for t, _ in logit_bias if t >= vocab_size]
    if bad:
        raise InvalidRequest(f"logit_bias: token id {bad[0]} is outside the vocabulary [0, {vocab_size})", "logit_bias")


def reachable_stop_ids(params: SamplingParams, vocab_size: int) -> SamplingParams:
    """``params`` without the stop ids outside the vocabulary: they can never be generated, so they
    are accepted (as SGLang does) and dropped, since the stop set also bans its members from
    early positions by index (both engines)."""
    if any(t >= vocab_size for t in params.stop_token_ids):
        return params.replace(stop_token_ids=tuple(t for t in params.stop_token_ids if t < vocab_size))
    return params


def check_prompt_ids(ids: Sequence[int], vocab_size: int) -> None:
    """The vocabulary rule, the one check of it (the server's 400 names ``input_ids``; the
    block-diffusion client runs it too): a non-empty prompt of token ids in [0, vocab_size)."""
    V = vocab_size
    if not ids:
        raise InvalidRequest("the prompt is empty", "input_ids")
    # the common case at C speed (exact ints in range); anything else is looked at token by token
    if not (set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < V):
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or t < 0 or t >= V]
        if bad:
            raise InvalidRequest(f"token id {bad[0]!r} is outside the vocabulary [0, {V})", "input_ids")


def check_context(prompt_len: int, max_new_tokens: int, context_length: int, block: int = 1) -> None:
    """The context rule, the one check of it (SGLang's: prompt + max_new_tokens must fit the
    context; with ``block`` > 1, a model that runs whole blocks, that total rounded up to whole
    blocks). Names the field to change: ``prompt`` when it leaves no room, else ``max_new_tokens``.
    (The server shortens a budget the client left to its default before this: server/protocol.py
    ``fit_to_context``.)"""
    ctx = context_length
    if prompt_len > ctx:
        raise InvalidRequest(f"the prompt ({prompt_len} tokens) is longer than the context length {ctx}", "prompt")
    total = -(-(prompt_len + max_new_tokens) // block) * block
    if total <= ctx:
        return
    if prompt_len >= ctx:
        raise InvalidRequest(f"the prompt ({prompt_len} tokens) fills the whole context length {ctx}: no room is "
                             "left to generate; shorten the prompt", "prompt")
    blocks = f" in whole blocks of {block} ({total} tokens)" if block > 1 else ""
    raise InvalidRequest(f"prompt ({prompt_len} tokens) plus max_new_tokens ({max_new_tokens}){blocks} exceeds the "
                         f"context length {ctx}", "max_new_tokens")


def check_min_new_tokens(params: SamplingParams) -> None:
    """The ``min_new_tokens`` rule against the budget, the one check of it (SGLang's: in
    [0, max_new_tokens]; >= 0 is the parameter's own, in ``SamplingParams``). It runs here, where
    ``max_new_tokens`` is final, not when the parameters are built: a budget the client left to
    its default is filled, and shortened to the context, by the server first (server/protocol.py
    ``fit_to_context``), so an implicit one is judged as it will run."""
    if params.min_new_tokens > params.max_new_tokens:
        raise InvalidRequest(f"min_new_tokens must be in [0, max_new_tokens], got min_new_tokens "
                             f"{params.min_new_tokens} > max_new_tokens {params.max_new_tokens}", "min_new_tokens")


def validate_request(greq: GenerateRequest, limits: RequestLimits) -> ValidRequest:
    """Raise ValueError naming what is wrong (an :class:`InvalidRequest` with the field, for the
    rules the server's 400 names), else the request as the engine will run it."""
    ids, V = greq.input_ids, limits.vocab_size
    if not isinstance(greq.rid, str) or not greq.rid:
        raise ValueError(f"rid must be a non-empty string, got {greq.rid!r}")
    check_prompt_ids(ids, V)
    gen, ctx = limits.generation, limits.context_length
    params = greq.params.resolved(gen.sampling_defaults())
    fam = limits.family
    plan = DecodePlan.resolve(params, limits.decode, gen, fam)
    if plan.algorithm not in fam.algorithms:
        raise ValueError(f"dllm_algorithm: {plan.algorithm!r} is not an algorithm the loaded model's family "
                         f"({fam.family}) runs; it runs {', '.join(fam.algorithms)}")
    cap = plan.spec.max_steps_per_block
    if cap is not None and plan.steps_per_block > cap:
        raise ValueError(f"steps: the {plan.schedule} schedule ({plan.algorithm}) runs at most {cap} steps per "
                         f"block, got {plan.steps_per_block}")
    check_context(len(ids), params.max_new_tokens, ctx)
    check_min_new_tokens(params)
    if len(ids) + plan.gen_len > ctx:
        # SGLang refuses only prompt + max_new_tokens > context: the last block is cut short to fit
        plan = dataclasses.replace(plan, gen_len=ctx - len(ids))
    params = reachable_stop_ids(params, V)
    check_logprob_fields(greq)
    if greq.bicache_depth is not None and not 0 <= greq.bicache_depth <= limits.n_layers:
        raise InvalidRequest(f"bicache_depth must be in [0, {limits.n_layers}]", "bicache_depth")
    check_logit_bias(params.logit_bias, V)
    kv = sum(kv_lengths(len(ids), plan.gen_len, params.cfg_scale, greq.return_logprob, greq.logprob_start_len))
    if limits.kv_budget is not None and kv > limits.kv_budget:
        raise ValueError(f"the request needs K/V for {kv} positions, more than the engine's whole "
                         f"budget of {limits.kv_budget} (--max-total-tokens)")
    if params is not greq.params:
        greq = dataclasses.replace(greq, params=params)
    return ValidRequest(greq, plan, kv)
