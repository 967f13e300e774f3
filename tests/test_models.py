"""Model code against an independent plain reference forward, and checkpoint errors."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from bicache_sgl.attention import create_backend
from bicache_sgl.kv_cache.store import KVStore
from bicache_sgl.models.config import CheckpointError
from bicache_sgl.models.forward_batch import ForwardBatch, SeqWork
from bicache_sgl.models.loader import load_model, load_tokenizer
from bicache_sgl.reference import load_reference_model, reference_logits


def reference_forward(folder: str, ids: list[int]) -> torch.Tensor:
    """The independent plain reference forward (bicache_sgl.reference, float64, written straight
    from the published architectures, no code shared with bicache_sgl.models): per-position logits
    as each model defines them (Dream shifted), in float32."""
    return reference_logits(load_reference_model(folder), ids).float()


IDS = [5, 17, 200, 33, 33, 90, 4, 250, 11, 77, 3, 64]


@pytest.mark.parametrize("fixture", ["tiny_llada", "tiny_dream", "tiny_llada_sharded", "tiny_dream_sharded"])
def test_forward_matches_reference(fixture, request):
    folder = request.getfixturevalue(fixture)
    model, cfg = load_model(folder, "float32")
    ref = reference_forward(folder, IDS)
    ours = model.forward_dense(torch.tensor(IDS))
    if cfg.logit_shift:
        ours = torch.cat([ours[:1], ours[:-1]], dim=0)
    assert torch.allclose(ours, ref, atol=1e-5, rtol=1e-5), (ours - ref).abs().max()
    # the packed batched path, with logits read only at selected positions
    N = len(IDS)
    store, (kv,) = KVStore.for_sequences(cfg, [N], torch.float32, torch.device("cpu"))
    want = np.array([2, 5, 11])
    fb = ForwardBatch([SeqWork(kv, torch.tensor(IDS), np.arange(N), want - cfg.logit_shift)],
                      torch.device("cpu"), store).build(cfg.n_layers)
    packed = model.forward_batch(fb, create_backend("torch", torch.device("cpu")))
    assert packed.shape == (3, cfg.vocab_size)  # the LM head ran on the 3 requested rows only
    assert torch.allclose(packed, ref[want], atol=1e-5, rtol=1e-5)


def test_bf16_and_fp16_load(tiny_llada):
    for dt, want in (("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        model, _ = load_model(tiny_llada, dt)
        assert next(model.parameters()).dtype == want
        out = model.forward_dense(torch.tensor(IDS))
        assert torch.isfinite(out).all()


def test_tokenizer_and_chat_template(tiny_llada):
    tok = load_tokenizer(tiny_llada)
    text = "Question: 3+4?\nAnswer: 7 — ok"
    assert tok.decode(tok.encode(text)) == text
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert "hi" in rendered and rendered.endswith("assistant<|end_header_id|>\n\n")


def _copy(src: str, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_unknown_architecture(tiny_llada, tmp_path):
    d = _copy(tiny_llada, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["GPT2LMHeadModel"], "gpt2"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="unsupported architecture.*GPT2LMHeadModel"):
        load_model(str(d))


def test_missing_tensor(tiny_llada, tmp_path):
    d = _copy(tiny_llada, tmp_path / "m")
    sd = load_file(str(d / "model.safetensors"))
    del sd["model.transformer.blocks.1.up_proj.weight"]
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\): model.transformer.blocks.1.up_proj.weight"):
        load_model(str(d))


def test_wrong_shape(tiny_dream, tmp_path):
    d = _copy(tiny_dream, tmp_path / "m")
    sd = load_file(str(d / "model.safetensors"))
    sd["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(3, 64)
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model.layers.0.self_attn.k_proj.weight.*shape \(3, 64\)"):
        load_model(str(d))


def test_wrong_dtype_and_truncated_file(tiny_llada, tmp_path):
    d = _copy(tiny_llada, tmp_path / "m")
    sd = load_file(str(d / "model.safetensors"))
    sd["model.transformer.ln_f.weight"] = torch.ones(64, dtype=torch.int32)
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match="ln_f.weight.*dtype"):
        load_model(str(d))
    d2 = _copy(tiny_llada, tmp_path / "m2")
    raw = (d2 / "model.safetensors").read_bytes()
    (d2 / "model.safetensors").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(CheckpointError, match="safetensors"):
        load_model(str(d2))


def test_missing_tokenizer_config_and_bad_values(tiny_llada, tmp_path):
    d = _copy(tiny_llada, tmp_path / "m")
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (d / f).unlink(missing_ok=True)
    with pytest.raises(CheckpointError, match="no tokenizer found"):
        load_tokenizer(str(d))
    (d / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json is not valid JSON"):
        load_model(str(d))
    cfg = json.loads((Path(tiny_llada) / "config.json").read_text())
    cfg["n_layers"] = -2
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="n_layers must be a positive integer"):
        load_model(str(d))
    (d / "config.json").unlink()
    with pytest.raises(CheckpointError, match="has no config.json"):
        load_model(str(d))


def test_missing_shard(tiny_llada_sharded, tmp_path):
    d = _copy(tiny_llada_sharded, tmp_path / "m")
    next(d.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(CheckpointError, match="shard.*do not exist"):
        load_model(str(d))


def test_hub_id_unreachable_is_clear(monkeypatch):
    from bicache_sgl.models.loader import resolve_model_path
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(CheckpointError, match="could not fetch 'GSAI-ML/LLaDA-8B-Instruct'"):
        resolve_model_path("GSAI-ML/LLaDA-8B-Instruct")
    with pytest.raises(CheckpointError, match="neither a local folder"):
        resolve_model_path("./no/such/folder")
