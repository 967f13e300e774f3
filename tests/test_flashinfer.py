"""Attention backends over the row store: the registry, FlashInfer's fallback, the paged index
construction checked on CPU against an emulation of FlashInfer's documented paged-prefill
semantics, and (where CUDA is present) FlashInfer against the torch reference."""

import logging

import numpy as np
import pytest
import torch

from bicache_sgl.attention import available_backends, create_backend
from bicache_sgl.attention.flashinfer_backend import paged_indices, unsupported_reason
from bicache_sgl.attention.torch_backend import sdpa_one

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashInfer needs a CUDA GPU")


def test_registry_names_and_cpu_error():
    assert {"torch", "flashinfer"} <= set(available_backends())
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="needs a CUDA device"):
            create_backend("flashinfer", torch.device("cpu"))
    with pytest.raises(ValueError, match="unknown attention backend"):
        create_backend("nope", torch.device("cpu"))


def test_unsupported_dtype_or_head_dim_falls_back_to_torch_with_one_warning(caplog):
    assert unsupported_reason(torch.bfloat16, 128) is None
    assert "dtype" in unsupported_reason(torch.float32, 128)
    assert "head_dim" in unsupported_reason(torch.float16, 48)
    with caplog.at_level(logging.WARNING):
        be = create_backend("flashinfer", torch.device("cpu"), torch.float32, 64)
    assert be.name == "torch" and caplog.text.count("does not support") == 1


def _paged_prefill_emulation(q, k_pages, v_pages, qo_indptr, kv_indptr, kv_indices):
    """FlashInfer's BatchPrefillWithPagedKVCacheWrapper as documented, page_size 1, NHD layout,
    causal=False: request i's queries q[qo_indptr[i]:qo_indptr[i+1]] attend to the tokens of pages
    kv_indices[kv_indptr[i]:kv_indptr[i+1]], in that order. k_pages: [num_pages, 1, Hkv, Dh]."""
    out = torch.empty_like(q)
    for i in range(len(qo_indptr) - 1):
        pages = torch.from_numpy(kv_indices[kv_indptr[i]:kv_indptr[i + 1]].astype(np.int64))
        s, e = qo_indptr[i], qo_indptr[i + 1]
        out[s:e] = sdpa_one(q[s:e], k_pages[pages, 0], v_pages[pages, 0])
    return out


def _store_and_rows(H=4, Hkv=2, Dh=16, L=3):
    """Three sequences; the first two share 5 prefix rows at layers 0-1 (read in place), each
    layer has its own rows."""
    g = torch.Generator().manual_seed(0)
    lens = [9, 12, 4]
    n_rows = 5 * 2 + L * sum(lens)
    k = torch.randn(n_rows, Hkv, Dh, generator=g)
    v = torch.randn(n_rows, Hkv, Dh, generator=g)
    kv_rows, base = [], 10
    for n in lens:
        r = np.arange(base, base + L * n).reshape(L, n)
        base += L * n
        kv_rows.append(r)
    for r in kv_rows[:2]:
        r[0, :5] = np.arange(0, 5)
        r[1, :5] = np.arange(5, 10)
    q_lens = [3, 12, 4]
    q = torch.randn(sum(q_lens), H, Dh, generator=g)
    return q, k, v, kv_rows, [0, *np.cumsum(q_lens).tolist()]


@pytest.mark.parametrize("layer", [0, 1, 2])
def test_paged_indices_under_flashinfer_semantics_equal_the_torch_backend(layer):
    q, k, v, kv_rows, qo_indptr = _store_and_rows()
    kv_indptr, kv_indices = paged_indices(kv_rows, layer)
    assert kv_indptr.dtype == np.int32 and kv_indices.dtype == np.int32
    assert kv_indptr.tolist() == [0, 9, 21, 25]
    if layer < 2:  # the shared prefix rows appear in both sequences' page lists
        assert kv_indices[:5].tolist() == kv_indices[9:14].tolist()
    emu = _paged_prefill_emulation(q, k[:, None], v[:, None], qo_indptr, kv_indptr, kv_indices)
    torch_be = create_backend("torch", torch.device("cpu"))
    torch_be.begin_forward(kv_rows)
    ref = torch_be.attend(q, k, v, layer, qo_indptr, ("seg", 0))
    assert torch.allclose(emu, ref, atol=1e-5)


@cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_flashinfer_matches_torch(dtype):
    pytest.importorskip("flashinfer")
    dev = torch.device("cuda")
    q, k, v, kv_rows, qo_indptr = _store_and_rows(H=8, Hkv=2, Dh=64)
    q, k, v = (t.to(dev, dtype) for t in (q, k, v))
    outs = []
    for name in ("torch", "flashinfer"):
        be = create_backend(name, dev, dtype, 64)
        be.begin_forward(kv_rows)
        outs.append(torch.stack([be.attend(q, k, v, layer, qo_indptr, ("seg", 0)) for layer in range(3)]))
    assert torch.allclose(outs[0].float(), outs[1].float(), atol=2e-2, rtol=2e-2)


@cuda
def test_engine_with_flashinfer_equals_torch(tiny_llada):
    pytest.importorskip("flashinfer")
    from bicache_sgl import Engine
    outs = []
    for backend in ("torch", "flashinfer"):
        eng = Engine(tiny_llada, device="cuda", dtype="bfloat16", attention_backend=backend, block_length=8,
                     prefix_cache="off")
        outs.append(eng.generate(["hello there", "a b c d"], {"max_new_tokens": 16, "temperature": 0}))
        eng.shutdown()
    same = sum(a["output_ids"] == b["output_ids"] for a, b in zip(*outs))
    assert same == 2
