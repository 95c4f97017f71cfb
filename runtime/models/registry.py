"""Model registry: a Hugging Face `architectures` name to the module that runs it."""

from __future__ import annotations

from runtime.models.dense import DenseForCausalLM

MODELS: dict[str, type] = {
    "LlamaForCausalLM": DenseForCausalLM,
    "MistralForCausalLM": DenseForCausalLM,
    "Qwen2ForCausalLM": DenseForCausalLM,
    "Qwen3ForCausalLM": DenseForCausalLM,
}
