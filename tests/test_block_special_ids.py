"""Special ids read as the published code reads them (models/special_ids.py), for every family
with a published config.json that names no mask token (LLaDA-MoE, LLaDA2.x, SDAR): config.json,
generation_config.json, the tokenizer's ``<|mask|>`` / declared ``mask_token`` (its
``eos_token``), the family's hard-coded id last; an id outside the vocabulary is refused naming
its source. Tiny folders laid out as published (no ``mask_token_id`` in config.json, the mask
at another id than the makers' usual one) load and decode as the re-stated published generate
loops do, given the mask id the published code would take from the tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_llada_moe import _model_card_generate
from transformers import AutoTokenizer

from bicache_sgl import Engine
from bicache_sgl.blockdiff.engine import BlockEngine, BlockEngineOptions, BlockParams
from bicache_sgl.models.block_model import load_block_model
from bicache_sgl.models.config import CheckpointError
from bicache_sgl.models.loader import load_model, load_model_config
from bicache_sgl.reference import load_block_reference, reference_block_logits
from bicache_sgl.testing import make_tiny_llada_moe
from bicache_sgl.testing.block import make_tiny_llada2, make_tiny_sdar
from bicache_sgl.testing.block_generate import llada2_generate, sdar_generate

pytestmark = pytest.mark.usefixtures("one_torch_thread")

B = 4
# <|mask|> last: id 260, where the makers' usual tokenizer has <|start_header_id|> (the mask at 258)
MOVED = ("<|endoftext|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>", "<|mask|>")
# SDAR's own tokenizer: no <|mask|>, it declares <|MASK|> as its mask_token
SDAR_STYLE = ("<|endoftext|>", "<|im_end|>", "<|im_start|>", "<|MASK|>")
MAKERS = {"llada2": make_tiny_llada2, "sdar": make_tiny_sdar}


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _published(name: str, folder: str, prompt: list[int], gen: int, mask_id: int, cfg) -> list[int]:
    ref = load_block_reference(folder)

    def fn(ids):
        return reference_block_logits(ref, ids, B)

    if name == "sdar":
        return sdar_generate(fn, prompt, mask_id=mask_id, stop_ids=cfg.eos_token_ids, gen_length=gen, block_length=B,
                             denoising_steps=cfg.decode.steps, confidence_threshold=cfg.decode.threshold)
    return llada2_generate(fn, prompt, mask_id=mask_id, eos_id=cfg.eos_token_ids[0], gen_length=gen, block_length=B,
                           steps=cfg.decode.steps, threshold=cfg.decode.threshold)


@pytest.mark.parametrize("name,special,mask_token", [("llada2", MOVED, "<|mask|>"), ("sdar", MOVED, "<|mask|>"),
                                                     ("sdar", SDAR_STYLE, "<|MASK|>")])
def test_published_block_folder_takes_the_tokenizers_mask_and_decodes_as_published(tmp_path, name, special,
                                                                                     mask_token):
    folder = MAKERS[name](tmp_path / name, block_length=B, published_ids=True, special=special,
                          mask_token=mask_token)
    assert "mask_token_id" not in json.loads(Path(folder, "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(folder)
    # what the published code takes: SDAR's generate tokenizer.mask_token, the dllm pipelines <|mask|>
    want_mask = tok.mask_token_id if name == "sdar" else tok.convert_tokens_to_ids("<|mask|>")
    assert want_mask == 256 + special.index(mask_token) and want_mask != 258
    model = load_block_model(folder, dtype=torch.float64)
    assert model.cfg.mask_token_id == want_mask
    assert load_model_config(folder).mask_token_id == want_mask  # the registry's view reads the same
    decoded = 0
    for seed in (3, 4):
        prompt = _ids(6, seed)
        got = BlockEngine(model, BlockEngineOptions(prefix_cache=False)).run([prompt], BlockParams(max_new_tokens=7))
        want = _published(name, folder, prompt, 7, want_mask, model.cfg)
        assert got[0].tokens == want
        # the mask id matters to these answers: the old fallback's id (258) decodes other tokens
        decoded += want != _published(name, folder, prompt, 7, 258, model.cfg)
    assert decoded


def test_published_llada_moe_folder_takes_the_tokenizers_mask_and_decodes_as_the_model_card(tmp_path):
    folder = make_tiny_llada_moe(tmp_path / "moe", published_ids=True,
                                 special=("<|endoftext|>", "<|role_end|>", "<role>", "</role>", "<|mask|>"))
    assert "mask_token_id" not in json.loads(Path(folder, "config.json").read_text())
    mask = AutoTokenizer.from_pretrained(folder).convert_tokens_to_ids("<|mask|>")
    assert mask == 260
    model, cfg = load_model(folder, "float32")
    assert cfg.mask_token_id == mask
    eng = Engine(folder, prefix_cache="off", threshold=None, cache_mode="none")
    try:
        assert eng.model_config.mask_token_id == mask
        text = "The quick brown fox jumps"
        ids, mask_top = _model_card_generate(model, eng.encode(text), mask, 16, 16, 8)
        assert mask_top == 0
        out = eng.generate(text, {"temperature": 0, "max_new_tokens": 16, "steps": 16, "block_length": 8,
                                  "ignore_eos": True})
        assert out["output_ids"] == ids
    finally:
        eng.shutdown()


def _drop_tokenizer_mask(folder: str) -> None:
    """The tokenizer names no mask at all: <|mask|> renamed, no declared mask_token."""
    p = Path(folder)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        f = p / name
        if f.exists():
            d = json.loads(f.read_text())
            d.pop("mask_token", None)
            for t in (d.get("added_tokens_decoder") or {}).values():
                if t.get("content") == "<|mask|>":
                    t["content"] = "<|unused|>"
            f.write_text(json.dumps(d))
    tj = json.loads((p / "tokenizer.json").read_text())
    for t in tj["added_tokens"]:
        if t["content"] == "<|mask|>":
            t["content"] = "<|unused|>"
    (p / "tokenizer.json").write_text(json.dumps(tj))


def _load(family: str, folder: str):
    return load_model_config(folder) if family == "llada_moe" else load_block_model(folder).cfg


FAMILY_MAKERS = {"llada2": lambda f: make_tiny_llada2(f, block_length=B, published_ids=True),
                 "sdar": lambda f: make_tiny_sdar(f, block_length=B, published_ids=True),
                 "llada_moe": lambda f: make_tiny_llada_moe(f, published_ids=True)}


@pytest.mark.parametrize("family", ["llada2", "sdar", "llada_moe"])
def test_the_order_and_one_refusal_naming_the_source(tmp_path, family):
    folder = FAMILY_MAKERS[family](tmp_path / family)
    cfg_file, gen_file = Path(folder, "config.json"), Path(folder, "generation_config.json")
    raw = json.loads(cfg_file.read_text())
    gen = json.loads(gen_file.read_text()) if gen_file.exists() else {}
    assert _load(family, folder).mask_token_id == 258  # the tokenizer's <|mask|>
    gen_file.write_text(json.dumps({**gen, "mask_token_id": 7}))  # generation_config.json is above the tokenizer
    assert _load(family, folder).mask_token_id == 7
    cfg_file.write_text(json.dumps({**raw, "mask_token_id": 9}))  # config.json above both
    assert _load(family, folder).mask_token_id == 9
    cfg_file.write_text(json.dumps({**raw, "mask_token_id": 999}))
    with pytest.raises(CheckpointError, match=r"^config\.json: mask_token_id 999 is outside the vocabulary \(261\)$"):
        _load(family, folder)
    cfg_file.write_text(json.dumps(raw))
    gen_file.write_text(json.dumps({**gen, "mask_token_id": 5000}))
    with pytest.raises(CheckpointError, match=r"^generation_config\.json: mask_token_id 5000 is outside the "):
        _load(family, folder)
    gen_file.write_text(json.dumps(gen))
    _drop_tokenizer_mask(folder)
    # nothing names it: the family's hard-coded id, refused by the same text naming where it came from
    with pytest.raises(CheckpointError, match=rf"^the {family} default \(config\.json, generation_config\.json and the "
                                              rf"tokenizer name no mask token\): mask_token_id \d+ is outside the "
                                              r"vocabulary \(261\)$"):
        _load(family, folder)


def test_eos_from_the_tokenizer_when_config_names_none(tmp_path):
    folder = make_tiny_sdar(tmp_path / "sdar", block_length=B, published_ids=True, special=SDAR_STYLE,
                            mask_token="<|MASK|>")
    raw = json.loads(Path(folder, "config.json").read_text())
    Path(folder, "config.json").write_text(json.dumps({k: v for k, v in raw.items() if k != "eos_token_id"}))
    tok = AutoTokenizer.from_pretrained(folder)
    assert load_block_model(folder).cfg.eos_token_ids == (tok.eos_token_id,) == (256,)
