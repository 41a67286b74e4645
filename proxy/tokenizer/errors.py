"""The exception raised when a GGUF's tokenizer cannot be reproduced exactly."""

from __future__ import annotations

__all__ = ["UnsupportedTokenizerError"]


class UnsupportedTokenizerError(Exception):
    """The GGUF's tokenizer cannot be reproduced exactly here; use the server's tokenizer."""
