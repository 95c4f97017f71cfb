"""CUDA graphs of the decode forward (layers and lm_head) for batch sizes up to a maximum.

A decode step pads to a captured size: the next one up, or one at most twice as large whose graph replayed
faster at start-up (cuBLAS picks poor kernels for some one-row GEMMs: Qwen3-0.6B's whole decode
step ran faster padded to 8 rows than at 1 on the H200). Padding rows attend to, and write into, a scratch
page past the scheduler's pool, so they never touch a live sequence. Inputs live in static
buffers: each replay copies the step's rows in with one host-to-device copy and gathers the
token ids from the engine's last sampled tokens on the device.
"""

from __future__ import annotations

import bisect

import numpy as np
import torch
from torch import nn

from runtime.attention import AttentionMeta, ForwardBatch, kv_rows


def replay_ms(graph: torch.cuda.CUDAGraph, repeats: int = 10) -> float:
    """Mean milliseconds of one replay, after one untimed replay."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


def padding_choice(times: dict[int, float], margin: float = 0.95) -> dict[int, int]:
    """Captured size -> the size its steps replay: itself, unless a graph at most twice as large
    (or up to 8) replayed faster by more than the margin. The cap keeps a GPU that was busy during
    start-up from choosing for nothing: three servers starting together on one H200 once padded
    every size to 256 and lost a fifth of their decode speed."""
    return {bs: min((big for big in times if bs < big <= max(2 * bs, 8) and times[big] < margin * times[bs]),
                    key=times.__getitem__, default=bs) for bs in times}


def capture_sizes(max_batch_size: int) -> list[int]:
    return sorted({s for s in (1, 2, 4, 8, *range(16, max_batch_size + 1, 16), max_batch_size) if s <= max_batch_size})


class DecodeGraphs:
    @torch.inference_mode()
    def __init__(self, model: nn.Module, attention, max_batch_size: int, max_pages_per_seq: int, scratch_page: int,
                 device: torch.device) -> None:
        self.sizes = capture_sizes(max_batch_size)
        self.attention, self.scratch_page = attention, scratch_page
        self.input_ids = torch.zeros(max_batch_size, dtype=torch.int64, device=device)
        self.scratch_rows = kv_rows(np.array([scratch_page]), np.array([0]), attention.pool.page_size)[0]  # where padding rows write
        self.rows = torch.zeros(3, max_batch_size, dtype=torch.int64, device=device)  # positions, K rows, V rows
        self.rows[1:].copy_(torch.from_numpy(self.scratch_rows)[:, None])
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        pool = None
        for bs in reversed(self.sizes):  # largest first: smaller graphs reuse its memory pool
            attention.graph_wrapper(bs, bs * max_pages_per_seq)
            batch = ForwardBatch(self.input_ids[:bs], self.rows[0, :bs], self.rows[1:, :bs].T,
                                 self._padded(AttentionMeta(*(np.zeros(n, np.int32) for n in (1, 1, 0, 0))), bs))
            attention.prepare(batch.meta, bs)
            model.logits(model(batch, attention))  # warm-up: lazy initialisation stays out of the graph
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[bs] = model.logits(model(batch, attention))
            pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        self.replay_size = self._fastest_padding()

    def _fastest_padding(self) -> dict[int, int]:
        times = dict.fromkeys(self.sizes, float("inf"))
        for _ in range(3):  # best of three, alternated: a GPU busy for a moment favours no size
            for bs in self.sizes:
                times[bs] = min(times[bs], replay_ms(self.graphs[bs]))
        return padding_choice(times)

    def fits(self, batch_size: int) -> bool:
        return 0 < batch_size <= self.sizes[-1]

    def _padded(self, meta: AttentionMeta, bs: int) -> AttentionMeta:
        pad = bs - len(meta.kv_lens)
        last = meta.kv_indptr[-1]
        return AttentionMeta(
            np.arange(bs + 1, dtype=np.int32),
            np.concatenate([meta.kv_indptr, last + np.arange(1, pad + 1, dtype=np.int32)]),
            np.concatenate([meta.kv_indices, np.full(pad, self.scratch_page, np.int32)]),
            np.concatenate([meta.kv_lens, np.ones(pad, np.int32)]),
        )

    def replay(self, meta: AttentionMeta, positions: np.ndarray, rows_kv: np.ndarray, decode_slots: torch.Tensor,
               last_tokens: torch.Tensor) -> torch.Tensor:
        """Logits [n, vocab] of a decode-only step of n sequences."""
        n = len(positions)
        bs = self.replay_size[self.sizes[bisect.bisect_left(self.sizes, n)]]
        rows = np.zeros((3, bs), dtype=np.int64)
        rows[1:, n:] = self.scratch_rows[:, None]
        rows[0, :n], rows[1:, :n] = positions, rows_kv.T
        self.rows[:, :bs].copy_(torch.from_numpy(rows), non_blocking=True)
        torch.index_select(last_tokens, 0, decode_slots, out=self.input_ids[:n])
        self.attention.prepare(self._padded(meta, bs), bs)
        self.graphs[bs].replay()
        return self.logits[bs][:n]
