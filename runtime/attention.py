"""The paged KV pool and the attention backends behind one interface, chosen by name.

The pool stores each layer's K and V as [token slot, kv head, head dim]; page p holds slots
[p * page_size, (p + 1) * page_size), which is flashinfer's NHD page layout viewed flat.
`torch` is the reference backend (CPU, or CUDA); `flashinfer` runs paged prefill and decode on
CUDA in bf16 or fp16, planned once per step before the layers run.
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
    kv_len: int  # positions 0..kv_len-1 attended, the new tokens included
    pages: list[int]  # the sequence's page table, covering kv_len


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    out_slots: torch.Tensor  # [T]: where each new token's K and V go
    seqs: list[SeqSpan]


class KVPool:
    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.page_size, self.device = page_size, device
        shape = (num_pages * page_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]


class AttentionBackend(Protocol):
    def __init__(self, pool: KVPool, num_heads: int) -> None: ...

    def prepare(self, batch: ForwardBatch) -> None:
        """Per-step planning shared by every layer."""
        ...

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """q: [T, heads, dim]; k, v: [T, kv heads, dim] for the new tokens. Returns [T, heads, dim]."""
        ...


def write_kv(pool: KVPool, layer: int, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch) -> None:
    pool.k[layer][batch.out_slots] = k
    pool.v[layer][batch.out_slots] = v


class TorchAttention:
    """Gathers each sequence's K and V from the pool and runs causal SDPA on it."""

    def __init__(self, pool: KVPool, num_heads: int) -> None:
        self.pool = pool

    def prepare(self, batch: ForwardBatch) -> None:
        ps = self.pool.page_size
        self._slots = []
        for seq in batch.seqs:
            positions = torch.arange(seq.kv_len)
            pages = torch.tensor(seq.pages, dtype=torch.long)
            self._slots.append((pages[positions // ps] * ps + positions % ps).to(self.pool.device))

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        write_kv(self.pool, layer, k, v, batch)
        k_cache, v_cache = self.pool.k[layer], self.pool.v[layer]
        out = torch.empty_like(q)
        for seq, slots in zip(batch.seqs, self._slots):
            rows = slice(seq.q_start, seq.q_start + seq.q_len)
            keys, values = k_cache[slots].transpose(0, 1), v_cache[slots].transpose(0, 1)
            mask = None
            if seq.q_len > 1:  # query i sits at position kv_len - q_len + i
                first = seq.kv_len - seq.q_len
                mask = torch.arange(seq.kv_len, device=q.device)[None, :] <= first + torch.arange(seq.q_len, device=q.device)[:, None]
            attended = F.scaled_dot_product_attention(q[rows].transpose(0, 1), keys, values, attn_mask=mask, enable_gqa=True)
            out[rows] = attended.transpose(0, 1)
        return out


class FlashInferAttention:
    """flashinfer's batch prefill kernel over the paged pool, for prefill chunks and decodes alike
    (its causal mask is aligned to the end of each sequence's KV)."""

    def __init__(self, pool: KVPool, num_heads: int) -> None:
        import flashinfer  # optional: present on CUDA machines only

        self.pool, self.num_heads = pool, num_heads
        self.workspace = torch.empty(256 << 20, dtype=torch.uint8, device=pool.device)
        self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")

    def prepare(self, batch: ForwardBatch) -> None:
        ps = self.pool.page_size
        pages_used = [-(-seq.kv_len // ps) for seq in batch.seqs]
        qo_indptr = torch.tensor([0] + [seq.q_len for seq in batch.seqs], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        kv_indptr = torch.tensor([0] + pages_used, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        indices = torch.tensor([p for seq, n in zip(batch.seqs, pages_used) for p in seq.pages[:n]], dtype=torch.int32)
        last_page_len = torch.tensor([seq.kv_len - (n - 1) * ps for seq, n in zip(batch.seqs, pages_used)], dtype=torch.int32)
        _, kv_heads, head_dim = self.pool.k[0].shape
        self.wrapper.plan(
            qo_indptr, kv_indptr, indices.to(self.pool.device), last_page_len, self.num_heads, kv_heads, head_dim, ps,
            causal=True, q_data_type=self.pool.k[0].dtype, kv_data_type=self.pool.k[0].dtype,
        )

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        write_kv(self.pool, layer, k, v, batch)
        k_cache, v_cache = self.pool.k[layer], self.pool.v[layer]
        paged = (k_cache.view(-1, self.pool.page_size, *k_cache.shape[1:]), v_cache.view(-1, self.pool.page_size, *v_cache.shape[1:]))
        return self.wrapper.run(q, paged)


ATTENTION_BACKENDS: dict[str, type] = {"torch": TorchAttention, "flashinfer": FlashInferAttention}
