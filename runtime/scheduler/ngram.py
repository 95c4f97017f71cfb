"""NGRAM drafts (prompt lookup, as SGLang's NGRAM and vLLM's n-gram speculation): the tokens that followed the
latest earlier occurrence of the sequence's last n tokens, for the longest n in the window that occurs."""

from __future__ import annotations

from collections.abc import Sequence


def ngram_draft(tokens: Sequence[int], count: int, min_n: int, max_n: int) -> list[int]:
    """Up to `count` tokens that followed the latest earlier match of the last n tokens (n from `max_n` down to
    `min_n`); [] where none of them occurs earlier."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        tail = list(tokens[length - n :])
        first = tail[0]
        for start in range(length - n - 1, -1, -1):  # the latest match first: it follows the text nearest now
            if tokens[start] == first and list(tokens[start : start + n]) == tail:
                return list(tokens[start + n : start + n + count])
    return []
