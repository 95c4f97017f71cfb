"""Model registry: a Hugging Face `architectures` name to the module that runs it."""

from __future__ import annotations

from runtime.models.decoder import DecoderForCausalLM

MODELS: dict[str, type[DecoderForCausalLM]] = {
    "LlamaForCausalLM": DecoderForCausalLM,
    "MistralForCausalLM": DecoderForCausalLM,
    "Qwen2ForCausalLM": DecoderForCausalLM,
    "Qwen3ForCausalLM": DecoderForCausalLM,
    "Qwen3MoeForCausalLM": DecoderForCausalLM,
}
