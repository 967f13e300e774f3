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

Logprobs (``blockdiff/logprobs.py``): a request submitted with a ``Logprobs`` recorder gets each
output token's logprob at the step that wrote it, and input logprobs from one scoring forward
(packed into its first step) on a buffer of its own. ``max_new_tokens`` 0 is a prefill-only
request: one forward that computes the prompt's whole blocks (into the prefix cache) and, with
logprobs, scores the prompt; it has no output.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from ..constrained import NoCompletion
from ..decoding.block import BlockLayout, cut_answer, effective_steps, select_transfer, transfer_schedule
from ..decoding.logprobs import Logprobs
from ..io_struct import InvalidRequest
from ..models.block_model import BlockDiffusionLM, BlockKV, RowsWork
from ..scheduler.structured import StructuredOutput
from ..scheduler.validate import check_context, check_logprob_start, check_prompt_ids
from .caches import BlockCaches
from .logprobs import BlockScore, record_written
from .params import BlockParams
from .sampling import BlockSampler


@dataclass(frozen=True)
class BlockEngineOptions:
    """prefix_cache: reuse whole prompt blocks across requests (exact); cache_output: insert a
    finished request's committed answer blocks too (multi-turn); cache_blocks: the cache's size
    in blocks; max_running: requests decoded together; kv_budget: K/V token positions over the
    running requests' windows and the cache together (blockdiff/budget.py; None: unbounded)."""

    prefix_cache: bool = True
    cache_output: bool = True
    cache_blocks: int = 4096
    max_running: int = 16
    eos_ids: tuple[int, ...] | None = None  # the model's end ids ignore_eos bans (None: config.json's)
    kv_budget: int | None = None  # K/V positions for the running windows and the cache (None: unbounded)

    def __post_init__(self) -> None:
        if self.cache_blocks < 0 or self.max_running < 1:
            raise ValueError("cache_blocks must be >= 0 and max_running >= 1")
        if self.kv_budget is not None and self.kv_budget < 1:
            raise ValueError("kv_budget must be >= 1 (or None: unbounded)")


@dataclass
class BlockResult:
    rid: int
    tokens: list[int]
    meta: dict
    structured: StructuredOutput | None = None  # the request's constraint (its final check is the caller's)


@dataclass
class _Req:
    rid: int
    prompt: list[int]
    params: BlockParams
    layout: BlockLayout
    B: int  # its block length (the request's, else the model's): its blocks, attention and cache
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
    logprobs: Logprobs | None = None  # return_logprob: the output (and input) logprob recorder
    score: BlockScore | None = None  # input logprobs: the scoring forward, until it has run
    sampler: BlockSampler | None = None  # logit processing and constraint (blockdiff/sampling.py)
    abort: dict | None = None  # why the constraint ended it (no matching output fits)

    @property
    def generates(self) -> bool:
        return self.params.max_new_tokens > 0


