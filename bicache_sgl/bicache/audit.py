"""The online audit: trust in a depth is earned on live traffic, and lost on one disagreement.

An audited request's first forward also runs without reuse, in the same batch (a shadow sequence
with its own rows; it carries the request's capture, so what is stored is the request's own exact
state). The request then continues from the exact forward: its answer equals cache off whatever
the audit finds. The two distributions at the masked positions are compared (top-1 agreement,
KL(exact || reused)) and kept per r-bucket (the profile's table rows).

Two objects: :class:`DepthAudit`, the per-bucket trust the depth policy reads (its caps) and the
statistics; and :class:`OnlineAudit`, the scheduler's one handle on the audit of its requests: at
admission it decides whether a request is audited and allocates its shadow (or, with no room for
one, serves the request without reuse), it adds the shadow to the request's first forward, and
after that forward it records the comparison and swaps the request onto the exact K/V. A request
(``scheduler/request.py``) knows nothing of this beyond ``continue_exact``.

- probation: a bucket is trusted only after ``probation`` consecutive audits at its current depth
  agreed; until then EVERY reusing request in it is audited (so served exact); after that, the
  configured ``rate``;
- a disagreement (top-1 agreement below ``min_agreement``) drops the bucket, and every lower bucket
  (the table stays non-decreasing and errs safe), to the largest depth below the failed one that
  has agreed in that bucket, else to half the failed depth (a few failures reach a safe depth, not
  one layer per failure); the bucket is then on probation again at the new depth.
- raising (``probe_rate`` > 0, docs/prefix_cache.md "Earning depth: probes"): a drawn request is
  planned at each bucket's next rung (0 -> 1 -> 2 -> 4 ..., ``next_rung``) under the unchanged
  capture-context rule and, when it reads rows beyond the depths in force, audited (answered exact
  whatever it finds); a bucket rises to a probed depth once ``raise_samples(raise_bound)`` probes at
  it agreed (calibration's 95% bound, ``profile.tolerated``), and a disagreement bans that depth
  there and below (the bucket then climbs one layer at a time under the ban). Probes stop at the
  ceiling: the profile's deepest depth, or the top when it has none.

This holds whoever made the profile: a shipped one (beside the model), one passed as a file, or a
first-run one (only the probation's default length differs: engine.py). A profile of the ``exact``
criterion (calibrated so that answers equal cache off's, within its tolerance) is held to that
promise here too: a disagreement is a top-1 agreement below ``1 - tolerance`` (any changed position
at tolerance 0), whatever the configured ``min_agreement`` allows for other criteria. Each lowering
is logged (a WARNING naming the profile, the bucket, the depths) and kept in ``history``.

A profile with a table per generation mode (bicache/profile.py: "stop", "ignore_eos") is audited
per (mode, bucket): a disagreement of an ignore_eos request lowers the ignore_eos table, not the
stop table, and the reverse. A single-table profile has one set of buckets for every mode.
"""

from __future__ import annotations

import logging
import random
import threading
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch

from .profile import (
    CRITERION_EXACT,
    DEFAULT_FRACTIONS,
    MAX_BOUND,
    MODE_IGNORE_EOS,
    BicacheProfile,
    flip_bound,
    tolerated,
)

log = logging.getLogger(__name__)

MAX_HISTORY = 64  # depth changes kept for /get_server_info
RAISE_FRACTIONS = DEFAULT_FRACTIONS  # r-buckets (percent) a raising audit splits a coarse table at


@dataclass
class _Bucket:
    r_pct: float  # its lowest r, in percent (the profile table's r, or a RAISE_FRACTIONS split)
    profile_depth: int
    depth: int  # the depth in force (the profile's, then what the audit lowered or raised it to)
    samples: int = 0
    agree_sum: float = 0.0
    kl_sum: float = 0.0
    streak: int = 0  # consecutive agreeing audits at `depth`
    disagreements: int = 0
    agreed: set[int] = field(default_factory=set)  # depths that agreed here at least once
    # raising (probes): depths at or above `banned` disagreed here (or in a bucket above) and are
    # never probed again; `probes[d]`: agreeing probes at d (> depth) since d was first probed
    banned: int = 1 << 30
    probes: dict[int, int] = field(default_factory=dict)
    raises: int = 0

    @property
    def r_lo(self) -> float:
        return self.r_pct / 100.0

    @property
    def cap(self) -> int | None:
        """The audit's cap (None: never lowered below the profile)."""
        return self.depth if self.depth < self.profile_depth else None


