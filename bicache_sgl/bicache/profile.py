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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

PROFILE_FILENAME = "bicache_profile.json"
# Special values of --bicache-profile / EngineConfig.bicache_profile (anything else is a file):
PROFILE_AUTO = "auto"  # calibrate at start-up (cached on disk): bicache_sgl.calibration.auto
PROFILE_NONE = "none"  # no profile: depth 0, prefixes are matched but never reused


@dataclass(frozen=True)
class BicacheProfile:
    table: tuple[tuple[float, int], ...]  # (r percent, b), r ascending
    n_layers: int
    model: str = ""
    criterion: str = "kv-cosine"
    threshold: float = 0.97
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        rs = [r for r, _ in self.table]
        if rs != sorted(rs) or len(set(rs)) != len(rs):
            raise ValueError("bicache profile: r values must be strictly increasing")
        for r, b in self.table:
            if not 0 <= r <= 100:
                raise ValueError(f"bicache profile: r={r} is outside [0, 100]")
            if not 0 <= b <= self.n_layers:
                raise ValueError(f"bicache profile: depth {b} at r={r} is outside [0, {self.n_layers}]")
        bs = [b for _, b in self.table]
        if any(b2 < b1 for b1, b2 in itertools.pairwise(bs)):
            raise ValueError("bicache profile: depths must be non-decreasing in r")

    @property
    def max_depth(self) -> int:
        return max((b for _, b in self.table), default=0)

    def lookup(self, r: float) -> int:
        """r in [0, 1] -> safe depth b(r)."""
        pct = 100.0 * r
        b = 0
        for rp, bp in self.table:
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

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "n_layers": self.n_layers, "criterion": self.criterion,
                "threshold": self.threshold, "table": [[r, b] for r, b in self.table], **self.extra}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> BicacheProfile:
        try:
            d = json.loads(Path(path).read_text())
            table = tuple((float(r), int(b)) for r, b in d["table"])
            known = {"model", "n_layers", "criterion", "threshold", "table"}
            return cls(table=table, n_layers=int(d["n_layers"]), model=str(d.get("model", "")),
                       criterion=str(d.get("criterion", "kv-cosine")), threshold=float(d.get("threshold", 0.97)),
                       extra={k: v for k, v in d.items() if k not in known})
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
