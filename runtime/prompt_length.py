"""Telling a prompt that cannot fit the context early and cheaply, before it is encoded whole.

Every token stands for at most `max_token_bytes` bytes of text, so a text of B bytes has at least
B / max_token_bytes tokens: the api worker refuses a prompt past that bound without encoding it.
Below the bound a long text is probed by its head: if the head alone overflows the context, the
whole text does too, and encoding stops there.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable, Iterable
from typing import Any

Encode = Callable[[list[str]], Iterable[list[int]]]
PROBE_CHARS_PER_TOKEN = 8  # a head of this many characters a context token overflows any ordinary text


def max_token_bytes(tokenizer: Any) -> int:
    """The most UTF-8 bytes any one token of `tokenizer` decodes to (an upper bound where a token's
    text cannot be read back byte for byte, as in SentencePiece's '▁' for a space)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_of = {c: b for b, c in bytes_to_unicode().items()}

    def size(token: str) -> int:
        return len(token) if all(c in byte_of for c in token) else len(token.encode())

    return max(map(size, tokenizer.get_vocab()), default=1)


def text_bytes(text: str) -> int:
    """UTF-8 bytes of `text` once NFC-normalized, as Qwen's tokenizer does first: composing can
    only shrink a text, so the bound holds for tokenizers that normalize and those that do not."""
    if not text.isascii() and not unicodedata.is_normalized("NFC", text):
        text = unicodedata.normalize("NFC", text)
    return len(text.encode())


def encode_unless_longer(encode: Encode, text: str, max_tokens: int) -> list[int] | None:
    """`text`'s ids, or None when its head alone has more than `max_tokens` of them. Only a text
    far longer than that many tokens could fill is probed, by a head cut at white space so that
    the cut splits no word that the whole text would encode otherwise."""
    head = PROBE_CHARS_PER_TOKEN * max_tokens
    if len(text) > 2 * head:
        cut = max(text.rfind(" ", 0, head), text.rfind("\n", 0, head))
        if len(next(iter(encode([text[: cut if cut > 0 else head]])))) > max_tokens:
            return None
    return list(next(iter(encode([text]))))
