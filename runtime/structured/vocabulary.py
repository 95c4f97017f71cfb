"""The model's vocabulary as xgrammar compiles grammars against it (xgrammar.TokenizerInfo), for the engine.

Loading a Hugging Face tokenizer takes about a second, much of it holding the GIL (parsing tokenizer.json
held it for up to ~0.2 s at a time): on the compile thread beside the engine's steps, it held a step of 16
streams for a second. So the engine reads the vocabulary from a cache file (RINGLLM_CACHE/xgrammar_vocab,
keyed by the tokenizer's files, the vocabulary size, the stop tokens and xgrammar's version; ~40 ms, without
the GIL), and where there is none, has it built out of its way (runtime.structured.builder: once per
tokenizer and machine) and writes it there. Where holding the GIL costs nothing (start-up), it is built here.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import structlog

from runtime.models.source import load_tokenizer
from transport import env

log = structlog.get_logger()
# what a tokenizer may read from its folder: any of them changes the cache's key
TOKENIZER_FILES = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt", "*.model")


def tokenizer_info(model_dir: Path, vocab_size: int, stop_token_ids: Sequence[int], build: Callable[[], str] | None = None) -> Any:
    """The vocabulary from the cache, else built (by `build`, else here: `serialized`) and cached."""
    import xgrammar as xgr

    path = _cache_path(model_dir, vocab_size, stop_token_ids)
    try:
        return xgr.TokenizerInfo.deserialize_json(path.read_text())
    except (OSError, RuntimeError, ValueError):  # none yet, or a damaged one: built again
        pass
    text = build() if build is not None else serialized(str(model_dir), vocab_size, list(stop_token_ids))
    _write(path, text)
    return xgr.TokenizerInfo.deserialize_json(text)


def serialized(model_dir: str, vocab_size: int, stop_token_ids: list[int]) -> str:
    """The vocabulary as xgrammar serializes it, from the folder's tokenizer."""
    import xgrammar as xgr

    tokenizer = load_tokenizer(model_dir, required=True)
    return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids).serialize_json()


def _cache_path(model_dir: Path, vocab_size: int, stop_token_ids: Sequence[int]) -> Path:
    digest = hashlib.sha256(f"{vocab_size} {list(stop_token_ids)} {importlib.metadata.version('xgrammar')}".encode())
    for file in sorted({file for pattern in TOKENIZER_FILES for file in Path(model_dir).glob(pattern) if file.is_file()}):
        digest.update(file.name.encode() + b"\0" + file.read_bytes())
    return env.cache_root() / "xgrammar_vocab" / f"{digest.hexdigest()[:24]}.json"


def _write(path: Path, text: str) -> None:
    """Whole or not at all: a reader never sees half a file, and of two writers one's stays."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        partial.write_text(text)
        os.replace(partial, path)
    except OSError as exc:  # a read-only cache: built again next time
        log.warning("vocabulary_not_cached", path=str(path), error=str(exc))
