"""Each worker's counters behind a router (``python -m bicache_sgl.router stats``)."""

from __future__ import annotations

from typing import Any

from bicache_sgl.runtime import http_json

COUNTERS = ("num_requests_total", "prompt_tokens_total", "cached_tokens_total", "computed_layer_tokens",
            "skipped_layer_tokens")


def cluster_stats(router_url: str, api_key: str | None = None, timeout: float = 30.0) -> dict[str, Any]:
    """Each worker's counters behind a router (from the router's ``/workers`` list and each
    worker's ``/get_server_info``), and their sums: ``{"workers": [{"url", <COUNTERS>,
    "cached_fraction", "saved_compute_fraction"}...], "total": {...}}``. ``cached_fraction`` is
    the share of prompt tokens found in the worker's prefix tree (SGLang's cached tokens);
    ``saved_compute_fraction`` the share of layer-token computations bicache skipped (reused
    layers only; 0 at depth 0). A worker that does not answer gets ``"error"``."""
    listing = http_json(router_url.rstrip("/") + "/workers", api_key=api_key, timeout=timeout)
    rows: list[dict[str, Any]] = []
    for entry in listing.get("workers", []):
        url = entry.get("url")
        row: dict[str, Any] = {"url": url, "healthy": entry.get("is_healthy")}
        try:
            info = http_json(url + "/get_server_info", api_key=api_key, timeout=timeout)
            state = (info.get("internal_states") or [{}])[0]
            row.update({k: int(state.get(k) or 0) for k in COUNTERS})
        except (OSError, ValueError) as e:
            row["error"] = str(e)
        rows.append(row)
    total = {k: sum(r.get(k, 0) for r in rows) for k in COUNTERS}
    for r in [*rows, total]:
        if "prompt_tokens_total" in r:
            r["cached_fraction"] = (r["cached_tokens_total"] / r["prompt_tokens_total"]
                                    if r["prompt_tokens_total"] else 0.0)
            layer_tokens = r["computed_layer_tokens"] + r["skipped_layer_tokens"]
            r["saved_compute_fraction"] = r["skipped_layer_tokens"] / layer_tokens if layer_tokens else 0.0
    return {"workers": rows, "total": total}
