"""The online audit: checks the profile's depths on live traffic and lowers the ones that fail.

For a sample of requests that reuse a prefix (``rate``), the engine also runs their first forward
without reuse, in the same batch. The two distributions at the masked positions are compared
(top-1 agreement, KL(exact || reused)) and kept per r-bucket (the profile's table rows). A sample
whose top-1 agreement is below ``min_agreement`` lowers that bucket's cap to one layer below the
depth it used, and every lower bucket with it (the table stays non-decreasing and errs safe).
Later samples in the bucket then test the lower depth; the cap never rises again.
"""

from __future__ import annotations

import logging
import random
import threading
from dataclasses import dataclass

import torch

from .profile import BicacheProfile

log = logging.getLogger(__name__)


@dataclass
class _Bucket:
    r_lo: float
    samples: int = 0
    agree_sum: float = 0.0
    kl_sum: float = 0.0
    cap: int | None = None  # None: the profile's depth


def compare(reused: torch.Tensor, exact: torch.Tensor) -> tuple[float, float]:
    """Logits [n, V] of the same positions -> (top-1 agreement, mean KL(exact || reused))."""
    if reused.numel() == 0:
        return 1.0, 0.0
    agree = (reused.argmax(-1) == exact.argmax(-1)).double().mean().item()
    lp_e = torch.log_softmax(exact.double(), -1)
    lp_r = torch.log_softmax(reused.double(), -1)
    kl = (lp_e.exp() * (lp_e - lp_r)).sum(-1).mean().item()
    return agree, max(kl, 0.0)


class DepthAudit:
    """Per-bucket audit statistics and depth caps for one profile. Thread-safe."""

    def __init__(self, profile: BicacheProfile, rate: float, min_agreement: float = 0.9, seed: int = 0) -> None:
        if not 0 <= rate <= 1:
            raise ValueError(f"audit rate must be in [0, 1], got {rate}")
        if not 0 <= min_agreement <= 1:
            raise ValueError(f"audit min_agreement must be in [0, 1], got {min_agreement}")
        self.rate, self.min_agreement = rate, min_agreement
        self._buckets = [_Bucket(r / 100.0) for r, _ in profile.table]
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.lowered = 0

    def _index(self, r: float) -> int:
        i = 0
        for j, b in enumerate(self._buckets):
            if r + 1e-12 >= b.r_lo:
                i = j
        return i

    def sample(self) -> bool:
        """Whether to audit the next reusing request."""
        with self._lock:
            return self.rate > 0 and self._rng.random() < self.rate

    def cap(self, r: float) -> int | None:
        """The audit's cap on the depth at prefix fraction ``r`` (None: no cap)."""
        with self._lock:
            return self._buckets[self._index(r)].cap

    def record(self, r: float, depth: int, reused: torch.Tensor, exact: torch.Tensor) -> None:
        """One audited request's first forward: reused at ``depth`` vs no reuse."""
        agree, kl = compare(reused, exact)
        with self._lock:
            i = self._index(r)
            b = self._buckets[i]
            b.samples += 1
            b.agree_sum += agree
            b.kl_sum += kl
            if agree < self.min_agreement and depth > 0:
                new = depth - 1
                for lower in self._buckets[:i + 1]:
                    if lower.cap is None or lower.cap > new:
                        lower.cap = new
                self.lowered += 1
                log.warning("bicache audit: at r=%.2f depth %d agreed on %.0f%% of masked positions (KL %.3g) "
                            "< %.0f%%: capping r < %.2f at depth %d", r, depth, 100 * agree, kl,
                            100 * self.min_agreement, self._buckets[i + 1].r_lo if i + 1 < len(self._buckets)
                            else 1.0, new)

    def stats(self) -> dict:
        with self._lock:
            n = sum(b.samples for b in self._buckets)
            return {
                "bicache_audit_rate": self.rate,
                "bicache_audit_samples_total": n,
                "bicache_audit_lowered_total": self.lowered,
                "bicache_audit_top1_agreement": sum(b.agree_sum for b in self._buckets) / n if n else None,
                "bicache_audit_kl": sum(b.kl_sum for b in self._buckets) / n if n else None,
                "bicache_audit_buckets": [
                    {"r_from": b.r_lo, "samples": b.samples, "cap": b.cap,
                     "top1_agreement": b.agree_sum / b.samples if b.samples else None,
                     "kl": b.kl_sum / b.samples if b.samples else None} for b in self._buckets],
            }
