"""The scheduler: waiting and running requests, admission, and one step's bookkeeping.

A step is ``schedule() -> Batch``, the model runner's forward over ``batch.works``, then
``postprocess(batch, logits)`` (nano-vllm's shape). :class:`Scheduler` owns the requests, the cache
manager, the online audit and the request factory: it admits (the cache manager matches, locks and
plans each request's reuse; the audit picks the requests it audits), plans every running request's
sequences (the audit adds its shadows), commits the captures of the requests whose first forward
just ran, lets each request consume its logits (the audit's first: it records and swaps), and
retires the finished requests. It never runs the model.

:class:`Admission` is the admission rule alone, tensor-free: it sees prompts (int64 token arrays), each
request's private K/V cost in positions (``kv_tokens``), the cached length of each waiting prompt
(a non-mutating peek), and the running set, so it is tested on CPU in milliseconds.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from radix import common_prefix_len

from ..bicache.audit import OnlineAudit
from ..config import SamplingParams
from ..decoding import decide_greedy
from ..io_struct import GenerateRequest

if TYPE_CHECKING:
    from ..bicache.audit import DepthAudit
    from ..bicache.planner import RequestFacts
    from ..kv_cache.manager import CacheGrant, CacheManager
    from ..kv_cache.pool import KVPool
    from ..kv_cache.store import SeqKV
    from ..models.forward_batch import SeqWork
    from .factory import RequestFactory
    from .request import Req

log = logging.getLogger(__name__)


class Schedulable(Protocol):
    prompt_ids: np.ndarray  # int64 [prompt_len]: compared vectorised, never converted per step
    kv_tokens: int
    internal: bool  # an output capture: the engine's prefill of a finished request's prompt + answer


class Admission:
    """FIFO queue with prefix-aware admission against two budgets: running requests
    (``max_running``) and private K/V positions over all running requests (``kv_budget``).

    - Waiting requests with the longest cached prefix go first (ties: arrival order).
    - When several waiting requests share a prefix that is not cached yet, only the first is
      admitted this round; it inserts the prefix after its first forward, so the others hit the
      cache when they are admitted on the next step. ``min_shared`` tokens of uncached common
      prefix trigger the deferral, and only for a request that could reuse them (``reusable``:
      the policy gives depth > 0 to that shared length in its generation mode): waiting a
      forward for a prefix it will recompute anyway only splits the batch (SGLang's
      generated-shared-prefix requests, ``ignore_eos``, on a model whose ignore_eos table is 0).
      A cached prefix the request could not reuse at that length counts as not cached: a
      prefill-only hint's rows (context: the prefix alone) serve a question only at b(hint / N);
      the first question re-captures them (docs/prefix_cache.md), and the rest wait one
      forward to reuse its rows.
    - A request that shares with an earlier waiting output capture (``internal``: a finished
      turn's prompt + answer, queued for the cache) more than is cached of either prompt (the
      capture will insert part of this prompt: the next turn continues into the answer) waits
      for that capture whatever the length: the capture exists for the next turn to reuse it,
      and an answer is often shorter than ``min_shared``.
    - A request whose K/V does not fit the budget left waits (and so does everything behind it
      in the order, so a large request is never starved by smaller ones).
    """

    def __init__(self, max_running: int, kv_budget: int, *, prefix_aware: bool = True, min_shared: int = 16) -> None:
        if max_running < 1 or kv_budget < 1:
            raise ValueError("max_running and kv_budget must be >= 1")
        self.max_running, self.kv_budget = max_running, kv_budget
        self.prefix_aware, self.min_shared = prefix_aware, min_shared
        self.waiting: deque = deque()
        self.kv_in_use = 0  # private K/V positions held by admitted, unfinished requests

    def add(self, req: Schedulable) -> None:
        self.waiting.append(req)

    def remove(self, req: Schedulable) -> bool:
        try:
            self.waiting.remove(req)
            return True
        except ValueError:
            return False

    def select(self, num_running: int, cached_len: Callable[[Schedulable], int],
               reusable: Callable[[Schedulable, int], bool] | None = None) -> list:
        """Pop and return the requests to admit now; their K/V is counted as in use until
        :meth:`finished` is called for each. ``reusable(r, n)``: whether ``r`` could reuse ``n``
        leading tokens once cached (None: any request could)."""
        free = self.max_running - num_running
        if free <= 0 or not self.waiting:
            return []
        cands = list(self.waiting)
        if self.prefix_aware:
            cached = [cached_len(r) for r in cands]
            order = sorted(range(len(cands)), key=lambda i: (-cached[i], i))
        else:
            cached = [0] * len(cands)
            order = list(range(len(cands)))
        # waiting output captures with their arrival index: a request waits only for captures
        # queued before it, so the earliest never waits for another (no cycle)
        captures = [(j, r) for j, r in enumerate(cands) if r.internal] if self.prefix_aware else []
        picked: list = []
        budget = self.kv_budget - self.kv_in_use
        for i in order:
            if len(picked) >= free:
                break
            r = cands[i]
            if self.prefix_aware and picked:
                shared = max(common_prefix_len(p.prompt_ids, r.prompt_ids) for p in picked)
                # what is cached counts only if it could serve r (a prefill-only hint's rows
                # serve only up to b(hint / N), often 0: then a picked request re-captures it)
                base = cached[i] if reusable is None or not cached[i] or reusable(r, cached[i]) else 0
                if shared >= base + self.min_shared and (reusable is None or reusable(r, shared)):
                    continue  # a picked request computes this shared prefix first
            if any(j < i and common_prefix_len(c.prompt_ids, r.prompt_ids) > max(cached[i], cached[j])
                   for j, c in captures):
                continue  # a pending output capture (picked or not yet) inserts more of this prompt
            if r.kv_tokens > budget:
                break
            budget -= r.kv_tokens
            picked.append(r)
        for r in picked:
            self.waiting.remove(r)
            self.kv_in_use += r.kv_tokens
        return picked

    def finished(self, req: Schedulable) -> None:
        """An admitted request left the running set: its K/V is free again."""
        self.kv_in_use -= req.kv_tokens


@dataclass
class Batch:
    """One step's work: the running requests in order, each with how many sequences it planned
    (``works`` is their concatenation, what the model runner packs into one forward); ``failed``:
    clients' requests that failed at admission this step, already finished with their error and
    retired (they are in no forward: their final event is due now, not after one)."""

    reqs: list[tuple[Req, int]] = field(default_factory=list)
    works: list[SeqWork] = field(default_factory=list)
    failed: list[Req] = field(default_factory=list)


class Scheduler:
    """Owns waiting and running requests, the cache manager, the request factory, the online
    audit of ``audit`` (None: no audit) and the pool the requests' private K/V comes from (module
    docstring): admitted requests' buffers within the admission budget (``KVPool.alloc_request``),
    an audit shadow's outside it (the audit's). Not thread-safe: the engine drives it from its one
    step thread."""

    def __init__(self, admission: Admission, cache: CacheManager, requests: RequestFactory, pool: KVPool,
                 n_layers: int, *, audit: DepthAudit | None = None, cache_output: bool = False,
                 context_length: int = 0) -> None:
        self.admission, self.cache, self.requests, self.pool = admission, cache, requests, pool
        self.n_layers, self.audit = n_layers, OnlineAudit(audit, pool)
        self.cache_output, self.context_length = cache_output, context_length
        self.running: list[Req] = []
        self.stats = {"num_forward_passes": 0, "num_finished_reqs": 0, "generated_tokens": 0,
                      "computed_layer_tokens": 0, "skipped_layer_tokens": 0}
        self.finish_reasons: dict[str, int] = {"stop": 0, "length": 0, "abort": 0}
        # matched prompt tokens of finished requests per depth they were served at (0: computed)
        self.reused_tokens_by_depth: dict[int, int] = {}
        self.output_captures = 0  # finished requests whose prompt + answer were queued for the cache

    # -------------------------------------------------------------------------------- queue
    @property
    def waiting(self) -> deque:
        return self.admission.waiting

    def add(self, req: Req) -> None:
        self.admission.add(req)

    def remove_waiting(self, req: Req) -> bool:
        """Take a request that was not admitted yet out of the queue (an abort)."""
        return self.admission.remove(req)

    def has_work(self) -> bool:
        return bool(self.running or self.admission.waiting)

    def num_waiting(self) -> int:
        """Clients' requests waiting (the engine's own output captures are not counted)."""
        return sum(not r.internal for r in self.admission.waiting)

    # --------------------------------------------------------------------------------- step
    def schedule(self) -> Batch:
        """Admit what fits, then the sequences every running request contributes to the next
        forward (a request that fails while planning is finished with its error, not batched; one
        that fails at admission is retired and listed in ``batch.failed``, for its event)."""
        batch = Batch(failed=self._admit())
        for req in self.running:
            try:
                ws = self.audit.add(req, req.plan_step(self.n_layers))
            except Exception as e:
                log.exception("request %s failed while planning", req.rid)
                req.fail(f"internal error: {type(e).__name__}: {e}", "error")
                continue
            batch.works.extend(ws)
            batch.reqs.append((req, len(ws)))
        return batch

    def postprocess(self, batch: Batch, logits: list[Any]) -> list[Req]:
        """After the forward: commit the captures of the requests whose first forward this was,
        let each request consume its logits (an audited one after the audit recorded and swapped
        it onto its exact forward). Returns the requests to emit an event
        for (a block became final, or the request finished and was retired), in order."""
        self.stats["num_forward_passes"] += 1
        emit: list[Req] = []
        decisions = self._decide_greedy(batch, logits)
        i = 0
        for req, n in batch.reqs:
            parts, i = logits[i:i + n], i + n
            if req.finished:  # failed while planning: its works were not in the batch
                continue
            if req.grant.capture is not None:  # its first forward just wrote the capture
                self.cache.commit(req.prompt_ids, req.grant, req.capture_len)
            try:
                block_done = req.apply(self.audit.apply(req, parts), self.n_layers, decisions.get(id(req)))
            except Exception as e:
                log.exception("request %s failed", req.rid)
                req.fail(f"internal error: {type(e).__name__}: {e}", "error")
                continue
            if block_done and not req.finished:
                emit.append(req)
        return emit + self.retire_finished()

    @staticmethod
    def _decide_greedy(batch: Batch, logits: list[Any]) -> dict[int, tuple[Any, Any]]:
        """The decisions of every ``greedy_threshold`` request of the batch, made together
        (``decoding.decide_greedy``), keyed by ``id(req)``; the others decide on their own."""
        reqs, parts, i = [], [], 0
        for req, n in batch.reqs:
            if n == 1 and not req.finished and req.greedy_threshold:
                reqs.append(req)
                parts.append(logits[i])
            i += n
        if not reqs:
            return {}
        try:
            made = decide_greedy(parts, [r.banned_ids for r in reqs])
        except Exception:  # each request then decides (and fails, if it must) on its own
            log.exception("the batched greedy decision failed")
            return {}
        return {id(r): d for r, d in zip(reqs, made)}

    def fail_batch(self, batch: Batch, e: Exception) -> list[Req]:
        """The forward failed: every request of the batch ends with the error."""
        for req, _ in batch.reqs:
            req.fail(f"internal error in the forward pass: {type(e).__name__}: {e}", "error")
        return self.retire_finished()

    def _reusable(self, req: Req, shared: int) -> bool:
        """Whether ``req`` could reuse ``shared`` leading tokens captured by a request like it: the
        engine's depth for that fraction of its sequence in its generation mode (an output capture
        stores for the next turn, whatever it is: always)."""
        if req.internal:
            return True
        return self.cache.policy.target_depth(shared / max(req.seq_len, 1), req.gen_mode) > 0

    def _admit(self) -> list[Req]:
        """Admit what fits: the request takes its private buffers and the cache manager's grant
        (``Req.admit``), the audit picks it or not, its K/V points at the rows it reuses. Returns
        the clients' requests that failed meanwhile: finished with the error and retired
        (everything they took given back), their final event not sent yet."""
        failed: list[Req] = []
        if not self.admission.waiting:
            return failed
        for req in self.admission.select(len(self.running), lambda r: self.cache.peek(r.prompt_ids), self._reusable):
            self.running.append(req)
            try:
                facts = self.audit.probe(req, req.facts())  # drawn to probe deeper, or not
                req.admit(*self._take(req, facts))
                self.audit.admit(req, facts)  # its shadow, or no reuse when there is no room for one
                self.cache.share(req.grant, req.kv)
            except Exception as e:
                log.exception("admitting request %s failed", req.rid)
                req.fail(f"internal error: {type(e).__name__}: {e}", "error")
                self.retire(req)
                if not req.internal:
                    failed.append(req)
        return failed

    def _take(self, req: Req, facts: RequestFacts) -> tuple[list[SeqKV], CacheGrant]:
        """What admission gives ``req``: its private buffers from the pool (``Req.kv_lengths``)
        and the cache manager's grant, all or none (what was taken before a failure goes back:
        the request holds nothing yet, so retiring it could not)."""
        kvs: list[SeqKV] = []
        try:
            for n in req.kv_lengths():
                kvs.append(self.pool.alloc_request(n))
            return kvs, self.cache.admit(req.prompt_ids, facts)
        except Exception:
            for kv in kvs:
                self.pool.free_seq(kv)
            raise

    # ----------------------------------------------------------------------------- retiring
    def retire_finished(self) -> list[Req]:
        """Retire every finished running request; returns the clients' ones (to emit)."""
        done = [r for r in self.running if r.finished]
        for req in done:
            self.retire(req)
        return [r for r in done if not r.internal]

    def retire(self, req: Req) -> None:
        """The request leaves: budget, cache locks and buffers back; counted in the stats."""
        if req in self.running:
            self.running.remove(req)
            self.admission.finished(req)
        self.cache.release(req.grant)
        for kv in req.detach_kv():
            self.pool.free_seq(kv)
        self.audit.release(req)
        if req.internal:
            return
        self._capture_output(req)
        st = self.stats
        st["num_finished_reqs"] += 1
        reason = (req.finish_reason or {}).get("type", "abort")
        self.finish_reasons[reason] = self.finish_reasons.get(reason, 0) + 1
        st["generated_tokens"] += len(req.out_ids)
        st["computed_layer_tokens"] += req.computed_layer_tokens
        st["skipped_layer_tokens"] += req.skipped_layer_tokens
        for d, n in req.reused_by_depth().items():
            self.reused_tokens_by_depth[d] = self.reused_tokens_by_depth.get(d, 0) + n

    def _capture_output(self, req: Req) -> None:
        """Multi-turn reuse: queue one prefill-only forward over a finished request's prompt and
        answer, which inserts them into the prefix cache. The answer's state is captured where it
        is final (no masks left), in the context of exactly this conversation so far; turn 2 then
        reuses it as far as the capture-context rule allows (docs/prefix_cache.md)."""
        if not (self.cache_output and self.cache.enabled and self.cache.policy.max_node_depth > 0):
            return
        reason = (req.finish_reason or {}).get("type")
        if not req.generates or reason not in ("stop", "length") or not req.out_ids:
            return
        ids = req.prompt + [t for t in req.out_ids if t != req.mask_id]
        if len(ids) > self.context_length:
            return
        try:
            cap = self.requests.build(GenerateRequest(ids, SamplingParams(max_new_tokens=0)), None, internal=True)
        except ValueError:  # nothing to capture that the engine would accept
            return
        self.output_captures += 1
        self.admission.add(cap)
