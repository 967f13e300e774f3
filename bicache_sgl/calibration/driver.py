"""The one measurement driver: the items to measure, the meters on the already loaded model, the
measurement loop (budget, progress) and the per-(group, bucket) tallies.

Two thin front ends use it: the command line (``bicache_sgl/calibrate.py``: every item once, the
criterion's meters, JSON + plot) and the first-run profile (``auto``: stages under a wall-clock
budget, a cache on disk). Neither loads weights: both hand over the model their caller loaded,
and for the agreement meter a measurement stack built on that same model by the engine layer
(``bicache_sgl.engine.engine.measurement_stack``; duck-typed here as ``MeasureStack``, since this
package sits below the engine).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from .data import Sample, Task, first_request_rest
from .measure import AgreementMeter, NothingReused, SimilarityMeter, mean_rows


@dataclass
class Item:
    """One measurement: a sample of a group at a bucket (``task``), with the prompt tokens after S
    of the first request that computed S (``context``; None: the prefix-only cached state).
    ``round``: its index among the items of its (group, bucket)."""

    group: str
    round: int
    sample: Sample
    task: Task
    context: list[int] | None


class MeasureStack(Protocol):
    """What the agreement meter runs requests on (``bicache_sgl.engine.engine.Engine`` is one): a
    ``naive`` prefix cache on the loaded model, stepped on the caller's thread."""

    model: Any
    n_layers: int

    def flush(self) -> None: ...

    def run_sync(self, greqs: Sequence[Any]) -> list[Any]: ...


def items_for(samples: Sequence[Sample], tasks: Sequence[Task], group: str, cached_context: str) -> list[Item]:
    """The tasks of one group's samples as items, in order. ``first_request``: a task without
    another sample of the group to give the first request's question is dropped; ``prefix_only``:
    every task, with no context."""
    items: list[Item] = []
    rounds: dict[int, int] = {}
    for t in tasks:
        ctx = None
        if cached_context == "first_request":
            rest = first_request_rest(samples, t)
            if rest is None:
                continue
            ctx = list(rest)
        n = rounds.get(t.bucket, 0)
        rounds[t.bucket] = n + 1
        items.append(Item(group, n, samples[t.sample], t, ctx))
    return items


def by_rounds(items: Sequence[Item], n_buckets: int) -> list[Item]:
    """Round by round, and within a round the buckets from high r down (then the groups by
    name): a measurement cut short by a budget leaves the LOW buckets unmeasured."""
    cells: dict[tuple[str, int], list[Item]] = {}
    for it in items:
        cells.setdefault((it.group, it.task.bucket), []).append(it)
    groups = sorted({it.group for it in items})
    order = []
    for rnd in range(max((len(v) for v in cells.values()), default=0)):
        for b in reversed(range(n_buckets)):
            for g in groups:
                lst = cells.get((g, b), [])
                if rnd < len(lst):
                    order.append(lst[rnd])
    return order


class Tally:
    """Rows measured per (group, bucket)."""

    def __init__(self) -> None:
        self.rows: dict[tuple[str, int], list[list[float]]] = {}

    def add(self, item: Item, row: list[float]) -> None:
        self.rows.setdefault((item.group, item.task.bucket), []).append(row)

    def get(self, group: str, bucket: int) -> list[list[float]]:
        return self.rows.get((group, bucket), [])

    def mean(self, group: str, bucket: int) -> list[float] | None:
        return mean_rows(self.get(group, bucket))


class Driver:
    """Measurements on one loaded model. ``model``: the loaded ``DiffusionLM`` (the similarity
    meter runs its dense forward); ``stack``: where the agreement meter runs requests (it must hold
    that same model: nothing here loads weights); ``clock``: the budget's clock (seconds)."""

    def __init__(self, model: Any, mask_id: int, device: Any, stack: MeasureStack | None = None, *,
                 gen_length: int, log: logging.Logger, clock: Callable[[], float] = time.monotonic) -> None:
        if stack is not None and stack.model is not model:
            raise ValueError("the measurement stack must run the driver's model (one copy of the weights)")
        self.model, self.stack, self.log, self.clock = model, stack, log, clock
        self._sim = SimilarityMeter(model, mask_id, device)
        self._agr = AgreementMeter(stack, gen_length) if stack is not None else None

    def similarity(self, item: Item) -> tuple[list[float], list[float], list[float]]:
        """Per-layer (K, V, h) similarity of S, cached state against in context."""
        return self._sim.measure(item.sample, item.task, item.context)

    def agreement(self, item: Item, sampling: dict,
                  max_depth: int | None = None) -> tuple[list[float], list[list[int]]]:
        """Agreement with depth 0 at each depth 0..``max_depth`` (default L), and the outputs."""
        if self._agr is None:
            raise RuntimeError("the agreement meter needs a measurement stack")
        return self._agr.measure(item.sample, item.task, sampling, item.context, max_depth=max_depth)

    def run(self, label: str, items: Sequence[Item], measure: Callable[[Item], None], *,
            deadline: float | None = None, soft_deadline: float | None = None,
            give_up: Callable[[int], str | None] | None = None, bar: bool | None = None,
            postfix: Callable[[Item], str] | None = None) -> tuple[int, str | None]:
        """Measure ``items`` in order until done or out of time. Progress: a bar on stderr (``bar``
        True: always, None: on a terminal only, False: never; ``postfix(item)`` beside it) and log
        lines at 0/25/50/75/100 % (the quarters only for 8 items or more). An item is not started
        if the mean time of those before it would overrun ``deadline``; past ``soft_deadline`` only
        round 0 is finished; ``give_up(done)`` may end early with a reason. Returns (how many ran,
        the give-up reason or None)."""
        from tqdm import tqdm

        total = len(items)
        if total == 0:
            self.log.info("%s: nothing to measure", label)
            return 0, None
        t0 = self.clock()
        self.log.info("%s: 0%% (0/%d)", label, total)
        done, next_mark, stopped, reason = 0, 25, "", None
        skipped = 0  # items whose shared prefix the runtime would not reuse at all (NothingReused)
        progress = tqdm(total=total, desc=label, unit="item", disable=None if bar is None else not bar,
                        file=sys.stderr, dynamic_ncols=True)
        try:
            for it in items:
                now = self.clock()
                est = (now - t0) / done if done else 0.0
                if deadline is not None and now + est > deadline:
                    stopped = "budget spent"
                    break
                if soft_deadline is not None and it.round > 0 and now + est > soft_deadline:
                    stopped = "its share of the budget spent"
                    break
                reason = give_up(done) if give_up is not None else None
                if reason:
                    stopped = reason
                    break
                if postfix is not None:
                    progress.set_postfix_str(postfix(it), refresh=False)
                try:
                    measure(it)
                except NothingReused:  # the span cut leaves nothing to reuse: no evidence either way
                    skipped += 1
                done += 1
                progress.update()
                pct = 100 * done // total
                if pct >= next_mark and done < total and total >= 8:
                    self.log.info("%s: %d%% (%d/%d, %.1f s)", label, pct, done, total, self.clock() - t0)
                    while next_mark <= pct:
                        next_mark += 25
        finally:
            progress.close()
        self.log.info("%s: %d%% (%d/%d) in %.1f s%s%s", label, 100 * done // total, done, total, self.clock() - t0,
                      f", {skipped} skipped (nothing reused before the span cut)" if skipped else "",
                      f", stopped: {stopped}" if stopped else "")
        return done, reason
