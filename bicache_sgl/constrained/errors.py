"""Errors of the constrained-decoding package."""

from __future__ import annotations


class ConstraintError(ValueError):
    """An invalid, unsupported or too complex constraint (a client error: HTTP 400). The message
    says what is wrong: the regex parser's message, the JSON-schema keyword, or the limit hit."""


class BuildPoolBusy(ConstraintError):
    """Every constraint build worker stayed busy past the build timeout: the constraint itself may
    be fine (not cached as a failure); the client may retry."""


class NoCompletion(RuntimeError):
    """No output that fully matches the constraint fits in the positions left (or the fixed tokens
    of the block admit none). The caller finishes the request with a finish reason that says so;
    it never returns the partial text as a valid output."""
