"""Model registry: a Hugging Face `architectures` name to the module that runs it."""

from __future__ import annotations

from runtime.models.decoder import DecoderForCausalLM
from runtime.models.deepseek import DeepseekV3ForCausalLM
from runtime.models.eagle import Eagle3Head, EagleHead
from runtime.models.gemma import GemmaForCausalLM
from runtime.models.gpt_oss import GptOssForCausalLM

MODELS: dict[str, type[DecoderForCausalLM]] = {
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,  # DeepSeek-V3 and R1
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
    "Gemma3ForConditionalGeneration": GemmaForCausalLM,  # its text model; the vision tower is not loaded
    "GptOssForCausalLM": GptOssForCausalLM,
    "LlamaForCausalLM": DecoderForCausalLM,
    "MistralForCausalLM": DecoderForCausalLM,
    "MixtralForCausalLM": DecoderForCausalLM,
    "Phi3ForCausalLM": DecoderForCausalLM,  # Phi-3 and Phi-4: Llama's layers, q/k/v and gate/up fused in the checkpoint
    "Qwen2ForCausalLM": DecoderForCausalLM,
    "Qwen3ForCausalLM": DecoderForCausalLM,
    "Qwen3MoeForCausalLM": DecoderForCausalLM,
    "EAGLE": EagleHead,  # draft heads, by --speculative-algorithm: their checkpoints' architectures name the target's
    "EAGLE3": Eagle3Head,
}
