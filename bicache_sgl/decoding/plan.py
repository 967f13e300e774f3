"""A request's resolved diffusion settings (:class:`DecodePlan`), from the request, the server
flags and the checkpoint's generation defaults."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Protocol

import numpy as np

from ..config import (
    ALGORITHMS,
    BIDIRECTIONAL_ALGORITHMS,
    DEFAULT_EPS,
    DREAM_ALGORITHMS,
    LLADA_ALGORITHMS,
    REMASKING,
    SGLANG_ALGORITHM_NAMES,
    DecodeDefaults,
    SamplingParams,
)

# Dream's schedule may have more steps than tokens (the extra ones unmask nothing and cost no
# forward, but their timesteps are kept and walked): a bound on that bookkeeping
MAX_DREAM_STEPS = 1 << 16


@dataclass(frozen=True)
class AlgorithmSpec:
    """What an unmasking algorithm (``config.ALGORITHMS``) is to the request loop.

    ``schedule``: the step schedule, which picks the denoiser (``decoding.denoiser.DENOISERS``):
    "llada" (each block's steps unmask an even share of its masked positions) or "dream" (Dream's
    timestep schedule); "block": run by the block-diffusion engine only (``blockdiff``: LLaDA2.1's
    joint_threshold), which no bidirectional family accepts, so no plan of the bidirectional
    engine has it. Not to be confused with a checkpoint family (``models.families``): any family
    may run any algorithm it accepts (:class:`FamilyDecoding`)."""

    name: str
    schedule: str
    max_steps_per_block: int | None  # None: at most block_length (every step unmasks >= 1 position)
    batch_greedy: bool  # its greedy threshold step is ``decoding.decide_greedy``'s, made for many requests at once


ALGORITHM_SPECS: Mapping[str, AlgorithmSpec] = MappingProxyType(
    {a: AlgorithmSpec(a, "llada", None, a == "low_confidence") for a in LLADA_ALGORITHMS}
    | {a: AlgorithmSpec(a, "dream", MAX_DREAM_STEPS, False) for a in DREAM_ALGORITHMS}
    | {"joint_threshold": AlgorithmSpec("joint_threshold", "block", None, False)})


@dataclass(frozen=True)
class FamilyDecoding:
    """What a checkpoint family (``models.families``) declares about decoding: the algorithm a
    request runs when neither it, the server flags nor the checkpoint's generation_config.json
    name one, and the algorithms the family accepts (another is refused, naming the family)."""

    family: str = ""
    default_algorithm: str = "low_confidence"
    algorithms: tuple[str, ...] = BIDIRECTIONAL_ALGORITHMS
    # whether it takes SGLang's --dllm-algorithm-config file (the block-diffusion families)
    algorithm_config: bool = False

    def __post_init__(self) -> None:
        unknown = [a for a in (self.default_algorithm, *self.algorithms) if a not in ALGORITHMS]
        if unknown:
            raise ValueError(f"family {self.family!r}: unknown decoding algorithm(s) {unknown}")
        if self.default_algorithm not in self.algorithms:
            raise ValueError(f"family {self.family!r}: its default algorithm {self.default_algorithm!r} is not one "
                             f"it accepts {self.algorithms}")

    def check_flags(self, algorithm: str | None, algorithm_config: str | None = None) -> None:
        """The server's ``--dllm-algorithm`` (a canonical name; None: not given) and
        ``--dllm-algorithm-config`` against what the family accepts: a startup error (ValueError)
        naming the flag and the valid values otherwise."""
        if algorithm is not None and algorithm not in self.algorithms:
            valid = ", ".join(f"{a} ({SGLANG_ALGORITHM_NAMES[a]})" if a in SGLANG_ALGORITHM_NAMES else a
                              for a in self.algorithms)
            raise ValueError(f"--dllm-algorithm {SGLANG_ALGORITHM_NAMES.get(algorithm, algorithm)}: the "
                             f"{self.family} family does not run {algorithm}; valid: {valid}")
        if algorithm_config is not None and not self.algorithm_config:
            raise ValueError(f"--dllm-algorithm-config applies to the block-diffusion families (LLaDA2.x, SDAR); "
                             f"the {self.family} family takes --threshold, --block-length and --steps-per-block")


# no family's constraints: the built-in default algorithm, every bidirectional algorithm accepted
ANY_FAMILY = FamilyDecoding()


class CheckpointHints(Protocol):
    """The checkpoint's generation defaults a plan reads (``models.loader.GenerationDefaults``;
    ``None``: not set by the checkpoint)."""

    steps: int | None
    algorithm: str | None
    eps: float | None
    alg_temp: float | None


def _first(*values: Any) -> Any:
    return next(v for v in values if v is not None)


@dataclass(frozen=True)
class DecodePlan:
    """A request's resolved diffusion settings."""

    gen_len: int  # generation region (whole blocks; the last one clipped to fit the context)
    block_length: int
    steps_per_block: int
    threshold: float | None
    cache_mode: str
    refresh_interval: int
    algorithm: str = "low_confidence"  # config.ALGORITHMS
    eps: float = DEFAULT_EPS  # Dream's last timestep
    alg_temp: float = 0.0  # Dream's position sampling temperature (0: the most confident)
    step_rows: str = "block"  # config.STEP_ROWS: what a dual-cache block step computes

    @property
    def remasking(self) -> str:
        """The confidence the LLaDA sampler ranks positions by: the algorithm itself for LLaDA's
        two, "low_confidence" (the confidence a constraint reports) for Dream's."""
        return self.algorithm if self.algorithm in REMASKING else "low_confidence"

    @property
    def spec(self) -> AlgorithmSpec:
        """What its algorithm is to the request loop (:data:`ALGORITHM_SPECS`)."""
        return ALGORITHM_SPECS[self.algorithm]

    @property
    def schedule(self) -> str:
        """The step schedule, which picks the denoiser: "llada" or "dream" (:class:`AlgorithmSpec`)."""
        return ALGORITHM_SPECS[self.algorithm].schedule

    def refreshes(self, step: int) -> bool:
        """Whether a block's step ``step`` computes the whole sequence (reusing only the planned
        prefix span): its first step, every step without an in-request cache, and every
        ``refresh_interval``-th one."""
        if self.cache_mode == "none" or step == 0:
            return True
        return self.refresh_interval > 0 and step % self.refresh_interval == 0

    def step_positions(self, refresh: bool, block: tuple[int, int], seq_len: int, shift: int,
                       masked: np.ndarray, unmasked_last: np.ndarray) -> np.ndarray:
        """The positions (int64, sorted) a block's step computes: the whole sequence on a refresh
        (:meth:`refreshes`); else with ``step_rows`` "active" the rows that can still change; with
        the prefix cache the block and everything after it; with the dual cache the block only.
        With ``shift`` 1 (Dream: position i's logits come from row i - 1) the row before each
        decided position too. ``masked``: the block's masked positions; ``unmasked_last``: those
        the previous forward unmasked."""
        bs, be = block
        if refresh:
            return np.arange(seq_len, dtype=np.int64)
        if self.step_rows == "active":
            # Only rows whose K/V can still change: the masked positions (and the rows giving their
            # logits) and the positions unmasked by the previous forward, computed once more with
            # their token in place. Every other block row keeps the K/V it was last computed with
            # (an approximation: they no longer see later unmasks).
            return np.union1d(np.union1d(masked, masked - shift), unmasked_last)
        if self.cache_mode == "prefix":
            return np.arange(bs - shift, seq_len, dtype=np.int64)
        return np.arange(bs - shift, be, dtype=np.int64)

    @classmethod
    def resolve(cls, p: SamplingParams, d: DecodeDefaults, g: CheckpointHints | None = None,
                family: FamilyDecoding | None = None) -> DecodePlan:
        """Each knob from, in order: the request, the server (``d``), the checkpoint's
        generation_config.json (``g``), the checkpoint family's default (``family``; the
        algorithm), the built-in default. Whether the family accepts the algorithm is the
        request edge's check (``scheduler.validate``)."""
        g_steps, g_alg, g_eps, g_temp = (g.steps, g.algorithm, g.eps, g.alg_temp) if g is not None else (None,) * 4
        block = p.block_length or d.block_length
        alg = p.dllm_algorithm or d.dllm_algorithm or g_alg or (family or ANY_FAMILY).default_algorithm
        cache_mode = p.cache_mode or d.cache_mode
        step_rows = p.step_rows or d.step_rows
        if step_rows != "block" and cache_mode != "dual":
            raise ValueError(f"step_rows {step_rows!r} needs cache_mode 'dual' (got {cache_mode!r})")
        knobs = {"algorithm": alg, "eps": _first(p.dllm_eps, d.dllm_eps, g_eps, DEFAULT_EPS),
                 "alg_temp": _first(p.dllm_alg_temp, d.dllm_alg_temp, g_temp, 0.0), "step_rows": step_rows}
        if p.max_new_tokens <= 0:
            return cls(0, block, 1, None, cache_mode, 0, **knobs)
        n_blocks = -(-p.max_new_tokens // block)
        gen = n_blocks * block
        if p.steps_per_block:
            spb = p.steps_per_block
        elif p.steps:
            spb = max(1, p.steps // n_blocks)
        elif d.steps_per_block:
            spb = d.steps_per_block
        elif g_steps:
            spb = max(1, g_steps // n_blocks)
        else:
            spb = block
        if ALGORITHM_SPECS[alg].max_steps_per_block is None:
            spb = min(spb, block)  # Dream's schedule may have more steps than tokens (steps that unmask none)
        thr = p.threshold if p.threshold is not None else d.threshold
        return cls(gen, block, spb, thr if thr else None, cache_mode,
                   p.refresh_interval if p.refresh_interval is not None else d.refresh_interval, **knobs)
