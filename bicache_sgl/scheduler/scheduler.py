"""Admission: which waiting requests join the running batch before the next step.

Tensor-free: it sees prompts (token lists), each request's private K/V cost in positions
(``kv_tokens``), the cached length of each waiting prompt (a non-mutating peek), and the running
set, so it is tested on CPU in milliseconds.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Protocol

from radix import common_prefix_len


class Schedulable(Protocol):
    prompt: list[int]
    kv_tokens: int


class Scheduler:
    """FIFO queue with prefix-aware admission against two budgets: running requests
    (``max_running``) and private K/V positions over all running requests (``kv_budget``).

    - Waiting requests with the longest cached prefix go first (ties: arrival order).
    - When several waiting requests share a prefix that is not cached yet, only the first is
      admitted this round; it inserts the prefix after its first forward, so the others hit the
      cache when they are admitted on the next step. ``min_shared`` tokens of uncached common
      prefix trigger the deferral.
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

    def select(self, num_running: int, cached_len: Callable[[Schedulable], int]) -> list:
        """Pop and return the requests to admit now; their K/V is counted as in use until
        :meth:`finished` is called for each."""
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
        picked: list = []
        budget = self.kv_budget - self.kv_in_use
        for i in order:
            if len(picked) >= free:
                break
            r = cands[i]
            if self.prefix_aware and picked and \
                    any(common_prefix_len(p.prompt, r.prompt) >= cached[i] + self.min_shared for p in picked):
                continue  # a picked request computes this shared prefix first
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