class BlockEngine:
    """Offline engine over a loaded ``BlockDiffusionLM``: ``submit`` requests, ``step`` (one
    forward for every running request), ``run`` until all are done."""

    def __init__(self, model: BlockDiffusionLM, options: BlockEngineOptions = BlockEngineOptions()) -> None:
        self.model, self.options = model, options
        self.cfg = model.cfg
        self.B = self.cfg.decode.block_length  # the model's; a request may name its own (BlockParams.block_length)
        # exact reuse keyed by block length (blockdiff/caches.py); cache_blocks counts the model's blocks
        self.cache = BlockCaches(options.cache_blocks * self.B if options.prefix_cache else 0)
        self.waiting: deque[_Req] = deque()
        self.running: list[_Req] = []
        self.done: dict[int, BlockResult] = {}
        self._rids = itertools.count()
        # called with (rid, the output so far, _progress) when a block is done (streaming)
        self.on_block: Callable[[int, list[int], dict], None] | None = None
        w = model.embed.weight
        self.dtype, self.device = w.dtype, w.device

    # ---- requests ------------------------------------------------------------------------------
    def submit(self, prompt: Sequence[int], params: BlockParams = BlockParams(), logprobs: Logprobs | None = None,
               logprob_start_len: int = -1) -> int:
        """Queue a request; returns its id. ``logprobs``: record its logprobs there (output
        logprobs; input logprobs from ``logprob_start_len`` when it is >= 0, or of the whole
        prompt for a prefill-only request, as the bidirectional engine defines them)."""
        prompt = [int(t) for t in prompt]
        B = params.block_length or self.B
        check_prompt_ids(prompt, self.cfg.vocab_size)
        check_context(len(prompt), params.max_new_tokens, self.cfg.max_position_embeddings, block=B)
        d = self.cfg.decode
        self.check_fits(len(prompt), params.max_new_tokens, B)
        layout = BlockLayout(len(prompt), params.max_new_tokens, B)
        steps = params.steps or d.steps
        if d.cap_steps_by_gen_length:
            steps = effective_steps(steps, params.max_new_tokens, params.minimal_topk)
        x = torch.full((layout.total_length,), self.cfg.mask_token_id, dtype=torch.long)
        x[:len(prompt)] = torch.tensor(prompt)
        if logprobs is not None:
            check_logprob_start(logprob_start_len, len(prompt))
        gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        sampler = BlockSampler(params, prompt, mask_id=self.cfg.mask_token_id,
                               eos_ids=self.options.eos_ids or self.cfg.eos_token_ids, vocab_size=self.cfg.vocab_size)
        req = _Req(next(self._rids), prompt, params, layout, B, transfer_schedule(B, steps),
                   d.threshold if params.threshold is None else params.threshold, x, None, layout.first_block,
                   generator=gen, logprobs=logprobs, sampler=sampler)
        if logprobs is not None and (not req.generates or logprob_start_len >= 0):
            req.score = BlockScore(logprobs, prompt, logprob_start_len, self.cfg.mask_token_id, B)
        self.waiting.append(req)
        return req.rid

    def check_fits(self, prompt_len: int, max_new_tokens: int, block_length: int | None = None) -> None:
        """A request's window (prompt + max_new_tokens in whole blocks of ``block_length``, None:
        the model's) fits the whole K/V budget; one that does not could never be admitted (it
        would wait forever)."""
        budget = self.options.kv_budget
        B = block_length or self.B
        total = BlockLayout(prompt_len, max_new_tokens, B).total_length
        if budget is not None and total > budget:
            raise InvalidRequest(f"the prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) in whole "
                                 f"blocks of {B} needs {total} K/V positions, over the whole K/V budget of "
                                 f"{budget} (--max-total-tokens)", "max_new_tokens")

    @property
    def kv_in_use(self) -> int:
        """K/V positions held now: the running requests' windows and the cached blocks."""
        return self._windows() + self.cache.n_tokens

    def _windows(self) -> int:
        return sum(r.layout.total_length for r in self.running)

    def _cache_room(self, B: int) -> int:
        """Blocks of length B the cache may hold beside the running windows and the other block
        lengths' blocks (blockdiff/caches.py)."""
        budget = self.options.kv_budget
        return self.cache.room(B, None if budget is None else budget - self._windows())

    def _admit(self) -> None:
        """Admit waiting requests in arrival order while there is a running slot and (with a
        budget) room for the next one's whole window: least-recently-used cache leaves are evicted
        to make it; when the running windows alone leave too little, it waits (head of line)."""
        budget = self.options.kv_budget
        while self.waiting and len(self.running) < self.options.max_running:
            r = self.waiting[0]
            room = None if budget is None else budget - self._windows() - r.layout.total_length
            if room is not None and room < 0:
                break  # only finishing requests make room: evicting the cache would not
            self.waiting.popleft()
            hit = []
            B = r.B
            if self.options.prefix_cache and r.params.use_cache:
                # whole prompt blocks only, computed with this request's block length (never another
                # length's: blockdiff/caches.py): the block holding the prompt's tail is computed; the
                # match touches its path, so the eviction below takes it last
                hit = self.cache.of(B).match(r.prompt, (len(r.prompt) // B) * B)
            if room is not None:
                # the caches keep at most room positions, the other block lengths' blocks evicted
                # first; the matched path is the newest, so it goes last, deepest block first: the
                # blocks that survive are hit[:keep], and the references to the others are dropped
                # before the window is allocated (exact budget)
                keep = self.cache.make_room(B, room)
                del hit[keep:]
            r.kv = BlockKV.empty(self.cfg, r.layout.total_length, self.dtype, self.device)
            if hit:
                for b, (k, v) in enumerate(hit):
                    r.kv.k[:, b * B:(b + 1) * B] = k
                    r.kv.v[:, b * B:(b + 1) * B] = v
                r.reused = len(hit) * B
                r.kv.committed = r.reused
            if r.score is not None:
                r.score.admit(self.cfg, hit, self.dtype, self.device)
            self.running.append(r)

    # ---- one step ------------------------------------------------------------------------------
    def step(self) -> list[BlockResult]:
        """One forward for every running request; returns the requests that finished."""
        self._admit()
        if not self.running:
            return []
        work = []
        for r in self.running:
            # a prefill-only request computes its whole prompt blocks (no logits)
            start, end = r.kv.committed, (r.block + 1 if r.generates else r.block) * r.B
            work.append(RowsWork(r.x[start:end], start, r.kv, logit_from=r.block * r.B - start, block_length=r.B))
        # input logprobs: each new request's scoring rows ride on the same forward
        scores = [r for r in self.running if r.score is not None and r.score.pending]
        packed = [w for w in work if w.ids.numel()] + [r.score.work() for r in scores]
        it = iter(self.model.forward_rows(packed) if packed else [])
        logits = [next(it) if w.ids.numel() else None for w in work]
        for r, lg in zip(scores, it):
            r.computed_rows += r.score.rows
            r.score.take(lg)
        finished = []
        for r, w, lg in zip(self.running, work, logits):
            r.forwards += 1
            r.computed_rows += int(w.ids.shape[0])
            r.kv.committed = r.block * r.B  # every row before the current block is final now
            if r.forwards == 1 and self.options.prefix_cache and r.params.use_cache and r.kv.committed > r.reused:
                # the prompt's whole blocks are final after the first forward: cache them now, so
                # requests admitted later share them while this one still decodes
                self.cache.of(r.B).insert(r.prompt, min(r.kv.committed, (len(r.prompt) // r.B) * r.B), r.kv.k,
                                          r.kv.v, room=self._cache_room(r.B))
            if not r.generates:
                finished.append(r)
                continue
            if self._apply(r, lg):
                finished.append(r)
        for r in finished:
            self.running.remove(r)
            self.done[r.rid] = self._finish(r)
        return [self.done[r.rid] for r in finished]

    def _apply(self, r: _Req, logits: torch.Tensor) -> bool:
        """Unmask this step's tokens of r's current block; True when r is done."""
        a, b = r.block * r.B, (r.block + 1) * r.B
        blk = r.x[a:b]
        masked = blk == self.cfg.mask_token_id
        try:  # the processed logits' decision (under a constraint: its path on the masked rows)
            tok, conf, processed = r.sampler.decide(logits, r.x, a, b, r.generator)
        except NoCompletion as e:
            r.abort = r.sampler.no_completion(str(e), max(a - len(r.prompt), 0))
            return True
        before = blk.clone() if r.logprobs is not None else None
        if r.params.edit_threshold is not None:
            block_done = self._edit_step(r, blk, masked, tok, conf)
        else:
            sel = select_transfer(conf, masked, r.schedule[r.step], r.threshold)
            blk[sel] = tok[sel]
            r.step += 1
            block_done = not bool((blk == self.cfg.mask_token_id).any()) or r.step >= len(r.schedule)
        if before is not None:  # the logprobs of what this step wrote, under the logits it decided on
            record_written(r.logprobs, processed, before, blk, a, r.params.top_k, r.params.top_p)
        if not block_done:
            return False
        # the block is done (no mask left, or its steps ran out as in the published loop)
        P = len(r.prompt)
        r.abort = r.sampler.advance(r.x, a, b)
        if r.abort is not None:
            return True
        r.finished_blocks.append(r.x[max(a, P):b].tolist())
        gen = r.x[P:b]
        if self.on_block is not None:
            self.on_block(r.rid, gen.tolist(), self._progress(r))
        eos = torch.tensor(self._stop_ids(r), dtype=torch.long)
        # an end id ends the answer from min_new_tokens on (before it the sampler bans end ids;
        # one still lands there only when every other token is banned too)
        if bool(torch.isin(gen[r.params.min_new_tokens:], eos).any()) or r.block + 1 == r.layout.num_blocks:
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
        a = r.block * r.B
        prompt = torch.arange(a, a + r.B) < len(r.prompt)
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
        if bool(t2t.any()) and r.sampler.structured is not None:
            # under a constraint only edits that keep the block on a matching path
            t2t = r.sampler.viable_edits(r.x, a, a + r.B, m2t, t2t, tok, conf)
        change = m2t | t2t
        if not bool(change.any()):
            return True
        blk[change] = tok[change]
        r.step += 1
        return r.step >= r.B + p.max_post_edit_steps

    def _finish(self, r: _Req) -> BlockResult:
        P = len(r.prompt)
        if self.options.prefix_cache and r.params.use_cache:
            # committed rows: the prompt's whole blocks, and with cache_output the answer's
            # committed blocks (their tokens and K/V are final)
            n = r.kv.committed if self.options.cache_output else min(r.kv.committed, (P // r.B) * r.B)
            # r is out of the running windows already; its buffer is freed right after the copy
            self.cache.of(r.B).insert(r.x.tolist(), n, r.kv.k, r.kv.v, room=self._cache_room(r.B))
        stop = self._stop_ids(r)
        # aborted by its constraint: the committed blocks only (the current one is not final)
        tokens = cut_answer(r.x[P:max(P, r.block * r.B) if r.abort else None].tolist(), r.params.max_new_tokens,
                            stop, r.params.min_new_tokens)
        stopped = len(tokens) > r.params.min_new_tokens and tokens[-1] in stop
        meta = {**self._progress(r), "completion_tokens": len(tokens),
                "finish_reason": "abort" if r.abort else "stop" if stopped else "length"}
        if r.abort:
            meta["abort"] = r.abort  # {"type": "abort", "message": ...}
        r.kv = None  # free the buffer
        return BlockResult(r.rid, tokens, meta, r.sampler.structured)

    def _progress(self, r: _Req) -> dict:
        """The request's reuse and work so far (known from admission on; every event carries it):
        the reused span ``[0, R)`` (whole blocks, full depth), forwards and computed rows."""
        P, L = len(r.prompt), self.cfg.n_layers
        return {"prompt_tokens": P, "cached_tokens": r.reused, "bicache_depth": L if r.reused else 0,
                "reused_span": [0, r.reused], "sequence_tokens": P + r.params.max_new_tokens,
                "block_length": r.B, "reuse_rule": "exact-block", "forwards": r.forwards,
                "computed_rows": r.computed_rows}

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
