"""The paged KV pool. Each layer is one tensor [page, 2 (K, V), slot in page, kv head, head dim]:
flashinfer's NHD paged layout, so K and V of a token land with one write. Sliding-window layers may
have fewer pages than the others (the window pool: runtime.scheduler.window_pages). An FP8 pool stores each
value divided by its layer's K or V scale (1.0 unless the checkpoint gives k_scale / v_scale, as vLLM
reads them) and hands back the product in the model's dtype."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch import Tensor

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


class KVPool:
    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        compute_dtype: torch.dtype | None = None,
        scales: list[tuple[float, float]] | None = None,
        memory: Tensor | None = None,
        layer_pages: Sequence[int] = (),
    ) -> None:
        """`dtype`: what the pages store; `compute_dtype`: what attention reads (the same unless FP8);
        `memory`: bytes to lay the layers in (KVPool.bytes_per_page x pages, zero when new), e.g. a
        shared segment that outlives this process, whose pages are taken as they are; `layer_pages`: each
        layer's pages where they are not all num_pages."""
        self.page_size, self.device, self.dtype = page_size, device, dtype
        self.compute_dtype = compute_dtype or dtype
        self.quantized = self.dtype != self.compute_dtype
        self.scales = scales or [(1.0, 1.0)] * num_layers
        # each layer's (K, V) scale shaped to divide a write's [T, 2, heads·dim]
        self._divisors = torch.tensor(self.scales, dtype=torch.float32, device=device)[:, :, None]
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.layer_pages = tuple(layer_pages or [num_pages] * num_layers)
        shapes = [(pages, 2, page_size, num_kv_heads, head_dim) for pages in self.layer_pages]
        if memory is None:  # zeroed: kernels load whole pages, and a masked slot's NaN garbage times a zero weight is NaN
            self.kv = [torch.zeros(shape, dtype=dtype, device=device) for shape in shapes]
            return
        page_bytes = self.bytes_per_page(1, page_size, num_kv_heads, head_dim, dtype)
        if memory.numel() != sum(self.layer_pages) * page_bytes:
            raise ValueError(f"a KV pool of {sum(self.layer_pages)} layer pages takes {sum(self.layer_pages) * page_bytes} bytes")
        starts = [0, *itertools.accumulate(pages * page_bytes for pages in self.layer_pages)]
        self.kv = [memory[a:b].view(dtype).view(shape) for a, b, shape in zip(starts, starts[1:], shapes)]

    @staticmethod
    def bytes_per_page(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return num_layers * 2 * page_size * num_kv_heads * head_dim * dtype.itemsize

    @property
    def memory_bytes(self) -> int:
        return sum(layer.numel() for layer in self.kv) * self.dtype.itemsize

    def rows(self, layer: int) -> Tensor:
        """The layer as [page·2·slot, heads·dim], the view kv_rows indexes."""
        return self.kv[layer].view(-1, self.num_kv_heads * self.head_dim)

    def latents(self, layer: int) -> Tensor:
        """The layer as [page, slot, 2 · heads · dim]: a page's K half and V half side by side, its tokens' MLA latents
        one after another (runtime.models.mla), the layout flashinfer's MLA kernels read."""
        return self.kv[layer].view(len(self.kv[layer]), self.page_size, -1)

    def write(self, layer: int, kv: Tensor, rows: Tensor) -> None:
        """kv: [T, 2, kv heads, dim] for the step's new tokens, into `rows` [T, 2] (on CUDA rope_kv writes them instead)."""
        kv = kv.flatten(2)
        if self.quantized:  # float8 is written as bytes: not every device's indexing kernels take it
            kv = (kv.float() / self._divisors[layer]).clamp(-FP8_MAX, FP8_MAX).to(self.dtype)
            self.rows(layer).view(torch.uint8)[rows] = kv.view(torch.uint8)
        else:
            self.rows(layer)[rows] = kv

    def gather(self, layer: int, pages: Tensor) -> tuple[Tensor, Tensor]:
        """K and V of `pages` ([P] page numbers), each [P, slot, kv heads, dim] in the compute dtype."""
        pool = self.kv[layer]
        if not self.quantized:
            return pool.select(1, 0).index_select(0, pages), pool.select(1, 1).index_select(0, pages)
        pages_of = lambda part: pool.view(torch.uint8).select(1, part).index_select(0, pages).view(self.dtype)  # noqa: E731
        k_scale, v_scale = self.scales[layer]
        return pages_of(0).to(self.compute_dtype).mul_(k_scale), pages_of(1).to(self.compute_dtype).mul_(v_scale)
