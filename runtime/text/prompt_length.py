"""Telling a prompt that cannot fit the context before it is encoded whole: by its bytes (a token
covers at most `max_token_bytes`), else by encoding its head first."""

from __future__ import annotations

import unicodedata
from collections.abc import Callable, Iterable
from typing import Any

Encode = Callable[[list[str]], Iterable[list[int]]]
PROBE_CHARS_PER_TOKEN = 8  # head length per context token; overflows with any ordinary text


def max_token_bytes(tokenizer: Any) -> int:
    """The most UTF-8 bytes one token decodes to (an upper bound for SentencePiece's '▁')."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_of = {c: b for b, c in bytes_to_unicode().items()}

    def size(token: str) -> int:
        return len(token) if all(c in byte_of for c in token) else len(token.encode())

    return max(map(size, tokenizer.get_vocab()), default=1)


def text_bytes(text: str) -> int:
    """UTF-8 bytes once NFC-normalized, which only shrinks a text: a bound for either kind of tokenizer."""
    if not text.isascii() and not unicodedata.is_normalized("NFC", text):
        text = unicodedata.normalize("NFC", text)
    return len(text.encode())


def encode_unless_longer(encode: Encode, text: str, max_tokens: int) -> list[int] | None:
    """`text`'s ids, or None when its head (cut at white space) alone has more than `max_tokens`."""
    head = PROBE_CHARS_PER_TOKEN * max_tokens
    if len(text) > 2 * head:
        cut = max(text.rfind(" ", 0, head), text.rfind("\n", 0, head))
        if len(next(iter(encode([text[: cut if cut > 0 else head]])))) > max_tokens:
            return None
    return list(next(iter(encode([text]))))
