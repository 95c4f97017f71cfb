"""DeepSeek's multi-head latent attention (MLA), with the weights absorbed as DeepSeek's own decode runs it. A
token's KV is its latent: kv_lora_rank normed values, from which kv_b_proj would make every head's K (its unroped
part) and V, and the roped key part the heads share. The pool keeps that latent (MlaConfig.latent values a token,
not per head), and attention runs over it as one shared head: each head's query is its unroped part through its
slice of kv_b_proj's K rows (W_UK) beside its roped part, so q·k is the same sum; the heads' weights over the
latents, through their slices of the V rows (W_UV), are each head's output. Prefill and decode both run so.
The pool holds the latents in its K and V halves of each page (KVPool.latents)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from runtime.attention.backend import AttentionBackend
from runtime.batch import ForwardBatch
from runtime.config import ModelConfig
from runtime.distributed import TensorParallel
from runtime.models.layers import FusedOps, RMSNorm, torch_rope, torch_rope_tables


def token_rows(batch: ForwardBatch, page_size: int) -> torch.Tensor:
    """Each new token's row of KVPool.latents flattened to [page · slot, latent], from its K row of the pool
    (page · 2 · page_size + slot)."""
    k = batch.kv_rows[:, 0]
    return k - (k // (2 * page_size)) * page_size


class MlaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, ops: FusedOps, tp: TensorParallel) -> None:
        super().__init__()
        mla = cfg.mla
        assert mla is not None
        if tp.size > 1:  # kv_b_proj's heads and the latent's one head are not cut into shards yet
            raise ValueError("multi-head latent attention runs on one rank (--tp 1) for now")
        self.layer, self.mla, self.ops, self.eps = layer, mla, ops, cfg.rms_norm_eps
        self.heads, qk_dim = cfg.num_heads, mla.qk_nope_head_dim + mla.qk_rope_head_dim
        # the normed rows' projections, side by side: q's (through the low rank, or whole), and the latent with its roped part
        q_rows = mla.q_lora_rank or self.heads * qk_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_rows + mla.latent, bias=cfg.attention_bias)
        self.qkv_proj.shard_sizes = (q_rows, mla.latent)  # pyright: ignore[reportArgumentType]  # see decoder.Attention
        if mla.q_lora_rank is not None:
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, cfg.rms_norm_eps, ops)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, self.heads * qk_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, cfg.rms_norm_eps, ops)
        self.kv_b_proj = nn.Linear(mla.kv_lora_rank, self.heads * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False)
        self.o_proj = nn.Linear(self.heads * mla.v_head_dim, cfg.hidden_size, bias=cfg.attention_bias)

    def attend(self, qkv: torch.Tensor, rope: tuple[torch.Tensor, Any], batch: ForwardBatch, backend: AttentionBackend) -> torch.Tensor:
        """[T, heads · v_head_dim] before o_proj; the new latents reach the pool first. rope: (positions, tables)."""
        mla, tokens = self.mla, qkv.shape[0]
        positions, tables = rope
        q, latent = qkv.split([qkv.shape[1] - mla.latent, mla.latent], dim=-1)
        if mla.q_lora_rank is not None:
            q = self.q_b_proj(self.q_a_layernorm(q))
        q_nope, q_rope = q.view(tokens, self.heads, -1).split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        # the heads' roped parts and the shared one, rotated together (by the reference rope: on CUDA `tables` is the
        # whole fp32 cache, which the CUDA rope kernels index themselves)
        roped = torch.cat([q_rope, latent[:, None, mla.kv_lora_rank :]], dim=1)
        torch_rope(positions, roped, self.heads, tables if isinstance(tables, tuple) else torch_rope_tables(positions, tables))
        cached = torch.cat([self.kv_a_layernorm(latent[:, : mla.kv_lora_rank]), roped[:, self.heads]], dim=-1)
        backend.pool.latents(self.layer).flatten(0, 1)[token_rows(batch, backend.pool.page_size)] = cached
        w_uk, w_uv = self.kv_b_proj.weight.view(self.heads, -1, mla.kv_lora_rank).split([mla.qk_nope_head_dim, mla.v_head_dim], dim=1)
        query = torch.cat([torch.einsum("thn,hnl->thl", q_nope, w_uk), roped[:, : self.heads]], dim=-1)
        attended = backend.forward(self.layer, query, batch)  # [T, heads, kv_lora_rank]: weights over the latents
        return torch.einsum("thl,hvl->thv", attended, w_uv).reshape(tokens, -1)
