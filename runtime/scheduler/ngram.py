"""NGRAM drafts (prompt lookup, as SGLang's NGRAM and vLLM's n-gram speculation): the tokens that followed the
latest earlier occurrence of the sequence's last n tokens, for the longest n in the window that occurs."""

from __future__ import annotations

from array import array
from collections.abc import Sequence


def ngram_draft(tokens: Sequence[int], count: int, min_n: int, max_n: int) -> list[int]:
    """Up to `count` tokens that followed the latest earlier match of the last n tokens (n from `max_n` down to
    `min_n`); [] where none of them occurs earlier. The search runs over the tokens as int32 bytes, at C speed:
    a step looks up every drafting request's whole context."""
    length = len(tokens)
    data = array("i", tokens).tobytes()
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        tail = data[(length - n) * 4 :]
        end = (length - 1) * 4  # a match ends before the last token: at least one token follows it
        while (at := data.rfind(tail, 0, end)) >= 0 and at % 4:  # a match across token boundaries: look further back
            end = at + len(tail) - 1
        if at >= 0:
            start = at // 4 + n
            return list(tokens[start : start + count])
    return []
