"""FlashInfer backend vs the torch reference on the same inputs (runs only where CUDA is present)."""

import pytest
import torch

from bicache_sgl.attention import available_backends, create_backend

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashInfer needs a CUDA GPU")


def test_registry_names_and_cpu_error():
    assert {"torch", "flashinfer"} <= set(available_backends())
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="needs a CUDA device"):
            create_backend("flashinfer", torch.device("cpu"))
    with pytest.raises(ValueError, match="unknown attention backend"):
        create_backend("nope", torch.device("cpu"))


@cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads", [(8, 8), (8, 2)])
def test_flashinfer_matches_torch(dtype, heads):
    pytest.importorskip("flashinfer")
    dev = torch.device("cuda")
    H, Hkv = heads
    g = torch.Generator(device=dev).manual_seed(0)
    kv_lens, q_lens = [37, 128, 5], [9, 128, 5]
    keys = [torch.randn(n, Hkv, 64, device=dev, dtype=dtype, generator=g) for n in kv_lens]
    vals = [torch.randn(n, Hkv, 64, device=dev, dtype=dtype, generator=g) for n in kv_lens]
    q = torch.randn(sum(q_lens), H, 64, device=dev, dtype=dtype, generator=g)
    indptr = [0]
    for n in q_lens:
        indptr.append(indptr[-1] + n)
    ref = create_backend("torch", dev).attend(q, keys, vals, indptr, "x")
    fi = create_backend("flashinfer", dev)
    fi.begin_forward()
    out = fi.attend(q, keys, vals, indptr, "x")
    assert torch.allclose(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


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
