"""What a checkpoint's config.json makes of the model: an architecture outside the registry is refused with the
list of those served, and a sliding window that every layer uses caps the context where ringllm is exact."""

from __future__ import annotations

import json
from typing import Any

import pytest

from runtime import LLM
from runtime.config import ModelConfig
from runtime.models.registry import MODELS
from tests.tiny_models import SHAPE


def raw_config(config_class: Any, architecture: str, **extra: Any) -> dict[str, Any]:
    """A tiny model's config.json as transformers' config class writes it."""
    return {**config_class(**SHAPE, **extra).to_dict(), "architectures": [architecture]}


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

    def load(config_class: Any, architecture: str, **extra: Any) -> ModelConfig:
        return ModelConfig.from_dict(raw_config(config_class, architecture, **extra))

    full = SHAPE["max_position_embeddings"]
    assert load(MistralConfig, "MistralForCausalLM", sliding_window=64).max_position == 64
    assert load(MistralConfig, "MistralForCausalLM", sliding_window=None).max_position == full
    assert load(Qwen2Config, "Qwen2ForCausalLM", sliding_window=64, use_sliding_window=False).max_position == full


@pytest.mark.parametrize(
    ("rope", "message"),
    [
        ({"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}, "rope type 'longrope' is not supported"),
        ({"rope_type": "default", "partial_rotary_factor": 0.75}, "partial_rotary_factor"),
    ],
)
def test_phi_rope_variants_not_served_are_refused_by_name(rope, message):
    """Phi-3-mini-128k and Phi-3.5 scale rope by LongRoPE, Phi-4-mini rotates part of each head: refused at load,
    where a wrong rope would give fluent, wrong text."""
    from transformers import Phi3Config

    raw = {**raw_config(Phi3Config, "Phi3ForCausalLM"), "rope_parameters": {"rope_theta": 1e4, **rope}}
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(raw)
