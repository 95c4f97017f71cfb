"""Prompt encoding through tiktoken, many times faster with the same ids, where a tokenizer has its shape
(byte-level BPE whose merges follow ids: Qwen2/3, Llama 3); else, or if a sample disagrees, Hugging Face's."""

from __future__ import annotations

import functools
import json
import os
import re
import threading
import unicodedata
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import structlog

log = structlog.get_logger()

Encode = Callable[[list[str]], Iterable[list[int]]]
MAX_CHARS = 100_000  # longer texts go to transformers: tiktoken's regex gives up on long runs
ENCODE_THREADS = min(8, os.cpu_count() or 1)

SAMPLE = (
    "Hello world!  It's 2026-11-22, 3.14159 and 1234567 units.\n\n\tIndented\r\nline   with  spaces  \n"
    "Ünïcödé: naïve café, Straße, 東京は晴れ。 Привет, мир! مرحبا 🙂👍🏽 <|im_start|>user\nhi<|im_end|>"
    "<think>x</think> don't we'll I'M, cafe\u0301 A\u030a"
)


def encode_with_transformers(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def _pattern(pre_tokenizer: dict | None) -> str | None:
    """The Split regex of a [Split, ByteLevel(no regex)] pre-tokenizer, else None."""
    steps = (pre_tokenizer or {}).get("pretokenizers") or []
    if len(steps) != 2:
        return None
    split, byte_level = steps
    if (
        split.get("type") != "Split"
        or split.get("behavior") != "Isolated"
        or split.get("invert")
        or byte_level.get("type") != "ByteLevel"
        or byte_level.get("use_regex", True)
        or byte_level.get("add_prefix_space")
    ):
        return None
    return split.get("pattern", {}).get("Regex")


def _merges_follow_ids(vocab: dict[str, int], merges: list) -> bool:
    """Merged ids never fall along the list, and every split of a token into two tokens is listed."""
    pairs = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in merges]
    merged = [vocab.get(a + b, -1) for a, b in pairs]
    if min(merged, default=0) < 0 or any(x > y for x, y in zip(merged, merged[1:])):
        return False
    listed = set(pairs)
    return all(
        (token[:k], token[k:]) in listed for token in vocab for k in range(1, len(token)) if token[:k] in vocab and token[k:] in vocab
    )


def _plain_added_tokens(spec: dict[str, Any], tokenizer: Any) -> dict[str, int] | None:
    added = spec.get("added_tokens", [])
    special = {t["content"]: t["id"] for t in added}
    if any(t.get("lstrip") or t.get("rstrip") or t.get("single_word") for t in added) or special != tokenizer.get_added_vocab():
        return None
    if any(a != b and b.startswith(a) for a in special for b in special):  # tiktoken's alternation is not leftmost-longest
        return None
    return special


def _encoding(spec: dict[str, Any], tokenizer: Any, name: str) -> Any | None:
    import tiktoken
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    model, pattern = spec.get("model") or {}, _pattern(spec.get("pre_tokenizer"))
    if (
        model.get("type") != "BPE"
        or model.get("byte_fallback")
        or not model.get("ignore_merges")
        or pattern is None
        or spec.get("normalizer") not in (None, {"type": "NFC"})
    ):
        return None
    special = _plain_added_tokens(spec, tokenizer)
    if special is None or not _merges_follow_ids(model["vocab"], model["merges"]):
        return None
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    ranks = {bytes(byte_of[c] for c in token): rank for token, rank in model["vocab"].items()}
    if any(bytes([b]) not in ranks for b in range(256)):  # tiktoken needs every byte as a token
        return None
    return tiktoken.Encoding(name, pat_str=pattern, mergeable_ranks=ranks, special_tokens=special)


def nfc_between(added_tokens: set[str]) -> Callable[[str], str | None]:
    """text with each stretch between added tokens NFC-normalized, as Hugging Face does; None if that moves one."""
    split = re.compile("(" + "|".join(map(re.escape, sorted(added_tokens, key=len, reverse=True))) + ")") if added_tokens else None

    def normalize(text: str) -> str | None:
        if unicodedata.is_normalized("NFC", text):
            return text
        if split is None:
            return unicodedata.normalize("NFC", text)
        parts = split.split(text)  # stretches at even indices, added tokens at odd ones
        parts[::2] = [unicodedata.normalize("NFC", stretch) for stretch in parts[::2]]
        normalized = "".join(parts)
        return normalized if split.split(normalized) == parts else None

    return normalize


def fast_encoder(tokenizer: Any) -> Encode | None:
    """A tiktoken batch encoder giving `tokenizer`'s ids, or None where it cannot."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        spec = json.loads(backend.to_str())
        encoding = _encoding(spec, tokenizer, tokenizer.name_or_path or "tokenizer")
    except (ImportError, ValueError, KeyError) as exc:
        log.info("fast_encoder_unavailable", reason=f"{type(exc).__name__}: {exc}")
        return None
    if encoding is None:
        return None

    with_transformers = functools.partial(encode_with_transformers, tokenizer)
    normalize = nfc_between(encoding.special_tokens_set) if spec.get("normalizer") else lambda text: text
    one_at_a_time = threading.Lock()  # a tokenizer's Rust core may not be entered by two threads at once
    pool = ThreadPoolExecutor(ENCODE_THREADS, thread_name_prefix="encode")

    def one_with_transformers(text: str) -> list[int]:
        with one_at_a_time:
            return with_transformers([text])[0]

    def encode_one(text: str) -> list[int]:
        normalized = normalize(text)
        if normalized is None:
            return one_with_transformers(text)
        try:
            return encoding.encode(normalized, allowed_special="all")
        except BaseException as exc:  # a panic in tiktoken's Rust core arrives as pyo3's PanicException, a BaseException
            if type(exc).__name__ != "PanicException":
                raise
            log.warning("fast_encoder_panicked", error=str(exc)[:200])
            return one_with_transformers(text)

    def encode(texts: list[str]) -> Iterable[list[int]]:
        """In parallel (tiktoken releases the GIL), each text's ids ready as soon as those before it are."""
        if any(len(t) > MAX_CHARS for t in texts):
            with one_at_a_time:
                return with_transformers(texts)
        return [encode_one(texts[0])] if len(texts) == 1 else pool.map(encode_one, texts)

    if list(encode([SAMPLE])) != with_transformers([SAMPLE]):
        log.warning("fast_encoder_disagrees", tokenizer=tokenizer.name_or_path)
        return None
    return encode
