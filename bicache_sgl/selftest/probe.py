"""Throughput probe: cache off vs bicache on the bundled model, few-shot shared-prefix workload.

Each round is a fresh set of held-out families of the bundled task (``FAMILIES`` families x
``QUESTIONS`` questions behind a ``SHOTS``-shot prefix, r ~ 0.7), submitted all at once to each
mode's engine (default serving flags: dual in-request cache, threshold 0.9); the modes alternate
which runs first. Rounds go on until the timed rounds of both modes add up to the time asked
for (at least one each); one untimed warm-up round per mode comes first. Output tokens/s =
completion tokens / seconds inside ``generate``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..io_struct import span_depth
from ..training.task import heldout_items
from .battery import EngineFactory
from .report import INFO, Row, skipped

SECTION = "throughput"
FAMILIES, QUESTIONS, SHOTS = 4, 6, 6
PROBE_PARAMS = {"max_new_tokens": 32, "temperature": 0}
MODES = ("off", "bicache")
WARMUP_SEED = 10_000  # families of the warm-up round (the timed rounds use seeds 0, 1, ...)


@dataclass
class ModeTotals:
    tokens: int = 0
    requests: int = 0
    seconds: float = 0.0
    depth_sum: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens found in the prefix cache (reused or not)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def _prompts(seed: int) -> list[str]:
    items = heldout_items(FAMILIES * QUESTIONS, num_shots=SHOTS, seed=seed, questions_per_family=QUESTIONS)
    return [it["prompt"] for it in items]


def throughput_rows(make_engine: EngineFactory, seconds: float) -> list[Row]:
    """Rows for cache off, bicache and their ratio (INFO: measurements, nothing to fail)."""
    if seconds <= 0:
        return [Row(SECTION, "bicache / off", skipped("--probe-seconds 0"))]
    engines = {m: make_engine(m) for m in MODES}
    totals = {m: ModeTotals() for m in MODES}
    same = compared = 0
    try:
        for m in MODES:
            engines[m].generate(_prompts(WARMUP_SEED), PROBE_PARAMS)
        rnd = 0
        while rnd == 0 or sum(t.seconds for t in totals.values()) < seconds:
            prompts = _prompts(rnd)
            texts = {}
            for m in (MODES if rnd % 2 == 0 else MODES[::-1]):
                t0 = time.perf_counter()
                outs = engines[m].generate(prompts, PROBE_PARAMS)
                tot = totals[m]
                tot.seconds += time.perf_counter() - t0
                tot.tokens += sum(o["meta_info"]["completion_tokens"] for o in outs)
                tot.requests += len(outs)
                tot.depth_sum += sum(span_depth(o["meta_info"]) for o in outs)
                tot.prompt_tokens += sum(o["meta_info"]["prompt_tokens"] for o in outs)
                tot.cached_tokens += sum(o["meta_info"]["cached_tokens"] for o in outs)
                texts[m] = [o["text"] for o in outs]
            same += sum(a == b for a, b in zip(texts["off"], texts["bicache"]))
            compared += len(prompts)
            rnd += 1
    finally:
        for eng in engines.values():
            eng.shutdown()
    off, bic = totals["off"], totals["bicache"]

    def line(t: ModeTotals) -> str:
        return f"{t.tokens_per_s:.1f} output tok/s ({t.tokens} tokens, {t.requests} requests, {t.seconds:.1f} s)"
    ratio = bic.tokens_per_s / off.tokens_per_s if off.tokens_per_s else float("nan")
    cached = bic.cached_tokens / max(1, bic.prompt_tokens)
    reuse = (f"; mean depth {bic.depth_sum / max(1, bic.requests):.2f}, {cached:.0%} of prompt tokens cached, "
             f"answers equal to off {same}/{compared}")
    return [
        Row(SECTION, "cache off", INFO, line(off)),
        Row(SECTION, "bicache", INFO, line(bic) + reuse),
        Row(SECTION, "bicache / off", INFO, f"{ratio:.2f}x ({rnd} rounds of {FAMILIES} families x {QUESTIONS} "
                                            f"questions, {SHOTS}-shot prefixes)"),
    ]
