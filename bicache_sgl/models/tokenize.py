"""Prompt text -> token ids on the request path.

``tokenizer.encode(text)`` of a transformers fast tokenizer is a thin layer over the Rust
tokenizer: it resolves padding and truncation strategies, wraps the text in a batch of one,
calls ``encode_batch`` and converts the encoding to a ``BatchEncoding``. On the server's hot path
(one prompt per request) that layer costs about as much as the tokenization itself, and more on
a core that was idle while the engine ran (docs/performance.md, "Results after issue 22's fifth
round"). :class:`TextEncoder` calls the Rust tokenizer directly when that is exactly what
transformers would run, and ``tokenizer.encode`` otherwise.
"""

from __future__ import annotations

from typing import Any


def _direct_backend(tok: Any) -> Any | None:
    """The Rust tokenizer behind ``tok`` when ``tok.encode`` is transformers' own unchanged path
    to it (no subclass overriding encode, its strategies or ``_encode_plus``), else None."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: always the tokenizer's own encode
        return None
    if not isinstance(tok, TokenizersBackend):
        return None
    cls, base = type(tok), PreTrainedTokenizerBase
    if (cls.encode is not base.encode or cls._encode_plus is not TokenizersBackend._encode_plus
            or cls._get_padding_truncation_strategies is not base._get_padding_truncation_strategies):
        return None
    return getattr(tok, "_tokenizer", None)


class TextEncoder:
    """``encoder(text, add_special_tokens=True) -> list[int]``, equal to
    ``list(tokenizer.encode(text, add_special_tokens=...))`` for every text (tests compare both).

    The direct call is taken only while the Rust tokenizer is in the state ``encode`` would put it
    in: no truncation or padding configured on it (a caller of ``tokenizer(...,
    truncation=True)`` leaves it configured until the next call) and special tokens matched as
    ``split_special_tokens`` says. Checked on every call (three attribute reads)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._backend = _direct_backend(tokenizer)

    @property
    def direct(self) -> bool:
        """Whether the Rust tokenizer is called directly (when its state allows)."""
        return self._backend is not None

    def __call__(self, text: str, add_special_tokens: bool = True) -> list[int]:
        bt = self._backend
        if (bt is not None and isinstance(text, str) and bt.truncation is None and bt.padding is None
                and bt.encode_special_tokens == bool(self.tokenizer.split_special_tokens)):
            return bt.encode(text, add_special_tokens=add_special_tokens).ids
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
