"""Errors of the constrained-decoding package."""

from __future__ import annotations


class ConstraintError(ValueError):
    """An invalid, unsupported or too complex constraint (a client error: HTTP 400). The message
    says what is wrong: the regex parser's message, the JSON-schema keyword, or the limit hit."""


class NoCompletion(RuntimeError):
    """No output that fully matches the constraint fits in the positions left (or the fixed tokens
    of the block admit none). The caller finishes the request with a finish reason that says so;
    it never returns the partial text as a valid output."""
