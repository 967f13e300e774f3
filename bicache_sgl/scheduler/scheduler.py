"""Admission policy: which waiting requests join the running batch before the next step.

Tensor-free: it sees prompts (token lists), the radix match length per waiting request, and the
running count, so it is tested on CPU in milliseconds.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Protocol, Sequence


class _HasPrompt(Protocol):
    prompt: list[int]


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Scheduler:
    """FIFO queue with prefix-aware admission.

    - Waiting requests with the longest cached prefix go first (ties: arrival order).
    - When several waiting requests share a prefix that is not cached yet, only the first is
      admitted this round; it inserts the prefix after its first forward, so the others hit the
      cache when they are admitted on the next step. ``min_shared`` tokens of uncached common
      prefix trigger the deferral.
    """

    def __init__(self, max_running: int, min_shared: int = 16, prefix_aware: bool = True) -> None:
        self.max_running = max_running
        self.min_shared, self.prefix_aware = min_shared, prefix_aware
        self.waiting: deque = deque()

    def add(self, req) -> None:
        self.waiting.append(req)

    def remove(self, req) -> bool:
        try:
            self.waiting.remove(req)
            return True
        except ValueError:
            return False

    def select(self, num_running: int, match_len: Callable[[_HasPrompt], int]) -> list:
        """Pop and return the requests to admit now."""
        free = self.max_running - num_running
        if free <= 0 or not self.waiting:
            return []
        cands = list(self.waiting)
        if self.prefix_aware:
            cached = {id(r): match_len(r) for r in cands}
            order = sorted(range(len(cands)), key=lambda i: (-cached[id(cands[i])], i))
        else:
            cached = {}
            order = list(range(len(cands)))
        picked: list = []
        for i in order:
            if len(picked) >= free:
                break
            r = cands[i]
            if self.prefix_aware and picked:
                have = cached[id(r)]
                if any(common_prefix_len(p.prompt, r.prompt) >= have + self.min_shared for p in picked):
                    continue  # a picked request computes this shared prefix first
            picked.append(r)
        if not picked and cands:
            picked.append(cands[0])
        for r in picked:
            self.waiting.remove(r)
        return picked
