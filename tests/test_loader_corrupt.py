"""The checkpoint loader against corrupt inputs: every case ends in a ``CheckpointError`` whose
message names the file, key or tensor at fault, never an exception from deep inside torch,
safetensors, tokenizers or the model constructor.

Extends tests/test_models.py (which covers an unknown architecture, one missing tensor, a wrong
shape, an int32 tensor, a file cut in half, a missing tokenizer, config.json that is not JSON,
a negative n_layers, a missing config.json and a missing shard) without repeating those cases.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from bicache_sgl.models.config import CheckpointError, parse_model_config
from bicache_sgl.models.loader import load_model, load_tokenizer


@pytest.fixture(scope="module")
def llada(tmp_path_factory) -> str:
    from bicache_sgl.testing import make_tiny_llada

    return make_tiny_llada(tmp_path_factory.mktemp("corrupt_src") / "llada", n_layers=2)


@pytest.fixture(scope="module")
def dream(tmp_path_factory) -> str:
    from bicache_sgl.testing import make_tiny_dream

    return make_tiny_dream(tmp_path_factory.mktemp("corrupt_src") / "dream", n_layers=2)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> str:
    from bicache_sgl.testing import make_tiny_llada

    return make_tiny_llada(tmp_path_factory.mktemp("corrupt_src") / "sharded", n_layers=2, shards=2)


def copy(src: str, tmp_path: Path, name: str = "m") -> Path:
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def load_fails(folder: Path, *patterns: str) -> CheckpointError:
    """load_model raises CheckpointError (nothing else) and its message matches every pattern."""
    with pytest.raises(CheckpointError) as ei:
        load_model(str(folder))
    msg = str(ei.value)
    for p in patterns:
        assert p in msg, f"{p!r} not in {msg!r}"
    return ei.value


def edit_config(folder: Path, **changes) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    for k, v in changes.items():
        if v is _DELETE:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (folder / "config.json").write_text(json.dumps(cfg))


_DELETE = object()


# ------------------------------------------------------------------------------------------------
# truncated and corrupt safetensors files
# ------------------------------------------------------------------------------------------------

def _header_len(path: Path) -> int:
    return struct.unpack("<Q", path.read_bytes()[:8])[0]


@pytest.mark.parametrize("where", ["empty", "4 bytes", "length only", "inside header", "header end",
                                   "first tensor", "one byte short"])
def test_truncated_safetensors(llada, tmp_path, where):
    d = copy(llada, tmp_path)
    f = d / "model.safetensors"
    raw = f.read_bytes()
    hl = _header_len(f)
    cut = {"empty": 0, "4 bytes": 4, "length only": 8, "inside header": 8 + hl // 2, "header end": 8 + hl,
           "first tensor": 8 + hl + 100, "one byte short": len(raw) - 1}[where]
    f.write_bytes(raw[:cut])
    load_fails(d, "model.safetensors")


@pytest.mark.parametrize("content", [
    b"\x00" * 64,  # header length 0
    struct.pack("<Q", 2**62) + b"{}",  # header length far past the end of the file
    struct.pack("<Q", 2) + b"[]",  # a header that is not an object
    struct.pack("<Q", 9) + b"not json!",
    random.Random(20240601).randbytes(4096),  # seeded: a failure reproduces
], ids=["zero header", "huge header length", "header is a list", "header not json", "random bytes"])
def test_garbage_safetensors(llada, tmp_path, content):
    d = copy(llada, tmp_path)
    (d / "model.safetensors").write_bytes(content)
    load_fails(d, "model.safetensors")


def test_tensor_offsets_past_end_of_file(llada, tmp_path):
    """A well-formed header whose data offsets point past the end of the file."""
    d = copy(llada, tmp_path)
    f = d / "model.safetensors"
    raw = f.read_bytes()
    hl = _header_len(f)
    header = json.loads(raw[8:8 + hl])
    name = "model.transformer.ln_f.weight"
    a, b = header[name]["data_offsets"]
    header[name]["data_offsets"] = [a + 10**9, b + 10**9]
    new = json.dumps(header).encode()
    f.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + hl:])
    load_fails(d, "model.safetensors")


def test_no_weight_files(llada, tmp_path):
    d = copy(llada, tmp_path)
    (d / "model.safetensors").unlink()
    load_fails(d, "has no safetensors weights")


# ------------------------------------------------------------------------------------------------
# wrong dtypes and shapes
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.int64, torch.int8, torch.uint8, torch.bool, torch.complex64,
                                   torch.float8_e4m3fn], ids=str)
def test_non_float_dtype(llada, tmp_path, dtype):
    d = copy(llada, tmp_path)
    sd = load_file(str(d / "model.safetensors"))
    name = "model.transformer.blocks.0.q_proj.weight"
    sd[name] = torch.zeros(sd[name].shape).to(dtype)
    save_file(sd, str(d / "model.safetensors"))
    err = load_fails(d, name, "dtype")
    assert str(dtype).replace("torch.", "") in str(err)


def test_float64_is_converted(llada, tmp_path):
    """A float64 tensor is a float dtype: converted (values kept), not rejected."""
    d = copy(llada, tmp_path)
    sd = load_file(str(d / "model.safetensors"))
    ref = torch.linspace(0.5, 1.5, sd["model.transformer.ln_f.weight"].numel(), dtype=torch.float64)
    sd["model.transformer.ln_f.weight"] = ref
    save_file(sd, str(d / "model.safetensors"))
    model, _ = load_model(str(d), "float32")
    norm = dict(model.named_parameters())["norm.weight"]
    assert norm.dtype == torch.float32
    torch.testing.assert_close(norm.detach(), ref.float())


@pytest.mark.parametrize("shape", [(), (64, 1), (65,)], ids=["scalar", "2d", "longer"])
def test_norm_weight_wrong_shape(llada, tmp_path, shape):
    d = copy(llada, tmp_path)
    sd = load_file(str(d / "model.safetensors"))
    sd["model.transformer.ln_f.weight"] = torch.ones(shape)
    save_file(sd, str(d / "model.safetensors"))
    load_fails(d, "model.transformer.ln_f.weight", "shape", "expected (64,)")


# ------------------------------------------------------------------------------------------------
# missing keys
# ------------------------------------------------------------------------------------------------

def test_every_tensor_missing_is_summarised(llada, tmp_path):
    d = copy(llada, tmp_path)
    save_file({"unrelated": torch.zeros(1)}, str(d / "model.safetensors"))
    err = load_fails(d, "missing tensor(s)", "model.transformer.wte.weight", "more)")
    assert len(str(err)) < 600  # five names and a count, not the whole list


def test_untied_head_missing(llada, tmp_path):
    d = copy(llada, tmp_path)
    sd = load_file(str(d / "model.safetensors"))
    del sd["model.transformer.ff_out.weight"]
    save_file(sd, str(d / "model.safetensors"))
    load_fails(d, "model.transformer.ff_out.weight")


def test_dream_bias_missing(dream, tmp_path):
    d = copy(dream, tmp_path)
    sd = load_file(str(d / "model.safetensors"))
    del sd["model.layers.1.self_attn.v_proj.bias"]
    save_file(sd, str(d / "model.safetensors"))
    load_fails(d, "model.layers.1.self_attn.v_proj.bias")


def test_index_names_tensor_its_shard_lacks(sharded, tmp_path):
    d = copy(sharded, tmp_path)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    name = "model.transformer.wte.weight"
    shard = index["weight_map"][name]
    other = next(f for f in set(index["weight_map"].values()) if f != shard)
    index["weight_map"][name] = other
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    load_fails(d, name, other)


def test_index_without_a_tensor(sharded, tmp_path):
    d = copy(sharded, tmp_path)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.transformer.ln_f.weight"]
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    load_fails(d, "missing tensor(s)", "model.transformer.ln_f.weight")


# ------------------------------------------------------------------------------------------------
# bad index json
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("content", [
    "{not json", "[]", "null", '"weight_map"', "{}", '{"weight_map": null}', '{"weight_map": []}',
    '{"weight_map": "model.safetensors"}', '{"weight_map": {"model.transformer.wte.weight": 5}}',
    '{"weight_map": {"model.transformer.wte.weight": null}}', '{"weight_map": {"model.transformer.wte.weight": ""}}',
    '{"weight_map": {"model.transformer.wte.weight": "../outside.safetensors"}}',
    '{"weight_map": {"model.transformer.wte.weight": "/etc/passwd"}}',
], ids=["not json", "list", "null", "string", "no weight_map", "weight_map null", "weight_map list",
        "weight_map string", "file is an int", "file is null", "file is empty", "file outside folder",
        "absolute path"])
def test_bad_index(sharded, tmp_path, content):
    d = copy(sharded, tmp_path)
    (tmp_path / "outside.safetensors").write_bytes((d / "model-00001-of-00002.safetensors").read_bytes())
    (d / "model.safetensors.index.json").write_text(content)
    load_fails(d, "model.safetensors.index.json")


def test_symlinked_shards_load(sharded, tmp_path):
    """Hub snapshots link their shards to blobs outside the folder: that is not "outside"; the
    weights read through the links are the shards' weights."""
    d = copy(sharded, tmp_path)
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    for shard in d.glob("model-*.safetensors"):
        target = blobs / shard.name.replace("model", "blob")
        shard.rename(target)
        shard.symlink_to(target)
    assert all(p.is_symlink() for p in d.glob("model-*.safetensors"))
    model, cfg = load_model(str(d), "float32")
    direct, _ = load_model(sharded, "float32")
    assert cfg.n_layers == 2
    got, want = model.state_dict(), direct.state_dict()
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value), name


