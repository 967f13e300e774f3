"""The engine-side state of one request (:class:`Req`): its identity, its resources (private K/V
buffers, the cache grant) and its progress through the semi-autoregressive blocks, with
in-request cache refreshes (``scheduler.factory.RequestFactory`` validates submitted
requests and builds it). What callers submit and receive (GenerateRequest, RequestEvent) is in
``bicache_sgl.io_struct``.

How each step's positions are unmasked is the step schedule's denoiser
(``bicache_sgl.decoding.denoiser``: LLaDA's schedule, Dream's); the logits a decision is made on,
stop conditions, logprobs and text are ``decoding.sampling``, ``decoding.stop``,
``decoding.logprobs`` and ``decoding.text``; an output constraint is ``scheduler.structured``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from ..bicache.planner import RequestFacts, ReusePlan
from ..bicache.policy import request_mode
from ..bicache.segments import SegmentBoundaries
from ..constrained import Constraint, NoCompletion
from ..decoding import NEG_INF
from ..decoding.denoiser import make_denoiser
from ..decoding.logprobs import Logprobs
from ..decoding.plan import MAX_DREAM_STEPS, DecodePlan
from ..decoding.sampling import LogitsProcessor
from ..decoding.stop import StopRule
from ..decoding.text import Detokenizer
from ..io_struct import GenerateRequest, RequestEvent
from ..kv_cache.manager import CacheGrant
from ..kv_cache.store import Capture, SeqKV
from ..models.forward_batch import SeqWork
from .structured import StructuredOutput
from .validate import kv_lengths

__all__ = ["MAX_DREAM_STEPS", "DecodePlan", "Req"]


class Req:
    """Engine-thread state of one request: a sequence being denoised (``generates``), or a
    prefill-only request (max_new_tokens 0: one forward that fills the prefix cache, with input
    logprobs when asked for: a score)."""

    def __init__(self, greq: GenerateRequest, plan: DecodePlan, *, mask_id: int, eos_ids: tuple[int, ...],
                 logit_shift: int, tokenizer: Any, on_event: Callable[[RequestEvent], None] | None, seed: int,
                 constraint: Constraint | None = None, internal: bool = False,
                 segments: SegmentBoundaries | None = None) -> None:
        self.greq, self.plan = greq, plan
        self._segments = segments  # the engine's boundary tokens (None: the prefix span is not cut)
        self._boundaries: tuple[int, ...] | None = None  # the prompt's, found on the first admission
        self.rid = greq.rid
        self.params = p = greq.params.resolved()  # the factory has filled in the model's defaults
        self.prompt = list(greq.input_ids)
        self.prompt_len = len(self.prompt)
        # the prompt as the prefix index compares it (peeked every step while waiting): made once
        self.prompt_ids = np.asarray(self.prompt, dtype=np.int64)
        self.prompt_ids.flags.writeable = False  # the cache's capture contexts may keep it
        self.mask_id, self.shift, self.on_event = mask_id, logit_shift, on_event
        self.generates = plan.gen_len > 0  # else prefill-only: one forward, no output
        self.internal = internal  # the engine's own work (an output capture): no events, not in the stats
        self.created = time.perf_counter()
        # input logprobs: a prefill-only request with logprobs is a score, whatever its start
        self.needs_score = greq.return_logprob and (not self.generates or greq.logprob_start_len >= 0)
        self.generator = torch.Generator().manual_seed(p.seed if p.seed is not None else seed)
        # how it decodes: the family's schedule, the logits a decision is made on, where the output
        # ends, its logprobs; structured generation (docs/structured.md): the compiled constraint
        # (shared, immutable) and the automaton state after the committed blocks
        self.denoiser = make_denoiser(plan, p, mask_id)
        self.logits_processor = LogitsProcessor(p, self.prompt, min(plan.gen_len, p.max_new_tokens),
                                                mask_id=mask_id, eos_ids=tuple(eos_ids))
        detok = Detokenizer(tokenizer, p.skip_special_tokens)
        self.stops = StopRule(p, tuple(eos_ids), plan.gen_len, detok, constraint)
        self.logprobs = Logprobs(greq.top_logprobs_num, detok, greq.return_text_in_logprobs)
        self.structured = StructuredOutput(constraint, p) if constraint is not None else None
        # which profile table serves it: "stop" only when nothing forces its answer past EOS
        self.gen_mode = request_mode(p, eos_ids, constrained=constraint is not None)
        # resources, set at admission (:meth:`admit`)
        self.kv: SeqKV | None = None
        self.uncond: tuple[torch.Tensor, SeqKV] | None = None  # classifier-free guidance: (tokens, K/V)
        self.score_kv: SeqKV | None = None  # the input-logprob probe
        self.grant = CacheGrant()  # the cache manager's grant at admission: reuse plan, locks, capture
        self.served_exact = False  # audited: continued from the no-reuse forward (answer == cache off)
        # progress: the sequence [prompt_len + gen_len] (masks where not decided yet), the block
        # and its step, the final (whole-block) output
        self.seq_len = self.prompt_len + plan.gen_len
        self.x = torch.tensor(self.prompt + [mask_id] * plan.gen_len, dtype=torch.long)
        self._xn = self.x.numpy()  # the same memory (x is a CPU tensor): host-side reads and writes
        self.block = 0
        self.step_in_block = 0
        self.final_len = 0  # generated positions that are final (whole blocks)
        self.out_ids: list[int] = []
        self.text = ""
        self.finished = False
        self.finish_reason: dict | None = None
        self.error: str | None = None
        self._pending: np.ndarray = np.zeros(0, dtype=np.int64)  # masked positions the planned forward decides
        self._unmasked_last: np.ndarray = np.zeros(0, dtype=np.int64)  # positions the last forward unmasked
        # accounting
        self.forward_passes = 0
        self.tokens_computed = 0
        self.computed_layer_tokens = 0
        self.skipped_layer_tokens = 0
        self.reuse_forwards = 0  # forwards that read the reused span (skipped layer-tokens in them)

    def reseed(self, seed: int) -> None:
        """The engine's per-request seed (requests without ``sampling_params.seed``)."""
        self.generator = torch.Generator().manual_seed(seed)

    @property
    def constraint(self) -> Constraint | None:
        """The request's compiled output constraint (None: unconstrained)."""
        return self.structured.constraint if self.structured is not None else None

    # ------------------------------------------------------------------------------ buffers
    @property
    def choice(self) -> ReusePlan:
        """What this request reuses (the planner's decision; no reuse once served exact)."""
        return self.grant.plan

    @property
    def capture_len(self) -> int:
        """Positions of the forward that captures this request's prefix state (its context)."""
        return self.seq_len if self.generates else self.prompt_len

    def facts(self) -> RequestFacts:
        """What the planner needs to know about this request."""
        # an output capture (internal) may reuse its own prompt's rows: its result is only state
        exact = self.exact and not self.internal
        return RequestFacts(self.prompt_len, self.capture_len, self.greq.bicache_depth, exact, self.gen_mode,
                            boundaries=self.boundaries)

    @property
    def boundaries(self) -> tuple[int, ...] | None:
        """The prompt's segment boundaries (bicache/segments.py), where its reused span may end;
        None when the engine does not cut the span."""
        if self._segments is None:
            return None
        if self._boundaries is None:
            self._boundaries = self._segments.positions(self.prompt_ids)
        return self._boundaries

    @property
    def exact(self) -> bool:
        """Likelihood scoring and prefill-only requests reuse no prefix state (exact results)."""
        return not self.generates

    def kv_lengths(self) -> list[int]:
        """Positions of each private K/V buffer this request needs: the sequence itself, its
        classifier-free-guidance shadow, its likelihood probe."""
        return kv_lengths(self.prompt_len, self.plan.gen_len, self.params.cfg_scale, self.greq.return_logprob,
                          self.greq.logprob_start_len)

    @property
    def kv_tokens(self) -> int:
        """Private K/V positions (all layers) this request holds while it runs: its memory cost."""
        return sum(self.kv_lengths())

    def admit(self, kvs: Sequence[SeqKV], grant: CacheGrant) -> None:
        """What admission gives: the private K/V buffers :meth:`kv_lengths` lists, in that order
        (the scheduler allocates them from the pool), and the cache manager's ``grant`` (reuse
        plan, locks, capture). The request holds them until the scheduler retires it
        (:meth:`detach_kv`, ``CacheManager.release``)."""
        self.grant = grant
        it = iter(kvs)
        self.kv = next(it)
        if self.generates and self.params.cfg_scale > 0:
            x_un = self.x.clone()
            x_un[:self.prompt_len] = self.mask_id
            self.uncond = (x_un, next(it))
        if self.needs_score:
            self.score_kv = next(it)

    def detach_kv(self) -> list[SeqKV]:
        """Every private K/V buffer this request holds, now let go: the scheduler gives them back
        to the pool."""
        kvs = [kv for kv in (self.kv, self.uncond[1] if self.uncond else None, self.score_kv) if kv is not None]
        self.kv = self.uncond = self.score_kv = None
        return kvs

    def continue_exact(self, kv: SeqKV) -> SeqKV:
        """Continue from an exact first forward computed on ``kv`` (the online audit's shadow,
        bicache/audit.py): ``kv`` becomes this request's K/V and later forwards reuse nothing, so
        its answer equals cache off's. Returns the K/V it leaves (the audit gives it back)."""
        left, self.kv = self.kv, kv
        self.grant.give_up_reuse()
        self.served_exact = True
        return left

    # ---------------------------------------------------------------------------------- planning
    @property
    def block_range(self) -> tuple[int, int]:
        """The current block's positions [start, end) in the sequence."""
        s = self.prompt_len + self.block * self.plan.block_length
        return s, min(s + self.plan.block_length, self.seq_len)

    def plan_step(self, n_layers: int) -> list[SeqWork]:
        """The sequences this request contributes to the next batched forward."""
        works: list[SeqWork] = []
        if not self.generates:
            works.append(self._prefill_work())
            if self.needs_score:
                works.append(self._score_work())
            return works
        block = self.block_range
        masked = block[0] + np.flatnonzero(self._xn[block[0]:block[1]] == self.mask_id)
        refresh = self.plan.refreshes(self.step_in_block)
        positions = self.plan.step_positions(refresh, block, self.seq_len, self.shift, masked, self._unmasked_last)
        self.denoiser.plan_forward(len(masked), self.step_in_block == 0, self.generator)
        self._pending = masked
        own = self._own_work(positions, masked - self.shift, reuse=refresh, capture=self.grant.capture)
        works.append(own)
        if self.uncond is not None:
            x_un, kv_un = self.uncond
            x_un[self.prompt_len:] = self.x[self.prompt_len:]
            works.append(SeqWork(kv_un, x_un, positions, masked - self.shift))
        if self.needs_score and self.forward_passes == 0:
            works.append(self._score_work())
        self._count(positions, own.depth, own.skip, n_layers)
        return works

    def _own_work(self, positions: np.ndarray, logit_positions: np.ndarray, *, reuse: bool,
                  capture: Capture | None) -> SeqWork:
        """This request's own sequence, reusing the planned span when ``reuse`` (its refresh
        forwards; the span's rows are the pool's, the rest its private ones)."""
        plan = self.choice
        skip = plan.reused if reuse else 0
        return SeqWork(self.kv, self.x, positions, logit_positions, depth=plan.depth if reuse else 0, skip=skip,
                       skip_from=plan.start, resume_rows=self.grant.resume_rows if skip else None, capture=capture)

    def _prefill_work(self) -> SeqWork:
        # the plan reuses nothing unless this is an output capture (facts(): exact otherwise)
        return self._own_work(np.arange(self.prompt_len, dtype=np.int64), np.zeros(0, dtype=np.int64), reuse=True,
                              capture=self.grant.capture)

    def _score_work(self) -> SeqWork:
        """Input likelihoods: the prompt with its scored positions masked together, on its own
        buffer (``decoding.logprobs``)."""
        x, targets = self.logprobs.plan_input(self.x[:self.prompt_len], self.greq.logprob_start_len, self.mask_id)
        return SeqWork(self.score_kv, x, np.arange(self.prompt_len, dtype=np.int64), targets - self.shift)

    def _count(self, positions: np.ndarray, depth: int, skip: int, n_layers: int) -> None:
        self.forward_passes += 1
        self.tokens_computed += len(positions)
        self.computed_layer_tokens += len(positions) * n_layers - skip * depth
        self.skipped_layer_tokens += skip * depth
        self.reuse_forwards += skip * depth > 0

    # ----------------------------------------------------------------------------------- results
    @property
    def greedy_threshold(self) -> bool:
        """Whether this step's decision is the plain greedy one that ``decoding.decide_greedy``
        makes for many requests at once: a threshold step of an algorithm whose spec allows it
        (``AlgorithmSpec.batch_greedy``: ``low_confidence``) at temperature 0 with no
        filtering, bias, penalty, early ban, constraint, logprobs or guidance (the server's
        default sampling). Its processed logits are then the forward's with the mask (and with
        ``ignore_eos`` the end ids) banned. The scheduler batches only requests with one sequence
        in the forward (not an audited first forward, which carries a shadow)."""
        p = self.params
        return (self.generates and self.plan.spec.batch_greedy
                and bool(self.plan.threshold) and p.temperature <= 0 and p.top_k <= 0 and p.top_p >= 1.0
                and p.min_p <= 0 and not p.logit_bias and not self.logits_processor.penalized
                and (p.ignore_eos or p.min_new_tokens <= 0) and self.structured is None
                and not self.greq.return_logprob and self.uncond is None)

    @property
    def banned_ids(self) -> tuple[int, ...]:
        """The ids a greedy-threshold step bans on every position (see ``greedy_threshold``)."""
        return self.logits_processor.suppress_ids if self.params.ignore_eos else (self.mask_id,)

    def apply(self, logits: list[torch.Tensor], n_layers: int,
              decision: tuple[torch.Tensor, torch.Tensor] | None = None) -> bool:
        """Consume this request's logits (one tensor per SeqWork it planned). ``decision``: the
        (tokens, confidence) the scheduler already made for this step's masked positions, for a
        ``greedy_threshold`` request (CPU tensors). Returns True when a block became final (an
        event should be emitted)."""
        if decision is not None:
            return self._transfer(None, decision)
        if not self.generates:
            self.forward_passes += 1
            self.tokens_computed += self.prompt_len
            self.computed_layer_tokens += self.prompt_len * n_layers
            if len(logits) > 1:
                self.logprobs.record_input(logits[1], self.prompt)
            self.final_len = 0
            self._finish({"type": "length", "length": 0})
            return True
        lg = logits[0]
        k = 1
        if self.uncond is not None:
            lg = self.denoiser.guide(lg, logits[k])
            k += 1
        if len(logits) > k:
            self.logprobs.record_input(logits[k], self.prompt)
        return self._transfer(lg)

    def _transfer(self, lg: torch.Tensor | None, decision: tuple[torch.Tensor, torch.Tensor] | None = None) -> bool:
        """Unmask this step's positions from the logits [n_masked, V] of the block's masked
        positions (or from the scheduler's ``decision``); at the block's end commit it and check
        the stop conditions."""
        d = self.denoiser
        bs, be = self.block_range
        if decision is not None:
            x0, conf = decision
        else:
            lg = self.logits_processor(lg, self.x, self._pending, ban_mask=d.bans_mask)
            if self.structured is not None:
                try:
                    x0, conf, lp = self.structured.decide(lg, self.x[bs:be], self.mask_id, d, self.generator)
                except NoCompletion as e:
                    self._finish(self.structured.no_completion(str(e), self.final_len))
                    return True
            else:
                x0, conf, lp = d.decide(lg, self.generator)
        # under a constraint every x0 is the DP path's token: the threshold (or the schedule)
        # picks which of the path's positions to unmask
        chosen = d.select(conf, self.generator).cpu()
        pos = self._pending[chosen.numpy()]
        self._xn[pos] = x0[chosen].cpu().numpy()
        self._unmasked_last = pos
        if self.greq.return_logprob:
            if not d.bans_mask:  # the mask token is never an output: not in the logprobs' distribution
                lg[:, self.mask_id] = NEG_INF
            self.logprobs.record_output(lg, chosen, lp, self._pending)
        if (self._xn[bs:be] == self.mask_id).any():
            self.step_in_block += 1
            d.next_step()
            return False
        self.block += 1
        self.step_in_block = 0
        self.final_len = be - self.prompt_len
        if self.structured is not None:
            reason = self.structured.advance(self.x[bs:be])
            if reason is not None:
                self._finish(reason)
                return True
        self._check_stop()
        return True

    def _check_stop(self) -> None:
        """The final output changed: its ids and text, and whether it ended."""
        gen = self.x[self.prompt_len:self.prompt_len + self.final_len].tolist()
        self.out_ids, self.text, reason = self.stops.check(gen)
        if reason is not None:
            if self.structured is not None:
                reason = self.structured.finished(self.out_ids, reason)
            self._finish(reason)

    def _finish(self, reason: dict) -> None:
        self.finished = True
        self.finish_reason = reason

    def fail(self, message: str, kind: str = "abort") -> None:
        """End the request with ``message`` (``kind`` "error": an internal error, reported as one)."""
        self.error = message if kind == "error" else None
        self._finish({"type": "abort", "message": message})

    # ----------------------------------------------------------------------------------- events
    def reused_by_depth(self) -> dict[int, int]:
        """Matched prompt tokens per depth they were served at: the reused span at its depth, the
        rest of the match at 0 (computed in full). Empty without a match; an audited request
        (answered from its exact forward) reused nothing."""
        c = self.choice
        reused = c.reused if c.depth else 0
        out: dict[int, int] = {c.depth: reused} if reused else {}
        if c.matched > reused:
            out[0] = c.matched - reused
        return out

    def meta_info(self) -> dict[str, Any]:
        """SGLang's meta_info of the request so far: usage, finish reason, the cache fields,
        logprobs when asked for. ``bicache_depth`` is the depth MOST of the matched tokens were
        served at (0 when most of the match was computed in full); ``reused_tokens_by_depth``
        the whole split (docs/prefix_cache.md, "What a request reports")."""
        c = self.choice
        by_depth = self.reused_by_depth()
        reused = c.reused if c.depth else 0
        m = {
            "id": self.rid,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_len,
            "completion_tokens": len(self.out_ids),
            "cached_tokens": c.matched,
            "bicache_depth": c.depth if 2 * reused > c.matched else 0,
            "reused_tokens_by_depth": {str(d): n for d, n in sorted(by_depth.items(), reverse=True)},
            "prefix_fraction": round(c.prefix_fraction, 6),
            "reused_prefix_tokens": c.reused,
            "reused_prefix_start": c.start,
            "bicache_audited": self.served_exact,
            "skipped_layer_tokens": self.skipped_layer_tokens,
            "computed_layer_tokens": self.computed_layer_tokens,
            "reuse_forwards": self.reuse_forwards,
            "forward_passes": self.forward_passes,
            "tokens_computed": self.tokens_computed,
            "e2e_latency": time.perf_counter() - self.created,
        }
        if self.greq.return_logprob:
            m.update(self.logprobs.meta(self.prompt_len, self.out_ids))
        return m

    def event(self) -> RequestEvent:
        """Every event carries the whole meta_info so far (logprobs of everything decoded, the
        cache fields), as SGLang puts every field in every streamed frame."""
        return RequestEvent(self.rid, self.text, list(self.out_ids), self.finished, self.finish_reason,
                            self.meta_info(), self.error)

