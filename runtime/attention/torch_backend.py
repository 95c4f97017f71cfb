"""The reference backend: SDPA per sequence for prefill, one batched SDPA per layer for decode,
and ringllm's paged decode kernel in place on fp32 CPUs that build it."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from runtime.attention.pool import KVPool
from runtime.batch import AttentionMeta, ForwardBatch
from runtime.kernels.cpu import build as cpu_kernels


class TorchAttention:
    """Gathers whole pages (cheaper than token rows) and runs SDPA: one masked call per layer for decode."""

    rotates = False

    def __init__(self, pool: KVPool, num_heads: int, deterministic: bool = False) -> None:
        """`deterministic`: every row, a prompt's too, attends as a decode row (ringllm's paged decode
        kernel over its own prefix), so a row's output is the same whatever shares its step."""
        self.pool = pool
        self.in_place = pool.device.type == "cpu" and pool.dtype == torch.float32 and cpu_kernels.available()
        if deterministic and not self.in_place:
            raise ValueError("deterministic inference on the torch backend needs a float32 CPU pool and ringllm's CPU kernels")
        self.deterministic = deterministic

    def prepare(self, meta: AttentionMeta) -> None:
        device, ps = self.pool.device, self.pool.page_size
        self._decode = None
        if self.deterministic or meta.decode_only:
            # each row attends as a decode row: its sequence's pages, padded with its own last page, up to its own
            # position (row i of a sequence whose step adds q rows to kv tokens sees kv - q + i + 1)
            q_lens = np.diff(meta.qo_indptr)
            seq = np.repeat(np.arange(len(q_lens)), q_lens)
            row_lens = (meta.kv_lens - q_lens - meta.qo_indptr[:-1])[seq] + np.arange(len(seq)) + 1
            counts = np.diff(meta.kv_indptr)[seq]
            width = int(counts.max())
            at = meta.kv_indptr[seq, None] + np.minimum(np.arange(width)[None, :], counts[:, None] - 1)
            pages = torch.from_numpy(meta.kv_indices[at].astype(np.int64)).to(device)
            if self.in_place:
                self._decode = (pages, torch.from_numpy(row_lens.astype(np.int64)))
                return
            # additive, in the pool's dtype: SDPA would convert a boolean mask in every layer
            hidden = np.arange(width * ps)[None, :] >= row_lens[:, None]
            mask = torch.from_numpy(hidden).to(device)[:, None, None, :]
            self._decode = (pages, torch.zeros(mask.shape, dtype=self.pool.compute_dtype, device=device).masked_fill_(mask, float("-inf")))
            return
        self._pages = [
            torch.from_numpy(meta.kv_indices[a:b].astype(np.int64)).to(device) for a, b in zip(meta.kv_indptr[:-1], meta.kv_indptr[1:])
        ]

    def _kv(self, layer: int, pages: Tensor) -> tuple[Tensor, Tensor]:
        """K and V of `pages` ([B, P] or [P]), gathered apart so that each lands contiguous."""
        shape = (*pages.shape[:-1], -1, self.pool.num_kv_heads, self.pool.head_dim)
        keys, values = self.pool.gather(layer, pages.flatten())
        return keys.view(shape), values.view(shape)

    def forward(self, layer: int, q: Tensor, batch: ForwardBatch) -> Tensor:
        meta, kv_heads = batch.meta, self.pool.num_kv_heads
        if self._decode is not None and self.in_place:
            pages, kv_lens = self._decode
            return torch.ops.ringllm_cpu.paged_decode_attention(q, self.pool.kv[layer], pages, kv_lens, q.shape[-1] ** -0.5)
        if self._decode is not None:
            pages, mask = self._decode
            keys, values = self._kv(layer, pages)
            # each KV head's query heads as its rows: SDPA then needs no GQA expansion
            grouped = q.view(len(q), kv_heads, -1, q.shape[-1])
            return F.scaled_dot_product_attention(grouped, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask).reshape(q.shape)
        out = torch.empty_like(q)
        for i, pages in enumerate(self._pages):
            rows = slice(int(meta.qo_indptr[i]), int(meta.qo_indptr[i + 1]))
            q_len, kv_len = rows.stop - rows.start, int(meta.kv_lens[i])
            keys, values = (x[:kv_len].transpose(0, 1)[None] for x in self._kv(layer, pages))
            mask = None
            if 1 < q_len < kv_len:  # after a cached prefix: query i sits at position kv_len - q_len + i
                mask = torch.arange(kv_len, device=q.device)[None, :] <= kv_len - q_len + torch.arange(q_len, device=q.device)[:, None]
            # 4-D, batch of one: torch routes 3-D GQA inputs to its slow unfused math kernel
            attended = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1)[None], keys, values, attn_mask=mask, is_causal=1 < q_len == kv_len, enable_gqa=True
            )
            out[rows] = attended[0].transpose(0, 1)
        return out
