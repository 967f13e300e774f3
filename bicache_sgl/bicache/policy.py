"""The bicache decision, in one object per mode.

A :class:`DepthPolicy` answers ``target_depth(r)``: the depth b(r) that state captured in a
sequence sharing a fraction r with the request is allowed (docs/prefix_cache.md). Which
positions a request reuses, and at which depth, is decided from this b(.) and the capture context
of every matched row by bicache/planner.py. ``max_node_depth`` bounds what any node may hold (it
sizes the pool).

Modes: ``off`` (no reuse, no cache), ``naive`` (every layer: the baseline that breaks
bidirectional models), ``fixed:N`` (N layers) and ``bicache`` (b(r) from a calibrated profile).
Nothing outside this module branches on the mode.

A request's generation mode (``request_mode``: "stop" or "ignore_eos") picks the profile's table:
answers that are the model's own text up to its EOS were calibrated apart from answers forced past
it, and are far less fragile under reuse (docs/calibration.md).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass

from ..config import SamplingParams, parse_prefix_cache_mode
from .audit import DepthAudit
from .profile import GEN_MODES, MAX_BOUND, MODE_IGNORE_EOS, MODE_STOP, BicacheProfile


def request_mode(params: SamplingParams, eos_ids: Iterable[int], constrained: bool = False) -> str:
    """The generation mode whose table serves a request: ``stop`` only when its answer region is
    the model's own text up to where the model ends it; ``ignore_eos`` (conservatively) whenever
    something can force text past that point, as the calibration's past-EOS samples are:
    ``ignore_eos``; ``min_new_tokens`` > 0 (EOS banned on the first positions); a ``logit_bias`` on
    an EOS id (either sign moves where the answer ends); a frequency/presence/repetition penalty
    (it penalises EOS once the answer holds one); a regex / JSON-schema constraint (it bans EOS
    until the pattern is complete). Stop strings and ``stop_token_ids`` only end an answer earlier:
    ``stop``."""
    eos = set(eos_ids)
    forced = (params.ignore_eos or params.min_new_tokens > 0 or constrained
              or any(t in eos for t, _ in params.logit_bias)
              or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0
              or params.repetition_penalty != 1.0 or params.regex is not None or params.json_schema is not None)
    return MODE_IGNORE_EOS if forced else MODE_STOP


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
    def target_depth(self, r: float, mode: str = MODE_IGNORE_EOS) -> int:
        """The depth this policy allows for a request of generation ``mode`` (``request_mode``;
        default the conservative one) whose reused prefix is fraction ``r``."""

    @property
    def without_profile(self) -> bool:
        """A mode that reads a calibrated profile running without one (every depth 0: prefixes
        are matched, never reused): worth a warning."""
        return False

    def store_depth(self, r: float) -> int:
        """The layers worth storing for a capture at fraction ``r``: the deepest any generation
        mode may later reuse (storing a row never serves it; reuse checks the reader's own mode)."""
        return max(self.target_depth(r, m) for m in GEN_MODES)

    def probing(self) -> DepthPolicy:
        """The policy a probe of the online audit is planned under (``ProbePolicy``); itself when
        nothing probes."""
        return self

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

    def target_depth(self, r: float, mode: str = MODE_IGNORE_EOS) -> int:
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

    def target_depth(self, r: float, mode: str = MODE_IGNORE_EOS) -> int:
        return min(self.depth, self.n_layers)

    def describe(self) -> str:
        return f"{self.name}:{self.depth}" if self.name == "fixed" else super().describe()


@dataclass(frozen=True)
class ProfilePolicy(DepthPolicy):
    """bicache: b(r) from a calibrated profile; without a profile, depth 0 (matched, not reused)
    unless the audit's probes earn more."""

    n_layers: int
    profile: BicacheProfile | None
    audit: DepthAudit | None = None  # online audit: lowers buckets below the profile, probes may raise them
    name: str = "bicache"

    @property
    def without_profile(self) -> bool:
        return self.profile is None

    @property
    def _raising(self) -> bool:
        return self.audit is not None and self.audit.probing

    @property
    def max_node_depth(self) -> int:
        d = min(self.profile.max_depth, self.n_layers) if self.profile is not None else 0
        # raising: nodes hold what a probe may read, up to the audit's ceiling
        return max(d, min(self.audit.ceiling, self.n_layers)) if self._raising else d

    def target_depth(self, r: float, mode: str = MODE_IGNORE_EOS) -> int:
        if self.audit is not None:  # the profile's depth as the audit lowered or raised it
            return min(self.audit.depth(r, mode), self.n_layers)
        if self.profile is None:
            return 0
        return min(self.profile.lookup(r, mode), self.n_layers)

    def store_depth(self, r: float) -> int:
        """Raising: also the layers the probe depth at ``r`` reads, so that probes find rows."""
        d = super().store_depth(r)
        if self._raising:
            d = max(d, *(min(self.audit.probe_depth(r, m), self.n_layers) for m in GEN_MODES))
        return d

    def probing(self) -> DepthPolicy:
        return ProbePolicy(self.n_layers, self.max_node_depth, self.audit) if self._raising else self


@dataclass(frozen=True)
class ProbePolicy(DepthPolicy):
    """The depths a probe of the online audit is planned at: each r-bucket's next rung while it
    probes, else its depth in force (``DepthAudit.probe_depth``). Used only for a request the audit
    then audits (answered from its exact forward), never to serve one."""

    n_layers: int
    node_depth: int
    audit: DepthAudit | None = None  # required (``ProfilePolicy.probing`` passes its own)
    name: str = "bicache-probe"

    @property
    def max_node_depth(self) -> int:
        return self.node_depth

    def target_depth(self, r: float, mode: str = MODE_IGNORE_EOS) -> int:
        return min(self.audit.probe_depth(r, mode), self.n_layers)


def make_policy(mode: str, n_layers: int, profile: BicacheProfile | None = None, *, audit_rate: float = 0.0,
                audit_min_agreement: float = 0.9, seed: int = 0, probation: int = 0, probe_rate: float = 0.0,
                raise_bound: float = MAX_BOUND) -> DepthPolicy:
    """``off | naive | bicache | fixed:N`` -> its policy (``profile`` and the audit are used by
    ``bicache``; fixed depths are experiments and are not audited). ``probation``: consecutive
    agreeing audits a bucket needs before it is trusted; ``probe_rate`` > 0: buckets earn depth on
    probes, rising once the 95% bound on their disagreement rate is at most ``raise_bound``
    (bicache/audit.py); with it, a missing profile is audited too (every depth 0 until earned)."""
    kind, n = parse_prefix_cache_mode(mode)
    if kind == "off":
        return OffPolicy(n_layers)
    if kind == "naive":
        return FixedPolicy(n_layers, n_layers, name="naive")
    if kind == "fixed":
        return FixedPolicy(n_layers, int(n or 0))
    audited = (profile is not None and (audit_rate > 0 or probation > 0)) or probe_rate > 0
    audit = DepthAudit(profile, audit_rate, audit_min_agreement, seed, probation, probe_rate=probe_rate,
                       raise_bound=raise_bound, n_layers=n_layers) if audited else None
    return ProfilePolicy(n_layers, profile, audit)


def uses_profile(mode: str) -> bool:
    """Whether the mode ``mode`` (``--prefix-cache``) decides depths from a calibrated profile:
    what tells the engine whether to look one up or calibrate one, and whether running without one
    is worth a warning (only ``bicache``; the others never read it)."""
    return parse_prefix_cache_mode(mode)[0] == "bicache"
