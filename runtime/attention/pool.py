"""The paged KV pool. Each layer is one tensor [page, 2 (K, V), slot in page, kv head, head dim]:
flashinfer's NHD paged layout, so K and V of a token land with one write."""

from __future__ import annotations

import torch
from torch import Tensor

from runtime.engine.batch import ForwardBatch


class KVPool:
    def __init__(
        self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.page_size, self.device, self.dtype = page_size, device, dtype
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        shape = (num_pages, 2, page_size, num_kv_heads, head_dim)
        # zeroed: kernels load whole pages, and a masked slot's NaN garbage times a zero weight is NaN
        self.kv = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_page(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return num_layers * 2 * page_size * num_kv_heads * head_dim * dtype.itemsize

    def rows(self, layer: int) -> Tensor:
        """The layer as [page·2·slot, heads·dim], the view kv_rows indexes."""
        return self.kv[layer].view(-1, self.num_kv_heads * self.head_dim)

    def write(self, layer: int, kv: Tensor, batch: ForwardBatch) -> None:
        """kv: [T, 2, kv heads, dim] for the step's new tokens (on CUDA rope_kv writes them instead)."""
        self.rows(layer)[batch.kv_rows] = kv.flatten(2)
