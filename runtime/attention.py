"""The paged KV pool and the attention backends behind one interface, chosen by name.

The pool stores each layer's K and V as [token slot, kv head, head dim]; page p holds slots
[p * page_size, (p + 1) * page_size). `torch` is the reference backend (CPU, or CUDA).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F


@dataclass
class SeqSpan:
    q_start: int
    q_len: int
    kv_slots: torch.Tensor  # KV slot of every position 0..kv_len-1, new tokens included


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    out_slots: torch.Tensor  # [T]: where each new token's K and V go
    seqs: list[SeqSpan]


class KVPool:
    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        shape = (num_slots, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]


class AttentionBackend(Protocol):
    def __init__(self, pool: KVPool) -> None: ...

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """q: [T, heads, dim]; k, v: [T, kv heads, dim] for the new tokens. Returns [T, heads, dim]."""
        ...


class TorchAttention:
    """Gathers each sequence's K and V from the pool and runs causal SDPA on it."""

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        k_cache, v_cache = self.pool.k[layer], self.pool.v[layer]
        k_cache[batch.out_slots] = k
        v_cache[batch.out_slots] = v
        out = torch.empty_like(q)
        for seq in batch.seqs:
            rows = slice(seq.q_start, seq.q_start + seq.q_len)
            keys = k_cache[seq.kv_slots].transpose(0, 1)
            values = v_cache[seq.kv_slots].transpose(0, 1)
            kv_len = keys.shape[1]
            mask = None
            if seq.q_len > 1:  # query i sits at position kv_len - q_len + i
                first = kv_len - seq.q_len
                mask = torch.arange(kv_len, device=q.device)[None, :] <= first + torch.arange(seq.q_len, device=q.device)[:, None]
            attended = F.scaled_dot_product_attention(q[rows].transpose(0, 1), keys, values, attn_mask=mask, enable_gqa=True)
            out[rows] = attended.transpose(0, 1)
        return out


ATTENTION_BACKENDS: dict[str, type] = {"torch": TorchAttention}
