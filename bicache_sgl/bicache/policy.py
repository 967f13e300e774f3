"""The bicache decision, in one object per mode.

A :class:`DepthPolicy` answers the two questions of bicache (DESIGN.md sections 4-5):

- ``target_depth(r)``: the depth b(r) a request whose reused prefix is fraction r is allowed;
  cache nodes hold the largest b(r) of the requests that used them (kv_cache/manager.py);
- ``choose(segments, matched, seq_len)``: which reused prefix length p' and depth d a request
  uses, given its radix match. d = min(b(p'/N), min node depth up to p'), p' maximising p' x d.
``max_node_depth`` bounds what any node may hold (it sizes the pool).

Modes: ``off`` (no reuse, no cache), ``naive`` (every layer: the baseline that breaks
bidirectional models), ``fixed:N`` (N layers) and ``bicache`` (b(r) from a calibrated profile).
Nothing outside this module branches on the mode.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from ..config import parse_prefix_cache_mode
from .audit import DepthAudit
from .profile import BicacheProfile


@dataclass(frozen=True)
class DepthChoice:
    """What one request reuses. ``matched`` is reported as cached_tokens."""

    matched: int  # tokens matched in the radix tree
    prefix: int  # tokens actually reused (p' <= matched)
    depth: int  # layers in which the reused prefix is skipped
    r: float  # prefix fraction of the reused prefix: prefix / seq_len

    @property
    def skipped_layer_tokens(self) -> int:
        return self.prefix * self.depth


NO_REUSE = DepthChoice(0, 0, 0, 0.0)


class DepthPolicy(ABC):
    """One bicache mode: the depth cache nodes hold and the depth each request uses."""

    name: str
    n_layers: int
    audit: DepthAudit | None = None  # only the profile policy is audited

    @property
    @abstractmethod
    def max_node_depth(self) -> int:
        """The most layers of prefix state a cache node holds under this policy (sizes the pool)."""

    @property
    def uses_cache(self) -> bool:
        """False: no prefix index and no pool at all (``off``)."""
        return True

    @abstractmethod
    def target_depth(self, r: float) -> int:
        """The depth this mode allows for a request whose reused prefix is fraction ``r``."""

    def choose(self, segments: Sequence[tuple[int, int]], matched: int, seq_len: int) -> DepthChoice:
        """Pick p' <= matched at a node boundary (or ``matched`` itself) maximising p' x depth,
        depth(p') = min(target_depth(p'/N), min node depth up to p'). ``segments``: the match's
        ((end_len, node_depth), ...) in path order."""
        best = DepthChoice(matched, 0, 0, 0.0)
        if matched <= 0 or seq_len <= 0:
            return best
        run_min = self.n_layers
        for end, node_depth in segments:
            run_min = min(run_min, node_depth)
            p = min(end, matched)
            d = min(self.target_depth(p / seq_len), run_min)
            gain, best_gain = p * d, best.prefix * best.depth
            if gain > best_gain or (gain == best_gain and d > 0 and p > best.prefix):
                best = DepthChoice(matched, p, d, p / seq_len)
            if end >= matched:
                break
        return best

    def describe(self) -> str:
        return f"{self.name} (nodes hold up to {self.max_node_depth} of {self.n_layers} layers)"


@dataclass(frozen=True)
class OffPolicy(DepthPolicy):
    """No prefix cache: every request computes everything."""

    n_layers: int
    name: str = "off"

    @property
    def max_node_depth(self) -> int:
        return 0

    @property
    def uses_cache(self) -> bool:
        return False

    def target_depth(self, r: float) -> int:
        return 0


@dataclass(frozen=True)
class FixedPolicy(DepthPolicy):
    """The same depth for every request (``fixed:N``; ``naive`` is N = L)."""

    n_layers: int
    depth: int
    name: str = "fixed"

    def __post_init__(self) -> None:
        if not self.depth >= 0:
            raise ValueError(f"fixed depth must be >= 0, got {self.depth}")

    @property
    def max_node_depth(self) -> int:
        return min(self.depth, self.n_layers)

    def target_depth(self, r: float) -> int:
        return min(self.depth, self.n_layers)

    def describe(self) -> str:
        return f"{self.name}:{self.depth}" if self.name == "fixed" else super().describe()


@dataclass(frozen=True)
class ProfilePolicy(DepthPolicy):
    """bicache: b(r) from a calibrated profile; without a profile, depth 0 (matched, not reused)."""

    n_layers: int
    profile: BicacheProfile | None
    audit: DepthAudit | None = None  # online audit: may cap buckets below the profile
    name: str = "bicache"

    @property
    def max_node_depth(self) -> int:
        return min(self.profile.max_depth, self.n_layers) if self.profile is not None else 0

    def target_depth(self, r: float) -> int:
        if self.profile is None:
            return 0
        b = min(self.profile.lookup(r), self.n_layers)
        cap = self.audit.cap(r) if self.audit is not None else None
        return b if cap is None else min(b, cap)


def make_policy(mode: str, n_layers: int, profile: BicacheProfile | None = None, *, audit_rate: float = 0.0,
                audit_min_agreement: float = 0.9, seed: int = 0) -> DepthPolicy:
    """``off | naive | bicache | fixed:N`` -> its policy (``profile`` and the audit are used by
    ``bicache``; fixed depths are experiments and are not audited)."""
    kind, n = parse_prefix_cache_mode(mode)
    if kind == "off":
        return OffPolicy(n_layers)
    if kind == "naive":
        return FixedPolicy(n_layers, n_layers, name="naive")
    if kind == "fixed":
        return FixedPolicy(n_layers, int(n or 0))
    audit = DepthAudit(profile, audit_rate, audit_min_agreement, seed) if profile is not None and audit_rate > 0 \
        else None
    return ProfilePolicy(n_layers, profile, audit)


def request_policy(engine_policy: DepthPolicy, forced_depth: int | None, exact: bool) -> DepthPolicy:
    """The policy one request runs under: ``exact`` requests (likelihood scoring, prefill-only)
    reuse nothing; a request's own ``bicache_depth`` fixes its depth (still capped by what the
    matched nodes hold); otherwise the engine's policy."""
    if exact:
        return OffPolicy(engine_policy.n_layers)
    if forced_depth is not None:
        return FixedPolicy(engine_policy.n_layers, forced_depth)
    return engine_policy
