"""What a checkpoint's config.json makes of the model: an architecture outside the registry is refused with the
list of those served, and a sliding window that every layer uses caps the context where ringllm is exact."""

from __future__ import annotations

import json

import pytest

from runtime import LLM
from runtime.config import ModelConfig
from runtime.models.registry import MODELS
from tests.tiny_models import SHAPE


def test_an_unknown_architecture_is_refused_with_the_supported_list(tiny_model, tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    config = json.loads((tiny_model("llama") / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["FalconH9ForCausalLM"]}))
    with pytest.raises(ValueError, match="FalconH9ForCausalLM is not supported") as refused:
        LLM(folder)
    assert all(name in str(refused.value) for name in MODELS if name.endswith("ForCausalLM"))


def test_a_sliding_window_caps_the_context_and_an_unused_one_does_not():
    """Mistral-7B-v0.1 attends to its last `sliding_window` tokens in every layer: until
    windows are served, the context stops at the window. Qwen2's config names a window it does not use."""
    from transformers import MistralConfig, Qwen2Config

    def load(config_class, architecture: str, **extra) -> ModelConfig:
        return ModelConfig.from_dict({**config_class(**SHAPE, **extra).to_dict(), "architectures": [architecture]})

    full = SHAPE["max_position_embeddings"]
    assert load(MistralConfig, "MistralForCausalLM", sliding_window=64).max_position == 64
    assert load(MistralConfig, "MistralForCausalLM", sliding_window=None).max_position == full
    assert load(Qwen2Config, "Qwen2ForCausalLM", sliding_window=64, use_sliding_window=False).max_position == full
