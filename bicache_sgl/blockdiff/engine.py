"""BlockEngine: continuous batching of block-diffusion requests with exact prefix reuse.

Each request decodes one block at a time (``decoding/block.py``, the published algorithm). A
step runs ONE packed forward (``BlockDiffusionLM.forward_rows``) over every running request,
each computing only

- its current block's rows (the logits the step needs), and
- the rows before it whose K/V are not final yet: the prompt blocks not found in the prefix cache
  (first step) or the block that just finished (its tokens are final now),

against the K/V of every earlier position already in the request's buffer. Rows before the
current block are final after that forward (block-causal: nothing later changes them), so they
are committed then: this is the family's natural K/V cache, exact, with no extra forward per
block (the commit rides on the next block's first step).

Prefix reuse (``kv_cache/block_prefix.py``) is exact: at admission a request copies the K/V of
the longest chain of its whole prompt blocks found in the cache (every layer: depth L), so the
reused span is ``[0, R)`` with R a multiple of the block length; the last partial prompt block
is computed. When a request finishes, every committed block (prompt and answer) is inserted, so a
next turn that repeats the conversation reuses the answer's blocks too (multi-turn reuse).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from ..decoding.block import BlockLayout, cut_answer, effective_steps, sample_tokens, select_transfer, transfer_schedule
from ..kv_cache.block_prefix import BlockPrefixCache
from ..models.block_model import BlockDiffusionLM, BlockKV, RowsWork
from ..scheduler.validate import check_context, check_prompt_ids


@dataclass(frozen=True)
class BlockParams:
    """One request's decoding parameters; None: the family's published default."""

    max_new_tokens: int = 128
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

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
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


@dataclass(frozen=True)
class BlockEngineOptions:
    """prefix_cache: reuse whole prompt blocks across requests (exact); cache_output: insert a
    finished request's committed answer blocks too (multi-turn); cache_blocks: the cache's size
    in blocks; max_running: requests decoded together."""

    prefix_cache: bool = True
    cache_output: bool = True
    cache_blocks: int = 4096
    max_running: int = 16

    def __post_init__(self) -> None:
        if self.cache_blocks < 0 or self.max_running < 1:
            raise ValueError("cache_blocks must be >= 0 and max_running >= 1")


@dataclass
class BlockResult:
    rid: int
    tokens: list[int]
    meta: dict


@dataclass
class _Req:
    rid: int
    prompt: list[int]
    params: BlockParams
    layout: BlockLayout
    schedule: list[int]
    threshold: float
    x: torch.Tensor  # [total_length] long: prompt, decoded tokens, masks
    kv: BlockKV
    block: int  # current block
    step: int = 0
    post_steps: int = 0  # token editing: steps of the current block after its last mask went
    reused: int = 0  # prompt tokens whose K/V came from the prefix cache
    forwards: int = 0
    computed_rows: int = 0
    finished_blocks: list[list[int]] = field(default_factory=list)
    generator: torch.Generator | None = None


class BlockEngine:
    """Offline engine over a loaded ``BlockDiffusionLM``: ``submit`` requests, ``step`` (one
    forward for every running request), ``run`` until all are done."""

    def __init__(self, model: BlockDiffusionLM, options: BlockEngineOptions = BlockEngineOptions()) -> None:
        self.model, self.options = model, options
        self.cfg = model.cfg
        self.B = self.cfg.decode.block_length
        self.cache = BlockPrefixCache(self.B, options.cache_blocks if options.prefix_cache else 0)
        self.waiting: deque[_Req] = deque()
        self.running: list[_Req] = []
        self.done: dict[int, BlockResult] = {}
        self._rids = itertools.count()
        # called with (rid, generated tokens so far) each time a request finishes a block
        self.on_block: Callable[[int, list[int]], None] | None = None
        w = model.embed.weight
        self.dtype, self.device = w.dtype, w.device

    # ---- requests ------------------------------------------------------------------------------
    def submit(self, prompt: Sequence[int], params: BlockParams = BlockParams()) -> int:
        prompt = [int(t) for t in prompt]
        check_prompt_ids(prompt, self.cfg.vocab_size)
        check_context(len(prompt), params.max_new_tokens, self.cfg.max_position_embeddings, block=self.B)
        d = self.cfg.decode
        layout = BlockLayout(len(prompt), params.max_new_tokens, self.B)
        steps = params.steps or d.steps
        if d.cap_steps_by_gen_length:
            steps = effective_steps(steps, params.max_new_tokens, params.minimal_topk)
        x = torch.full((layout.total_length,), self.cfg.mask_token_id, dtype=torch.long)
        x[:len(prompt)] = torch.tensor(prompt)
        gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        req = _Req(next(self._rids), prompt, params, layout, transfer_schedule(self.B, steps),
                   d.threshold if params.threshold is None else params.threshold, x, None, layout.first_block,
                   generator=gen)
        self.waiting.append(req)
        return req.rid

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.options.max_running:
            r = self.waiting.popleft()
            r.kv = BlockKV.empty(self.cfg, r.layout.total_length, self.dtype, self.device)
            if self.options.prefix_cache:
                # whole prompt blocks only: the block holding the prompt's tail is computed
                hit = self.cache.match(r.prompt, (len(r.prompt) // self.B) * self.B)
                for b, (k, v) in enumerate(hit):
                    r.kv.k[:, b * self.B:(b + 1) * self.B] = k
                    r.kv.v[:, b * self.B:(b + 1) * self.B] = v
                r.reused = len(hit) * self.B
                r.kv.committed = r.reused
            self.running.append(r)

    # ---- one step ------------------------------------------------------------------------------
    def step(self) -> list[BlockResult]:
        """One forward for every running request; returns the requests that finished."""
        self._admit()
        if not self.running:
            return []
        work = []
        for r in self.running:
            start, end = r.kv.committed, (r.block + 1) * self.B
            work.append(RowsWork(r.x[start:end], start, r.kv, logit_from=r.block * self.B - start))
        logits = self.model.forward_rows(work)
        finished = []
        for r, w, lg in zip(self.running, work, logits):
            r.forwards += 1
            r.computed_rows += int(w.ids.shape[0])
            r.kv.committed = r.block * self.B  # every row before the current block is final now
            if r.forwards == 1 and self.options.prefix_cache and r.kv.committed > r.reused:
                # the prompt's whole blocks are final after the first forward: cache them now, so
                # requests admitted later share them while this one still decodes
                self.cache.insert(r.prompt, min(r.kv.committed, (len(r.prompt) // self.B) * self.B), r.kv.k, r.kv.v)
            if self._apply(r, lg):
                finished.append(r)
        for r in finished:
            self.running.remove(r)
            self.done[r.rid] = self._finish(r)
        return [self.done[r.rid] for r in finished]

    def _apply(self, r: _Req, logits: torch.Tensor) -> bool:
        """Unmask this step's tokens of r's current block; True when r is done."""
        a, b = r.block * self.B, (r.block + 1) * self.B
        blk = r.x[a:b]
        masked = blk == self.cfg.mask_token_id
        p = r.params
        tok, conf = sample_tokens(logits, p.temperature, p.top_k, p.top_p, r.generator)
        if p.edit_threshold is not None:
            if not self._edit_step(r, blk, masked, tok.cpu(), conf.cpu()):
                return False
        else:
            sel = select_transfer(conf.cpu(), masked, r.schedule[r.step], r.threshold)
            blk[sel] = tok.cpu()[sel]
            r.step += 1
            if bool((blk == self.cfg.mask_token_id).any()) and r.step < len(r.schedule):
                return False
        # the block is done (no mask left, or its steps ran out as in the published loop)
        P = len(r.prompt)
        r.finished_blocks.append(r.x[max(a, P):b].tolist())
        gen = r.x[P:b]
        if self.on_block is not None:
            self.on_block(r.rid, gen.tolist())
        eos = torch.tensor(self._stop_ids(r), dtype=torch.long)
        if bool(torch.isin(gen, eos).any()) or r.block + 1 == r.layout.num_blocks:
            return True
        r.block += 1
        r.step = 0
        r.post_steps = 0
        return False

    def _edit_step(self, r: _Req, blk: torch.Tensor, masked: torch.Tensor, tok: torch.Tensor,
                   conf: torch.Tensor) -> bool:
        """One step of LLaDA2.1's joint rule (SGLang's JointThreshold) on the current block; True
        when the block is done. Mask-to-token: the masked positions above ``threshold``, else the
        most confident one. Token-to-token: decoded (non-prompt) positions whose prediction differs
        from their token with confidence above ``edit_threshold`` are rewritten. Once no mask is
        left, at most ``max_post_edit_steps`` more steps; the block ends when a step changes
        nothing, or after block_length + max_post_edit_steps steps."""
        p = r.params
        a = r.block * self.B
        prompt = torch.arange(a, a + self.B) < len(r.prompt)
        if bool(masked.any()):
            conf_m = torch.where(masked, conf, torch.full_like(conf, float("-inf")))
            m2t = conf_m > r.threshold
            if not bool(m2t.any()):
                m2t = torch.zeros_like(masked)
                m2t[conf_m.argmax()] = True
        else:
            r.post_steps += 1
            if r.post_steps > p.max_post_edit_steps:
                return True
            m2t = torch.zeros_like(masked)
        t2t = (conf > p.edit_threshold) & (blk != tok) & ~masked & ~prompt
        change = m2t | t2t
        if not bool(change.any()):
            return True
        blk[change] = tok[change]
        r.step += 1
        return r.step >= self.B + p.max_post_edit_steps

    def _finish(self, r: _Req) -> BlockResult:
        P = len(r.prompt)
        if self.options.prefix_cache:
            # committed rows: the prompt's whole blocks, and with cache_output the answer's
            # committed blocks (their tokens and K/V are final)
            n = r.kv.committed if self.options.cache_output else min(r.kv.committed, (P // self.B) * self.B)
            self.cache.insert(r.x.tolist(), n, r.kv.k, r.kv.v)
        stop = self._stop_ids(r)
        tokens = cut_answer(r.x[P:].tolist(), r.params.max_new_tokens, stop)
        L = self.cfg.n_layers
        meta = {
            "prompt_tokens": P, "completion_tokens": len(tokens), "cached_tokens": r.reused,
            "bicache_depth": L if r.reused else 0, "reused_span": [0, r.reused], "block_length": self.B,
            "reuse_rule": "exact-block", "forwards": r.forwards, "computed_rows": r.computed_rows,
            "finish_reason": "stop" if tokens and tokens[-1] in stop else "length",
        }
        r.kv = None  # free the buffer
        return BlockResult(r.rid, tokens, meta)

    def _stop_ids(self, r: _Req) -> tuple[int, ...]:
        return self.cfg.eos_token_ids if r.params.stop_ids is None else r.params.stop_ids

    def abort(self, rid: int) -> bool:
        """Drop a waiting or running request (no result); True when it was found."""
        for q in (self.waiting, self.running):
            for r in list(q):
                if r.rid == rid:
                    q.remove(r)
                    r.kv = None
                    return True
        return False

    def finish_now(self, rid: int) -> BlockResult | None:
        """End a running request at its committed state (a stop string matched): its committed
        blocks are cached as usual; returns its result (None when not running)."""
        for r in self.running:
            if r.rid == rid:
                self.running.remove(r)
                res = self._finish(r)
                return res
        return None

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def run(self, prompts: Iterable[Sequence[int]], params: BlockParams | Sequence[BlockParams] = BlockParams()
            ) -> list[BlockResult]:
        """Submit every prompt, step until all are done; results in prompt order."""
        prompts = list(prompts)
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        rids = [self.submit(p, q) for p, q in zip(prompts, plist)]
        while any(rid not in self.done for rid in rids):
            self.step()
        return [self.done.pop(rid) for rid in rids]

    def flush_cache(self) -> None:
        self.cache.flush()
