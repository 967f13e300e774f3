"""The engine-side state machine of one request (Req): semi-autoregressive blocks, denoising
steps, in-request cache refreshes, stop conditions, logprobs. What callers submit and receive
(GenerateRequest, RequestEvent) is in ``bicache_sgl.io_struct``.

Two families of unmasking algorithms share the block loop (docs/server.md, "Dream's generation
algorithms"):

- LLaDA's (``low_confidence``, ``random``): each block's steps unmask an even share of its
  masked positions (``num_transfer_schedule``), the most confident by the algorithm;
- Dream's (``origin``, ``maskgit_plus``, ``topk_margin``, ``entropy``): each block runs Dream's
  timestep schedule over its steps (``bicache_sgl.decoding.dream``). A step that would unmask
  nothing (``int(n * (1 - s / t)) == 0``, or no ``origin`` draw) is skipped without a forward:
  it changes nothing, and the next step's schedule is computed as the reference computes it.
  With one block over the whole region, no in-request cache and no threshold, a greedy run is
  the reference's ``diffusion_generate``.

Threshold decoding (``threshold`` > 0) replaces either schedule: every masked position of the
block whose confidence reaches it, at least the most confident one (Dream's ``entropy`` compares
``exp(-entropy)``; ``origin`` has no confidence and keeps its own schedule).
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..bicache.planner import RequestFacts, ReusePlan
from ..config import DEFAULT_EPS, DREAM_ALGORITHMS, REMASKING, DecodeDefaults, SamplingParams
from ..constrained import Constraint, ConstraintError, NoCompletion, compile_constraint, constrained_decide
from ..decoding import (
    NEG_INF,
    apply_logit_bias,
    apply_penalties,
    decide,
    dream_confidence,
    dream_decide,
    dream_next_transfer,
    dream_origin_draw,
    dream_probs,
    dream_select,
    dream_timesteps,
    num_transfer_schedule,
    select_transfer,
    threshold_score,
    token_counts,
)
from ..io_struct import GenerateRequest, RequestEvent
from ..kv_cache.manager import CacheGrant
from ..kv_cache.store import Capture, SeqKV
from ..models.config import ModelConfig
from ..models.forward_batch import SeqWork
from ..models.loader import GenerationDefaults, generation_defaults

# Dream's schedule may have more steps than tokens (the extra ones unmask nothing and cost no
# forward, but their timesteps are kept and walked): a bound on that bookkeeping
MAX_DREAM_STEPS = 1 << 16


def _first(*values: Any) -> Any:
    return next(v for v in values if v is not None)


@dataclass(frozen=True)
class DecodePlan:
    """A request's resolved diffusion settings."""

    gen_len: int  # generation region (whole blocks; the last one clipped to fit the context)
    block_length: int
    steps_per_block: int
    threshold: float | None
    remasking: str  # LLaDA's algorithm, or the confidence a constraint reports for Dream's
    cache_mode: str
    refresh_interval: int
    algorithm: str = "low_confidence"  # config.ALGORITHMS
    eps: float = DEFAULT_EPS  # Dream's last timestep
    alg_temp: float = 0.0  # Dream's position sampling temperature (0: the most confident)
    step_rows: str = "block"  # config.STEP_ROWS: what a dual-cache block step computes

    @property
    def dream(self) -> bool:
        """Dream's timestep schedule (``origin``, ``maskgit_plus``, ``topk_margin``, ``entropy``)."""
        return self.algorithm in DREAM_ALGORITHMS

    @classmethod
    def resolve(cls, p: SamplingParams, d: DecodeDefaults, g: GenerationDefaults | None = None) -> "DecodePlan":
        """Each knob from, in order: the request, the server (``d``), the checkpoint's
        generation_config.json (``g``), the built-in default."""
        g = g or GenerationDefaults()
        block = p.block_length or d.block_length
        alg = p.dllm_algorithm or p.remasking or d.algorithm or g.algorithm or d.remasking
        remasking = alg if alg in REMASKING else "low_confidence"
        cache_mode = p.cache_mode or d.cache_mode
        step_rows = p.step_rows or d.step_rows
        if step_rows != "block" and cache_mode != "dual":
            raise ValueError(f"step_rows {step_rows!r} needs cache_mode 'dual' (got {cache_mode!r})")
        knobs = {"algorithm": alg, "eps": _first(p.eps, d.eps, g.eps, DEFAULT_EPS),
                 "alg_temp": _first(p.alg_temp, d.alg_temp, g.alg_temp, 0.0), "step_rows": step_rows}
        if p.max_new_tokens <= 0:
            return cls(0, block, 1, None, remasking, cache_mode, 0, **knobs)
        n_blocks = -(-p.max_new_tokens // block)
        gen = n_blocks * block
        if p.steps_per_block:
            spb = p.steps_per_block
        elif p.steps:
            spb = max(1, p.steps // n_blocks)
        elif d.steps_per_block:
            spb = d.steps_per_block
        elif g.steps:
            spb = max(1, g.steps // n_blocks)
        else:
            spb = block
        if alg not in DREAM_ALGORITHMS:
            spb = min(spb, block)  # Dream's schedule may have more steps than tokens (steps that unmask none)
        thr = p.threshold if p.threshold is not None else d.threshold
        return cls(gen, block, spb, thr if thr else None, remasking, cache_mode,
                   p.refresh_interval if p.refresh_interval is not None else d.refresh_interval, **knobs)


class Req:
    """Engine-thread state of one request. Kinds: ``generate``; ``prefill`` (max_new_tokens 0:
    one forward that fills the prefix cache); ``score`` (prefill with input logprobs)."""

    def __init__(self, greq: GenerateRequest, plan: DecodePlan, *, mask_id: int, eos_ids: tuple[int, ...],
                 logit_shift: int, tokenizer, on_event: Callable[[RequestEvent], None] | None, seed: int,
                 constraint: Constraint | None = None) -> None:
        self.greq, self.plan = greq, plan
        self.rid = greq.rid or uuid.uuid4().hex
        self.params = greq.params.resolved()  # the factory has filled in the model's defaults
        self.prompt = list(greq.input_ids)
        self.prompt_len = len(self.prompt)
        self.mask_id, self.shift, self.tokenizer, self.on_event = mask_id, logit_shift, tokenizer, on_event
        self.eos_ids = () if self.params.ignore_eos else tuple(eos_ids)
        self.suppress_ids = tuple(eos_ids) + (mask_id,)
        self.stop_ids = set(self.params.stop_token_ids)
        if plan.gen_len == 0:
            self.kind = "score" if greq.return_logprob else "prefill"
        else:
            self.kind = "generate"
        self.seq_len = self.prompt_len + plan.gen_len
        self.x = torch.tensor(self.prompt + [mask_id] * plan.gen_len, dtype=torch.long)
        self.generator = torch.Generator().manual_seed(self.params.seed if self.params.seed is not None else seed)
        self.created = time.perf_counter()
        self.needs_score = self.kind == "score" or (greq.return_logprob and greq.logprob_start_len >= 0)
        # structured generation (docs/structured.md): the compiled constraint (shared, immutable)
        # and the automaton state after the committed blocks
        self.constraint = constraint
        self.cstate = constraint.start(self.params.max_new_tokens) if constraint is not None else None
        p = self.params
        self._penalized = p.frequency_penalty != 0 or p.presence_penalty != 0 or p.repetition_penalty != 1
        self._prompt_ids = torch.unique(torch.tensor(self.prompt, dtype=torch.long)) \
            if p.repetition_penalty != 1 else None
        # set at admission
        self.kv: SeqKV | None = None
        self.uncond: tuple[torch.Tensor, SeqKV] | None = None
        self.cache = CacheGrant()
        # online audit: a no-reuse shadow of the first forward (transient, not in kv_lengths)
        self.audit_kv: SeqKV | None = None
        self.auditing = False  # the next forward carries the audit shadow
        # (r, depth, reused logits, exact logits) of the audited first forward, for the audit
        self.audit_pair: tuple[float, int, torch.Tensor, torch.Tensor] | None = None
        self.served_exact = False  # audited: continued from the no-reuse forward (answer == cache off)
        self.internal = False  # the engine's own work (an output capture): no events, not in the stats
        # decoding progress
        self.block = 0
        self.step_in_block = 0
        self.schedule: list[int] = []
        # Dream's schedule: the block's timesteps, the timestep index (steps that unmask nothing
        # are skipped without a forward), what the planned step unmasks: a count of the most
        # confident (``_k``), or for ``origin`` the drawn rows of ``_pending`` (``_drawn``)
        self.timesteps: torch.Tensor | None = None
        self.tstep = 0
        self._k = 0
        self._drawn: torch.Tensor | None = None
        self.final_len = 0  # generated positions that are final (whole blocks)
        self.out_ids: list[int] = []
        self.text = ""
        self.finished = False
        self.finish_reason: dict | None = None
        self.error: str | None = None
        # logprobs: position -> (logprob, [(lp, id), ...])
        self.out_logprobs: dict[int, tuple[float, list[tuple[float, int]]]] = {}
        self.input_logprobs: list[tuple[float | None, int, list[tuple[float, int]] | None]] | None = None
        self._pending: np.ndarray = np.zeros(0, dtype=np.int64)
        self._unmasked_last: np.ndarray = np.zeros(0, dtype=np.int64)  # positions the last forward unmasked
        self._score_pending: tuple[np.ndarray, np.ndarray] | None = None
        self.score_kv: SeqKV | None = None
        # accounting
        self.forward_passes = 0
        self.tokens_computed = 0
        self.computed_layer_tokens = 0
        self.skipped_layer_tokens = 0

    def reseed(self, seed: int) -> None:
        """The engine's per-request seed (requests without ``sampling_params.seed``)."""
        self.generator = torch.Generator().manual_seed(seed)

    # ------------------------------------------------------------------------------ buffers
    @property
    def choice(self) -> ReusePlan:
        """What this request reuses (the planner's decision; no reuse once served exact)."""
        return self.cache.plan

    @property
    def capture_len(self) -> int:
        """Positions of the forward that captures this request's prefix state (its context)."""
        return self.seq_len if self.kind == "generate" else self.prompt_len

    def facts(self) -> RequestFacts:
        """What the planner needs to know about this request."""
        # an output capture (internal) may reuse its own prompt's rows: its result is only state
        exact = self.exact and not self.internal
        return RequestFacts(self.prompt_len, self.capture_len, self.greq.bicache_depth, exact)

    @property
    def exact(self) -> bool:
        """Likelihood scoring and prefill-only requests reuse no prefix state (exact results)."""
        return self.kind != "generate"

    def kv_lengths(self) -> list[int]:
        """Positions of each private K/V buffer this request needs: the sequence itself, its
        classifier-free-guidance shadow, its likelihood probe."""
        n = [self.seq_len if self.kind == "generate" else self.prompt_len]
        if self.kind == "generate" and self.params.cfg_scale > 0:
            n.append(self.seq_len)
        if self.needs_score:
            n.append(self.prompt_len)
        return n

    @property
    def kv_tokens(self) -> int:
        """Private K/V positions (all layers) this request holds while it runs: its memory cost."""
        return sum(self.kv_lengths())

    def allocate(self, alloc: Callable[[int], SeqKV]) -> None:
        """Allocate the private K/V buffers listed by :meth:`kv_lengths`."""
        self.kv = alloc(self.kv_lengths()[0])
        if self.kind == "generate" and self.params.cfg_scale > 0:
            x_un = self.x.clone()
            x_un[:self.prompt_len] = self.mask_id
            self.uncond = (x_un, alloc(self.seq_len))
        if self.needs_score:
            self.score_kv = alloc(self.prompt_len)

    def free_buffers(self, free: Callable[[SeqKV], None]) -> None:
        """Give every private K/V buffer back (``free``: the pool's)."""
        for kv in (self.kv, self.uncond[1] if self.uncond else None, self.score_kv, self.audit_kv):
            if kv is not None:
                free(kv)
        self.kv = self.uncond = self.score_kv = self.audit_kv = None

    # ---------------------------------------------------------------------------------- planning
    @property
    def block_range(self) -> tuple[int, int]:
        s = self.prompt_len + self.block * self.plan.block_length
        return s, min(s + self.plan.block_length, self.seq_len)

    def _needs_refresh(self) -> bool:
        p = self.plan
        if p.cache_mode == "none" or self.step_in_block == 0:
            return True
        return p.refresh_interval > 0 and self.step_in_block % p.refresh_interval == 0

    def plan_step(self, n_layers: int) -> list[SeqWork]:
        """The sequences this request contributes to the next batched forward."""
        works: list[SeqWork] = []
        if self.kind != "generate":
            works.append(self._prefill_work())
            if self.needs_score:
                works.append(self._score_work())
            return works
        N = self.seq_len
        bs, be = self.block_range
        refresh = self._needs_refresh()
        if refresh:
            positions = np.arange(N, dtype=np.int64)
        elif self.plan.cache_mode == "prefix":
            positions = np.arange(bs - self.shift, N, dtype=np.int64)
        else:  # dual: the block only (Dream also needs the row before it for the shifted logits)
            positions = np.arange(bs - self.shift, be, dtype=np.int64)
        in_block = self.x[bs:be]
        masked = bs + np.nonzero((in_block == self.mask_id).numpy())[0]
        if not refresh and self.plan.step_rows == "active":
            # Only rows whose K/V can still change: the masked positions (and, for Dream, the row
            # before each, which gives its logits) and the positions unmasked by the previous
            # forward, computed once more with their token in place. Every other block row keeps
            # the K/V it was last computed with (an approximation: they no longer see later unmasks).
            positions = np.union1d(np.union1d(masked, masked - self.shift), self._unmasked_last)
        if self.step_in_block == 0:
            if self.plan.dream:
                self.timesteps = dream_timesteps(self.plan.steps_per_block, self.plan.eps)
                self.tstep = 0
            else:
                self.schedule = num_transfer_schedule(len(masked), self.plan.steps_per_block)
        if self.plan.dream:
            self._plan_dream(len(masked))
        self._pending = masked
        # an audited forward captures from its exact shadow: stored rows are then this request's own
        # context whatever the audit finds
        own = self._own_work(positions, masked - self.shift, reuse=refresh,
                             capture=None if self.auditing else self.cache.capture)
        works.append(own)
        if self.uncond is not None:
            x_un, kv_un = self.uncond
            x_un[self.prompt_len:] = self.x[self.prompt_len:]
            works.append(SeqWork(kv_un, x_un, positions, masked - self.shift))
        if self.needs_score and self.forward_passes == 0:
            works.append(self._score_work())
        if self.auditing:  # first forward only: the same positions without reuse
            works.append(SeqWork(self.audit_kv, self.x, positions, masked - self.shift, capture=self.cache.capture))
        self._count(positions, own.depth, own.skip, n_layers)
        return works

    def _own_work(self, positions: np.ndarray, logit_positions: np.ndarray, *, reuse: bool,
                  capture: Capture | None) -> SeqWork:
        """This request's own sequence, reusing the planned span when ``reuse`` (its refresh
        forwards; the span's rows are the pool's, the rest its private ones)."""
        plan = self.choice
        skip = plan.reused if reuse else 0
        return SeqWork(self.kv, self.x, positions, logit_positions, depth=plan.depth if reuse else 0, skip=skip,
                       skip_from=plan.start, resume_rows=self.cache.resume_rows if skip else None, capture=capture)

    def _plan_dream(self, n: int) -> None:
        """Dream's schedule for the next forward: skip the steps that unmask nothing, then keep
        what this one unmasks (``origin``: its draw over the ``n`` masked positions, in order)."""
        self._drawn = None
        if self.plan.algorithm == "origin":
            while True:
                drawn = dream_origin_draw(n, self.tstep, self.timesteps, self.generator)
                if bool(drawn.any()) or n == 0 or self.tstep >= len(self.timesteps) - 2:
                    break
                self.tstep += 1
            self._drawn = drawn.nonzero()[:, 0]
        elif self.plan.threshold is None:
            self.tstep, self._k = dream_next_transfer(n, self.tstep, self.timesteps)

    def _prefill_work(self) -> SeqWork:
        # the plan reuses nothing unless this is an output capture (facts(): exact otherwise)
        return self._own_work(np.arange(self.prompt_len, dtype=np.int64), np.zeros(0, dtype=np.int64), reuse=True,
                              capture=self.cache.capture)

    def _score_work(self) -> SeqWork:
        """Input likelihoods (docs/server.md, "Logprobs for a diffusion model"): mask positions
        [s, n) together and read log p(token_i | unmasked rest) for each in one forward."""
        n = self.prompt_len
        start = self.greq.logprob_start_len
        if start < 0:  # prefill-only with return_logprob and no start: every position
            start = 0
        s = max(start, 1)
        x = self.x[:n].clone()
        x[s:n] = self.mask_id
        targets = np.arange(s, n, dtype=np.int64)
        self._score_pending = (np.arange(start, n, dtype=np.int64), targets)
        return SeqWork(self.score_kv, x, np.arange(n, dtype=np.int64), targets - self.shift)

    def _count(self, positions: np.ndarray, depth: int, skip: int, n_layers: int) -> None:
        self.forward_passes += 1
        self.tokens_computed += len(positions)
        self.computed_layer_tokens += len(positions) * n_layers - skip * depth
        self.skipped_layer_tokens += skip * depth

    # ----------------------------------------------------------------------------------- results
    def apply(self, logits: list[torch.Tensor], n_layers: int) -> bool:
        """Consume this request's logits (one tensor per SeqWork it planned). Returns True when a
        block became final (an event should be emitted)."""
        if self.kind != "generate":
            self.forward_passes += 1
            self.tokens_computed += self.prompt_len
            self.computed_layer_tokens += self.prompt_len * n_layers
            if len(logits) > 1:
                self._apply_score(logits[1])
            self.final_len = 0
            self._finish({"type": "length", "length": 0})
            return True
        if self.auditing:
            # The audited request continues from the exact forward (its answer equals cache off):
            # its logits and its K/V become the shadow's, and later forwards reuse nothing.
            plan = self.choice
            self.audit_pair = (plan.r, plan.depth, logits[0], logits[-1])
            logits = [logits[-1], *logits[1:-1]]
            self.kv, self.audit_kv = self.audit_kv, self.kv
            self.cache.plan = plan.without_reuse()
            self.auditing, self.served_exact = False, True
        lg = logits[0]
        k = 1
        if self.uncond is not None:
            un = logits[k]
            k += 1
            lg = un + (self.params.cfg_scale + 1.0) * (lg - un)
        if len(logits) > k:
            self._apply_score(logits[k])
        return self._transfer(lg)

    def _process_logits(self, lg: torch.Tensor, ban_mask: bool = True) -> torch.Tensor:
        """The logits the decision is made on (a new tensor): logit bias, penalties, then the bans
        (the mask id, unless ``ban_mask`` is False: Dream's algorithms keep it in the distribution
        their confidence is computed on, and exclude it from the decision themselves; EOS with
        ignore_eos, or before min_new_tokens)."""
        p = self.params
        lg = apply_logit_bias(lg, p.logit_bias) if p.logit_bias else lg.clone()
        if self._penalized:
            lg = apply_penalties(lg, *self._penalty_state(lg.shape[-1]), frequency_penalty=p.frequency_penalty,
                                 presence_penalty=p.presence_penalty, repetition_penalty=p.repetition_penalty)
        if ban_mask:
            lg[:, self.mask_id] = NEG_INF
        if p.ignore_eos:
            lg[:, list(self.suppress_ids)] = NEG_INF
        elif p.min_new_tokens > 0:
            early = torch.from_numpy(self._pending - self.prompt_len < p.min_new_tokens)
            if early.any():
                rows = early.nonzero()[:, 0]
                ban = list(self.suppress_ids) + sorted(self.stop_ids)
                lg[rows[:, None], torch.tensor(ban)[None, :]] = NEG_INF
        return lg

    def _penalty_state(self, V: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(counts [V] of the output tokens unmasked so far, seen [V] for the repetition penalty).
        The output region is the first max_new_tokens positions; the mask and EOS (padding) are
        not counted."""
        s = self.prompt_len
        out = self.x[s:s + min(self.plan.gen_len, self.params.max_new_tokens)]
        counts = token_counts(out, V, self.suppress_ids)
        seen = None
        if self._prompt_ids is not None:
            seen = counts > 0
            ids = self._prompt_ids[self._prompt_ids < V]
            seen[ids] = True
        return counts, seen

    def _transfer(self, lg: torch.Tensor) -> bool:
        p, plan = self.params, self.plan
        lg = self._process_logits(lg, ban_mask=not plan.dream)
        bs, be = self.block_range
        if self.constraint is not None:
            try:
                x0, conf, lp = self._decide_constrained(lg, bs, be)
            except NoCompletion as e:
                self._no_completion(str(e))
                return True
        elif plan.algorithm == "origin":  # only the drawn positions are decided, as in the reference
            rows = self._drawn
            x0 = torch.zeros(len(self._pending), dtype=torch.long)
            conf = torch.zeros(len(self._pending))
            lp = torch.zeros(len(self._pending))
            if len(rows):
                x0[rows], conf[rows], lp[rows] = dream_decide(
                    lg[rows], algorithm="origin", temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                    min_p=p.min_p, mask_id=self.mask_id, generator=self.generator)
        elif plan.dream:
            x0, conf, lp = dream_decide(lg, algorithm=plan.algorithm, temperature=p.temperature, top_k=p.top_k,
                                        top_p=p.top_p, min_p=p.min_p, mask_id=self.mask_id, generator=self.generator)
        else:
            x0, conf, lp = decide(lg, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p,
                                  remasking=plan.remasking, generator=self.generator)
        # under a constraint every x0 is the DP path's token: the threshold (or the schedule)
        # picks which of the path's positions to unmask
        if plan.algorithm == "origin":
            chosen = self._drawn
        elif plan.dream and plan.threshold is None:
            chosen = dream_select(conf, self._k, plan.alg_temp, self.generator)
        elif plan.dream:
            chosen = select_transfer(threshold_score(conf, plan.algorithm), 1, plan.threshold)
        else:
            k = self.schedule[self.step_in_block] if self.step_in_block < len(self.schedule) else 1
            chosen = select_transfer(conf, k, plan.threshold)
        pos = torch.from_numpy(self._pending)[chosen]
        self.x[pos] = x0[chosen]
        self._unmasked_last = self._pending[chosen.numpy()]
        if self.greq.return_logprob:
            if plan.dream:
                lg[:, self.mask_id] = NEG_INF
            self._record_out_logprobs(lg, chosen, x0, lp)
        if bool((self.x[bs:be] == self.mask_id).any()):
            self.step_in_block += 1
            self.tstep += 1
            return False
        self.block += 1
        self.step_in_block = 0
        self.final_len = be - self.prompt_len
        if self.constraint is not None:
            try:
                self.cstate = self.constraint.advance(self.cstate, self.x[bs:be])
            except ConstraintError as e:  # cannot happen: every unmasked token is on a viable path
                self._not_matching(f"a committed token left the constraint ({e})")
                return True
        self._check_stop()
        return True

    def _decide_constrained(self, lg: torch.Tensor, bs: int, be: int):
        """The constrained path's tokens for every masked position of the block, with the
        algorithm's confidence: the path token's probability given the constraint for
        ``low_confidence`` and ``maskgit_plus``, noise for ``random``; Dream's margin or
        entropy of the model's own distribution for ``topk_margin`` and ``entropy``."""
        p, plan = self.params, self.plan
        banned = lg
        if plan.dream:
            banned = lg.clone()
            banned[:, self.mask_id] = NEG_INF
        block = self.x[bs:be]
        x0, conf, lp = constrained_decide(self.constraint, self.cstate, block, block == self.mask_id, banned,
                                          temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p,
                                          remasking=plan.remasking, generator=self.generator)
        if plan.algorithm in ("topk_margin", "entropy"):
            probs = dream_probs(lg, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p)
            conf = dream_confidence(probs, x0, plan.algorithm)
        return x0, conf, lp

    def _no_completion(self, why: str) -> None:
        """No output matching the constraint fits: finish with a reason saying so (never a partial
        output claimed as a match). Before anything is committed the message names max_new_tokens."""
        c, st, p = self.constraint, self.cstate, self.params
        if self.final_len == 0 and not c.feasible(st):
            need = c.min_tokens(st)
            if need is None:
                why = "the constraint matches no output this tokenizer can produce"
            elif not c.end_ids:
                why = (f"no output matching the constraint is exactly max_new_tokens={p.max_new_tokens} tokens "
                       f"long (ignore_eos: every position is output)")
            else:
                why = (f"no output matching the constraint fits in max_new_tokens={p.max_new_tokens} "
                       f"(at least {need} tokens needed)")
        self._finish({"type": "abort", "message": why})

    def _not_matching(self, why: str) -> None:
        self._finish({"type": "abort", "message": f"the output does not match the constraint: {why}"})

    def _record_out_logprobs(self, lg, chosen, x0, lp) -> None:
        k = self.greq.top_logprobs_num
        top = None
        if k > 0:
            lsm = torch.log_softmax(lg[chosen].double(), dim=-1)
            tv, ti = torch.topk(lsm, min(k, lsm.shape[-1]), dim=-1)
        for j, c in enumerate(chosen.tolist()):
            pos = int(self._pending[c])
            if k > 0:
                top = list(zip(tv[j].tolist(), ti[j].tolist()))
            self.out_logprobs[pos] = (float(lp[c]), top or [])

    def _apply_score(self, lg: torch.Tensor) -> None:
        report, targets = self._score_pending
        lsm = torch.log_softmax(lg.double(), dim=-1)
        tgt = torch.tensor([self.prompt[t] for t in targets], dtype=torch.long)
        vals = lsm.gather(-1, tgt[:, None])[:, 0].tolist()
        k = self.greq.top_logprobs_num
        tops = None
        if k > 0:
            tv, ti = torch.topk(lsm, min(k, lsm.shape[-1]), dim=-1)
        by_pos = {}
        for j, t in enumerate(targets.tolist()):
            by_pos[t] = (vals[j], list(zip(tv[j].tolist(), ti[j].tolist())) if k > 0 else None)
        out = []
        for pos in report.tolist():
            lpv, tops = by_pos.get(pos, (None, None))
            out.append((lpv, self.prompt[pos], tops))
        self.input_logprobs = out
        self._score_pending = None

    # -------------------------------------------------------------------------------- stopping
    def _check_stop(self) -> None:
        p = self.params
        c = self.constraint
        gen = self.x[self.prompt_len:self.prompt_len + self.final_len].tolist()
        limit = min(len(gen), p.max_new_tokens)
        cut, reason = limit, None
        # under a constraint an end id only ever follows a complete match: the output ends at the
        # first one (min_new_tokens only steered the decision away from it)
        for i in range(0 if c is not None else min(p.min_new_tokens, limit), limit):
            t = gen[i]
            if t in self.eos_ids or t in self.stop_ids:
                cut, reason = i, {"type": "stop", "matched": t}
                break
        ids = gen[:cut]
        text = self._decode(ids)
        if p.stop:
            hit = self._find_stop(ids, text) if c is None else self._find_stop_constrained(ids, text)
            if hit is not None:
                ids, text, matched = hit
                cut, reason = len(ids), {"type": "stop", "matched": matched}
        self.out_ids, self.text = ids, text
        if reason is None and self.final_len >= p.max_new_tokens:
            reason = {"type": "length", "length": p.max_new_tokens}
        if reason is None and self.final_len >= self.plan.gen_len:
            reason = {"type": "length", "length": len(ids)}
        if reason is not None:
            if c is not None and not c.matches(ids):  # the safety check: never claim a non-match
                self._not_matching("the finished output is not a complete match")
                return
            self._finish(reason)

    def _find_stop_constrained(self, ids: list[int], text: str):
        """Stop strings under a constraint: the output ends at the earliest stop string that
        starts where the tokens before it are a complete match (a token boundary in an accepting
        state, at or after min_new_tokens) -> (those tokens, their text, matched). The stop string
        and what follows are dropped from both text and ids, so the output still matches;
        occurrences anywhere else are part of the constrained text."""
        c = self.constraint
        q = c.initial
        for j in range(len(ids) + 1):
            if j > 0:
                q = c.next_state(q, ids[j - 1])
                if q < 0:
                    return None
            if j < self.params.min_new_tokens or not c.is_accepting(q):
                continue
            head = self._decode(ids[:j])
            if not text.startswith(head):
                continue
            for s in self.params.stop:
                if s and text.startswith(s, len(head)):
                    return ids[:j], head, s
        return None

    def _find_stop(self, ids: list[int], text: str):
        """Earliest stop string (after min_new_tokens) -> (ids up to it, trimmed text, matched)."""
        best = None
        for s in self.params.stop:
            if not s:
                continue
            i = text.find(s)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        # shortest token prefix whose text reaches the end of the stop string
        n = len(ids)
        for j in range(max(self.params.min_new_tokens, 1), len(ids) + 1):
            if len(self._decode(ids[:j])) >= i + len(s):
                n = j
                break
        return ids[:n], text[:i], s

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.params.skip_special_tokens)

    def _finish(self, reason: dict) -> None:
        self.finished = True
        self.finish_reason = reason

    def fail(self, message: str, kind: str = "abort") -> None:
        self.error = message if kind == "error" else None
        self.finished = True
        self.finish_reason = {"type": "abort", "message": message}

    # ----------------------------------------------------------------------------------- events
    def meta_info(self) -> dict[str, Any]:
        m = {
            "id": self.rid,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_len,
            "completion_tokens": len(self.out_ids),
            "cached_tokens": self.choice.matched,
            "bicache_depth": self.choice.depth,
            "prefix_fraction": round(self.choice.prefix_fraction, 6),
            "reused_prefix_tokens": self.choice.reused,
            "reused_prefix_start": self.choice.start,
            "bicache_audited": self.served_exact,
            "skipped_layer_tokens": self.skipped_layer_tokens,
            "computed_layer_tokens": self.computed_layer_tokens,
            "forward_passes": self.forward_passes,
            "tokens_computed": self.tokens_computed,
            "e2e_latency": time.perf_counter() - self.created,
        }
        if self.greq.return_logprob:
            m.update(self._logprob_meta())
        return m

    def _tok_text(self, tid: int) -> str | None:
        return self.tokenizer.decode([tid]) if self.greq.return_text_in_logprobs else None

    def _logprob_meta(self) -> dict[str, Any]:
        def top_list(tops):
            return None if tops is None else [[lp, t, self._tok_text(t)] for lp, t in tops]
        inp = self.input_logprobs or []
        out_pos = [self.prompt_len + i for i in range(len(self.out_ids))]
        outs = [self.out_logprobs.get(p, (None, [])) for p in out_pos]
        m = {
            "input_token_logprobs": [[lp, t, self._tok_text(t)] for lp, t, _ in inp],
            "output_token_logprobs": [[lp, t, self._tok_text(t)] for (lp, _), t in zip(outs, self.out_ids)],
            "output_token_logprobs_length": len(self.out_ids),
        }
        if self.greq.top_logprobs_num > 0:
            m["input_top_logprobs"] = [top_list(tops) for _, _, tops in inp]
            m["output_top_logprobs"] = [top_list(tops) for (_, tops) in outs]
        return m

    def event(self) -> RequestEvent:
        """Every event carries the whole meta_info so far (logprobs of everything decoded, the
        cache fields), as SGLang puts every field in every streamed frame."""
        return RequestEvent(self.rid, self.text, list(self.out_ids), self.finished, self.finish_reason,
                            self.meta_info(), self.error)


class RequestFactory:
    """Validates submitted requests against the model and builds their state (once per request)."""

    def __init__(self, model_config: ModelConfig, tokenizer, eos_ids: tuple[int, ...], decode: DecodeDefaults,
                 context_length: int, kv_budget: int | None = None) -> None:
        self.mc, self.tokenizer, self.eos_ids = model_config, tokenizer, eos_ids
        self.decode, self.context_length = decode, context_length
        self.kv_budget = kv_budget  # the scheduler's whole private-K/V budget (positions); None: unchecked
        # the checkpoint's generation_config.json defaults (below the request and the server)
        self.generation = generation_defaults(model_config)

    def build(self, greq: GenerateRequest, on_event: Callable[[RequestEvent], None] | None) -> Req:
        """Raise ValueError naming what is wrong, else the request's state."""
        ids, mc = greq.input_ids, self.mc
        if not ids:
            raise ValueError("the prompt is empty")
        V = mc.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or t < 0 or t >= V]
        if bad:
            raise ValueError(f"token id {bad[0]!r} is outside the vocabulary [0, {V})")
        gen = self.generation
        params = greq.params.resolved(gen.sampling_defaults())
        if params is not greq.params:
            greq = dataclasses.replace(greq, params=params)
        plan = DecodePlan.resolve(params, self.decode, gen)
        if plan.dream and plan.steps_per_block > MAX_DREAM_STEPS:
            raise ValueError(f"steps: Dream's schedule ({plan.algorithm}) runs at most {MAX_DREAM_STEPS} steps per "
                             f"block, got {plan.steps_per_block}")
        if len(ids) + params.max_new_tokens > self.context_length:
            raise ValueError(f"prompt ({len(ids)} tokens) plus max_new_tokens ({params.max_new_tokens}) exceeds the "
                             f"context length {self.context_length}")
        if len(ids) + plan.gen_len > self.context_length:
            # SGLang refuses only prompt + max_new_tokens > context: the last block is cut short to fit
            plan = dataclasses.replace(plan, gen_len=self.context_length - len(ids))
        if any(t >= V for t in greq.params.stop_token_ids):
            # ids outside the vocabulary can never be generated: accepted (as SGLang does) and dropped,
            # since the stop set also bans its members from early positions by index
            kept = tuple(t for t in greq.params.stop_token_ids if t < V)
            greq = dataclasses.replace(greq, params=greq.params.replace(stop_token_ids=kept))
        if greq.return_logprob and greq.logprob_start_len >= len(ids):
            raise ValueError(f"logprob_start_len ({greq.logprob_start_len}) must be < the prompt length ({len(ids)})")
        if greq.top_logprobs_num < 0:
            raise ValueError("top_logprobs_num must be >= 0")
        if greq.bicache_depth is not None and not 0 <= greq.bicache_depth <= mc.n_layers:
            raise ValueError(f"bicache_depth must be in [0, {mc.n_layers}]")
        p = greq.params
        bad = [t for t, _ in p.logit_bias if t >= V]
        if bad:
            raise ValueError(f"logit_bias: token id {bad[0]} is outside the vocabulary [0, {V})")
        req = Req(greq, plan, mask_id=mc.mask_token_id, eos_ids=self.eos_ids, logit_shift=mc.logit_shift,
                  tokenizer=self.tokenizer, on_event=on_event, seed=0, constraint=self.constraint(p))
        if self.kv_budget is not None and req.kv_tokens > self.kv_budget:
            raise ValueError(f"the request needs K/V for {req.kv_tokens} positions, more than the engine's whole "
                             f"budget of {self.kv_budget} (--max-total-tokens)")
        return req

    def constraint(self, p: SamplingParams) -> Constraint | None:
        """Compile the request's output constraint (cached per constraint and end ids; a fresh
        build takes milliseconds to seconds, bounded by the core's limits, so callers run this
        off any event loop). Raises ValueError (ConstraintError) with the parser's message."""
        spec = p.constraint
        if spec is None:
            return None
        kind, value = spec
        # the ids that end the output, allowed only after a complete match: EOS (not with
        # ignore_eos) and stop_token_ids. With none (ignore_eos, no stop ids) every position is
        # output and the match has to fill them all
        end_ids = (() if p.ignore_eos else tuple(self.eos_ids)) + tuple(p.stop_token_ids)
        try:
            return compile_constraint(kind, value, self.tokenizer, end_ids=end_ids)
        except ConstraintError as e:
            msg = str(e)
            raise ConstraintError(msg if msg.startswith(kind) else f"{kind}: {msg}") from None
