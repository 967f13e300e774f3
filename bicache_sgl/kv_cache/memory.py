"""Memory sizing in one place: the shared prefix pool and the budget for requests' private K/V.

Two pools (docs/prefix_cache.md, "One row store"): the **prefix pool** holds cached prefix state (K/V of the layers
a node holds plus the residual entering the next one) and the **request K/V** is each running
sequence's private ``[L, N, Hkv, Dh]`` K and V. The scheduler admits requests against the request
budget, so neither can outgrow the device.

Sizing rules (all named below; flags override them):
- CUDA: the pool gets ``mem_fraction_static`` (default ``CUDA_POOL_FRACTION``) of the memory free
  after the weights; requests get ``CUDA_REQUEST_FRACTION`` of what is free after that.
- CPU: the pool gets ``CPU_POOL_BYTES``; requests ``CPU_REQUEST_BYTES``.
- The pool stores rows of (token, layer) state, so its byte budget buys *layer-tokens*; a token
  costs as many rows as its node's depth. The token count is capped separately
  (``MAX_POOL_TOKENS``): the index, free lists and the slot -> row table are host arrays, and a
  policy that stores depth 0 needs no rows at all (it only indexes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .store import KVShape

GiB = 1 << 30
CUDA_POOL_FRACTION = 0.3
CUDA_REQUEST_FRACTION = 0.6
CPU_POOL_BYTES = 2 * GiB
CPU_REQUEST_BYTES = 4 * GiB
MIN_POOL_TOKENS = 1024
MAX_POOL_TOKENS = {"cpu": 65536, "cuda": 1 << 20}
MIN_REQUEST_TOKENS = 4096


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def layer_token_bytes(cfg: KVShape, dtype: torch.dtype) -> int:
    """Prefix pool bytes per cached token per layer held: K, V and the residual leaving the layer
    (see kv_cache/pool.py for the layout)."""
    return (2 * cfg.kv_dim + cfg.hidden_size) * itemsize(dtype)


def prefix_bytes_per_token(cfg: KVShape, depth: int, dtype: torch.dtype) -> int:
    """Prefix pool bytes per cached token whose node holds ``depth`` layers."""
    return depth * layer_token_bytes(cfg, dtype)


def request_kv_bytes_per_token(cfg: KVShape, dtype: torch.dtype) -> int:
    """Private K/V bytes per sequence position, all layers."""
    return cfg.n_layers * 2 * cfg.kv_dim * itemsize(dtype)


@dataclass(frozen=True)
class MemoryPlan:
    """How many tokens each pool holds; computed once at engine start."""

    pool_tokens: int  # prefix pool token slots (cached tokens, any depth)
    pool_rows: int  # prefix pool layer-token rows (the tensor storage)
    pool_bytes_per_row: int
    request_tokens: int  # budget of private K/V positions over all running sequences
    request_bytes_per_token: int
    n_layers: int

    @property
    def request_rows(self) -> int:
        """Store rows of the request budget: one per position per layer."""
        return self.request_tokens * self.n_layers

    @property
    def pool_bytes(self) -> int:
        return self.pool_rows * self.pool_bytes_per_row

    @property
    def request_bytes(self) -> int:
        return self.request_tokens * self.request_bytes_per_token

    def describe(self) -> str:
        mib = 1 / (1 << 20)
        return (f"prefix pool {self.pool_tokens} tokens, {self.pool_rows} layer-tokens ({self.pool_bytes * mib:.1f} "
                f"MiB, {self.pool_bytes_per_row} B per layer-token); request K/V budget {self.request_tokens} tokens "
                f"({self.request_bytes * mib:.1f} MiB, {self.request_bytes_per_token} B/token)")


def plan_memory(cfg: KVShape, dtype: torch.dtype, device: torch.device, max_depth: int, *,
                max_prefix_cache_tokens: int | None = None, max_total_tokens: int | None = None,
                mem_fraction_static: float | None = None, free_bytes: int | None = None,
                max_positions: int | None = None) -> MemoryPlan:
    """Size both pools for a policy whose nodes hold at most ``max_depth`` layers.
    ``free_bytes`` (CUDA: free memory now) is read from the device when None; ``max_positions``
    (running requests x context length) caps the request budget when no flag sets it."""
    row_bytes = layer_token_bytes(cfg, dtype)
    req_per = request_kv_bytes_per_token(cfg, dtype)
    cap = MAX_POOL_TOKENS["cuda" if device.type == "cuda" else "cpu"]
    if device.type == "cuda":
        if free_bytes is None:
            free_bytes, _ = torch.cuda.mem_get_info(device)
        pool_budget = int(free_bytes * (mem_fraction_static or CUDA_POOL_FRACTION))
    else:
        free_bytes = None
        pool_budget = CPU_POOL_BYTES
    if max_prefix_cache_tokens is not None:  # the bytes of that many tokens at full depth
        rows = max_prefix_cache_tokens * max_depth
    else:
        rows = min(pool_budget // row_bytes, cap * max_depth)
    # token slots for every row at depth 1 (trimmed nodes keep tokens, drop rows): rows, not
    # rows / max_depth, so trimming frees room for more tokens
    if max_prefix_cache_tokens is not None:
        tokens = max(rows, max_prefix_cache_tokens)
    elif max_depth == 0:
        tokens = cap
    else:
        tokens = min(cap, max(rows, MIN_POOL_TOKENS))
    if max_total_tokens is not None:
        request_tokens = max_total_tokens
    else:
        if free_bytes is not None:
            req_budget = int(max(0, free_bytes - rows * row_bytes) * CUDA_REQUEST_FRACTION)
        else:
            req_budget = CPU_REQUEST_BYTES
        request_tokens = max(MIN_REQUEST_TOKENS, req_budget // req_per)
        if max_positions is not None:
            request_tokens = max(MIN_REQUEST_TOKENS, min(request_tokens, max_positions))
    return MemoryPlan(tokens, rows, row_bytes, request_tokens, req_per, cfg.n_layers)
