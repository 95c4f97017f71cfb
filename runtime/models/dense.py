"""The dense decoder family: Llama (Llama-3, SmolLM2), Mistral, Qwen2 (qkv bias) and Qwen3
(q/k norm). Parameter names match Hugging Face checkpoints, so weights load by name."""

from __future__ import annotations

import torch
from torch import nn

from runtime.attention import AttentionBackend, ForwardBatch
from runtime.config import ModelConfig
from runtime.layers import FusedOps, RMSNorm, apply_rope, rope_cos_sin, rope_inv_freq


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, ops: FusedOps) -> None:
        super().__init__()
        self.layer, self.heads, self.kv_heads, self.head_dim = layer, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, ops)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, ops)
        self.qk_norm = cfg.qk_norm

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch, backend: AttentionBackend) -> torch.Tensor:
        tokens = x.shape[0]
        q = self.q_proj(x).view(tokens, self.heads, self.head_dim)
        k = self.k_proj(x).view(tokens, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(tokens, self.kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = backend.forward(self.layer, q, k, v, batch)
        return self.o_proj(out.reshape(tokens, self.heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: FusedOps) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_proj(x), self.up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, ops: FusedOps) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer, ops)
        self.mlp = MLP(cfg, ops)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch, backend: AttentionBackend) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, batch, backend)
        return h + self.mlp(self.post_attention_layernorm(h))


class DenseModel(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: FusedOps) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, ops) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)


class DenseForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: FusedOps) -> None:
        super().__init__()
        self.config = cfg
        self.model = DenseModel(cfg, ops)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self._inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope)  # plain tensor: survives meta construction

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, batch: ForwardBatch, backend: AttentionBackend) -> torch.Tensor:
        """Final-norm hidden states, [T, hidden]."""
        if self._inv_freq.device != batch.positions.device:
            self._inv_freq = self._inv_freq.to(batch.positions.device)
        cos, sin = rope_cos_sin(batch.positions, self._inv_freq)
        h = self.model.embed_tokens(batch.input_ids)
        for layer in self.model.layers:
            h = layer(h, cos, sin, batch, backend)
        return self.model.norm(h)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
