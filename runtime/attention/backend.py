"""What every attention backend offers the model and the engine, and what CUDA graphs need more."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from torch import Tensor

from runtime.attention.pool import KVPool
from runtime.batch import AttentionMeta, ForwardBatch
from runtime.kernels.rope import Rope


class AttentionBackend(Protocol):
    pool: KVPool

    @property
    def rotates(self) -> bool:
        """Whether this step's forward takes the raw qkv and a Rope, and writes the new K and V itself."""
        ...

    def prepare(self, meta: AttentionMeta) -> None:
        """Per-step planning shared by every layer."""
        ...

    def forward(self, layer: int, q: Tensor, batch: ForwardBatch, rope: Rope | None = None) -> Tensor:
        """q: [T, heads, dim], the step's new K and V already in the pool; or, with `rope` (where
        `rotates`), the raw qkv [T, heads + 2 kv heads, dim]. Returns [T, heads, dim]."""
        ...


class GraphWrapper(Protocol):
    """One attention kernel whose plan lives in device buffers fixed for a CUDA graph's lifetime. The
    graph code only hands it back to `GraphAttention.prepare`; the backend's forward runs it."""

    def run(self, q: Tensor, kv: Tensor, *args: Any, **kwargs: Any) -> Tensor: ...


class GraphAttention(AttentionBackend, Protocol):
    """A backend whose steps runtime.engine.cuda_graph captures and replays: a graph keeps one wrapper,
    and each replay first plans it on the host for the step's sequences."""

    def decode_graph_wrapper(self, batch_size: int, max_pages: int) -> GraphWrapper:
        """The backend's decode kernel for graphs of `batch_size` sequences over at most `max_pages` pages."""
        ...

    def triton_decode_graph_wrapper(self, batch_size: int, max_pages: int, rotates: bool = True) -> GraphWrapper | None:
        """ringllm's split-KV decode kernel for such graphs, timed against the first; None where it cannot run.
        `rotates`: it does the rope pass's work (decodes); else it attends after that pass wrote every row's
        K and V (a short chunk's rows, each attending to the ones before it)."""
        ...

    def prefill_graph_wrapper(self, batch_size: int, max_pages: int) -> GraphWrapper:
        """A prefill kernel for graphs of exactly `batch_size` sequences."""
        ...

    def prepare(self, meta: AttentionMeta, wrapper: GraphWrapper | None = None, copies: Sequence[tuple[Tensor, Tensor]] = ()) -> None:
        """Plans `wrapper` (else the step's own kernel) for `meta`. `copies` (pinned host -> device, the
        caller's step inputs) are sent with the plan's own, in one launch where the backend can."""
        ...

    def wait_for_sent(self) -> None:
        """Blocks until the last prepare's copies have run, so their pinned sources may be rewritten."""
        ...
