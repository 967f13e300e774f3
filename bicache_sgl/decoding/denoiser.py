"""Denoisers: one block's denoising steps for one step schedule, chosen by name
(:data:`DENOISERS`, keyed by ``DecodePlan.schedule``; ``decoding.plan.ALGORITHM_SPECS`` says
which schedule each algorithm runs on).

Two schedules of unmasking algorithms share the request's block loop (docs/server.md, "Dream's
generation algorithms"):

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

A denoiser holds only its schedule's state; the request owns the sequence, its buffers and what
each forward computes. Per forward: :meth:`Denoiser.plan` before it (with the number of masked
positions of the block), then on its logits :meth:`Denoiser.decide` (or a constraint's decision,
re-scored by :meth:`Denoiser.path_confidence`), :meth:`Denoiser.select`, and
:meth:`Denoiser.next_step` while the block still has masks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from types import MappingProxyType
from typing import ClassVar

import torch

from ..config import SamplingParams
from . import (
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
)
from .plan import DecodePlan

Decision = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (tokens [n], confidence [n], logprob [n])


class Denoiser(ABC):
    """Planning and applying one block's steps for one step schedule (module docstring).

    ``bans_mask``: whether the logits the decision is made on have the mask token banned
    (LLaDA); Dream's algorithms keep it in the distribution their confidence is computed on and
    exclude it from the decision themselves."""

    schedule: ClassVar[str]
    bans_mask: ClassVar[bool]

    def __init__(self, plan: DecodePlan, params: SamplingParams, mask_id: int) -> None:
        self.plan, self.params, self.mask_id = plan, params, mask_id

    @abstractmethod
    def plan_forward(self, n_masked: int, block_start: bool, generator: torch.Generator) -> None:
        """Before a forward over the block, which has ``n_masked`` masked positions
        (``block_start``: its first step)."""

    @abstractmethod
    def decide(self, lg: torch.Tensor, generator: torch.Generator) -> Decision:
        """Processed logits [n_masked, V] of the block's masked positions (in order) -> the
        schedule's (tokens, confidence, logprob) for each."""

    def path_confidence(self, lg: torch.Tensor, x0: torch.Tensor, conf: torch.Tensor) -> torch.Tensor:
        """Under a constraint ``x0`` is the constraint's path and ``conf`` its confidence for the
        plan's ``remasking``: the confidence the schedule ranks the path's positions by."""
        return conf

    @abstractmethod
    def select(self, conf: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """Indices (into the masked positions) this step unmasks."""

    @abstractmethod
    def next_step(self) -> None:
        """The block still has masks after this step: the next step of its schedule."""

    def guide(self, cond: torch.Tensor, uncond: torch.Tensor) -> torch.Tensor:
        """Classifier-free guidance: the logits with the prompt (``cond``) pushed away from the
        prompt-masked shadow's (``uncond``) by ``cfg_scale``; both [n_masked, V]."""
        return uncond + (self.params.cfg_scale + 1.0) * (cond - uncond)


class LLaDADenoiser(Denoiser):
    """LLaDA's ``low_confidence`` / ``random``: the block's steps unmask an even share of its
    masked positions, the most confident (or every one above ``threshold``)."""

    schedule = "llada"
    bans_mask = True

    def __init__(self, plan: DecodePlan, params: SamplingParams, mask_id: int) -> None:
        super().__init__(plan, params, mask_id)
        self.schedule: list[int] = []  # positions each step of the block unmasks
        self.step = 0

    def plan_forward(self, n_masked: int, block_start: bool, generator: torch.Generator) -> None:
        if block_start:
            self.schedule = num_transfer_schedule(n_masked, self.plan.steps_per_block)
            self.step = 0

    def decide(self, lg: torch.Tensor, generator: torch.Generator) -> Decision:
        p = self.params
        return decide(lg, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p,
                      remasking=self.plan.remasking, generator=generator)

    def select(self, conf: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        k = self.schedule[self.step] if self.step < len(self.schedule) else 1
        return select_transfer(conf, k, self.plan.threshold)

    def next_step(self) -> None:
        self.step += 1


class DreamDenoiser(Denoiser):
    """Dream's ``origin`` / ``maskgit_plus`` / ``topk_margin`` / ``entropy`` on its timestep
    schedule; steps that unmask nothing are skipped without a forward."""

    schedule = "dream"
    bans_mask = False

    def __init__(self, plan: DecodePlan, params: SamplingParams, mask_id: int) -> None:
        super().__init__(plan, params, mask_id)
        # the same for every block: steps_per_block + 1 float32 values from 1 down to eps
        self.timesteps = dream_timesteps(plan.steps_per_block, plan.eps)
        self.tstep = 0  # index into timesteps of the planned step
        self.k = 0  # how many of the most confident the planned step unmasks
        self.drawn: torch.Tensor | None = None  # origin: rows (into the masked positions) drawn to unmask

    def plan_forward(self, n_masked: int, block_start: bool, generator: torch.Generator) -> None:
        if block_start:
            self.tstep = 0
        self.drawn = None
        if self.plan.algorithm == "origin":
            while True:
                drawn = dream_origin_draw(n_masked, self.tstep, self.timesteps, generator)
                if bool(drawn.any()) or n_masked == 0 or self.tstep >= len(self.timesteps) - 2:
                    break
                self.tstep += 1
            self.drawn = drawn.nonzero()[:, 0]
        elif self.plan.threshold is None:
            self.tstep, self.k = dream_next_transfer(n_masked, self.tstep, self.timesteps)

    def decide(self, lg: torch.Tensor, generator: torch.Generator) -> Decision:
        p, alg = self.params, self.plan.algorithm
        knobs = {"temperature": p.temperature, "top_k": p.top_k, "top_p": p.top_p, "min_p": p.min_p,
                 "mask_id": self.mask_id, "generator": generator}
        if alg != "origin":
            return dream_decide(lg, algorithm=alg, **knobs)
        # origin decides only the drawn positions, as in the reference
        n, rows = lg.shape[0], self.drawn
        x0, conf, lp = torch.zeros(n, dtype=torch.long), torch.zeros(n), torch.zeros(n)
        if len(rows):
            x0[rows], conf[rows], lp[rows] = dream_decide(lg[rows], algorithm="origin", **knobs)
        return x0, conf, lp

    def path_confidence(self, lg: torch.Tensor, x0: torch.Tensor, conf: torch.Tensor) -> torch.Tensor:
        alg = self.plan.algorithm
        if alg not in ("topk_margin", "entropy"):
            return conf  # maskgit_plus ranks by the path token's probability; origin ranks nothing
        p = self.params
        probs = dream_probs(lg, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p)
        return dream_confidence(probs, x0, alg)

    def select(self, conf: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        plan = self.plan
        if plan.algorithm == "origin":
            return self.drawn
        if plan.threshold is None:
            return dream_select(conf, self.k, plan.alg_temp, generator)
        return select_transfer(threshold_score(conf, plan.algorithm), 1, plan.threshold)

    def next_step(self) -> None:
        self.tstep += 1


# schedule name -> class, by DecodePlan.schedule
DENOISERS: Mapping[str, type[Denoiser]] = MappingProxyType({cls.schedule: cls
                                                          for cls in (LLaDADenoiser, DreamDenoiser)})


def make_denoiser(plan: DecodePlan, params: SamplingParams, mask_id: int) -> Denoiser:
    """The denoiser of the plan's step schedule. A schedule with none here (``block``: token
    editing, run by the block-diffusion engine) is a ValueError naming the algorithm."""
    cls = DENOISERS.get(plan.schedule)
    if cls is None:
        raise ValueError(f"dllm_algorithm {plan.algorithm} runs only in the block-diffusion engine (LLaDA2.x); "
                         f"this model takes {', '.join(sorted(DENOISERS))}-schedule algorithms")
    return cls(plan, params, mask_id)