def test_index_not_utf8(sharded, tmp_path):
    d = copy(sharded, tmp_path)
    (d / "model.safetensors.index.json").write_bytes(b'{"weight_map": {"\xff\xfe": 1}}')
    load_fails(d, "model.safetensors.index.json")


def test_shard_is_a_directory(sharded, tmp_path):
    d = copy(sharded, tmp_path)
    shard = d / "model-00002-of-00002.safetensors"
    shard.unlink()
    shard.mkdir()
    load_fails(d, "model-00002-of-00002.safetensors")


# ------------------------------------------------------------------------------------------------
# bad config values
# ------------------------------------------------------------------------------------------------

LLADA_BAD = [
    ("n_layers", 0, "n_layers"), ("n_layers", "four", "n_layers"), ("n_layers", "4", "n_layers"),
    ("n_layers", 2.5, "n_layers"), ("n_layers", True, "n_layers"), ("n_layers", [2], "n_layers"),
    ("n_layers", {"n": 2}, "n_layers"), ("n_layers", 1e300, "n_layers"),
    ("n_heads", 0, "n_heads"), ("n_heads", -4, "n_heads"), ("n_heads", 5, "n_heads"), ("n_heads", "4", "n_heads"),
    ("d_model", 0, "d_model"), ("d_model", -64, "d_model"), ("d_model", "64", "d_model"), ("d_model", None, "d_model"),
    ("n_kv_heads", -1, "n_kv_heads"), ("n_kv_heads", 3, "n_kv_heads"), ("n_kv_heads", "x", "n_kv_heads"),
    ("embedding_size", -5, "embedding_size"), ("embedding_size", "big", "embedding_size"),
    ("mlp_hidden_size", -1, "mlp_hidden_size"), ("mlp_hidden_size", "wide", "mlp_hidden_size"),
    ("mask_token_id", -1, "mask_token_id"), ("mask_token_id", 10**9, "mask_token_id"),
    ("mask_token_id", "m", "mask_token_id"),
    ("eos_token_id", "end", "eos_token_id"), ("eos_token_id", [1, "x"], "eos_token_id"),
    ("eos_token_id", {"a": 1}, "eos_token_id"),
    ("rms_norm_eps", 0, "rms_norm_eps"), ("rms_norm_eps", "tiny", "rms_norm_eps"),
    ("rms_norm_eps", -1e-5, "rms_norm_eps"),
    ("rope_theta", 0, "rope_theta"), ("rope_theta", "big", "rope_theta"), ("rope_theta", float("inf"), "rope_theta"),
    ("max_sequence_length", 0, "max_sequence_length"), ("max_sequence_length", -1, "max_sequence_length"),
    ("max_sequence_length", "long", "max_sequence_length"),
    ("architectures", 5, "architectures"), ("architectures", [5], "architectures"),
    ("block_type", "parallel", "block_type"), ("alibi", True, "alibi"),
]


