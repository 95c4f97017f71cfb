"""The paged KV pool and the attention backends behind one interface, chosen by name.

Each layer's pool is one tensor [page, 2 (K, V), slot in page, kv head, head dim]: flashinfer's
NHD paged layout, so K and V of a token land with one write. `torch` is the reference backend (CPU,
or CUDA); `flashinfer` runs paged prefill and tensor-core decode on CUDA in bf16 or fp16, planned
once per step on the host, and keeps fixed-size decode wrappers for CUDA graphs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

Tensor = torch.Tensor


@dataclass
class AttentionMeta:
    """A step's shape on the host (int32 numpy), shared by every layer."""

    qo_indptr: np.ndarray  # [B + 1]: sequence i's new tokens are rows qo_indptr[i]:qo_indptr[i+1]
    kv_indptr: np.ndarray  # [B + 1]: its pages are kv_indices[kv_indptr[i]:kv_indptr[i+1]]
    kv_indices: np.ndarray
    kv_lens: np.ndarray  # [B]: positions attended, the new tokens included

    @property
    def decode_only(self) -> bool:
        return len(self.kv_lens) == self.qo_indptr[-1]

    def last_page_lens(self, page_size: int) -> np.ndarray:
        return (self.kv_lens - 1) % page_size + 1


@dataclass
class ForwardBatch:
    input_ids: Tensor  # [T]
    positions: Tensor  # [T]
    kv_rows: Tensor  # [T, 2]: where each new token's K and V go (see kv_rows)
    meta: AttentionMeta


def kv_rows(pages: np.ndarray, offsets: np.ndarray, page_size: int) -> np.ndarray:
    """[..., 2]: the K and V rows of tokens at (page, offset) in a pool layer viewed as
    [page·2·slot, heads·dim] (KVPool.rows). One index into that flat view reads or writes whole rows."""
    k = pages * (2 * page_size) + offsets
    return np.stack([k, k + page_size], axis=-1)


