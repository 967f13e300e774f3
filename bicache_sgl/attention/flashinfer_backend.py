"""FlashInfer backend: batch prefill over a paged K/V cache with page size 1 and ``causal=False``
(CUDA only).

The row store is FlashInfer's paged cache with one token per page ([R, 1, Hkv, Dh], NHD), so a
sequence's keys at layer l are the pages ``kv_rows[i][l]``: reused prefix rows are read where
they live. The plan depends on the query and key lengths, which are the same for every layer
of a segment; the page indices differ per layer (each layer has its own rows), so each layer
passes its own int32 index array, built on the host once per forward.

What the kernels support is checked when the backend is chosen (fp16 / bf16, head_dim 64 / 128 /
256); anything else falls back to the torch backend with one warning (see ``create_backend``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .base import AttentionBackend

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
SUPPORTED_HEAD_DIMS = (64, 128, 256)


def paged_indices(kv_rows: Sequence[np.ndarray], layer: int) -> tuple[np.ndarray, np.ndarray]:
    """(kv_indptr int32 [B + 1], kv_indices int32 [sum N_i]) of ``layer`` for page size 1."""
    lens = [r.shape[1] for r in kv_rows]
    indptr = np.zeros(len(lens) + 1, dtype=np.int32)
    np.cumsum(lens, out=indptr[1:])
    indices = np.concatenate([r[layer] for r in kv_rows]).astype(np.int32) if kv_rows else np.zeros(0, np.int32)
    return indptr, indices


def unsupported_reason(dtype: torch.dtype, head_dim: int) -> str | None:
    if dtype not in SUPPORTED_DTYPES:
        return f"dtype {dtype} (FlashInfer's prefill kernels take float16 / bfloat16)"
    if head_dim not in SUPPORTED_HEAD_DIMS:
        return f"head_dim {head_dim} (FlashInfer's prefill kernels take {SUPPORTED_HEAD_DIMS})"
    return None


class FlashInferAttention(AttentionBackend):
    name = "flashinfer"

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda" or not torch.cuda.is_available():
            raise RuntimeError("attention backend 'flashinfer' needs a CUDA device; use --attention-backend torch on "
                               f"{device.type}")
        try:
            import flashinfer
        except ImportError as e:
            raise RuntimeError("attention backend 'flashinfer' needs the flashinfer-python package: "
                               "pip install 'bicache-sgl[cuda]'") from e
        self.device = device
        self._workspace = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device=device)
        self._wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
        self._planned: object = None
        self._layer_indices: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def begin_forward(self, kv_rows) -> None:
        super().begin_forward(kv_rows)
        self._planned = None
        self._layer_indices = {}

    def _indices(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        got = self._layer_indices.get(layer)
        if got is None:
            indptr, indices = paged_indices(self.kv_rows, layer)
            got = (torch.from_numpy(indptr).to(self.device, non_blocking=True),
                   torch.from_numpy(indices).to(self.device, non_blocking=True))
            self._layer_indices[layer] = got
        return got

    def attend(self, q: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor, layer: int,
               q_indptr: Sequence[int], layout_key: object) -> torch.Tensor:
        kv_indptr, kv_indices = self._indices(layer)
        key = (layout_key, layer)
        if self._planned != key:
            n = len(q_indptr) - 1
            self._wrapper.plan(
                torch.tensor(list(q_indptr), dtype=torch.int32, device=self.device), kv_indptr, kv_indices,
                torch.ones(n, dtype=torch.int32, device=self.device),
                num_qo_heads=q.shape[1], num_kv_heads=k_store.shape[1], head_dim_qk=q.shape[2], page_size=1,
                causal=False, q_data_type=q.dtype, kv_data_type=k_store.dtype)
            self._planned = key
        return self._wrapper.run(q.contiguous(), (k_store.unsqueeze(1), v_store.unsqueeze(1)))
