"""models.tokenize.TextEncoder: the request path's prompt encoding equals ``tokenizer.encode``
for every tokenizer kind the loader produces, whether it calls the Rust tokenizer directly or
falls back to transformers."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from bicache_sgl.models.loader import default_model_path, load_tokenizer
from bicache_sgl.models.tokenize import TextEncoder
from bicache_sgl.testing import SPECIAL_TOKENS, make_tiny_dream, save_byte_tokenizer

TEXTS = ["", " ", "Hello, world!", "  two  spaces\n\nand a newline\t", "ünïcödé → 漢字 🙂",
         "<|endoftext|>special<|mask|> inside<|eot_id|>", "k3=v7; k9=v1\n\nk3=", "<|mdm_mask|><|unk|>x" * 3,
         "a" * 700]


def _bos_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer whose post-processor adds a BOS (as Llama-style checkpoints do)."""
    vocab = {"<s>": 0, "<unk>": 1, **{ch: i + 2 for i, ch in enumerate("abcdefghij ")}}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tk.add_special_tokens(["<s>"])
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", unk_token="<unk>")


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict:
    byte_dir = tmp_path_factory.mktemp("byte")
    save_byte_tokenizer(byte_dir)
    dream_dir = tmp_path_factory.mktemp("dream")
    make_tiny_dream(dream_dir)
    return {"bundled": load_tokenizer(default_model_path()), "byte": load_tokenizer(str(byte_dir)),
            "dream": load_tokenizer(str(dream_dir)), "bos": _bos_tokenizer()}


@pytest.mark.parametrize("name", ["bundled", "byte", "dream", "bos"])
def test_direct_encoding_equals_tokenizer_encode(tokenizers, name):
    tok = tokenizers[name]
    enc = TextEncoder(tok)
    assert enc.direct  # every tokenizer the loader makes takes the direct call
    for text in TEXTS + [SPECIAL_TOKENS[0] + "x" + SPECIAL_TOKENS[2]]:
        for add in (True, False):
            got = enc(text, add_special_tokens=add)
            assert type(got) is list and got == list(tok.encode(text, add_special_tokens=add)), (name, text, add)
    if name == "bos":  # the post-processor's BOS is added exactly when asked for
        assert enc("abc")[0] == 0 and enc("abc", add_special_tokens=False)[0] != 0


def test_a_truncation_left_configured_by_another_call_falls_back_and_stays_equal(tokenizers):
    tok = tokenizers["byte"]
    enc = TextEncoder(tok)
    long = "abcdefghij" * 5
    tok(long, truncation=True, max_length=4)  # leaves truncation set on the Rust tokenizer
    assert tok.backend_tokenizer.truncation is not None
    assert enc(long) == list(tok.encode(long)) and len(enc(long)) == len(long)


def test_split_special_tokens_is_respected(tmp_path):
    save_byte_tokenizer(tmp_path)
    tok = PreTrainedTokenizerFast.from_pretrained(str(tmp_path), split_special_tokens=True)
    enc = TextEncoder(tok)
    text = "a<|endoftext|>b"
    assert enc(text) == list(tok.encode(text))
    assert len(enc(text)) == len(text.encode())  # the special token's text is split into bytes


def test_a_subclass_with_its_own_encode_is_called_as_it_is(tokenizers):
    base = tokenizers["byte"]

    class Shouting(type(base)):
        def encode(self, text, *args, **kwargs):
            return super().encode(text.upper(), *args, **kwargs)

    tok = Shouting(tokenizer_object=base.backend_tokenizer)
    enc = TextEncoder(tok)
    assert not enc.direct
    assert enc("abc") == list(base.encode("ABC")) != list(base.encode("abc"))
