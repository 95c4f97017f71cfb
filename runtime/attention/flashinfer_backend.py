"""flashinfer on CUDA: paged prefill and tensor-core decode, planned once per step on the host,
and the fixed-buffer wrappers that CUDA graphs replay. An FP8 pool's pages are read with bf16 (or
fp16) queries, its layer's K and V scales given to each run. MLA models run flashinfer's MLA kernel
for every step, over the pool's latents."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from runtime.attention.backend import AttentionSpec, GraphWrapper, PinnedRing
from runtime.attention.pool import KVPool
from runtime.batch import AttentionMeta, ForwardBatch
from runtime.kernels.rope import Rope


def _copy_each(copies: Sequence[tuple[Tensor, Tensor]]) -> None:
    for src, dst in copies:
        dst.copy_(src, non_blocking=True)


class Windows:
    """flashinfer wrappers of one kind, one per sliding window the model's layers use (0: none): each is planned
    for the step with its window, and a layer runs its window's."""

    def __init__(self, make: Callable[[], Any], windows: tuple[int, ...]) -> None:
        self.by_window = {window: make() for window in sorted({0, *windows})}

    def run(self, q: Tensor, kv: Tensor, *args: Any, **kwargs: Any) -> Tensor:  # GraphWrapper's: forward picks the window's
        raise NotImplementedError("run the wrapper of the layer's window (FlashInferAttention.forward)")


