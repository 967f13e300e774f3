"""Per-request depth choice: d = min(b(r), depth held along the match), r = prefix / sequence."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .profile import BicacheProfile


@dataclass(frozen=True)
class DepthChoice:
    matched: int  # tokens matched in the radix tree (reported as cached_tokens)
    prefix: int  # tokens actually reused (p' <= matched)
    depth: int  # layers in which the reused prefix is skipped
    r: float  # prefix fraction of the reused prefix: prefix / seq_len

    @property
    def skipped_layer_tokens(self) -> int:
        return self.prefix * self.depth


def target_depth(kind: str, fixed: int | None, profile: BicacheProfile | None, n_layers: int, r: float) -> int:
    if kind == "off":
        return 0
    if kind == "naive":
        return n_layers
    if kind == "fixed":
        return min(int(fixed or 0), n_layers)
    return profile.lookup(r) if profile is not None else 0


def choose_depth(kind: str, fixed: int | None, profile: BicacheProfile | None, n_layers: int,
                 segments: Sequence[tuple[int, int]], matched: int, seq_len: int) -> DepthChoice:
    """Pick p' <= matched at a node boundary (or matched itself) maximising p' x depth, where
    depth(p') = min(b(p'/N), min node depth up to p'). ``segments``: ((end_len, node_depth), ...)."""
    best = DepthChoice(matched, 0, 0, 0.0)
    if matched <= 0 or seq_len <= 0:
        return best
    run_min = n_layers
    for end, node_depth in segments:
        run_min = min(run_min, node_depth)
        p = min(end, matched)
        d = min(target_depth(kind, fixed, profile, n_layers, p / seq_len), run_min)
        if p * d > best.prefix * best.depth or (p * d == best.prefix * best.depth and d > 0 and p > best.prefix):
            best = DepthChoice(matched, p, d, p / seq_len)
        if end >= matched:
            break
    return best
