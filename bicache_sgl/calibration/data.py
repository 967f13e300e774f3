"""Calibration data: prompt records from jsonl, their tokens, and the (sample, bucket) tasks.

Pure Python (no torch, no engine): what is measured is decided here, how it is measured is in
``measure``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from radix import common_prefix_len

# the buckets calibration measures, defined with the profile (the online audit earns depth in them too)
from ..bicache.profile import DEFAULT_FRACTIONS  # noqa: F401  (re-exported: calibration's name for them)

log = logging.getLogger("bicache_sgl.calibrate")

# Where the cached prefix state comes from (see docs/calibration.md):
#   first_request: S computed inside another request's own context (S + a different question of the
#                  data set + its MASK generation region): what the runtime stores when the first
#                  request that computed S inserts it into the prefix cache;
#   prefix_only:   S alone through the model: what an explicit cache_prefix request stores.
CACHED_CONTEXTS = ("first_request", "prefix_only")
DEFAULT_CACHED_CONTEXT = "first_request"
# Pairs keep their question whole, so the fractions they reach are discrete (one per generation
# region); a pair is measured at the largest reachable r within this many percentage points at or
# below a bucket (half the spacing of DEFAULT_FRACTIONS), else that bucket skips it.
DEFAULT_PAIR_TOLERANCE = 5.0


class DataError(ValueError):
    """The calibration data file is unusable; the message names the file and line."""


@dataclass
class Record:
    line: int
    kind: str  # "prompt" | "pair"
    text: str = ""
    prefix: str = ""
    suffix: str = ""


@dataclass
class Sample:
    line: int
    kind: str
    ids: list[int]  # prompt tokens (prompts) or prefix + suffix tokens (pairs)
    prefix_len: int = 0  # pairs: |S| (tokens shared by prefix and prefix + suffix)


@dataclass(frozen=True)
class Task:
    """One (sample, bucket) measurement."""

    sample: int
    bucket: int
    s_len: int  # |S|
    prompt_len: int  # tokens of the request's prompt (S + the rest of the prompt)
    gen_len: int  # generation positions (whole blocks)

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.gen_len

    @property
    def r(self) -> float:
        return self.s_len / self.seq_len


def read_data(path: str | Path) -> list[Record]:
    """Parse the jsonl file; raise DataError naming the first bad line."""
    p = Path(path)
    if not p.exists():
        raise DataError(f"data file {path} does not exist")
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not UTF-8 text: {e}") from e
    out = []
    for n, raw in enumerate(lines, start=1):
        if raw.strip():
            out.append(_parse_record(raw, n, f"{path} line {n}"))
    if not out:
        raise DataError(f"{path} holds no samples (one JSON object per line)")
    return out


def _parse_record(raw: str, n: int, where: str) -> Record:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if "prefix" in obj or "suffix" in obj:
        pre, suf = obj.get("prefix"), obj.get("suffix")
        if not isinstance(pre, str) or not isinstance(suf, str):
            raise DataError(f"{where}: a prefix/suffix pair needs both \"prefix\" and \"suffix\" as strings")
        if not pre or not suf:
            raise DataError(f"{where}: \"prefix\" and \"suffix\" must be non-empty")
        return Record(n, "pair", prefix=pre, suffix=suf)
    key = "prompt" if "prompt" in obj else "text" if "text" in obj else None
    if key is None:
        raise DataError(f"{where}: expected {{\"prompt\": ...}}, {{\"text\": ...}} or "
                        f"{{\"prefix\": ..., \"suffix\": ...}}; got keys {sorted(obj)}")
    if not isinstance(obj[key], str) or not obj[key]:
        raise DataError(f"{where}: \"{key}\" must be a non-empty string")
    return Record(n, "prompt", text=obj[key])


def tokenize(records: Sequence[Record], encode, max_samples: int | None) -> list[Sample]:
    """Token ids per record. For a pair, |S| = the tokens that encode(prefix) and
    encode(prefix + suffix) share (a merge across the boundary is not part of the prefix)."""
    out = []
    for rec in records:
        if max_samples is not None and len(out) >= max_samples:
            break
        if rec.kind == "prompt":
            ids = list(encode(rec.text))
            if len(ids) < 2:
                log.warning("data line %d: prompt has %d token(s), too short for a shared prefix; skipped",
                            rec.line, len(ids))
                continue
            out.append(Sample(rec.line, "prompt", ids))
        else:
            full = list(encode(rec.prefix + rec.suffix))
            p = common_prefix_len(list(encode(rec.prefix)), full)
            if p < 1 or len(full) <= p:
                log.warning("data line %d: prefix and suffix do not tokenize into a non-empty prefix plus "
                            "a non-empty rest; skipped", rec.line)
                continue
            out.append(Sample(rec.line, "pair", full, p))
    return out


def gen_candidates(gen_length: int, block_length: int) -> list[int]:
    """Generation-region sizes to try, largest first: the full region (max_new_tokens rounded up
    to whole blocks, as the engine does), then one block less, ... down to one block."""
    g = -(-gen_length // block_length) * block_length
    return list(range(g, 0, -block_length))


def plan_task(sample: Sample, si: int, bi: int, r_pct: float, gens: Sequence[int], max_len: int,
              tolerance_pct: float = DEFAULT_PAIR_TOLERANCE) -> Task | None:
    """The sequence that puts this sample at prefix fraction r, or None if it cannot.

    A prompt is always whole: S is cut inside it, as exactly at r as rounding allows.

    A pair is always whole too, its question (suffix) included: a cut question is not a request
    anyone sends, and a model answers nothing meaningful to it at any depth, so every depth would
    "agree" with cache-off and the bucket would claim the deepest depth. Its S is fixed (the
    prefix), so the only free quantity is the generation region G (whole blocks, ``gens``):
    r = |prefix| / (|prefix + suffix| + G) takes a few discrete values. The pair is measured at the
    largest of them in [r - tolerance, r]: never above the bucket, since the table's entry at r
    serves every r' >= r and the table assumes the safe depth does not fall as r grows, so a
    measurement just below r is the conservative one. None if no region lands there (the bucket is
    skipped for this pair rather than measured on a cut question)."""
    r = r_pct / 100.0
    if sample.kind == "prompt":
        P = len(sample.ids)
        for g in gens:
            s = round(r * (P + g))
            # S stays inside the prompt and leaves its last token (always recomputed by the runtime)
            if 1 <= s <= P - 1 and P + g <= max_len:
                return Task(si, bi, s, P, g)
        return None
    p, P = sample.prefix_len, len(sample.ids)
    lo = r - tolerance_pct / 100.0
    best: Task | None = None
    for g in gens:
        if P + g > max_len:
            continue
        t = Task(si, bi, p, P, g)
        if lo - 1e-12 <= t.r <= r + 1e-12 and (best is None or t.r > best.r):
            best = t
    return best


def plan_tasks(samples: Sequence[Sample], fractions: Sequence[float], gens: Sequence[int],
               max_len: int, tolerance_pct: float = DEFAULT_PAIR_TOLERANCE) -> list[Task]:
    """Every (sample, bucket) that can be measured, sample by sample."""
    out = []
    for si, s in enumerate(samples):
        for bi, r in enumerate(fractions):
            t = plan_task(s, si, bi, r, gens, max_len, tolerance_pct)
            if t is not None:
                out.append(t)
    return out


def _rest_of(cand: Sample, target: Sample, n: int) -> list[int] | None:
    """What ``cand`` contributes as "the prompt after S" of the first request, for a target whose
    own rest is ``n`` tokens. Pair after pair: the candidate's whole question (its suffix), never a
    cut one, whatever its length. Otherwise the candidate's last ``n`` tokens (its question end,
    whole when it is no longer than ``n``); None if it is shorter than that."""
    if target.kind == "pair" and cand.kind == "pair":
        return list(cand.ids[cand.prefix_len:])
    return list(cand.ids[-n:]) if len(cand.ids) >= n else None


def first_request_rest(samples: Sequence[Sample], task: Task) -> list[int] | None:
    """The prompt tokens after S of the *first* request that computed S, for the ``first_request``
    cached context: another sample's question (``_rest_of``), chosen in this order:

    1. its first token differs from the target's rest: a request that reuses exactly S from a node
       is one whose prompt leaves the node's first request right after S (had they shared more, it
       would match more). Without such a sample, one that differs at all (the runtime then reuses
       the leading tokens the two questions share, and the meter expects that);
    2. its length is the nearest to the target's rest, so the first request's sequence (the same
       generation region) has about the target's length and r. Prompts always match it exactly;
       a pair's question is taken whole, so pairs with questions of other lengths differ by that;
    3. the next sample cyclically after the target.

    None if no other sample gives a rest that differs from the target's own."""
    target = samples[task.sample]
    n = task.prompt_len - task.s_len
    own = list(target.ids[task.s_len:task.prompt_len])
    k = len(samples)
    best, best_key = None, None
    for j in range(1, k):
        cand = _rest_of(samples[(task.sample + j) % k], target, n)
        if not cand or cand == own:
            continue
        key = (cand[0] == own[0], abs(len(cand) - n), j)
        if best_key is None or key < best_key:
            best, best_key = cand, key
    return best
