"""The prefix rows are backed by memory when the pool is built (kv_cache/store.py ``prefault``), so a
capture never pays the kernel's first-touch page faults inside a forward (issue 38, item 3)."""

from __future__ import annotations

import ctypes
import mmap
import sys

import numpy as np
import pytest
import torch

from bicache_sgl.kv_cache.pool import KVPool
from bicache_sgl.kv_cache.store import prefault


class Shape:
    """The model shape the pool is sized by (``KVShape``)."""

    n_layers, n_kv_heads, head_dim, hidden_size = 4, 4, 16, 64
    kv_dim = 64

PAGE = 4096
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore residency is read on Linux")


def resident_fraction(t: torch.Tensor) -> float:
    """Fraction of the whole pages of ``t`` the kernel has backed (``mincore``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    start = (t.data_ptr() + PAGE - 1) & ~(PAGE - 1)
    end = (t.data_ptr() + t.numel() * t.element_size()) & ~(PAGE - 1)
    n = (end - start) // PAGE
    vec = (ctypes.c_ubyte * n)()
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(end - start), vec) == 0, ctypes.get_errno()
    return float(np.frombuffer(vec, dtype=np.uint8).__and__(1).mean())


@linux_only
def test_prefault_backs_a_lazy_tensor_and_keeps_its_contents():
    # a fresh anonymous mapping: the kernel backs it on first write (torch.empty may hand out heap
    # memory an earlier test already touched, once malloc's mmap threshold has grown)
    mm = mmap.mmap(-1, 16 << 20)
    t = torch.frombuffer(mm, dtype=torch.uint8)
    assert resident_fraction(t) < 0.5
    t[:PAGE * 3].fill_(7)
    prefault(t)
    assert resident_fraction(t) == 1.0
    assert bool((t[:PAGE * 3] == 7).all())


@linux_only
def test_pool_prefix_rows_are_resident_at_construction():
    pool = KVPool(Shape(), token_capacity=8192, row_capacity=32768, request_row_capacity=65536, dtype=torch.float32,
                  device=torch.device("cpu"))
    st = pool.store
    for t in (st.k[:32768], st.v[:32768], st.h):
        assert resident_fraction(t) == 1.0
    # the private rows (used alike with the cache off) are not prefaulted; whether they are resident
    # depends on what the allocator hands out, so only the prefix rows are checked
