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


DEEPSEEK_V3 = dict(
    num_hidden_layers=3,
    num_key_value_heads=4,
    first_k_dense_replace=1,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    moe_intermediate_size=32,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 128,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
)


def _configs():
    from transformers import (
        DeepseekV3Config,
        Gemma2Config,
        Gemma3TextConfig,
        GptOssConfig,
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        Phi3Config,
        Qwen2Config,
        Qwen3Config,
        Qwen3MoeConfig,
    )

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
        # windows of 16 (shorter than most prompts) on layers 0 and 2, rope of their own, a linear-scaled global rope,
        # q/k norms, a softmax scale that is not head_dim's
        "gemma3": (
            Gemma3TextConfig,
            dict(
                head_dim=16,
                num_hidden_layers=3,
                query_pre_attn_scalar=24,
                sliding_window=16,
                layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                rope_parameters={
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                    "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
                },
            ),
        ),
        # every other layer windowed (16), attention and final soft caps
        "gemma2": (Gemma2Config, dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=16, final_logit_softcapping=5.0)),
        # every layer windowed (Mistral-7B-v0.1)
        "mistral_window": (MistralConfig, dict(sliding_window=16)),
        # every other layer windowed (16), a sink per head, YaRN rope, 4 experts (top 2) with biases and a clamped SwiGLU
        "gpt_oss": (
            GptOssConfig,
            dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2, intermediate_size=48, sliding_window=16, swiglu_limit=1.5),
        ),
        "mistral": (MistralConfig, dict(sliding_window=None)),
        # q/k/v and gate/up fused in the checkpoint
        "phi3": (Phi3Config, dict(sliding_window=None, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
        # 8 experts, top 2 renormalised, every layer sparse
        "qwen3_moe": (
            Qwen3MoeConfig,
            dict(head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
        ),
        # MLA (q through a rank of 32, a latent of 32 and 8 roped dims, interleaved in the checkpoint), YaRN with mscale;
        # layer 0 dense, then 8 experts in 4 groups (top 2 of the best 2 groups) beside a shared one
        "deepseek_v3": (DeepseekV3Config, DEEPSEEK_V3),
        # the same with q projected whole and its rope dims in halves
        "deepseek_v3_q_whole": (DeepseekV3Config, {**DEEPSEEK_V3, "q_lora_rank": None, "rope_interleave": False}),
        # 4 experts of the layer's intermediate size, top 2 renormalised; checkpoint names of its own
        "mixtral": (MixtralConfig, dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48, sliding_window=None)),
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


ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "phi3")
WINDOWED_ARCHITECTURES = ("gemma3", "gemma2", "mistral_window", "gpt_oss")
MOE_ARCHITECTURES = ("qwen3_moe", "qwen3_moe_mixed", "mixtral", "deepseek_v3", "deepseek_v3_q_whole")


def build(name: str, folder: Path, **overrides) -> Path:
    from transformers import AutoModelForCausalLM

    config_cls, extra = _configs()[name]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config_cls(**{**SHAPE, **extra, **overrides}))
    with torch.no_grad():  # Gemma's norms, GPT-OSS's sinks and biases start at 0: move them, or a misread goes unseen
        for name, param in [*model.named_parameters(), *model.named_buffers()]:  # DeepSeek's router bias is a buffer
            if name.endswith(("norm.weight", "sinks")) or (name.endswith("bias") and name.startswith("model.layers")):
                if not param.any():
                    param.normal_(0.0, 0.3)
    model.save_pretrained(folder)
    return folder


def build_eagle_head(kind: str, target: Path, folder: Path, draft_vocab: int | None = 200, aux_layers: tuple[int, ...] = (0, 0, 1)) -> Path:
    """A random draft head for the tiny model at `target`, in the layout its kind is published in: EAGLE (one
    layer named `layers.0.*` without an input norm, `fc` with a bias, the embedding copied in, as a
    pytorch_model.bin) or EAGLE-3 (`midlayer.*` reading 2h, `fc` over three target layers, its own `norm` and
    `lm_head` over a draft vocabulary mapped to the target's by `d2t`, as safetensors)."""
    import json

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    config = json.loads((target / "config.json").read_text())
    h, heads, kv = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    dim, inter, vocab = h // heads, config["intermediate_size"], config["vocab_size"]
    generator = torch.Generator().manual_seed(1)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * 0.3

    wide = 2 * h if kind == "EAGLE3" else h
    prefix = "midlayer" if kind == "EAGLE3" else "layers.0"
    tensors = {
        f"{prefix}.self_attn.q_proj.weight": rand(heads * dim, wide),
        f"{prefix}.self_attn.k_proj.weight": rand(kv * dim, wide),
        f"{prefix}.self_attn.v_proj.weight": rand(kv * dim, wide),
        f"{prefix}.self_attn.o_proj.weight": rand(h, heads * dim),
        f"{prefix}.mlp.gate_proj.weight": rand(inter, h),
        f"{prefix}.mlp.up_proj.weight": rand(inter, h),
        f"{prefix}.mlp.down_proj.weight": rand(h, inter),
        f"{prefix}.post_attention_layernorm.weight": 1 + rand(h) / 3,
    }
    folder.mkdir(parents=True, exist_ok=True)
    head = {**config, "num_hidden_layers": 1}
    if kind == "EAGLE":
        embed = AutoModelForCausalLM.from_pretrained(target).get_input_embeddings().weight.detach()
        tensors |= {"fc.weight": rand(h, 2 * h), "fc.bias": rand(h), "embed_tokens.weight": embed.clone()}
        torch.save(tensors, folder / "pytorch_model.bin")
    else:
        tensors |= {
            f"{prefix}.input_layernorm.weight": 1 + rand(h) / 3,
            f"{prefix}.hidden_norm.weight": 1 + rand(h) / 3,
            "fc.weight": rand(h, 3 * h),
            "norm.weight": 1 + rand(h) / 3,
            "lm_head.weight": rand(draft_vocab or vocab, h),
        }
        head["architectures"] = ["LlamaForCausalLMEagle3"]
        if draft_vocab:  # else a head over the target's whole vocabulary, with no id map
            ids = torch.randperm(vocab, generator=generator)[:draft_vocab].sort().values
            tensors |= {"d2t": ids - torch.arange(draft_vocab), "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill_(0, ids, True)}
            head["draft_vocab_size"] = draft_vocab
        save_file(tensors, str(folder / "model.safetensors"))
        head |= {"eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux_layers)}}
    (folder / "config.json").write_text(json.dumps(head))
    return folder
