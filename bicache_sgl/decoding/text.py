"""Token ids -> text, in one place: the output text (stop strings, events) and each token's text
(logprobs)."""

from __future__ import annotations

from typing import Any


class Detokenizer:
    """A request's view of the tokenizer. ``skip_special_tokens`` applies to the output text;
    a token's own text (``token``) is decoded as the tokenizer has it, special tokens included."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool) -> None:
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens

    def text(self, ids: list[int]) -> str:
        """The output text of ``ids``."""
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def token(self, tid: int) -> str:
        """One token's text (logprobs' ``return_text_in_logprobs``)."""
        return self.tokenizer.decode([tid])
