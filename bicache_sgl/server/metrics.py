"""Request counters and the Prometheus text exposition for ``/metrics``.

Names follow SGLang's (``sglang:prompt_tokens_total`` ...) so existing dashboards work; the
engine's own numeric stats (cache hit rate, pool usage, ...) are exported as
``bicache_sgl:<name>`` gauges.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Mapping
from typing import Any

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class Histogram:
    def __init__(self, buckets=_LATENCY_BUCKETS):
        self.buckets = tuple(buckets)
        self.counts = [0] * len(self.buckets)
        self.count = 0
        self.sum = 0.0

    def observe(self, v: float) -> None:
        self.count += 1
        self.sum += v
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1


class Metrics:
    """Thread-safe counters updated when requests finish."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.lock = threading.Lock()
        self.started = time.time()
        self.requests_total = 0
        self.requests_by_finish: dict[str, int] = {}
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.cached_tokens_total = 0
        self.forward_passes_total = 0
        self.gen_tokens_with_passes = 0
        self.errors_total = 0
        self.http_requests: dict[tuple[str, int], int] = {}
        self.e2e = Histogram()
        self.ttft = Histogram()
        self.last_finish = 0.0
        self._recent: list[tuple[float, int]] = []  # (time, completion tokens) for throughput

    def on_finish(self, prompt_tokens: int, meta: Mapping[str, Any], e2e: float, ttft: float | None) -> None:
        completion = int(meta.get("completion_tokens") or 0)
        now = time.time()
        with self.lock:
            self.requests_total += 1
            fr = meta.get("finish_reason")
            kind = fr.get("type", "unknown") if isinstance(fr, dict) else "unknown"
            self.requests_by_finish[kind] = self.requests_by_finish.get(kind, 0) + 1
            self.prompt_tokens_total += int(prompt_tokens)
            self.generation_tokens_total += completion
            self.cached_tokens_total += int(meta.get("cached_tokens") or 0)
            passes = meta.get("forward_passes")
            if isinstance(passes, (int, float)) and passes > 0 and completion > 0:
                self.forward_passes_total += int(passes)
                self.gen_tokens_with_passes += completion
            self.e2e.observe(e2e)
            if ttft is not None:
                self.ttft.observe(ttft)
            self.last_finish = now
            self._recent.append((now, completion))
            cutoff = now - 30.0
            while self._recent and self._recent[0][0] < cutoff:
                self._recent.pop(0)

    def on_http(self, route: str, status: int) -> None:
        with self.lock:
            key = (route, status)
            self.http_requests[key] = self.http_requests.get(key, 0) + 1

    @property
    def avg_tokens_per_forward(self) -> float:
        """Generated tokens per forward pass: the diffusion analogue of SGLang's speculative
        acceptance length (1.0 = one token per forward, like autoregressive decoding)."""
        with self.lock:
            if self.forward_passes_total == 0:
                return 1.0
            return self.gen_tokens_with_passes / self.forward_passes_total

    def gen_throughput(self) -> float:
        now = time.time()
        with self.lock:
            recent = [(t, c) for t, c in self._recent if t >= now - 30.0]
        if not recent:
            return 0.0
        span = max(now - recent[0][0], 1.0)
        return sum(c for _, c in recent) / span

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return {
                "num_requests_total": self.requests_total,
                "prompt_tokens_total": self.prompt_tokens_total,
                "generation_tokens_total": self.generation_tokens_total,
                "cached_tokens_total": self.cached_tokens_total,
                "forward_passes_total": self.forward_passes_total,
                "cache_hit_rate": (self.cached_tokens_total / self.prompt_tokens_total
                                   if self.prompt_tokens_total else 0.0),
            }

    # -- exposition ---------------------------------------------------------------------
    def render(self, engine_stats: Mapping[str, Any] | None = None) -> str:
        label = f'model_name="{_escape(self.model_name)}"'
        out: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]):
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")
            for suffix_labels, value in samples:
                out.append(f"{name}{suffix_labels} {_num(value)}")

        with self.lock:
            metric("sglang:num_requests_total", "counter", "Finished generation requests.",
                   [(f"{{{label}}}", self.requests_total)])
            metric("sglang:finished_requests_total", "counter", "Finished requests by finish reason.",
                   [(f'{{{label},finish_reason="{_escape(k)}"}}', v)
                    for k, v in sorted(self.requests_by_finish.items())]
                   or [(f'{{{label},finish_reason="stop"}}', 0)])
            metric("sglang:prompt_tokens_total", "counter", "Prompt tokens of finished requests.",
                   [(f"{{{label}}}", self.prompt_tokens_total)])
            metric("sglang:generation_tokens_total", "counter", "Generated tokens.",
                   [(f"{{{label}}}", self.generation_tokens_total)])
            metric("sglang:cached_tokens_total", "counter", "Prompt tokens served from the shared prefix cache.",
                   [(f"{{{label}}}", self.cached_tokens_total)])
            metric("sglang:forward_passes_total", "counter", "Model forward passes spent on finished requests.",
                   [(f"{{{label}}}", self.forward_passes_total)])
            metric("sglang:http_requests_total", "counter", "HTTP requests by route and status.",
                   [(f'{{{label},route="{_escape(r)}",status="{s}"}}', v)
                    for (r, s), v in sorted(self.http_requests.items())]
               or [(f'{{{label},route="/",status="200"}}', 0)])
            for name, h, help_ in (("sglang:e2e_request_latency_seconds", self.e2e, "End-to-end request latency."),
                                   ("sglang:time_to_first_token_seconds", self.ttft,
                                    "Time until the first final block was sent.")):
                samples = []
                for b, c in zip(h.buckets, h.counts):
                    samples.append((f'_bucket{{{label},le="{_num(b)}"}}', c))
                samples.append((f'_bucket{{{label},le="+Inf"}}', h.count))
                samples.append((f"_sum{{{label}}}", h.sum))
                samples.append((f"_count{{{label}}}", h.count))
                out.append(f"# HELP {name} {help_}")
                out.append(f"# TYPE {name} histogram")
                for sfx, v in samples:
                    out.append(f"{name}{sfx} {_num(v)}")
        metric("sglang:gen_throughput", "gauge", "Generated tokens per second over the last 30 s.",
               [(f"{{{label}}}", self.gen_throughput())])
        metric("sglang:avg_tokens_per_forward", "gauge",
               "Generated tokens per forward pass (diffusion analogue of the spec accept length).",
               [(f"{{{label}}}", self.avg_tokens_per_forward)])
        stats = dict(engine_stats or {})
        aliases = {"num_running_reqs": "sglang:num_running_reqs", "num_waiting_reqs": "sglang:num_queue_reqs",
                   "num_running": "sglang:num_running_reqs", "num_waiting": "sglang:num_queue_reqs"}
        for key, name in aliases.items():
            if _is_number(stats.get(key)):
                metric(name, "gauge", f"Engine {key}.", [(f"{{{label}}}", stats[key])])
        for key, value in sorted(_flatten(stats).items()):
            if _is_number(value):
                name = "bicache_sgl:" + _sanitize(key)
                metric(name, "gauge", f"Engine statistic {key}.", [(f"{{{label}}}", value)])
        return "\n".join(out) + "\n"


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(_flatten(v, key + "_"))
        else:
            out[key] = v
    return out


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)) or isinstance(v, bool)


def _sanitize(name: str) -> str:
    s = "".join(c if (c.isascii() and (c.isalnum() or c == "_")) else "_" for c in str(name))
    return s if s and not s[0].isdigit() else "_" + s


def _escape(s: str) -> str:
    return str(s).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _num(v: float) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, int):
        return str(v)
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))