@pytest.mark.parametrize("key,value,named", LLADA_BAD, ids=[f"{k}={v!r}"[:40] for k, v, _ in LLADA_BAD])
def test_bad_llada_config_value(llada, tmp_path, key, value, named):
    d = copy(llada, tmp_path)
    edit_config(d, **{key: value})
    load_fails(d, named)


@pytest.mark.parametrize("ratio", ["x", 0, -1, 1e30], ids=repr)
def test_bad_mlp_ratio_without_hidden_size(llada, tmp_path, ratio):
    d = copy(llada, tmp_path)
    edit_config(d, mlp_hidden_size=_DELETE, mlp_ratio=ratio)
    load_fails(d, "mlp_ratio")


def test_vocab_size_alone_when_embedding_size_missing(llada, tmp_path):
    d = copy(llada, tmp_path)
    edit_config(d, embedding_size=_DELETE, vocab_size="many")
    load_fails(d, "vocab_size")


DREAM_BAD = [
    ("num_attention_heads", 0, "num_attention_heads"), ("num_attention_heads", "four", "num_attention_heads"),
    ("hidden_size", 0, "hidden_size"), ("hidden_size", None, "hidden_size"),
    ("num_hidden_layers", -3, "num_hidden_layers"),
    ("num_key_value_heads", -2, "num_key_value_heads"), ("head_dim", 0, "head_dim"), ("head_dim", 7, "head_dim"),
    ("intermediate_size", 0, "intermediate_size"), ("intermediate_size", None, "intermediate_size"),
    ("max_position_embeddings", 0, "max_position_embeddings"), ("vocab_size", "v", "vocab_size"),
    ("tie_word_embeddings", "yes", "tie_word_embeddings"),
]


