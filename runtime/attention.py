"""The paged KV pool and the attention backends behind one interface, chosen by name.

Each layer's pool is one tensor [page, 2 (K, V), slot in page, kv head, head dim]: flashinfer's
NHD paged layout, so K and V of a token land with one write. `torch` is the reference backend (CPU,
or CUDA); `flashinfer` runs paged prefill and tensor-core decode on CUDA in bf16 or fp16, planned
once per step on the host, and makes the fixed-buffer wrappers that CUDA graphs replay.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from runtime import cpu_kernels

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
        # Zeroed: attention kernels load whole pages (tiles on CUDA, gathered pages on CPU), and a
        # masked slot's value still meets a zero weight, which NaN garbage would turn into NaN.
        self.kv = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_page(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return num_layers * 2 * page_size * num_kv_heads * head_dim * dtype.itemsize

    def rows(self, layer: int) -> Tensor:
        """The layer as [page·2·slot, heads·dim], the view kv_rows indexes."""
        return self.kv[layer].view(-1, self.num_kv_heads * self.head_dim)

    def write(self, layer: int, kv: Tensor, batch: ForwardBatch) -> None:
        """kv: [T, 2, kv heads, dim] for the step's new tokens. (On CUDA, rope_kv_kernel writes them
        as it rotates K.)"""
        self.rows(layer)[batch.kv_rows] = kv.flatten(2)


class Rope(NamedTuple):
    """What a backend that `rotates` needs to norm and rotate q and the new K itself: the inputs of
    runtime.rope_kv_kernel, whose pass it then replaces."""

    cos_sin: Tensor  # [max position, dim] fp32, cos halves then sin halves
    q_norm: Tensor | None  # [dim], or None for a model without q/k norms
    k_norm: Tensor | None
    eps: float


class AttentionBackend(Protocol):
    pool: KVPool
    rotates: bool  # whether this step's forward takes the raw qkv and a Rope, and writes the new K and V itself

    def prepare(self, meta: AttentionMeta) -> None:
        """Per-step planning shared by every layer."""
        ...

    def forward(self, layer: int, q: Tensor, batch: ForwardBatch, rope: Rope | None = None) -> Tensor:
        """q: [T, heads, dim], the step's new K and V already in the pool; or, with `rope` (where
        `rotates`), the raw qkv [T, heads + 2 kv heads, dim]. Returns [T, heads, dim]."""
        ...


class TorchAttention:
    """Gathers each sequence's pages from the pool and runs SDPA on them: one call per layer for
    a decode-only step (the batch padded to its longest sequence and masked), one per sequence
    otherwise. Whole pages, not token rows: on CPU, copying 16-row blocks took a seventh of the time
    of a per-row gather, which had cost more than the attention itself. In fp32 on CPU, where
    ringllm's kernels build, a decode-only step reads K and V where they lie instead."""

    rotates = False

    def __init__(self, pool: KVPool, num_heads: int) -> None:
        self.pool = pool
        self.in_place = pool.device.type == "cpu" and pool.dtype == torch.float32 and cpu_kernels.available()

    def prepare(self, meta: AttentionMeta) -> None:
        device, ps = self.pool.device, self.pool.page_size
        counts = np.diff(meta.kv_indptr)
        self._decode = None
        if meta.decode_only:
            # each row's pages, padded with its own last page; the mask hides all but kv_len slots
            width = int(counts.max())
            at = meta.kv_indptr[:-1, None] + np.minimum(np.arange(width)[None, :], counts[:, None] - 1)
            pages = torch.from_numpy(meta.kv_indices[at].astype(np.int64)).to(device)
            if self.in_place:
                self._decode = (pages, torch.from_numpy(meta.kv_lens.astype(np.int64)))
                return
            # additive, in the pool's dtype: SDPA would convert a boolean mask in every layer
            hidden = np.arange(width * ps)[None, :] >= meta.kv_lens[:, None]
            mask = torch.from_numpy(hidden).to(device)[:, None, None, :]
            self._decode = (pages, torch.zeros(mask.shape, dtype=self.pool.dtype, device=device).masked_fill_(mask, float("-inf")))
            return
        self._pages = [torch.from_numpy(meta.kv_indices[a:b].astype(np.int64)).to(device)
                       for a, b in zip(meta.kv_indptr[:-1], meta.kv_indptr[1:])]

    def _kv(self, layer: int, pages: Tensor) -> tuple[Tensor, Tensor]:
        """K and V of `pages` ([B, P] or [P]): each [(B,) P·page_size, kv heads, dim], gathered from the
        pool's K half and V half apart, so that each lands contiguous. (Gathering whole pages and then
        splitting them cost two more copies: 180 against 65 us per layer at 4 x 600 tokens on CPU.)"""
        pool, flat = self.pool.kv[layer], pages.flatten()
        shape = (*pages.shape[:-1], -1, self.pool.num_kv_heads, self.pool.head_dim)
        return pool.select(1, 0).index_select(0, flat).view(shape), pool.select(1, 1).index_select(0, flat).view(shape)

    def forward(self, layer: int, q: Tensor, batch: ForwardBatch) -> Tensor:
        meta, kv_heads = batch.meta, self.pool.num_kv_heads
        if self._decode is not None and self.in_place:
            pages, kv_lens = self._decode
            return torch.ops.ringllm_cpu.paged_decode_attention(q, self.pool.kv[layer], pages, kv_lens, q.shape[-1] ** -0.5)
        if self._decode is not None:
            pages, mask = self._decode
            keys, values = self._kv(layer, pages)
            # each KV head's query heads as its rows: SDPA then needs no GQA expansion (1.7x faster on CPU)
            grouped = q.view(len(q), kv_heads, -1, q.shape[-1])
            return F.scaled_dot_product_attention(grouped, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask).view(q.shape)
        out = torch.empty_like(q)
        for i, pages in enumerate(self._pages):
            rows = slice(int(meta.qo_indptr[i]), int(meta.qo_indptr[i + 1]))
            q_len, kv_len = rows.stop - rows.start, int(meta.kv_lens[i])
            keys, values = (x[:kv_len].transpose(0, 1)[None] for x in self._kv(layer, pages))
            mask = None
            if 1 < q_len < kv_len:  # after a cached prefix: query i sits at position kv_len - q_len + i
                mask = torch.arange(kv_len, device=q.device)[None, :] <= kv_len - q_len + torch.arange(q_len, device=q.device)[:, None]
            # 4-D, with a batch of one: torch routes 3-D GQA inputs to its unfused math kernel (4-13x slower on CPU)
            attended = F.scaled_dot_product_attention(q[rows].transpose(0, 1)[None], keys, values, attn_mask=mask,
                                                      is_causal=1 < q_len == kv_len, enable_gqa=True)
            out[rows] = attended[0].transpose(0, 1)
        return out


