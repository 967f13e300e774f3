"""Character-level tokenizer in Hugging Face format.

One token per character of printable ASCII plus "\\n" and "\\t", and three special
tokens: EOS (also used as padding), the diffusion mask token and an unknown token.
`save_tokenizer(folder)` writes tokenizer.json, tokenizer_config.json and
special_tokens_map.json; `transformers.AutoTokenizer.from_pretrained(folder)` loads it.
Decoding concatenates characters (no spaces are inserted, nothing is cleaned up).
"""

from __future__ import annotations

import os

EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mdm_mask|>"
UNK_TOKEN = "<|unk|>"
SPECIAL_TOKENS = [EOS_TOKEN, MASK_TOKEN, UNK_TOKEN]
CHARS = ["\n", "\t"] + [chr(c) for c in range(32, 127)]
VOCAB = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARS)}
EOS_ID = VOCAB[EOS_TOKEN]
MASK_ID = VOCAB[MASK_TOKEN]
UNK_ID = VOCAB[UNK_TOKEN]
PAD_ID = EOS_ID
VOCAB_SIZE = len(VOCAB)
ID_TO_TOKEN = {i: t for t, i in VOCAB.items()}


def encode(text: str) -> list:
    """Fast pure-Python encoding (identical to the saved tokenizer's)."""
    return [VOCAB.get(c, UNK_ID) for c in text]


def decode(ids, stop_at_eos: bool = True) -> str:
    out = []
    for i in ids:
        i = int(i)
        if i == EOS_ID and stop_at_eos:
            break
        if i < len(SPECIAL_TOKENS):
            continue
        out.append(ID_TO_TOKEN[i])
    return "".join(out)


def build_backend_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab=dict(VOCAB), unk_token=UNK_TOKEN))
    # every character is its own pre-token, whitespace included
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return tok


TOKENIZER_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "eos_token": EOS_TOKEN,
    "pad_token": EOS_TOKEN,
    "mask_token": MASK_TOKEN,
    "unk_token": UNK_TOKEN,
    "clean_up_tokenization_spaces": False,
    "add_bos_token": False,
    "add_eos_token": False,
    "model_max_length": 4096,
    "padding_side": "left",
}


def save_tokenizer(folder: str) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json."""
    import json

    os.makedirs(folder, exist_ok=True)
    build_backend_tokenizer().save(os.path.join(folder, "tokenizer.json"))
    cfg = dict(TOKENIZER_CONFIG)
    cfg["added_tokens_decoder"] = {
        str(VOCAB[t]): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                        "single_word": False, "special": True}
        for t in SPECIAL_TOKENS
    }
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    special = {"eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN, "mask_token": MASK_TOKEN,
               "unk_token": UNK_TOKEN}
    with open(os.path.join(folder, "special_tokens_map.json"), "w") as f:
        json.dump(special, f, indent=2)
        f.write("\n")
