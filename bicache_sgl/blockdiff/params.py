"""One block-diffusion request's decoding parameters (``BlockParams``): what the block engine
(``engine.py``) runs and its sampler (``sampling.py``) reads; its own module so neither imports
the other for it."""

from __future__ import annotations

from dataclasses import dataclass

from ..constrained import Constraint


@dataclass(frozen=True)
class BlockParams:
    """One request's decoding parameters; None: the family's published default."""

    max_new_tokens: int = 128
    # the request's block length (None: the model's), as the published generate takes one (SDAR's
    # block_length, LLaDA2's); its K/V is reused only by requests of the same length (caches.py)
    block_length: int | None = None
    steps: int | None = None  # per block
    threshold: float | None = None
    minimal_topk: int = 1
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop_ids: tuple[int, ...] | None = None  # ids that end the answer (None: the model's EOS ids)
    # LLaDA2.1's token editing (SGLang's JointThreshold): None = off (LLaDA2.0's mask-to-token rule)
    edit_threshold: float | None = None
    max_post_edit_steps: int = 16
    # logit processing (decoding/sampling.py's LogitsProcessor; docs/server.md, "Penalties"): EOS
    # (the model's end ids) banned with ignore_eos, EOS and stop_ids on the first min_new_tokens
    # output positions; the mask token is not banned (as in the published loops)
    min_new_tokens: int = 0
    ignore_eos: bool = False
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    # a compiled regex / JSON-schema constraint (scheduler/factory.py's request_constraint, with
    # stop_ids as its end ids); the output then fully matches it (docs/structured.md)
    constraint: Constraint | None = None
    # False (cache_mode "none"): the request neither reuses cached blocks nor stores its own
    # (docs/block_diffusion.md, section 5); its in-request K/V of committed blocks is exact either way
    use_cache: bool = True

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:  # 0: prefill-only (no output)
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.block_length is not None and self.block_length < 1:
            raise ValueError(f"block_length must be >= 1, got {self.block_length}")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.threshold is not None and not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {self.threshold}")
        if self.minimal_topk < 1:
            raise ValueError(f"minimal_topk must be >= 1, got {self.minimal_topk}")
        if self.edit_threshold is not None and not 0.0 <= self.edit_threshold <= 1.0:
            raise ValueError(f"edit_threshold must be in [0, 1], got {self.edit_threshold}")
        if self.max_post_edit_steps < 0:
            raise ValueError(f"max_post_edit_steps must be >= 0, got {self.max_post_edit_steps}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