def _copy_each(copies: Sequence[tuple[Tensor, Tensor]]) -> None:
    for src, dst in copies:
        dst.copy_(src, non_blocking=True)


class FlashInferAttention:
    """flashinfer's paged prefill (mixed steps) and tensor-core decode (decode-only steps). The
    tensor-core decode also wins at two query heads per KV head: Qwen3-0.6B's offline bench ran
    22,756 tok/s with it and 21,417 with the CUDA-core kernel on the H200.

    A wrapper's plan stages its work partition in pinned memory and copies it on the stream. With
    a step in flight, the next plan could overwrite that staging area before the copy ran, so each
    plan first waits for the copy of the one before, which is queued behind the step before that:
    with three steps in flight, the wait ends as the oldest of them does."""

    def __init__(self, pool: KVPool, num_heads: int) -> None:
        import flashinfer  # optional: present on CUDA machines only

        self.flashinfer, self.pool, self.num_heads = flashinfer, pool, num_heads
        self.workspace = torch.zeros(256 << 20, dtype=torch.uint8, device=pool.device)
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD", use_tensor_cores=True)
        self.active = self.prefill
        try:
            from runtime.host_copy_kernel import send
        except ImportError:  # no Triton: step inputs go by cudaMemcpyAsync
            send = _copy_each
        self._send = send
        self._planned = torch.cuda.Event()
        self._planned.record()

    def _graph_buffers(self, batch_size: int, max_pages: int) -> tuple[Tensor, Tensor, Tensor]:
        """kv indptr, kv indices and last page lengths, fixed for a graph's lifetime."""
        device = self.pool.device
        return (torch.zeros(batch_size + 1, dtype=torch.int32, device=device),
                torch.zeros(max_pages, dtype=torch.int32, device=device),
                torch.zeros(batch_size, dtype=torch.int32, device=device))

    def decode_graph_wrapper(self, batch_size: int, max_pages: int):
        """A decode wrapper with fixed buffers, for CUDA graphs of `batch_size` sequences."""
        indptr, indices, last_page_len = self._graph_buffers(batch_size, max_pages)
        return self.flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=True, paged_kv_indptr_buffer=indptr,
            paged_kv_indices_buffer=indices, paged_kv_last_page_len_buffer=last_page_len)

    def triton_decode_graph_wrapper(self, batch_size: int, max_pages: int) -> TritonDecode | None:
        """ringllm's split-KV decode (runtime.decode_attention_kernel) with fixed buffers, for CUDA graphs;
        None where Triton does not import."""
        try:
            from runtime.decode_attention_kernel import decode_attention
        except ImportError:
            return None
        return TritonDecode(batch_size, max_pages, self.pool.device, decode_attention)

    def prefill_graph_wrapper(self, batch_size: int, max_pages: int):
        """A prefill wrapper with fixed buffers, for CUDA graphs of exactly `batch_size` sequences. Its
        first plan fixes the most rows it takes, and with them its launch grid."""
        indptr, indices, last_page_len = self._graph_buffers(batch_size, max_pages)
        return self.flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=True, qo_indptr_buf=torch.zeros_like(indptr), paged_kv_indptr_buf=indptr,
            paged_kv_indices_buf=indices, paged_kv_last_page_len_buf=last_page_len)

    def prepare(self, meta: AttentionMeta, wrapper=None, copies: Sequence[tuple[Tensor, Tensor]] = ()) -> None:
        """Plans `wrapper` (a graph's), else the step's own: decode for a decode-only step, else prefill.
        `copies` (pinned host -> device, the caller's step inputs) go in one kernel with the plan's own,
        and the next prepare waits for them too."""
        self.wait_for_sent()
        self.active = wrapper or (self.decode if meta.decode_only else self.prefill)
        if isinstance(self.active, TritonDecode):
            copies = [*copies, self.active.plan(meta)]
        else:
            self._plan_flashinfer(meta)
        if copies:
            self._send(copies)
        self._planned.record()

    def wait_for_sent(self) -> None:
        """Blocks until the last prepare's copies have run, so their pinned sources may be rewritten."""
        self._planned.synchronize()

    def _plan_flashinfer(self, meta: AttentionMeta) -> None:
        pool = self.pool
        kv_indptr = torch.from_numpy(meta.kv_indptr)
        indices = torch.from_numpy(meta.kv_indices).to(pool.device, non_blocking=True)
        last_page_len = torch.from_numpy(meta.last_page_lens(pool.page_size))
        shape = (self.num_heads, pool.num_kv_heads, pool.head_dim, pool.page_size)
        if isinstance(self.active, self.flashinfer.BatchDecodeWithPagedKVCacheWrapper):
            self.active.plan(kv_indptr, indices, last_page_len, *shape,
                             q_data_type=pool.dtype, kv_data_type=pool.dtype, seq_lens=torch.from_numpy(meta.kv_lens))
        else:
            self.active.plan(torch.from_numpy(meta.qo_indptr), kv_indptr, indices, last_page_len, *shape, causal=True,
                             q_data_type=pool.dtype, kv_data_type=pool.dtype)

    @property
    def rotates(self) -> bool:
        """ringllm's split-KV decode norms and rotates q and writes the new K and V in its own pass."""
        return isinstance(self.active, TritonDecode)

    def forward(self, layer: int, q: Tensor, batch: ForwardBatch, rope: Rope | None = None) -> Tensor:
        # every row is written: flashinfer's own prefill output is zero-filled first (11 us a layer at 8k tokens)
        out = torch.empty(len(q), self.num_heads, q.shape[-1], dtype=q.dtype, device=q.device)
        if rope is not None:
            return self.active.run(q, self.pool.kv[layer], out=out, rope=rope)
        return self.active.run(q, self.pool.kv[layer], out=out)