def compare(reused: torch.Tensor, exact: torch.Tensor) -> tuple[float, float]:
    """Logits [n, V] of the same positions -> (top-1 agreement, mean KL(exact || reused))."""
    if reused.numel() == 0:
        return 1.0, 0.0
    agree = (reused.argmax(-1) == exact.argmax(-1)).double().mean().item()
    lp_e = torch.log_softmax(exact.double(), -1)
    lp_r = torch.log_softmax(reused.double(), -1)
    kl = (lp_e.exp() * (lp_e - lp_r)).sum(-1).mean().item()
    return agree, max(kl, 0.0)


def next_rung(depth: int) -> int:
    """The depth a bucket at ``depth`` probes next: double it, at least one more (0 -> 1 -> 2 -> 4
    -> 8 ...), so the top of L layers is log2(L) + 1 rungs away (each costs ``raise_samples``
    probes), the mirror of the halving on a disagreement. Capped by the ceiling and by the
    smallest depth that disagreed (``_Bucket.banned``): below a failed rung the bucket climbs one
    layer at a time (a failure at 8 from 4 probes 7, then 6, then 5)."""
    return max(depth + 1, 2 * depth)


def raise_samples(bound: float) -> int:
    """Agreeing probes a depth needs before a bucket rises to it: the least n whose one-sided 95%
    Clopper-Pearson bound on the disagreement rate with none seen (``profile.tolerated``, the
    calibration's rule) is at most ``bound`` (59 at 5%, 11 at 25%)."""
    n = 1
    while not tolerated(0, n, 0.0, bound):
        n += 1
    return n


