"""The bytes each token id contributes to the decoded text, as the tokenizer really decodes it.

- byte-level BPE (GPT-2 / Llama-3 / Qwen style, a ``ByteLevel`` decoder): the token string's
  characters map back to raw bytes through the byte-to-unicode table, so a token may be part of
  a UTF-8 sequence (the DFA works on bytes, so that is fine);
- ``ByteFallback`` vocabularies: ``<0xNN>`` tokens are that byte;
- anything else (WordLevel + Fuse as in the bundled model, Metaspace, WordPiece...): the
  tokenizer's own decoder, run on the token after an anchor token and with the anchor's text
  removed, so context-dependent rules (a SentencePiece ``\u2581`` is a space mid-text, WordPiece
  joins) act as they do in the middle of an output;
- added (non-special) tokens: their content, verbatim;
- special tokens (EOS, mask, pad, chat markers...) and tokens that decode to nothing: ``None``
  (never text; the end-of-generation ids are handled by the constraint itself).
"""

from __future__ import annotations

import hashlib
import json
import threading
import weakref
from dataclasses import dataclass


@dataclass(frozen=True)
class TokenTable:
    """Per token id: its bytes (``None``: never part of the text). ``fingerprint`` identifies the
    table (caches key on it, not on the tokenizer object)."""

    tokens: tuple[bytes | None, ...]
    fingerprint: str

    def __len__(self) -> int:
        return len(self.tokens)


def _byte_decoder() -> dict[str, int]:
    """Inverse of the GPT-2 byte-to-unicode table: printable Latin-1 bytes stand for
    themselves, the other 68 bytes are shifted to U+0100 onwards, in byte order."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in keep}
    n = 0
    for b in range(256):
        if b not in keep:
            table[chr(0x100 + n)] = b
            n += 1
    return table


def _decoder_types(node) -> set[str]:
    if not node:
        return set()
    out = {node.get("type", "")}
    for d in node.get("decoders") or []:
        out |= _decoder_types(d)
    return out


_CACHE: dict[int, tuple[weakref.ref, TokenTable]] = {}
_LOCK = threading.Lock()


def token_table(tokenizer) -> TokenTable:
    """The :class:`TokenTable` of a Hugging Face tokenizer (cached per tokenizer object)."""
    key = id(tokenizer)
    with _LOCK:
        hit = _CACHE.get(key)
        if hit is not None and hit[0]() is tokenizer:
            return hit[1]
    table = _build(tokenizer)
    with _LOCK:
        try:
            ref = weakref.ref(tokenizer, lambda _r, k=key: _CACHE.pop(k, None))
        except TypeError:  # not weak-referenceable: no caching
            return table
        _CACHE[key] = (ref, table)
    return table


def _build(tokenizer) -> TokenTable:
    vocab = tokenizer.get_vocab()
    n = max(len(tokenizer), max(vocab.values(), default=-1) + 1)
    id_to_tok: list[str | None] = [None] * n
    for t, i in vocab.items():
        if 0 <= i < n:
            id_to_tok[i] = t
    special = {int(i) for i in (getattr(tokenizer, "all_special_ids", None) or [])}
    added = {}
    for i, tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(tok, "special", False):
            special.add(int(i))
        else:
            added[int(i)] = str(tok.content) if hasattr(tok, "content") else str(tok)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    kinds: set[str] = set()
    if backend is not None:
        try:
            kinds = _decoder_types(json.loads(backend.to_str()).get("decoder"))
        except Exception:
            kinds = set()
    byte_level = "ByteLevel" in kinds
    byte_fallback = "ByteFallback" in kinds
    bdec = _byte_decoder() if byte_level else {}

    decode_strs = None
    if backend is not None and backend.decoder is not None:
        decode_strs = backend.decoder.decode
    anchor = None
    anchor_text = ""
    if decode_strs is not None and not byte_level:
        for cand in ("a", "x", "0", "\u2581a", "Ga"):
            if cand in vocab:
                anchor = cand
                anchor_text = decode_strs([cand])
                break

    def generic(i: int, t: str) -> bytes:
        if decode_strs is None:
            return tokenizer.decode([i]).encode("utf-8")
        if anchor is not None:
            both = decode_strs([anchor, t])
            if both.startswith(anchor_text):
                return both[len(anchor_text):].encode("utf-8")
        return decode_strs([t]).encode("utf-8")

    out: list[bytes | None] = []
    for i in range(n):
        t = id_to_tok[i]
        if i in special or t is None:
            out.append(None)
            continue
        if i in added:
            b = added[i].encode("utf-8")
        elif byte_level and all(ch in bdec for ch in t):
            b = bytes(bdec[ch] for ch in t)
        elif byte_fallback and len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
            try:
                b = bytes([int(t[3:5], 16)])
            except ValueError:
                b = generic(i, t)
        else:
            b = generic(i, t)
        out.append(b or None)
    h = hashlib.sha256()
    for b in out:
        if b is None:
            h.update(b"\xff\xff\xff\xff")
        else:
            h.update(len(b).to_bytes(4, "little"))
            h.update(b)
    return TokenTable(tuple(out), h.hexdigest())