class TritonDecode:
    """A flashinfer decode wrapper's plan and run, for runtime.decode_attention_kernel. A plan
    stages the step's page lists and lengths in pinned memory, and prepare sends them into the buffer
    its graph reads; like flashinfer's plans, the next one waits for that copy."""

    def __init__(self, batch_size: int, max_pages: int, device: torch.device, attend: Callable[..., Tensor]) -> None:
        self.staged = torch.zeros(2 * batch_size + 1 + max_pages, dtype=torch.int32, pin_memory=True)
        self.buffer = torch.zeros_like(self.staged, device=device)
        b = batch_size
        self.kv_indptr, self.kv_lens, self.kv_indices = self.buffer[: b + 1], self.buffer[b + 1 : 2 * b + 1], self.buffer[2 * b + 1 :]
        self.attend = attend

    def plan(self, meta: AttentionMeta) -> tuple[Tensor, Tensor]:
        """Stages the plan; returns the copy (pinned, device) that sends it."""
        b, used = len(self.kv_lens), 2 * len(self.kv_lens) + 1 + len(meta.kv_indices)
        assert len(meta.kv_lens) == b, "a graph's plan has its batch size"
        staged = self.staged.numpy()
        staged[: b + 1], staged[b + 1 : 2 * b + 1], staged[2 * b + 1 : used] = meta.kv_indptr, meta.kv_lens, meta.kv_indices
        return self.staged[:used], self.buffer[:used]

    def run(self, q: Tensor, kv: Tensor, out: Tensor, rope: Rope | None = None) -> Tensor:
        return self.attend(q, kv, self.kv_indptr, self.kv_indices, self.kv_lens, q.shape[-1] ** -0.5, out, rope)


ATTENTION_BACKENDS: dict[str, type] = {"torch": TorchAttention, "flashinfer": FlashInferAttention}
