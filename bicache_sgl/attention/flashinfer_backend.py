"""FlashInfer backend: batch prefill over ragged KV with ``causal=False`` (CUDA only).

The packed keys of all sequences are laid out ragged (kv_indptr); one plan per distinct layout
per forward is reused across the layers that share it (bicache segments change the query set).
"""

from __future__ import annotations

from typing import Sequence

import torch

from .base import AttentionBackend


class FlashInferAttention(AttentionBackend):
    name = "flashinfer"

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda" or not torch.cuda.is_available():
            raise RuntimeError("attention backend 'flashinfer' needs a CUDA device; use --attention-backend torch on "
                               f"{device.type}")
        try:
            import flashinfer  # noqa: F401
        except ImportError as e:
            raise RuntimeError("attention backend 'flashinfer' needs the flashinfer-python package: "
                               "pip install 'bicache-sgl[cuda]'") from e
        self._fi = flashinfer
        self.device = device
        self._workspace = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device=device)
        self._wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(self._workspace, "NHD")
        self._planned: object = None

    def begin_forward(self) -> None:
        self._planned = None

    def attend(self, q: torch.Tensor, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
               q_indptr: Sequence[int], layout_key: object) -> torch.Tensor:
        kv_lens = [k.shape[0] for k in keys]
        key = (layout_key, tuple(kv_lens))
        if self._planned != key:
            kv_indptr = [0]
            for n in kv_lens:
                kv_indptr.append(kv_indptr[-1] + n)
            dev = self.device
            self._wrapper.plan(
                torch.tensor(list(q_indptr), dtype=torch.int32, device=dev),
                torch.tensor(kv_indptr, dtype=torch.int32, device=dev),
                num_qo_heads=q.shape[1], num_kv_heads=keys[0].shape[1], head_dim_qk=q.shape[2],
                causal=False, q_data_type=q.dtype, kv_data_type=keys[0].dtype)
            self._planned = key
        k = torch.cat(list(keys), dim=0)
        v = torch.cat(list(values), dim=0)
        return self._wrapper.run(q.contiguous(), k, v)