class FlashInferAttention:
    """flashinfer's paged prefill (mixed steps) and tensor-core decode (decode-only steps; it ran
    faster than the CUDA-core kernel even at two query heads per KV head). As a GraphAttention it
    also gives CUDA graphs wrappers with fixed buffers, ringllm's split-KV decode among them.
    Sliding windows, the scale and a soft cap on the scores are the plan's (Windows).

    A wrapper's plan stages its work partition in pinned memory and copies it on the stream. With
    a step in flight, the next plan could overwrite that staging area before the copy ran, so a plan
    first waits for the last copy out of the area it writes: flashinfer's wrapper's own, or the next
    buffer of ringllm's kernel's ring (PinnedRing)."""

    def __init__(self, pool: KVPool, num_heads: int, spec: AttentionSpec, deterministic: bool = False) -> None:
        """`deterministic`: every row, prefill or decode, eager or in a graph, through FA3's paged prefill,
        whose plan neither splits a row's KV nor sizes its tiles by the batch (flashinfer's FA2 does both):
        a row's output is then the same whatever shares its step."""
        import flashinfer  # optional: present on CUDA machines only

        if spec.sinks:  # in flashinfer 0.6 only its Blackwell (trtllm-gen) kernels take sinks
            raise ValueError("attention sinks (GPT-OSS) are not in flashinfer's Hopper kernels: serve with --attention-backend torch")
        if spec.latent and deterministic:  # its MLA plan splits a row's latents by how many rows share the step
            raise ValueError("deterministic inference of multi-head latent attention (DeepSeek) runs on --attention-backend torch")

        self.flashinfer, self.pool, self.num_heads, self.spec = flashinfer, pool, num_heads, spec
        self.backend = "auto"
        if deterministic:
            if not flashinfer.utils.is_sm90a_supported(pool.device) or pool.head_dim not in (64, 128, 256):
                raise ValueError("deterministic inference needs FA3: a Hopper GPU, CUDA 12.3 or later, head dim 64, 128 or 256")
            self.backend = "fa3"
        self.workspace = torch.zeros(256 << 20, dtype=torch.uint8, device=pool.device)
        if spec.latent:  # one MLA kernel for prefill and decode rows (FA3's on Hopper: twice FA2's decode speed)
            self.prefill = self.decode = self._windows(lambda: flashinfer.mla.BatchMLAPagedAttentionWrapper(self.workspace))
        else:
            self.prefill = self._windows(
                lambda: flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend=self.backend)
            )
            self.decode = (
                self.prefill
                if deterministic
                else self._windows(lambda: flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD", use_tensor_cores=True))
            )
        self.deterministic = deterministic
        # the wrappers the next forward runs: flashinfer's, or a graph's (Windows or ringllm's); each has its own plan
        self.active: Windows | TritonDecode = self.prefill
        try:
            from runtime.kernels.triton.host_copy import send
        except ImportError:  # no Triton: step inputs go by cudaMemcpyAsync
            send = _copy_each
        self._send = send
        self._sent: dict[int, torch.cuda.Event] = {}  # the last copy out of a staging area, by its address

    def _graph_buffers(self, batch_size: int, max_pages: int) -> tuple[Tensor, Tensor, Tensor]:
        """kv indptr, kv indices and last page lengths, fixed for a graph's lifetime."""
        device = self.pool.device
        return (
            torch.zeros(batch_size + 1, dtype=torch.int32, device=device),
            torch.zeros(max_pages, dtype=torch.int32, device=device),
            torch.zeros(batch_size, dtype=torch.int32, device=device),
        )

    def _windows(self, make: Callable[[], Any]) -> Windows:
        return Windows(make, self.spec.windows)

    def decode_graph_wrapper(self, batch_size: int, max_pages: int) -> GraphWrapper:
        """Decode wrappers with fixed buffers, for CUDA graphs of `batch_size` sequences."""
        if self.deterministic or self.spec.latent:
            return self.prefill_graph_wrapper(batch_size, max_pages)

        def make() -> Any:
            indptr, indices, last_page_len = self._graph_buffers(batch_size, max_pages)
            return self.flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=True,
                paged_kv_indptr_buffer=indptr,
                paged_kv_indices_buffer=indices,
                paged_kv_last_page_len_buffer=last_page_len,
            )

        return self._windows(make)

    def triton_decode_graph_wrapper(self, batch_size: int, max_pages: int, rotates: bool = True) -> TritonDecode | None:
        """ringllm's split-KV decode (runtime.kernels.triton.decode_attention) with fixed buffers, for CUDA graphs;
        None where Triton does not import, where it would not be the kernel of every row (deterministic), where the
        head dim is not a power of two (its tiles span a head: Phi-3-mini's 96), or where the model has windows,
        a soft cap or MLA (it has none of them). `rotates`: as GraphAttention's."""
        head_dim = self.pool.head_dim
        if self.deterministic or head_dim & (head_dim - 1) or self.spec.windows or self.spec.softcap or self.spec.latent:
            return None
        try:
            from runtime.kernels.triton.decode_attention import decode_attention
        except ImportError:
            return None
        return TritonDecode(batch_size, max_pages, self.pool.device, decode_attention, self.spec.scale, rotates)

    def prefill_graph_wrapper(self, batch_size: int, max_pages: int) -> GraphWrapper:
        """Prefill wrappers with fixed buffers, for CUDA graphs of exactly `batch_size` sequences. Their
        first plan fixes the most rows they take, and with them their launch grid. MLA's take decodes too
        (its last buffer holds the sequences' lengths)."""

        def make() -> Any:
            indptr, indices, last_page_len = self._graph_buffers(batch_size, max_pages)
            if self.spec.latent:
                return self.flashinfer.mla.BatchMLAPagedAttentionWrapper(
                    self.workspace, True, torch.zeros_like(indptr), indptr, indices, kv_len_arr=last_page_len
                )
            return self.flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                self.workspace,
                "NHD",
                use_cuda_graph=True,
                backend=self.backend,
                qo_indptr_buf=torch.zeros_like(indptr),
                paged_kv_indptr_buf=indptr,
                paged_kv_indices_buf=indices,
                paged_kv_last_page_len_buf=last_page_len,
            )

        return self._windows(make)

    def prepare(self, meta: AttentionMeta, wrapper: GraphWrapper | None = None, copies: Sequence[tuple[Tensor, Tensor]] = ()) -> None:
        """Plans `wrapper` (a graph's), else the step's own: decode for a decode-only step, else prefill.
        `copies` (pinned host -> device, the caller's step inputs) go in one kernel with the plan's own,
        and a prepare that rewrites their sources waits for them (wait_for_sent)."""
        active = wrapper or (self.decode if meta.decode_only else self.prefill)
        assert isinstance(active, Windows | TritonDecode)  # this backend's graph wrappers are its own
        self.active = active
        areas = []  # the staging areas this prepare sends from: each waits for the send recorded here
        if isinstance(self.active, TritonDecode):
            staged = self.active.staging.take()
            self.wait_for_sent(staged)
            copies = [*copies, self.active.plan(meta, staged)]
        else:
            areas.append(id(self.active))  # flashinfer's plan stages into each wrapper's own pinned buffer
            self._wait(areas[0])
            for window, inner in self.active.by_window.items():
                self._plan_flashinfer(inner, meta.window if window and meta.window is not None else meta, window)
        areas += [src.data_ptr() for src, _ in copies]
        if copies:
            self._send(copies)
        sent = torch.cuda.Event()
        sent.record()
        self._sent.update(dict.fromkeys(areas, sent))

    def wait_for_sent(self, staged: Tensor) -> None:
        self._wait(staged.data_ptr())

    def _wait(self, area: int) -> None:
        if (sent := self._sent.get(area)) is not None:
            sent.synchronize()

    def _plan_flashinfer(self, wrapper: Any, meta: AttentionMeta, window: int) -> None:
        pool, spec = self.pool, self.spec
        kv_indptr = torch.from_numpy(meta.kv_indptr)
        indices = torch.from_numpy(meta.kv_indices).to(pool.device, non_blocking=True)
        if isinstance(wrapper, self.flashinfer.mla.BatchMLAPagedAttentionWrapper):
            latent = spec.latent  # the roped key part follows it in the pool's row
            wrapper.plan(
                torch.from_numpy(meta.qo_indptr),
                kv_indptr,
                indices,
                torch.from_numpy(meta.kv_lens),
                self.num_heads,
                latent,
                2 * pool.head_dim - latent,
                pool.page_size,
                True,
                spec.scale,
                pool.compute_dtype,
                pool.dtype,
            )
            return
        last_page_len = torch.from_numpy(meta.last_page_lens(pool.page_size))  # MLA's plan takes whole lengths instead
        shape = (self.num_heads, pool.num_kv_heads, pool.head_dim, pool.page_size)
        # flashinfer's window_left: the keys before the query's own that it sees
        attention = {"sm_scale": spec.scale, "logits_soft_cap": spec.softcap, "window_left": window - 1 if window else -1}
        if isinstance(wrapper, self.flashinfer.BatchDecodeWithPagedKVCacheWrapper):
            wrapper.plan(
                kv_indptr,
                indices,
                last_page_len,
                *shape,
                q_data_type=pool.compute_dtype,
                kv_data_type=pool.dtype,
                seq_lens=torch.from_numpy(meta.kv_lens),
                **attention,
            )
        else:
            wrapper.plan(
                torch.from_numpy(meta.qo_indptr),
                kv_indptr,
                indices,
                last_page_len,
                *shape,
                causal=True,
                q_data_type=pool.compute_dtype,
                kv_data_type=pool.dtype,
                **attention,
            )

    @property
    def rotates(self) -> bool:
        """ringllm's split-KV decode norms and rotates q and writes the new K and V in its own pass (where it
        runs decodes only)."""
        return isinstance(self.active, TritonDecode) and self.active.rotates

    def forward(self, layer: int, q: Tensor, batch: ForwardBatch, rope: Rope | None = None, sinks: Tensor | None = None) -> Tensor:
        if latent := self.spec.latent:  # MLA: q [T, heads, latent + roped part] -> [T, heads, latent]
            assert isinstance(self.active, Windows)
            latents, out = self.pool.latents(layer), q.new_empty(*q.shape[:2], latent)
            args = q[..., :latent], q[..., latent:], latents[..., :latent], latents[..., latent:]
            return self.active.by_window[0].run(*args, out=out)
        # left uninitialised (every row is written): flashinfer would zero-fill an output of its own first
        out = torch.empty(len(q), self.num_heads, q.shape[-1], dtype=q.dtype, device=q.device)
        scales: dict[str, Any] = {}
        if self.pool.quantized:  # ringllm's decode takes the pair, flashinfer's runs each by name
            k_scale, v_scale = self.pool.scales[layer]
            scales = (
                {"kv_scales": (k_scale, v_scale)} if isinstance(self.active, TritonDecode) else {"k_scale": k_scale, "v_scale": v_scale}
            )
        if isinstance(self.active, TritonDecode):
            return self.active.run(q, self.pool.kv[layer], out=out, rope=rope, **scales)
        return self.active.by_window[self.spec.window(layer)].run(q, self.pool.kv[layer], out=out, **scales)


