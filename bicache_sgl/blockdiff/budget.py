"""The block engine's K/V token budget (``--max-total-tokens``) and its default.

A block-diffusion request holds one K/V buffer for its whole window (prompt + answer in whole
blocks, ``[L, window, Hkv, Dh]`` K and V), allocated when it is admitted; the exact prefix cache
holds cached whole blocks at every layer. Both are the same kind of memory (K/V of every layer per
token position), so ONE budget in token positions bounds their sum: ``BlockEngine`` admits a
request only when the running windows plus its own plus the cache fit, evicting least-recently
used cache leaves first, and waits otherwise; the cache only grows into what the running windows
leave.

Default: what the bidirectional engine would take on the same device (``kv_cache/memory.py``'s
``plan_memory``, the one sizing rule): its request K/V budget (CUDA: ``CUDA_REQUEST_FRACTION`` of
the memory free after the weights and the prefix pool, capped at twice the running requests'
context; CPU: ``CPU_REQUEST_BYTES``) plus its prefix pool's bytes spent on whole-layer block K/V
(CUDA: ``--mem-fraction-static``, default ``CUDA_POOL_FRACTION``, of the free memory; CPU:
``CPU_POOL_BYTES``), or ``--max-prefix-cache-tokens`` when given (which also caps the cache; without
it the cache may fill whatever the running windows leave). ``--max-total-tokens`` replaces the sum.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import EngineConfig
from ..kv_cache.memory import plan_memory, request_kv_bytes_per_token
from ..models.block_config import BlockModelConfig


@dataclass(frozen=True)
class BlockBudget:
    """tokens: K/V positions over the running windows and the prefix cache together; cache_tokens:
    the prefix cache's own cap (never above ``tokens``); bytes_per_token: K and V of every layer."""

    tokens: int
    cache_tokens: int
    bytes_per_token: int

    def describe(self) -> str:
        gib = self.tokens * self.bytes_per_token / (1 << 30)
        return (f"K/V budget {self.tokens} tokens ({gib:.2f} GiB, {self.bytes_per_token} B/token) for running "
                f"requests and the prefix cache (cache at most {self.cache_tokens} tokens)")


def block_kv_budget(cfg: EngineConfig, mc: BlockModelConfig, dtype: torch.dtype, device: torch.device,
                    context_length: int, *, free_bytes: int | None = None) -> BlockBudget:
    """The budget ``cfg`` asks for on a loaded model (module docstring). ``free_bytes``: CUDA's free
    memory now (read from the device when None; call after the weights are loaded)."""
    per_token = request_kv_bytes_per_token(mc, dtype)
    caching = cfg.prefix_cache != "off"
    plan = plan_memory(mc, dtype, device, mc.n_layers if caching else 0,
                       max_prefix_cache_tokens=cfg.max_prefix_cache_tokens, max_total_tokens=cfg.max_total_tokens,
                       mem_fraction_static=cfg.mem_fraction_static, free_bytes=free_bytes,
                       max_positions=2 * cfg.max_running_requests * context_length)
    if not caching:
        share = 0
    elif cfg.max_prefix_cache_tokens is not None:
        share = cfg.max_prefix_cache_tokens
    else:  # the bytes the bidirectional engine's pool would take, as whole-layer K/V (no residual rows)
        share = plan.pool_bytes // per_token
    total = cfg.max_total_tokens if cfg.max_total_tokens is not None else plan.request_tokens + share
    # the cache may fill whatever the running windows leave, unless --max-prefix-cache-tokens caps it
    cap = 0 if not caching else (cfg.max_prefix_cache_tokens if cfg.max_prefix_cache_tokens is not None else total)
    return BlockBudget(total, min(cap, total), per_token)