@pytest.mark.parametrize("key,value,named", DREAM_BAD, ids=[f"{k}={v!r}"[:40] for k, v, _ in DREAM_BAD])
def test_bad_dream_config_value(dream, tmp_path, key, value, named):
    d = copy(dream, tmp_path)
    edit_config(d, **{key: value})
    load_fails(d, named)


@pytest.mark.parametrize("content", ["[]", "null", "5", '"config"', ""], ids=["list", "null", "int", "string",
                                                                              "empty"])
def test_config_not_an_object(llada, tmp_path, content):
    d = copy(llada, tmp_path)
    (d / "config.json").write_text(content)
    load_fails(d, "config.json")


def test_config_is_a_directory(llada, tmp_path):
    d = copy(llada, tmp_path)
    (d / "config.json").unlink()
    (d / "config.json").mkdir()
    load_fails(d, "config.json")


def test_config_not_utf8(llada, tmp_path):
    d = copy(llada, tmp_path)
    (d / "config.json").write_bytes(b'{"model_type": "llada\xff"}')
    load_fails(d, "config.json")


def test_parse_model_config_accepts_integral_floats():
    """Integral floats (4.0) are how some tools write ints: accepted, not truncated silently."""
    base = json.loads(json.dumps({"model_type": "llada", "d_model": 64.0, "n_heads": 4, "n_layers": 2.0,
                                  "vocab_size": 300, "mask_token_id": 5}))
    cfg = parse_model_config(base)
    assert (cfg.hidden_size, cfg.n_layers) == (64, 2)


# ------------------------------------------------------------------------------------------------
# tokenizer files
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("content", [b"{not json", b"", b"[]", b"\xff\xfe\x00"], ids=["not json", "empty", "list",
                                                                                    "binary"])
def test_corrupt_tokenizer_json(llada, tmp_path, content):
    d = copy(llada, tmp_path)
    (d / "tokenizer.json").write_bytes(content)
    for f in ("tokenizer_config.json", "special_tokens_map.json"):
        (d / f).unlink(missing_ok=True)
    with pytest.raises(CheckpointError, match="tokenizer"):
        load_tokenizer(str(d))


# ------------------------------------------------------------------------------------------------
# end to end: the server's command line reports a corrupt checkpoint in one line
# ------------------------------------------------------------------------------------------------

def test_server_cli_reports_corrupt_checkpoint(llada, tmp_path):
    d = copy(llada, tmp_path)
    edit_config(d, n_heads=0)
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    p = subprocess.run([sys.executable, "-m", "bicache_sgl.launch_server", "--model-path", str(d), "--port", "1",
                        "--num-threads", "1"], capture_output=True, text=True, timeout=120, env=env)
    out = p.stdout + p.stderr
    assert p.returncode == 1, out
    assert "could not start the engine: CheckpointError" in out and "n_heads" in out
    assert "Traceback" not in out