class TritonDecode:
    """A flashinfer decode wrapper's plan and run, for runtime.kernels.triton.decode_attention. A plan
    stages the step's page lists and lengths in a buffer of a pinned ring, and prepare sends them into the
    buffer its graph reads. `rotates`: the kernel does the rope pass's work too (see
    FlashInferAttention.triton_decode_graph_wrapper)."""

    def __init__(
        self, batch_size: int, max_pages: int, device: torch.device, attend: Callable[..., Tensor], scale: float, rotates: bool = True
    ) -> None:
        self.staging = PinnedRing(2 * batch_size + 1 + max_pages, torch.int32)
        self.buffer = torch.zeros_like(self.staging.buffers[0], device=device)
        b = batch_size
        self.kv_indptr, self.kv_lens, self.kv_indices = self.buffer[: b + 1], self.buffer[b + 1 : 2 * b + 1], self.buffer[2 * b + 1 :]
        self.attend, self.scale, self.rotates = attend, scale, rotates

    def plan(self, meta: AttentionMeta, staged: Tensor) -> tuple[Tensor, Tensor]:
        """Stages the plan in `staged` (the ring's, its last copy done); returns the copy (pinned, device) that sends it."""
        b, used = len(self.kv_lens), 2 * len(self.kv_lens) + 1 + len(meta.kv_indices)
        assert len(meta.kv_lens) == b, "a graph's plan has its batch size"
        host = staged.numpy()
        host[: b + 1], host[b + 1 : 2 * b + 1], host[2 * b + 1 : used] = meta.kv_indptr, meta.kv_lens, meta.kv_indices
        return staged[:used], self.buffer[:used]

    def run(self, q: Tensor, kv: Tensor, out: Tensor, rope: Rope | None = None, kv_scales: tuple[float, float] = (1.0, 1.0)) -> Tensor:
        return self.attend(q, kv, self.kv_indptr, self.kv_indices, self.kv_lens, self.scale, out, rope, kv_scales)
