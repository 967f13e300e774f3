"""Block-causal attention on FlashInfer (CUDA only), behind the same call as
``block_causal.block_causal_attention``: the same block-aligned query chunks; a chunk inside one
block is a plain non-causal prefill over the key prefix ``[0, block_end)``; a chunk spanning
blocks passes FlashInfer a custom mask of ``chunk x key_end`` (never the N x N mask).

What the kernels take (fp16 / bf16, head_dim 64 / 128 / 256) is checked by
``flashinfer_backend.unsupported_reason``; the caller falls back to the torch function otherwise.
"""

from __future__ import annotations

import torch

from .block_causal import DEFAULT_CHUNK_ROWS, block_chunks


def block_causal_attention_flashinfer(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int,
                                      block_length: int, chunk_rows: int = DEFAULT_CHUNK_ROWS) -> torch.Tensor:
    """q [m, H, Dh] at positions q_start.., k / v [N, Hkv, Dh] at positions 0.. -> [m, H, Dh]."""
    if q.device.type != "cuda":
        raise RuntimeError("FlashInfer block-causal attention needs a CUDA device")
    import flashinfer

    m, N, B = q.shape[0], k.shape[0], block_length
    out = torch.empty_like(q)
    for a, b, key_end in block_chunks(q_start, m, B, chunk_rows):
        ke = min(key_end, N)
        if (q_start + a) // B == (q_start + b - 1) // B:
            out[a:b] = flashinfer.single_prefill_with_kv_cache(q[a:b], k[:ke], v[:ke], causal=False)
        else:
            pos = torch.arange(q_start + a, q_start + b, device=q.device)
            mask = torch.arange(ke, device=q.device)[None, :] < ((pos // B + 1) * B)[:, None]
            out[a:b] = flashinfer.single_prefill_with_kv_cache(q[a:b], k[:ke], v[:ke], custom_mask=mask)
    return out
