"""Model code against an independent plain reference forward, and checkpoint errors."""

import json
import math
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


def _load_raw(folder: str) -> tuple[dict, dict]:
    cfg = json.loads((Path(folder) / "config.json").read_text())
    sd = {}
    index = Path(folder) / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists()
             else ["model.safetensors"])
    for f in files:
        sd.update(load_file(str(Path(folder) / f)))
    return cfg, sd


def reference_forward(folder: str, ids: list[int]) -> torch.Tensor:
    """Plain fp32 forward written straight from the published architectures, independent of
    bicache_sgl.models: returns per-position logits as each model defines them (Dream shifted)."""
    cfg, sd = _load_raw(folder)
    llada = cfg.get("model_type") == "llada"
    if llada:
        d, L, H = cfg["d_model"], cfg["n_layers"], cfg["n_heads"]
        Hkv, eps, theta = cfg["n_kv_heads"], cfg["rms_norm_eps"], cfg["rope_theta"]
        P = "model.transformer."
        emb, lnf = sd[P + "wte.weight"], sd[P + "ln_f.weight"]
        head = sd[P + "wte.weight"] if cfg["weight_tying"] else sd[P + "ff_out.weight"]

        def w(i, n):
            return sd.get(f"{P}blocks.{i}.{n}")
        names = dict(an="attn_norm.weight", q="q_proj.weight", k="k_proj.weight", v="v_proj.weight",
                     o="attn_out.weight", fn="ff_norm.weight", g="ff_proj.weight", u="up_proj.weight",
                     dn="ff_out.weight", qb="q_proj.bias", kb="k_proj.bias", vb="v_proj.bias")
    else:
        d, L, H = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]
        Hkv, eps, theta = cfg["num_key_value_heads"], cfg["rms_norm_eps"], cfg["rope_theta"]
        emb, lnf, head = sd["model.embed_tokens.weight"], sd["model.norm.weight"], sd["lm_head.weight"]

        def w(i, n):
            return sd.get(f"model.layers.{i}.{n}")
        names = dict(an="input_layernorm.weight", q="self_attn.q_proj.weight", k="self_attn.k_proj.weight",
                     v="self_attn.v_proj.weight", o="self_attn.o_proj.weight", fn="post_attention_layernorm.weight",
                     g="mlp.gate_proj.weight", u="mlp.up_proj.weight", dn="mlp.down_proj.weight",
                     qb="self_attn.q_proj.bias", kb="self_attn.k_proj.bias", vb="self_attn.v_proj.bias")
    hd = d // H
    N = len(ids)

    def rms(x, g):
        return g * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))

    inv = [1.0 / theta ** (2 * j / hd) for j in range(hd // 2)]
    ang = torch.tensor([[p * f for f in inv] for p in range(N)], dtype=torch.float64)
    cos, sin = torch.cos(ang).float(), torch.sin(ang).float()

    def rope(x):  # x [heads, N, hd]; pairs (j, j + hd/2)
        a, b = x[..., : hd // 2], x[..., hd // 2:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

    x = emb[torch.tensor(ids)]
    for i in range(L):
        hn = rms(x, w(i, names["an"]))
        q = hn @ w(i, names["q"]).T + (w(i, names["qb"]) if w(i, names["qb"]) is not None else 0)
        k = hn @ w(i, names["k"]).T + (w(i, names["kb"]) if w(i, names["kb"]) is not None else 0)
        v = hn @ w(i, names["v"]).T + (w(i, names["vb"]) if w(i, names["vb"]) is not None else 0)
        q = rope(q.view(N, H, hd).transpose(0, 1))
        k = rope(k.view(N, Hkv, hd).transpose(0, 1))
        v = v.view(N, Hkv, hd).transpose(0, 1)
        out = []
        for h in range(H):
            kh, vh = k[h // (H // Hkv)], v[h // (H // Hkv)]
            att = torch.softmax(q[h] @ kh.T / math.sqrt(hd), dim=-1)  # no causal mask
            out.append(att @ vh)
        a = torch.stack(out, 0).transpose(0, 1).reshape(N, d)
        x = x + a @ w(i, names["o"]).T
        hn = rms(x, w(i, names["fn"]))
        g = hn @ w(i, names["g"]).T
        x = x + (g * torch.sigmoid(g) * (hn @ w(i, names["u"]).T)) @ w(i, names["dn"]).T
    logits = rms(x, lnf) @ head.T
    if not llada:  # Dream: position i is predicted by the output at i - 1
        logits = torch.cat([logits[:1], logits[:-1]], dim=0)
    return logits


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
