"""Block-causal attention (block-diffusion families: LLaDA2.x, SDAR), torch implementation.

Positions are cut into blocks of ``block_length`` from absolute position 0; a query at position p
sees every key at a position < ``block_end(p) = (p // block_length + 1) * block_length`` (its own
block, bidirectionally, and all earlier blocks), never a later block.

One call computes the queries of one sequence: ``q`` holds positions ``q_start .. q_start + m - 1``
and ``k`` / ``v`` every key from position 0 (the cached K/V of earlier blocks followed by the rows
computed now). The queries are taken in chunks that start on a block boundary:

- a chunk inside one block (the decode step: the current block's rows) attends to the key prefix
  ``[0, block_end)`` with no mask at all;
- a chunk spanning several blocks (a prefill of many prompt blocks) gets a boolean mask of
  ``chunk_rows x key_end`` built from block indices, so memory is ``O(chunk x N)``, never the
  dense ``N x N`` mask of a long prompt.
"""

from __future__ import annotations

import torch

from .torch_backend import sdpa_batched

# Query rows per masked chunk (rounded down to whole blocks): bounds the mask at 512 x N bools.
DEFAULT_CHUNK_ROWS = 512


def block_chunks(q_start: int, m: int, block_length: int, chunk_rows: int = DEFAULT_CHUNK_ROWS
                 ) -> list[tuple[int, int, int]]:
    """[(row_a, row_b, key_end)]: query rows [row_a, row_b) of the call, each chunk starting on a
    block boundary (or at row 0) and holding whole blocks, with the end of its last block's keys."""
    B = block_length
    per = max(B, (chunk_rows // B) * B)
    out = []
    a = 0
    while a < m:
        pos = q_start + a
        # whole blocks from the start of pos's block, at most ``per`` positions
        end_pos = min(q_start + m, (pos // B) * B + per)
        b = end_pos - q_start
        key_end = ((end_pos - 1) // B + 1) * B
        out.append((a, b, key_end))
        a = b
    return out


def block_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, block_length: int,
                           chunk_rows: int = DEFAULT_CHUNK_ROWS) -> torch.Tensor:
    """q [m, H, Dh] at positions q_start.., k / v [N, Hkv, Dh] at positions 0..N-1 -> [m, H, Dh].
    Keys past N (a block not computed yet) do not exist, so ``key_end`` is capped at N."""
    m, N, B = q.shape[0], k.shape[0], block_length
    out = torch.empty_like(q)
    for a, b, key_end in block_chunks(q_start, m, B, chunk_rows):
        ke = min(key_end, N)
        qa, kk, vv = q[a:b][None], k[:ke][None], v[:ke][None]
        first_block = (q_start + a) // B
        last_block = (q_start + b - 1) // B
        if first_block == last_block:
            out[a:b] = sdpa_batched(qa, kk, vv, None)[0]
        else:
            pos = torch.arange(q_start + a, q_start + b, device=q.device)
            allowed = torch.arange(ke, device=q.device)[None, :] < ((pos // B + 1) * B)[:, None]  # [b-a, ke]
            out[a:b] = sdpa_batched(qa, kk, vv, allowed[None, None])[0]
    return out


def block_causal_mask_dense(n: int, block_length: int) -> torch.Tensor:
    """bool [n, n], True = attend: the published generate's mask (tril over blocks, repeated).
    For small checks only (it is the N x N mask the serving path never builds)."""
    blk = torch.arange(n) // block_length
    return blk[None, :] <= blk[:, None]
