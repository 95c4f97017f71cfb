"""Tiny random-weight models of each supported architecture, built with transformers.

A large initializer range makes the next-token distributions peaked, so greedy parity is
not drowned in near-ties the way a near-uniform random model would be.
"""

from __future__ import annotations

from pathlib import Path

import torch

SHAPE = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.3,
    tie_word_embeddings=False,
)


def _configs():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    llama3_rope = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    return {
        "llama": (LlamaConfig, dict(rope_scaling=llama3_rope, rope_theta=10000.0)),
        "qwen2": (Qwen2Config, dict(tie_word_embeddings=True)),
        "qwen3": (Qwen3Config, dict(head_dim=32)),
        "mistral": (MistralConfig, dict(sliding_window=None)),
        # 8 experts, top 2 renormalised, every layer sparse
        "qwen3_moe": (
            Qwen3MoeConfig,
            dict(head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
        ),
        # 6 experts, top 3 as the softmax gives them; layers 1 sparse, 0 and 2 dense by the step, 3 dense by name
        "qwen3_moe_mixed": (
            Qwen3MoeConfig,
            dict(
                head_dim=32,
                num_experts=6,
                num_experts_per_tok=3,
                moe_intermediate_size=48,
                norm_topk_prob=False,
                decoder_sparse_step=2,
                mlp_only_layers=[3],
                num_hidden_layers=4,
            ),
        ),
    }


ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral")
MOE_ARCHITECTURES = ("qwen3_moe", "qwen3_moe_mixed")


def build(name: str, folder: Path, **overrides) -> Path:
    from transformers import AutoModelForCausalLM

    config_cls, extra = _configs()[name]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config_cls(**{**SHAPE, **extra, **overrides}))
    model.save_pretrained(folder)
    return folder
