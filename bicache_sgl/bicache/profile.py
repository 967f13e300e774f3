"""A bicache profile: the table r (percent of the sequence that is shared prefix) -> safe depth b.

JSON shape::

    {"model": "...", "n_layers": 32, "criterion": "kv-cosine", "threshold": 0.97,
     "table": [[0, 0], [30, 2], [50, 5], [70, 9], [90, 14]]}

Lookup takes the entry with the largest r at or below the request's r (0 below the first entry).
The table is non-decreasing in b (a larger shared fraction never gets a smaller depth), and
calibration builds it on the safe side (``BicacheProfile.monotone``): the depth at r never
exceeds a depth measured at any r' >= r. Calibration lives in ``bicache_sgl.calibration`` (and the
first-run ``"auto"`` profile in ``bicache_sgl.calibration.auto``); this module imports nothing above it.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

PROFILE_FILENAME = "bicache_profile.json"
# Special values of --bicache-profile / EngineConfig.bicache_profile (anything else is a file):
PROFILE_AUTO = "auto"  # calibrate at start-up (cached on disk): bicache_sgl.calibration.auto
PROFILE_NONE = "none"  # no profile: depth 0, prefixes are matched but never reused
# The criterion whose depth means "equal to cache off": per bucket, the deepest d at which every
# measured sample's greedy answer (the whole generated region) equals cache off's at every depth
# 0..d, with a 95% upper bound on the flip rate (issue 34). Its per-bucket counts travel in the
# profile ("buckets"), so a tolerance chosen at serving time re-derives the table from them.
CRITERION_EXACT = "exact"
CONFIDENCE = 0.95
# The bound a bucket's depth must reach to be taken at all: with no disagreement in n samples, the
# 95% upper bound on the flip rate is ~3/n, so a depth above 0 needs n >= 59 samples in its bucket
# (docs/calibration.md promises this bound, per bucket, for every exact profile).
MAX_BOUND = 0.05
# The r-buckets (percent) calibration measures (``calibration.data``), and the buckets in which the
# online audit earns depth on traffic for a profile that has none of its own (bicache/audit.py)
DEFAULT_FRACTIONS = (10, 20, 30, 40, 50, 60, 70, 80, 90)
# Generation modes (how a request's answer region ends), each calibrated as a sample of its own
# (issue 34): "stop" = the answer is the model's own text up to its EOS; "ignore_eos" = the region
# runs past EOS (or is otherwise forced past where the model would stop: bicache/policy.py,
# ``request_mode``), where the text is out of distribution and far more fragile under reuse.
MODE_STOP = "stop"
MODE_IGNORE_EOS = "ignore_eos"
GEN_MODES = (MODE_STOP, MODE_IGNORE_EOS)


def _binom_cdf(k: int, n: int, p: float) -> float:
    """P(X <= k) for X ~ Binomial(n, p), in log space (no overflow for large n)."""
    if p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 1.0 if k >= n else 0.0
    lp, lq = math.log(p), math.log1p(-p)
    total = 0.0
    for i in range(0, min(k, n) + 1):
        total += math.exp(math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * lp + (n - i) * lq)
    return min(total, 1.0)


def flip_bound(k: int, n: int, confidence: float = CONFIDENCE) -> float:
    """One-sided Clopper-Pearson upper bound on a flip rate after ``k`` disagreements in ``n``
    samples: the p at which seeing <= k flips has probability 1 - confidence. k = 0 gives
    1 - (1 - confidence)^(1/n), about 3/n at 95%. No samples: 1.0 (nothing is known)."""
    if n <= 0:
        return 1.0
    if k >= n:
        return 1.0
    alpha = 1.0 - confidence
    lo, hi = k / n, 1.0
    for _ in range(60):  # bisection: the CDF falls as p grows
        mid = (lo + hi) / 2
        if _binom_cdf(k, n, mid) > alpha:
            lo = mid
        else:
            hi = mid
    return hi


def tolerated(k: int, n: int, tolerance: float, max_bound: float = MAX_BOUND) -> bool:
    """Whether ``k`` disagreements in ``n`` samples pass at ``tolerance`` (a tolerated flip rate).
    0 (the default): exact, no sample disagrees, and there are enough samples that the 95% bound on
    the flip rate is at most ``max_bound``. Above 0 it also passes when the 95% bound with the k
    disagreements seen is at most the tolerance (so a tolerance only ever adds passes: a small,
    disagreement-free sample passes or fails as it does at 0)."""
    if n <= 0:
        return False
    if k == 0 and flip_bound(0, n) <= max_bound + 1e-12:
        return True
    return tolerance > 0 and flip_bound(k, n) <= tolerance + 1e-12


def depth_for_tolerance(disagreements_by_depth: list[int], n: int, tolerance: float,
                        max_bound: float = MAX_BOUND) -> int:
    """The deepest d such that the samples that disagree with cache off at some depth 0..d
    (``disagreements_by_depth[d]``, non-decreasing in d; index 0 is cache off itself) pass at
    ``tolerance``. Depths past the list were not measured and are never taken."""
    best = 0
    for d, k in enumerate(disagreements_by_depth):
        if d > 0 and not tolerated(int(k), n, tolerance, max_bound):
            break
        best = d
    return best


def bucket_depth(disagreements_by_depth: list[int], n: int, tolerance: float,
                 max_bound: float = MAX_BOUND) -> int | None:
    """A bucket's verdict: ``depth_for_tolerance``, except that a bucket too small for the bound
    (``flip_bound(0, n) > max_bound``) whose samples all agree at depth 1 gives no verdict (None: no
    table entry; lookup falls back to the next lower bucket) rather than 0, which would pull every
    lower bucket down to 0 through the monotone table for want of samples, not for a disagreement.
    A disagreement at depth 1 is a verdict whatever n: 0."""
    d = depth_for_tolerance(disagreements_by_depth, n, tolerance, max_bound)
    if d == 0 and len(disagreements_by_depth) > 1 and n > 0:
        k1 = int(disagreements_by_depth[1])
        if k1 == 0 or (tolerance > 0 and flip_bound(k1, n) <= tolerance):
            return None  # it agreed at depth 1: too few samples for a bound, not evidence against reuse
    return d


@dataclass(frozen=True)
class BicacheProfile:
    table: tuple[tuple[float, int], ...]  # (r percent, b), r ascending
    n_layers: int
    model: str = ""
    criterion: str = "kv-cosine"
    threshold: float = 0.97
    extra: dict = field(default_factory=dict, compare=False)
    # One table per generation mode (GEN_MODES), or () for a profile without per-mode data, whose
    # ``table`` then serves every mode. With per-mode tables, ``table`` is what old readers see (the
    # calibration's pooled table, never deeper than any mode's) and a mode that was not measured
    # gets depth 0 (``table_for``).
    by_mode: tuple[tuple[str, tuple[tuple[float, int], ...]], ...] = ()

    def __post_init__(self) -> None:
        self._check(self.table, "")
        for mode, table in self.by_mode:
            if mode not in GEN_MODES:
                raise ValueError(f"bicache profile: unknown generation mode {mode!r} (one of {', '.join(GEN_MODES)})")
            self._check(table, f" ({mode})")
        if len({m for m, _ in self.by_mode}) != len(self.by_mode):
            raise ValueError("bicache profile: a generation mode has two tables")

    def _check(self, table: tuple[tuple[float, int], ...], what: str) -> None:
        rs = [r for r, _ in table]
        if rs != sorted(rs) or len(set(rs)) != len(rs):
            raise ValueError(f"bicache profile{what}: r values must be strictly increasing")
        for r, b in table:
            if not 0 <= r <= 100:
                raise ValueError(f"bicache profile{what}: r={r} is outside [0, 100]")
            if not 0 <= b <= self.n_layers:
                raise ValueError(f"bicache profile{what}: depth {b} at r={r} is outside [0, {self.n_layers}]")
        bs = [b for _, b in table]
        if any(b2 < b1 for b1, b2 in itertools.pairwise(bs)):
            raise ValueError(f"bicache profile{what}: depths must be non-decreasing in r")

    @property
    def tolerance(self) -> float:
        """The tolerated flip rate the file's tables were derived at (0 without one)."""
        return float(self.extra.get("tolerance") or 0.0)

    @property
    def modes(self) -> tuple[str, ...]:
        """The generation modes with a table of their own (() for a single-table profile)."""
        return tuple(m for m, _ in self.by_mode)

    def table_for(self, mode: str) -> tuple[tuple[float, int], ...]:
        """The table a request of generation ``mode`` is served by: its mode's, ``table`` for a
        profile without per-mode tables, and no reuse ((0, 0)) for a mode the profile did not measure."""
        if not self.by_mode:
            return self.table
        for m, table in self.by_mode:
            if m == mode:
                return table
        return ((0.0, 0),)

    @property
    def max_depth(self) -> int:
        return max((b for t in (self.table, *(t for _, t in self.by_mode)) for _, b in t), default=0)

    def lookup(self, r: float, mode: str = MODE_IGNORE_EOS) -> int:
        """r in [0, 1] -> safe depth b(r) for a request of generation ``mode`` (default: the
        conservative one, ignore_eos)."""
        return self.lookup_table(self.table_for(mode), r)

    @staticmethod
    def lookup_table(table: tuple[tuple[float, int], ...], r: float) -> int:
        """The entry with the largest r at or below ``r`` (in [0, 1]); 0 below the first."""
        pct = 100.0 * r
        b = 0
        for rp, bp in table:
            if rp <= pct + 1e-9:
                b = bp
            else:
                break
        return b

    @staticmethod
    def monotone(table: list[tuple[float, int]]) -> list[tuple[float, int]]:
        """The largest non-decreasing table that never exceeds a measured depth at or above r: a
        running min from the highest r down (what calibration writes). One noisy, too-high bucket
        at a low r therefore never raises the depth at higher r; a low bucket lowers every r below
        it instead."""
        out, low = [], None
        for r, b in sorted(table, reverse=True):
            low = int(b) if low is None else min(low, int(b))
            out.append((float(r), low))
        return out[::-1]

    @staticmethod
    def min_table(tables: list[tuple[tuple[float, int], ...]]) -> tuple[tuple[float, int], ...]:
        """The pointwise minimum of tables (each non-decreasing, so the minimum is too): at every r
        no deeper than any of them. What a per-mode profile writes as ``table`` for readers that
        know one table only."""
        rs = sorted({float(r) for t in tables for r, _ in t} | {0.0})
        return tuple((r, min(BicacheProfile.lookup_table(t, r / 100.0) for t in tables)) for r in rs)

    def rederived(self) -> BicacheProfile:
        """The per-mode tables re-derived from the counts (``buckets_by_mode``) at the profile's own
        tolerance, whatever ``table_by_mode`` the file had, with ``table`` lowered where it is deeper
        than a mode's (old readers get the minimum). Deterministic: what
        ``python -m bicache_sgl.calibration.rederive FILE`` writes back (docs/calibration.md)."""
        by_mode = self.tables_by_mode(self.tolerance)
        if not by_mode:
            return self
        table = self.min_table([self.table, *(t for _, t in by_mode)])
        return BicacheProfile(table=table, n_layers=self.n_layers, model=self.model, criterion=self.criterion,
                              threshold=self.threshold, extra=self.extra, by_mode=by_mode)

    def _derive(self, buckets: list, tolerance: float) -> tuple[tuple[float, int], ...]:
        """A table from per-bucket counts (``r``, or the position in ``fractions``; ``n``;
        ``disagreements_by_depth``) at ``tolerance``: the exact rule per bucket (``bucket_depth``),
        then the monotone pass that errs safe."""
        fractions = self.extra.get("fractions") or []
        entries: list[tuple[float, int]] = [(0.0, 0)]
        for i, bk in enumerate(buckets):
            if not bk or not bk.get("n"):
                continue
            r = bk.get("r", fractions[i] if i < len(fractions) else None)
            if r is None:
                raise ValueError(f"bicache profile: bucket {i} has no r (and no 'fractions' entry)")
            d = bucket_depth(list(bk["disagreements_by_depth"]), int(bk["n"]), tolerance,
                             float(MAX_BOUND if self.extra.get("max_bound") is None else self.extra["max_bound"]))
            if d is None:
                continue
            entries = [(rr, b) for rr, b in entries if rr != float(r)] + [(float(r), d)]
        return tuple(self.monotone(sorted(entries)))

    def tables_by_mode(self, tolerance: float) -> tuple[tuple[str, tuple[tuple[float, int], ...]], ...]:
        """Per generation mode, the table the ``exact`` rule gives at ``tolerance`` from the
        per-mode counts (``buckets_by_mode``); () without them (another criterion, an older file)."""
        by_mode = self.extra.get("buckets_by_mode")
        if self.criterion != CRITERION_EXACT or not isinstance(by_mode, dict):
            return ()
        return tuple((m, self._derive(list(by_mode[m]), tolerance)) for m in GEN_MODES if by_mode.get(m))

    def with_mode_tables(self) -> BicacheProfile:
        """This profile with its per-mode tables derived from its counts at its own tolerance (what
        ``python -m bicache_sgl.calibrate`` writes as ``table_by_mode``); unchanged without counts."""
        by_mode = self.tables_by_mode(self.tolerance)
        if not by_mode:
            return self
        return BicacheProfile(table=self.table, n_layers=self.n_layers, model=self.model, criterion=self.criterion,
                              threshold=self.threshold, extra=self.extra, by_mode=by_mode)

    def at_tolerance(self, tolerance: float) -> BicacheProfile:
        """This profile's tables re-derived for a tolerated flip rate, from the per-bucket counts an
        ``exact`` profile carries (``buckets``: r, n, disagreements_by_depth; per generation mode
        ``buckets_by_mode``). A profile without them (another criterion, an older file) is returned
        unchanged: its table stands."""
        buckets = self.extra.get("buckets")
        if self.criterion != CRITERION_EXACT or not buckets:
            return self
        if self.tolerance == float(tolerance):
            return self
        by_mode = self.tables_by_mode(tolerance)
        table = self._derive(list(buckets), tolerance)
        if by_mode:  # old readers' table: no deeper than any mode's
            table = self.min_table([table, *(t for _, t in by_mode)])
        log.info("bicache profile %s at tolerance %g: r%% -> depth %s%s (the file's, at tolerance %g: %s)",
                 self.model, tolerance, [list(e) for e in table],
                 "".join(f"; {m}: {[list(e) for e in t]}" for m, t in by_mode),
                 self.tolerance, [list(e) for e in self.table])
        return BicacheProfile(table=table, n_layers=self.n_layers, model=self.model, criterion=self.criterion,
                              threshold=tolerance, extra={**self.extra, "tolerance": tolerance}, by_mode=by_mode)

    def to_dict(self) -> dict[str, Any]:
        d = {"model": self.model, "n_layers": self.n_layers, "criterion": self.criterion,
             "threshold": self.threshold, "table": [[r, b] for r, b in self.table]}
        if self.by_mode:
            d["table_by_mode"] = {m: [[r, b] for r, b in t] for m, t in self.by_mode}
        return {**d, **{k: v for k, v in self.extra.items() if k != "table_by_mode"}}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> BicacheProfile:
        try:
            d = json.loads(Path(path).read_text())
            table = tuple((float(r), int(b)) for r, b in d["table"])
            known = {"model", "n_layers", "criterion", "threshold", "table", "table_by_mode"}
            # per generation mode: the file's table_by_mode; else, for an exact profile that carries
            # per-mode counts (buckets_by_mode), derived from them; else none (one table for all)
            by_mode = tuple((str(m), tuple((float(r), int(b)) for r, b in t))
                            for m, t in (d.get("table_by_mode") or {}).items())
            prof = cls(table=table, n_layers=int(d["n_layers"]), model=str(d.get("model", "")),
                       criterion=str(d.get("criterion", "kv-cosine")), threshold=float(d.get("threshold", 0.97)),
                       extra={k: v for k, v in d.items() if k not in known}, by_mode=by_mode)
            return prof if by_mode else prof.with_mode_tables()
        except FileNotFoundError:
            raise ValueError(f"bicache profile {path} does not exist") from None
        except (KeyError, TypeError, ValueError, json.JSONDecodeError) as e:
            raise ValueError(f"bicache profile {path} is invalid: {e}") from e


def find_profile(model_path: str, explicit: str | None, n_layers: int) -> BicacheProfile | None:
    """--bicache-profile FILE if given, else bicache_profile.json beside the model, else None;
    ``"none"`` gives None. ``"auto"`` calibrates, which this module cannot do: the engine resolves
    it with ``bicache_sgl.calibration.auto.resolve_profile``."""
    if explicit == PROFILE_NONE:
        return None
    if explicit == PROFILE_AUTO:
        raise ValueError("bicache profile 'auto' is resolved by bicache_sgl.calibration.auto.resolve_profile")
    path = Path(explicit) if explicit else Path(model_path) / PROFILE_FILENAME
    if not path.exists():
        if explicit:
            raise ValueError(f"bicache profile {explicit} does not exist")
        return None
    prof = BicacheProfile.load(path)
    if prof.n_layers != n_layers:
        raise ValueError(f"bicache profile {path} is for {prof.n_layers} layers, the model has {n_layers}")
    return prof

