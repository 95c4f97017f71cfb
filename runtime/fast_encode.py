"""Prompt encoding through tiktoken, where a model's tokenizer has tiktoken's shape: the same ids,
12x faster than the Hugging Face tokenizer on a 1,000-token Qwen3 chat prompt (0.13 against 1.6 ms
on the 2-core machine), which is time to first token at low load.

tiktoken's shape: byte-level BPE after one Split regex, at most an NFC normalizer (applied here
before encoding), added tokens matched anywhere in the text, and `ignore_merges` (a pre-token that
is in the vocabulary is one token). tiktoken merges the pair whose merged token has the lowest id,
Hugging Face the pair earliest in its merge list; they agree when merged ids never fall along the
list, which is how vocabularies trained the tiktoken way convert (Qwen2/3, Llama 3). Anything else,
or a sample that encodes differently, keeps the Hugging Face tokenizer.
"""

from __future__ import annotations

import json
import unicodedata
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

log = structlog.get_logger()

Encode = Callable[[list[str]], list[list[int]]]

SAMPLE = ("Hello world!  It's 2026-11-22, 3.14159 and 1234567 units.\n\n\tIndented\r\nline   with  spaces  \n"
          "Ünïcödé: naïve café, Straße, 東京は晴れ。 Привет, мир! مرحبا 🙂👍🏽 e\u0301 (combining) <|im_start|>user\nhi<|im_end|>"
          "<think>x</think> don't we'll I'M")


def _pattern(pre_tokenizer: dict | None) -> str | None:
    """The Split regex of a [Split, ByteLevel(no regex)] pre-tokenizer, else None."""
    steps = (pre_tokenizer or {}).get("pretokenizers") or []
    if len(steps) != 2:
        return None
    split, byte_level = steps
    if (split.get("type") != "Split" or split.get("behavior") != "Isolated" or split.get("invert")
            or byte_level.get("type") != "ByteLevel" or byte_level.get("use_regex", True) or byte_level.get("add_prefix_space")):
        return None
    return split.get("pattern", {}).get("Regex")


def _encoding(spec: dict[str, Any], name: str) -> Any | None:
    import tiktoken
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    model, pattern = spec.get("model") or {}, _pattern(spec.get("pre_tokenizer"))
    if model.get("type") != "BPE" or model.get("byte_fallback") or not model.get("ignore_merges") or pattern is None:
        return None
    vocab = model["vocab"]
    merged = [vocab.get(a + b, -1) for a, b in (m.split(" ") if isinstance(m, str) else m for m in model["merges"])]
    if min(merged, default=0) < 0 or any(x > y for x, y in zip(merged, merged[1:])):
        return None
    if any(t.get("lstrip") or t.get("rstrip") for t in spec.get("added_tokens", [])):
        return None
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    ranks = {bytes(byte_of[c] for c in token): rank for token, rank in vocab.items()}
    special = {t["content"]: t["id"] for t in spec.get("added_tokens", [])}
    return tiktoken.Encoding(name, pat_str=pattern, mergeable_ranks=ranks, special_tokens=special)


def fast_encoder(model_dir: str | Path, tokenizer: Any) -> Encode | None:
    """A batch encoder through tiktoken that gives `tokenizer`'s ids (no special tokens added), or
    None where the tokenizer is not tiktoken-shaped, tiktoken is missing, or the sample disagrees."""
    path = Path(model_dir) / "tokenizer.json"
    try:
        spec = json.loads(path.read_text())
        encoding = _encoding(spec, Path(model_dir).name)
    except (ImportError, OSError, ValueError, KeyError) as exc:
        log.info("fast_encoder_unavailable", reason=f"{type(exc).__name__}: {exc}")
        return None
    if encoding is None:
        return None
    nfc = spec.get("normalizer") == {"type": "NFC"}
    if spec.get("normalizer") not in (None, {"type": "NFC"}):
        return None

    def encode(texts: list[str]) -> list[list[int]]:
        if nfc:
            texts = [t if unicodedata.is_normalized("NFC", t) else unicodedata.normalize("NFC", t) for t in texts]
        if len(texts) == 1:  # encode_batch starts a thread pool per call
            return [encoding.encode(texts[0], allowed_special="all")]
        return encoding.encode_batch(texts, allowed_special="all")

    if encode([SAMPLE]) != tokenizer([SAMPLE], add_special_tokens=False)["input_ids"]:
        log.warning("fast_encoder_disagrees", model=str(model_dir))
        return None
    return encode