class KVPool:
    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.page_size, self.device, self.dtype = page_size, device, dtype
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        shape = (num_pages, 2, page_size, num_kv_heads, head_dim)
        # A slot is written before any step reads it, so the CPU pool stays uninitialised: a
        # restarted engine is back sooner without touching every page. On CUDA, zeroing costs
        # milliseconds and keeps garbage out of kernels that load whole tiles.
        self.kv = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        if device.type == "cuda":
            for layer in self.kv:
                layer.zero_()

    @staticmethod
    def bytes_per_page(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return num_layers * 2 * page_size * num_kv_heads * head_dim * dtype.itemsize

    def rows(self, layer: int) -> Tensor:
        """The layer as [page·2·slot, heads·dim], the view kv_rows indexes."""
        return self.kv[layer].view(-1, self.num_kv_heads * self.head_dim)

    def write(self, layer: int, kv: Tensor, batch: ForwardBatch) -> None:
        """kv: [T, 2, kv heads, dim] for the step's new tokens."""
        self.rows(layer)[batch.kv_rows] = kv.flatten(2)


class AttentionBackend(Protocol):
    def prepare(self, meta: AttentionMeta) -> None:
        """Per-step planning shared by every layer."""
        ...

    def forward(self, layer: int, q: Tensor, kv: Tensor, batch: ForwardBatch) -> Tensor:
        """q: [T, heads, dim]; kv: [T, 2, kv heads, dim] of the new tokens. Returns [T, heads, dim]."""
        ...


class TorchAttention:
    """Gathers each sequence's K and V from the pool and runs causal SDPA on it. A decode-only
    step gathers the whole batch at once, padded to its longest sequence and masked, and runs one
    SDPA call per layer: on CPU the per-sequence loop's small ops cost more than the padding."""

    def __init__(self, pool: KVPool, num_heads: int) -> None:
        self.pool = pool

    def _rows_of(self, meta: AttentionMeta, positions: np.ndarray, seqs: slice | np.ndarray) -> Tensor:
        """K and V rows (kv_rows) of `positions` [len(seqs), L] of the sequences `seqs`."""
        ps = self.pool.page_size
        pages = meta.kv_indices[meta.kv_indptr[seqs][:, None] + positions // ps]
        return torch.from_numpy(kv_rows(pages.astype(np.int64), positions % ps, ps)).to(self.pool.device)

    def prepare(self, meta: AttentionMeta) -> None:
        self._gathers, self._batched = [], None
        if meta.decode_only:
            lens = meta.kv_lens.astype(np.int64)[:, None]
            # padding repeats each sequence's last row (written, so finite) and is masked out
            positions = np.minimum(np.arange(int(lens.max()))[None, :], lens - 1)
            mask = torch.from_numpy(np.arange(positions.shape[1])[None, :] < lens).to(self.pool.device)[:, None, None, :]
            self._batched = (self._rows_of(meta, positions, slice(0, -1)), mask)
            return
        self._gathers = [self._rows_of(meta, np.arange(kv_len)[None, :], slice(i, i + 1))[0]
                         for i, kv_len in enumerate(meta.kv_lens.tolist())]

    def forward(self, layer: int, q: Tensor, kv: Tensor, batch: ForwardBatch) -> Tensor:
        self.pool.write(layer, kv, batch)
        flat, meta = self.pool.rows(layer), batch.meta
        heads_dim = (self.pool.num_kv_heads, self.pool.head_dim)
        if self._batched is not None:
            rows, mask = self._batched
            keys, values = (flat[rows[..., i]].view(*rows.shape[:2], *heads_dim).transpose(1, 2) for i in (0, 1))
            return F.scaled_dot_product_attention(q[:, :, None], keys, values, attn_mask=mask, enable_gqa=True)[:, :, 0]
        out = torch.empty_like(q)
        for i, seq_rows in enumerate(self._gathers):
            rows = slice(int(meta.qo_indptr[i]), int(meta.qo_indptr[i + 1]))
            q_len, kv_len = rows.stop - rows.start, len(seq_rows)
            keys, values = (flat[seq_rows[:, j]].view(kv_len, *heads_dim).transpose(0, 1) for j in (0, 1))
            mask = None
            if 1 < q_len < kv_len:  # after a cached prefix: query i sits at position kv_len - q_len + i
                mask = torch.arange(kv_len, device=q.device)[None, :] <= kv_len - q_len + torch.arange(q_len, device=q.device)[:, None]
            attended = F.scaled_dot_product_attention(q[rows].transpose(0, 1), keys, values, attn_mask=mask,
                                                      is_causal=1 < q_len == kv_len, enable_gqa=True)
            out[rows] = attended.transpose(0, 1)
        return out


class FlashInferAttention:
    """flashinfer's paged prefill (mixed steps) and tensor-core decode (decode-only steps). The
    tensor-core decode also wins at two query heads per KV head: Qwen3-0.6B's offline bench ran
    22,756 tok/s with it and 21,417 with the CUDA-core kernel on the H200.

    A wrapper's plan stages its work partition in pinned memory and copies it on the stream. With
    a step in flight, the next plan could overwrite that staging area before the copy ran, so each
    plan first waits for the copy of the one before (by then long done: the engine runs at most
    one step ahead)."""

    def __init__(self, pool: KVPool, num_heads: int) -> None:
        import flashinfer  # optional: present on CUDA machines only

        self.flashinfer, self.pool, self.num_heads = flashinfer, pool, num_heads
        self.workspace = torch.zeros(256 << 20, dtype=torch.uint8, device=pool.device)
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD", use_tensor_cores=True)
        self.graph_wrappers: dict[int, object] = {}
        self.active = self.prefill
        self._planned = torch.cuda.Event()
        self._planned.record()

    def graph_wrapper(self, batch_size: int, max_pages: int) -> None:
        """A decode wrapper with fixed buffers for CUDA graphs of `batch_size` sequences."""
        device = self.pool.device
        self.graph_wrappers[batch_size] = self.flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=True,
            paged_kv_indptr_buffer=torch.zeros(batch_size + 1, dtype=torch.int32, device=device),
            paged_kv_indices_buffer=torch.zeros(max_pages, dtype=torch.int32, device=device),
            paged_kv_last_page_len_buffer=torch.zeros(batch_size, dtype=torch.int32, device=device),
        )

    def prepare(self, meta: AttentionMeta, graph_batch_size: int | None = None) -> None:
        pool = self.pool
        self._planned.synchronize()
        kv_indptr = torch.from_numpy(meta.kv_indptr)
        indices = torch.from_numpy(meta.kv_indices).to(pool.device, non_blocking=True)
        last_page_len = torch.from_numpy(meta.last_page_lens(pool.page_size))
        shape = (self.num_heads, pool.num_kv_heads, pool.head_dim, pool.page_size)
        if meta.decode_only:
            self.active = self.decode if graph_batch_size is None else self.graph_wrappers[graph_batch_size]
            self.active.plan(kv_indptr, indices, last_page_len, *shape,
                             q_data_type=pool.dtype, kv_data_type=pool.dtype, seq_lens=torch.from_numpy(meta.kv_lens))
        else:
            self.active = self.prefill
            self.prefill.plan(torch.from_numpy(meta.qo_indptr), kv_indptr, indices, last_page_len, *shape, causal=True, q_data_type=pool.dtype, kv_data_type=pool.dtype)
        self._planned.record()

    def forward(self, layer: int, q: Tensor, kv: Tensor, batch: ForwardBatch) -> Tensor:
        self.pool.write(layer, kv, batch)
        return self.active.run(q, self.pool.kv[layer])


ATTENTION_BACKENDS: dict[str, type] = {"torch": TorchAttention, "flashinfer": FlashInferAttention}
