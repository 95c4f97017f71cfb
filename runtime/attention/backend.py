"""What every attention backend offers the model and the engine, and what CUDA graphs need more."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from runtime.attention.pool import KVPool
from runtime.batch import AttentionMeta, ForwardBatch
from runtime.config import ModelConfig
from runtime.kernels.rope import Rope


@dataclass(frozen=True)
class AttentionSpec:
    """What a model asks of attention beyond causal softmax(q·kᵀ)·v: the softmax's scale, a cap on the scores
    (Gemma 2: s becomes softcap · tanh(s / softcap)), each layer's sliding window (a query sees its last
    `window` positions, itself included; 0: all of them), sinks (GPT-OSS: each head's learned logit joins
    the softmax's sum and takes its share of the weight, the layer's `sinks` handed to forward), and a latent
    (MLA: the pool's one head holds each token's latent, its K half and V half side by side; the keys are the
    whole of it, the values its first `latent` values)."""

    scale: float
    softcap: float | None = None
    windows: tuple[int, ...] = ()
    sinks: bool = False
    latent: int = 0

    @classmethod
    def of(cls, cfg: ModelConfig) -> AttentionSpec:
        latent = cfg.mla.kv_lora_rank if cfg.mla is not None else 0
        return cls(cfg.attention_scale or cfg.head_dim**-0.5, cfg.attention_softcap, cfg.layer_windows, cfg.attention_sinks, latent)

    def window(self, layer: int) -> int:
        return self.windows[layer] if self.windows else 0


class AttentionBackend(Protocol):
    pool: KVPool

    @property
    def rotates(self) -> bool:
        """Whether this step's forward takes the raw qkv and a Rope, and writes the new K and V itself."""
        ...

    def prepare(self, meta: AttentionMeta) -> None:
        """Per-step planning shared by every layer."""
        ...

    def forward(self, layer: int, q: Tensor, batch: ForwardBatch, rope: Rope | None = None, sinks: Tensor | None = None) -> Tensor:
        """q: [T, heads, dim], the step's new K and V already in the pool; or, with `rope` (where
        `rotates`), the raw qkv [T, heads + 2 kv heads, dim]. `sinks`: [heads], the layer's (AttentionSpec).
        Returns [T, heads, dim]."""
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

    def wait_for_sent(self, staged: Tensor) -> None:
        """Blocks until the last copy out of `staged` (pinned, a prepare's) has run, so that it may be rewritten."""
        ...


STAGING_DEPTH = 4  # pinned buffers a PinnedRing turns through


class PinnedRing:
    """Pinned host buffers taken in turn, for a step's inputs on their way to the device: one is filled while
    the copies out of the ones before may still wait in the stream behind earlier steps (a draft model queues
    several steps behind a verify), and only a buffer whose own copy is pending holds the host up."""

    def __init__(self, size: int, dtype: torch.dtype) -> None:
        self.buffers = [torch.zeros(size, dtype=dtype, pin_memory=True) for _ in range(STAGING_DEPTH)]
        self.turn = 0

    def take(self) -> Tensor:
        """The next buffer: wait for its last copy (GraphAttention.wait_for_sent) before writing it."""
        self.turn = (self.turn + 1) % len(self.buffers)
        return self.buffers[self.turn]