class DepthAudit:
    """Per-bucket probation, audit statistics, depth caps and raises for one profile (None: no
    profile, every depth 0, ``n_layers`` then required). Thread-safe.

    ``probe_rate`` > 0 turns raising on: that fraction of the requests that could reuse is planned
    at the probe depth of every bucket (``probe_depth``) and audited, and a bucket rises to a probed
    depth once ``raise_samples(raise_bound)`` probes at it agreed (module docstring)."""

    def __init__(self, profile: BicacheProfile | None, rate: float, min_agreement: float = 0.9, seed: int = 0,
                 probation: int = 0, *, probe_rate: float = 0.0, raise_bound: float = MAX_BOUND,
                 n_layers: int | None = None) -> None:
        if not 0 <= rate <= 1:
            raise ValueError(f"audit rate must be in [0, 1], got {rate}")
        if not 0 <= min_agreement <= 1:
            raise ValueError(f"audit min_agreement must be in [0, 1], got {min_agreement}")
        if probation < 0:
            raise ValueError(f"audit probation must be >= 0, got {probation}")
        if not 0 <= probe_rate <= 1:
            raise ValueError(f"audit probe rate must be in [0, 1], got {probe_rate}")
        if not 0 < raise_bound < 1:
            raise ValueError(f"audit raise bound must be in (0, 1), got {raise_bound}")
        if profile is None:  # no profile: depth 0 everywhere, held to the exact promise when raised
            if n_layers is None:
                raise ValueError("an audit without a profile needs n_layers")
            profile = BicacheProfile(((0.0, 0),), n_layers, model="no profile", criterion=CRITERION_EXACT,
                                     threshold=0.0)
        if profile.criterion == CRITERION_EXACT:  # the profile's own promise (its tolerance)
            min_agreement = max(min_agreement, 1.0 - float(profile.threshold))
        self.rate, self.min_agreement, self.probation = rate, min_agreement, probation
        self.n_layers = n_layers if n_layers is not None else profile.n_layers
        self.source = f"{profile.model or 'unnamed'} ({profile.criterion})"
        # raising: never above the profile's deepest depth, or the top when the profile has none
        top = min(profile.max_depth, self.n_layers)
        self.ceiling = top if top > 0 else self.n_layers
        self.probe_rate, self.raise_bound = probe_rate, raise_bound
        self.probing = probe_rate > 0 and self.ceiling > 0
        self.raise_n = raise_samples(raise_bound)
        # per generation mode with a table of its own ("" for a single-table profile: every mode)
        self._table_of = dict(profile.by_mode or (("", profile.table),))
        self._by_mode = {m: self._buckets_of(t) for m, t in self._table_of.items()}
        self._buckets = [b for bs in self._by_mode.values() for b in bs]  # all of them (stats)
        self._rng = random.Random(seed)
        self._probe_rng = random.Random(f"{seed}-probe")  # apart: the audit's draws stay as they were
        self._lock = threading.Lock()
        self.disagreements = 0  # each one lowers its bucket (and the buckets below it)
        self.history: list[dict] = []  # depth changes, oldest first (at most MAX_HISTORY)
        self.changes = 0
        self.probes = 0  # audited requests planned at probe depths
        self.probe_disagreements = 0
        self.raised = 0  # times a bucket rose to a probed depth

    def _buckets_of(self, table: tuple[tuple[float, int], ...]) -> list[_Bucket]:
        """One bucket per table entry; when raising, also one per RAISE_FRACTIONS point (a profile
        of one entry, or none, would otherwise earn depth for every r at once from the r its
        traffic has), each starting at the profile's depth there."""
        rs = sorted({float(r) for r, _ in table} | ({float(r) for r in RAISE_FRACTIONS} if self.probing else set()))
        return [_Bucket(r, d, d) for r in rs for d in [BicacheProfile.lookup_table(table, r / 100.0)]]

    def _mode_buckets(self, mode: str) -> list[_Bucket]:
        if "" in self._by_mode:
            return self._by_mode[""]
        if mode not in self._by_mode:  # a mode the profile did not measure: depth 0 anyway
            self._by_mode[mode] = self._buckets_of(((0.0, 0),))
            self._buckets.extend(self._by_mode[mode])
        return self._by_mode[mode]

    def _bucket(self, r: float, mode: str) -> tuple[list[_Bucket], int]:
        """(the mode's buckets, the index of the one holding ``r``): the entry with the largest r
        at or below ``r``, as ``BicacheProfile.lookup_table`` reads the table."""
        bs = self._mode_buckets(mode)
        pct = 100.0 * r
        i = 0
        for j, b in enumerate(bs):
            if b.r_pct <= pct + 1e-9:
                i = j
        return bs, i

    def _rung(self, b: _Bucket) -> int | None:
        """The depth ``b`` probes next, None when it does not: raising off, at the ceiling, below a
        failed depth, or its depth in force not yet confirmed by an agreeing audit (a probe climbs
        from a depth seen to agree, so a failed probe never lowers the bucket below it)."""
        if not self.probing or (b.depth > 0 and b.depth not in b.agreed):
            return None
        d = min(next_rung(b.depth), self.ceiling, b.banned - 1)
        return d if d > b.depth else None

    @property
    def lowered(self) -> int:
        """Times the audit lowered a bucket: once per disagreement."""
        return self.disagreements

    def should_audit(self, r: float, mode: str = MODE_IGNORE_EOS) -> bool:
        """Whether a request of generation ``mode`` reusing state bounded by shared fraction ``r``
        is audited: always while its bucket is on probation, else with probability ``rate``."""
        with self._lock:
            bs, i = self._bucket(r, mode)
            if bs[i].streak < self.probation:
                return True
            return self.rate > 0 and self._rng.random() < self.rate

    def draw_probe(self, mode: str = MODE_IGNORE_EOS) -> bool:
        """Whether the next request of generation ``mode`` is planned at the probe depths (and then
        audited): with probability ``probe_rate`` while some bucket of its table still probes."""
        if not self.probing:
            return False
        with self._lock:
            if not any(self._rung(b) is not None for b in self._mode_buckets(mode)):
                return False
            return self._probe_rng.random() < self.probe_rate

    def trusted(self, r: float, mode: str = MODE_IGNORE_EOS) -> bool:
        with self._lock:
            bs, i = self._bucket(r, mode)
            return bs[i].streak >= self.probation

    def cap(self, r: float, mode: str = MODE_IGNORE_EOS) -> int | None:
        """The audit's cap on the depth at prefix fraction ``r`` for generation ``mode`` (None:
        never lowered)."""
        with self._lock:
            bs, i = self._bucket(r, mode)
            return bs[i].cap

    def depth(self, r: float, mode: str = MODE_IGNORE_EOS) -> int:
        """The depth in force at prefix fraction ``r`` for generation ``mode``: the profile's,
        as the audit lowered or raised it."""
        with self._lock:
            bs, i = self._bucket(r, mode)
            return bs[i].depth

    def probe_depth(self, r: float, mode: str = MODE_IGNORE_EOS) -> int:
        """The table value of a probe (``policy.ProbePolicy``): the next rung of ``r``'s bucket
        while it probes, else the depth in force."""
        with self._lock:
            bs, i = self._bucket(r, mode)
            d = self._rung(bs[i])
            return bs[i].depth if d is None else d

    def record(self, r: float, depth: int, reused: torch.Tensor, exact: torch.Tensor,
               mode: str = MODE_IGNORE_EOS, *, probe: bool = False, r_probe: float | None = None) -> None:
        """One audited request's first forward: reused at ``depth`` vs no reuse (the request itself
        was answered from the exact forward); ``mode``: its generation mode (whose table it tests).
        ``r``: the fraction that bounded the depth (the bucket a disagreement lowers, as ever).
        ``probe``: the reuse read rows beyond their depth in force; ``r_probe``: the least shared
        fraction among those rows' contexts (``ReusePlan.probe_r``), the bucket whose probe depth
        it tests (a raise is only credited to a bucket whose rows were read beyond its depth)."""
        agree, kl = compare(reused, exact)
        rp = r if r_probe is None else r_probe
        with self._lock:
            bs, i = self._bucket(r, mode)
            b = bs[i]
            b.samples += 1
            b.agree_sum += agree
            b.kl_sum += kl
            self.probes += probe
            tag = mode if "" not in self._by_mode else ""
            if agree >= self.min_agreement or depth <= 0:
                b.agreed.add(depth)
                if depth >= b.depth:  # a test of the depth in force (not of a lower, node-limited one)
                    b.streak += 1
                if probe:
                    self._probe_agreed(*self._bucket(rp, mode), depth, rp, tag)
                return
            self.disagreements += 1
            b.disagreements += 1
            self.probe_disagreements += probe
            # the failed depth (and deeper) is never probed again in the bucket of the rows it read,
            # nor below it (a larger shared fraction is assumed no less safe, as calibration does)
            _, j = self._bucket(rp, mode)
            for lower in bs[:max(i, j) + 1]:
                lower.banned = min(lower.banned, depth)
                lower.probes = {d: n for d, n in lower.probes.items() if d < depth}
            new = max((d for d in b.agreed if d < depth), default=depth // 2)
            for lower in bs[:i + 1]:
                if lower.depth > new:
                    old = lower.depth
                    lower.depth, lower.streak = new, 0
                    self._changed(lower, old, new, r, agree, kl, tag)

    def _probe_agreed(self, bs: list[_Bucket], i: int, depth: int, r: float, mode: str) -> None:
        """An agreeing probe at ``depth`` whose reused rows bound it to bucket ``bs[i]``: counted
        if it tests a depth above the one in force that the bucket may still reach; at
        ``raise_n`` of them the bucket rises to it (lock held)."""
        b = bs[i]
        if not b.depth < depth <= self.ceiling or depth >= b.banned:
            return
        n = b.probes[depth] = b.probes.get(depth, 0) + 1
        if not tolerated(0, n, 0.0, self.raise_bound):
            return
        old = b.depth
        # the n probes were n consecutive agreeing audits at the new depth: trust already earned
        b.depth, b.streak, b.raises = depth, n, b.raises + 1
        b.agreed.add(depth)
        b.probes = {d: k for d, k in b.probes.items() if d > depth}
        self.raised += 1
        log.info("bicache audit: %d probes at depth %d in bucket r >= %.2f%s of the profile %s all agreed with "
                 "the exact forward (95%% bound on the disagreement rate %.3g <= %.3g): the bucket goes from "
                 "depth %d to %d", n, depth, b.r_lo, f" ({mode} table)" if mode else "", self.source,
                 flip_bound(0, n), self.raise_bound, old, depth)
        self._record_change(b, old, depth, r, 1.0, mode)

    def _changed(self, b: _Bucket, old: int, new: int, r: float, agree: float, kl: float, mode: str) -> None:
        log.warning("bicache audit: at r=%.2f the reused forward agreed with the exact one on %.0f%% of masked "
                    "positions (KL %.3g) < %.0f%%: bucket r >= %.2f%s of the profile %s goes from depth %d to %d "
                    "(on probation)", r, 100 * agree, kl, 100 * self.min_agreement, b.r_lo,
                    f" ({mode} table)" if mode else "", self.source, old, new)
        self._record_change(b, old, new, r, agree, mode)

    def _record_change(self, b: _Bucket, old: int, new: int, r: float, agree: float, mode: str) -> None:
        self.changes += 1
        self.history.append({"r_from": b.r_lo, "from": old, "to": new, "at_r": round(r, 6),
                             "top1_agreement": agree, **({"mode": mode} if mode else {})})
        del self.history[:-MAX_HISTORY]

    @staticmethod
    def _key(mode: str, b: _Bucket) -> str:
        return f"{mode + '_' if mode else ''}r{round(b.r_pct)}"

    def stats(self) -> dict:
        with self._lock:
            n = sum(b.samples for b in self._buckets)
            return {
                "bicache_audit_rate": self.rate,
                "bicache_audit_probation": self.probation,
                "bicache_audit_samples_total": n,
                "bicache_audit_disagreements_total": self.disagreements,
                # every audited request is answered from its exact forward
                "bicache_audit_served_exact_total": n,
                "bicache_audit_lowered_total": self.lowered,
                "bicache_audit_top1_agreement": sum(b.agree_sum for b in self._buckets) / n if n else None,
                "bicache_audit_kl": sum(b.kl_sum for b in self._buckets) / n if n else None,
                "bicache_audit_trusted_buckets": sum(b.streak >= self.probation for b in self._buckets),
                # raising: probes (audited requests planned at probe depths, in the samples above),
                # their disagreements, and the raises they earned
                "bicache_audit_probe_rate": self.probe_rate if self.probing else 0.0,
                "bicache_audit_raise_bound": self.raise_bound,
                "bicache_audit_raise_samples": self.raise_n,
                "bicache_audit_probe_ceiling": self.ceiling if self.probing else 0,
                "bicache_audit_probes_total": self.probes,
                "bicache_audit_probe_disagreements_total": self.probe_disagreements,
                "bicache_audit_raised_total": self.raised,
                "bicache_audit_buckets": [
                    {**({"mode": m} if m else {}), "r_from": b.r_lo, "depth": b.depth, "samples": b.samples,
                     "cap": b.cap, "profile_depth": b.profile_depth,
                     "streak": b.streak, "trusted": b.streak >= self.probation, "disagreements": b.disagreements,
                     "probe_depth": self._rung(b) or 0, "probes": {str(d): k for d, k in sorted(b.probes.items())},
                     "raises": b.raises,
                     "top1_agreement": b.agree_sum / b.samples if b.samples else None,
                     "kl": b.kl_sum / b.samples if b.samples else None}
                    for m, bs in self._by_mode.items() for b in bs],
                "bicache_audit_depth_changes": list(self.history),
                "bicache_audit_depth_changes_total": self.changes,
                # per bucket, keyed by its lowest r in percent (flat numbers for /metrics); with a
                # table per generation mode, by mode too ("stop_r70")
                "bicache_audit_bucket_depth": {self._key(m, b): b.depth for m, bs in self._by_mode.items()
                                               for b in bs},
                "bicache_audit_bucket_trusted": {self._key(m, b): int(b.streak >= self.probation)
                                                 for m, bs in self._by_mode.items() for b in bs},
                # the depth each bucket probes next (0: none)
                "bicache_audit_bucket_probe_depth": {self._key(m, b): self._rung(b) or 0
                                                     for m, bs in self._by_mode.items() for b in bs},
            }


class ShadowPool(Protocol):
    """Where shadows come from (``kv_cache.pool.KVPool``): private rows of one sequence, all
    layers, outside the admission budget (None: no room)."""

    def alloc_seq(self, n_positions: int) -> Any | None: ...

    def free_seq(self, kv: Any) -> None: ...


class AuditedRequest(Protocol):
    """What the audit reads of a request (``scheduler.request.Req``)."""

    generates: bool
    seq_len: int
    grant: Any  # kv_cache.manager.CacheGrant: .plan (a ReusePlan), .give_up_reuse()

    def continue_exact(self, kv: Any) -> Any: ...


@dataclass
class _Shadow:
    kv: Any  # SeqKV: the shadow's rows, after the first forward the rows the request left
    applied: bool = False  # the first forward ran and the request continues on the shadow's rows
    probe: bool = False  # its reuse was planned at the probe depths


class OnlineAudit:
    """The audit of one scheduler's running requests (module docstring). ``depths`` None: nothing
    is audited (every call passes the request through). Engine-thread only, like the scheduler;
    the shared state it records into (``depths``) is thread-safe."""

    def __init__(self, depths: DepthAudit | None, pool: ShadowPool) -> None:
        self.depths, self._pool = depths, pool
        # admitted requests with a shadow, until they retire: before the first forward the
        # shadow's rows, after it the rows the request left (given back at release, as they are)
        self._shadows: dict[AuditedRequest, _Shadow] = {}

    def probe(self, req: AuditedRequest, facts: Any) -> Any:
        """Before the cache manager plans ``req``: its ``facts`` (planner.RequestFacts), marked
        ``probe`` when it is drawn to probe (``DepthAudit.draw_probe``); the planner then plans it
        under the probe depths (``policy.ProbePolicy``: the same capture-context rule, each
        bucket's next rung as its table value) and :meth:`admit` audits it whatever it reuses.
        Only a generating request whose depth the engine's policy chooses may probe."""
        d = self.depths
        if (d is None or not d.probing or facts.exact or facts.forced_depth is not None or not req.generates
                or not d.draw_probe(facts.mode)):
            return facts
        return replace(facts, probe=True)

    def admit(self, req: AuditedRequest, facts: Any) -> None:
        """After the cache manager's grant, before its rows are shared: whether ``req`` (its
        ``facts``: planner.RequestFacts) is audited, and its shadow. Only a depth the engine's
        policy chose is audited (not an exact request's, not its own ``bicache_depth``). A probe
        whose plan reads a row the depths in force forbid (``ReusePlan.probe``) is always audited:
        it is never served (a probe planned within them is an ordinary request). A request that
        would be audited but finds no room for its shadow reuses nothing."""
        plan = req.grant.plan
        if self.depths is None or plan.depth <= 0 or facts.exact or facts.forced_depth is not None:
            return
        probe = plan.probe_r is not None
        # drawn for every such request, a prefill-only one (an output capture) too, which is never
        # audited: the rate's random draws follow the admissions
        if not probe and (not self.depths.should_audit(plan.r, plan.mode) or not req.generates):
            return
        kv = self._pool.alloc_seq(req.seq_len)  # outside the admission budget
        if kv is None:
            req.grant.give_up_reuse()
            return
        self._shadows[req] = _Shadow(kv, probe=probe)

    def add(self, req: AuditedRequest, works: list[Any]) -> list[Any]:
        """The sequences ``req`` planned (``SeqWork``, its own first), with its shadow appended
        on its first forward: the same positions computed in full on the shadow's rows. The shadow
        carries the request's capture (what is stored is then this request's own exact state,
        whatever the audit finds); the reusing sequence stores nothing."""
        s = self._shadows.get(req) if self._shadows else None
        if s is None or s.applied:
            return works
        own = works[0]
        shadow = replace(own, kv=s.kv, depth=0, skip=0, skip_from=0, resume_rows=None)
        return [replace(own, capture=None), *works[1:], shadow]

    def apply(self, req: AuditedRequest, logits: list[Any]) -> list[Any]:
        """The logits of ``req``'s sequences after a forward, as the request consumes them. After
        an audited first forward: record reused vs exact, and the request continues from the
        exact one (its logits replace its own, its K/V becomes the shadow's, later forwards
        reuse nothing)."""
        s = self._shadows.get(req) if self._shadows else None
        if s is None or s.applied:
            return logits
        plan = req.grant.plan
        self.depths.record(plan.r, plan.depth, logits[0], logits[-1], plan.mode, probe=s.probe,
                           r_probe=plan.probe_r)
        s.kv, s.applied = req.continue_exact(s.kv), True
        return [logits[-1], *logits[1:-1]]

    def release(self, req: AuditedRequest) -> None:
        """``req`` retired: its shadow's rows (or the rows it left for them) go back."""
        s = self._shadows.pop(req, None)
        if s is not None:
            self._pool.free_seq(s.kv)
