"""CUDA graphs of the forward: decode steps (layers and lm_head) up to a batch size, and prefill
steps (layers only) up to a token count.

A step pads to a captured shape. Padding rows form sequences of their own that attend to, and write
into, a scratch page past the scheduler's pool (and the window pool's), so they never touch a live
sequence. Inputs live in static buffers that each replay fills.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import structlog
import torch
import torch.distributed as dist
from torch import nn

from runtime.attention.backend import GraphAttention, GraphWrapper, PinnedRing
from runtime.attention.pool import KVPool
from runtime.batch import AttentionMeta, ForwardBatch, kv_rows

if TYPE_CHECKING:  # a graph memory pool's handle (CUDAGraph.pool()): graphs captured into one share its memory
    from torch.cuda import _POOL_HANDLE as Pool

    from runtime.models.decoder import DecoderForCausalLM

log = structlog.get_logger()

TRITON_DECODE_MAX_BS = 16  # decode graphs up to this size are also captured with ringllm's split-KV attention
TIMING_CONTEXT = 1024  # tokens of context per sequence when the two are timed against each other

K = TypeVar("K")
T = TypeVar("T")


# Capture and timing, shared with runtime.engine.gemm_tuner.


def capture(run: Callable[[], T], pool: Pool | None = None) -> tuple[torch.cuda.CUDAGraph, T]:
    """A graph of `run` and its static output. One eager run comes first, so that lazy initialisation
    (and Triton's compiles) stays out of the graph."""
    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = run()
    return graph, out


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


def best_times(graphs: dict[K, torch.cuda.CUDAGraph], rounds: int = 3) -> dict[K, float]:
    """Each graph's best mean replay time over `rounds` alternated rounds: a GPU busy for a moment, or
    a clock still ramping up, favours none of them."""
    times = dict.fromkeys(graphs, float("inf"))
    for _ in range(rounds):
        for key, graph in graphs.items():
            times[key] = min(times[key], replay_ms(graph))
    return _agreed(times)


def _agreed(times: dict[K, float]) -> dict[K, float]:
    """Under tensor parallelism, each time averaged over the ranks, so that all of them choose the same
    kernel or graph: a rank whose own noisy timing chose a slower one would hold up every all-reduce."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return times
    summed = torch.tensor(list(times.values()), dtype=torch.float64, device=torch.cuda.current_device())
    dist.all_reduce(summed)
    return dict(zip(times, (summed / dist.get_world_size()).tolist(), strict=True))


def fastest(graphs: dict[K, torch.cuda.CUDAGraph]) -> K:
    """The key of the graph with the best replay time (best_times)."""
    times = best_times(graphs)
    return min(times, key=times.__getitem__)


def time_captured(runs: dict[K, Callable[[], object]]) -> dict[K, float]:
    """Each run captured alone (capture), then all timed against each other (best_times)."""
    return best_times({key: capture(run)[0] for key, run in runs.items()})


def padding_choice(times: dict[int, float], margin: float = 0.95) -> dict[int, int]:
    """Captured size -> the size its steps replay: itself, unless a graph at most twice as large
    (or up to 8) replayed faster by more than the margin. The cap bounds what a GPU busy with
    something else during start-up (another server starting) can make every size pay."""
    return {
        bs: min((big for big in times if bs < big <= max(2 * bs, 8) and times[big] < margin * times[bs]), key=times.__getitem__, default=bs)
        for bs in times
    }


def pad_meta(meta: AttentionMeta, tokens: int, seqs: int, scratch_page: int, page_size: int) -> AttentionMeta:
    """`meta` grown to exactly `tokens` rows in `seqs` sequences (at least one more): each added
    sequence attends to itself on the scratch page, repeated; the first takes the rows the others
    (one each) leave."""
    q_lens = np.ones(seqs - len(meta.kv_lens), dtype=np.int32)
    q_lens[0] = tokens - meta.qo_indptr[-1] - (len(q_lens) - 1)
    pages = -(-q_lens // page_size)
    grown = lambda head, tail: np.concatenate([head, head[-1] + np.cumsum(tail)]).astype(np.int32)  # noqa: E731
    return AttentionMeta(
        grown(meta.qo_indptr, q_lens),
        grown(meta.kv_indptr, pages),
        np.concatenate([meta.kv_indices, np.full(pages.sum(), scratch_page, np.int32)]),
        np.concatenate([meta.kv_lens, q_lens]).astype(np.int32),
    )


@dataclass(frozen=True)
class Scratch:
    """Where padding rows attend and write: the page past the scheduler's pool, and with sliding windows the page
    past the window pool."""

    page: int
    window_page: int | None
    page_size: int

    @property
    def rows(self) -> np.ndarray:
        """A padding row's K and V rows, [2] (or [4]: the window pool's after), as ForwardBatch.kv_rows lays them."""
        pages = [self.page] if self.window_page is None else [self.page, self.window_page]
        return np.concatenate([kv_rows(np.array([page]), np.array([0]), self.page_size)[0] for page in pages])

    def pad(self, meta: AttentionMeta, tokens: int, seqs: int) -> AttentionMeta:
        """pad_meta on the scratch pages, its window plan too."""
        padded = pad_meta(meta, tokens, seqs, self.page, self.page_size)
        if self.window_page is not None:
            padded.window = pad_meta(meta.window or no_sequences(), tokens, seqs, self.window_page, self.page_size)
        return padded


def context_meta(seqs: int, context: int, pool: KVPool) -> AttentionMeta:
    """`seqs` sequences of `context` tokens on the pool's first pages (and the window pool's), for timing graphs:
    they read those pages (as they are) and write nothing there."""
    pages = -(-context // pool.page_size)

    def on(pool_pages: int) -> AttentionMeta:
        indices = np.arange(seqs * pages) % (pool_pages - 1)
        return AttentionMeta(
            np.arange(seqs + 1, dtype=np.int32),
            (np.arange(seqs + 1) * pages).astype(np.int32),
            indices.astype(np.int32),
            np.full(seqs, context, np.int32),
        )

    meta = on(max(pool.layer_pages))
    if len(set(pool.layer_pages)) > 1:
        meta.window = on(min(pool.layer_pages))
    return meta


def no_sequences() -> AttentionMeta:
    """What graphs are captured on, padded to their shape."""
    empty = np.zeros(0, np.int32)
    return AttentionMeta(np.zeros(1, np.int32), np.zeros(1, np.int32), empty, empty)


def capture_sizes(max_batch_size: int) -> list[int]:
    return sorted({s for s in (1, 2, 4, 8, *range(16, max_batch_size + 1, 16), max_batch_size) if s <= max_batch_size})


class DecodeGraphs:
    """A decode step pads to the next captured batch size up, or to one at most twice as large whose
    graph replayed faster at start-up (cuBLAS picks poor kernels for some few-row GEMMs, so a larger
    batch can be the faster one). Each replay sends the step's positions, KV rows, token sources and
    tokens from pinned memory in the attention plan's copy kernel (runtime.kernels.triton.host_copy),
    and the graph gathers its token ids itself: a copy or small kernel between graphs leaves the chip
    idle. A row's source is its slot's last sampled token (`token_sources[slot]`), or for a row of a
    short chunk (a speculative verify, a draft model's catch-up) its own token, which the graph first
    puts at `token_sources[slots + row]`. Such a chunk's rows attend as sequences of one row each,
    each to the positions up to its own, after every row's K and V is written.

    Sizes up to TRITON_DECODE_MAX_BS are captured twice, attention by the backend's decode kernel and
    by ringllm's split-KV kernel (runtime.kernels.triton.decode_attention, which fills the chip better
    at few sequences), and keep the graph that replayed faster over sequences of TIMING_CONTEXT tokens. The split-KV
    kernel writes each row's K and V in its own pass, where a chunk's later rows could not see them: where it won,
    a step with chunk rows replays a third graph, the same kernel after the rope pass has written every row's K
    and V (no flashinfer plan on the host: a speculative step's host time is on its critical path)."""

    @torch.inference_mode()
    def __init__(
        self,
        model: DecoderForCausalLM,
        attention: GraphAttention,
        max_batch_size: int,
        max_pages_per_seq: int,
        scratch: Scratch,
        token_sources: torch.Tensor,
        slots: int,
    ) -> None:
        """`token_sources`: [slots + max_batch_size], the engine's last sampled tokens of its `slots` slots first."""
        self.sizes = capture_sizes(max_batch_size)
        self.attention, self.scratch = attention, scratch
        self.page_size = attention.pool.page_size
        device = token_sources.device
        self.input_ids = torch.zeros(max_batch_size, dtype=torch.int64, device=device)
        # positions, K and V rows (2, or 4 with the window pool's), token sources, tokens (a chunk row's)
        k = self.kv_width = len(scratch.rows)
        self.staging = PinnedRing((3 + k) * max_batch_size, torch.int64)
        self.rows = torch.zeros(3 + k, max_batch_size, dtype=torch.int64, device=device)
        self.rows[1 : 1 + k] = torch.from_numpy(scratch.rows).to(device)[:, None]

        def forward(bs: int, batch: ForwardBatch) -> torch.Tensor:
            token_sources[slots : slots + bs].copy_(self.rows[2 + k, :bs])
            torch.index_select(token_sources, 0, self.rows[1 + k, :bs], out=self.input_ids[:bs])
            return model.logits(model(batch, attention))

        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.wrappers: dict[int, GraphWrapper] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.in_order: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, GraphWrapper]] = {}  # chunk steps', where the kept graph rotates
        self.attention_kernels: dict[int, str] = {}  # size -> "flashinfer" or "triton", where both were timed
        self.pool: Pool | None = None  # the graphs' shared memory pool
        for bs in reversed(self.sizes):  # largest first: smaller graphs reuse its memory pool
            pages = bs * max_pages_per_seq
            wrappers = {"flashinfer": attention.decode_graph_wrapper(bs, pages)}
            if bs <= TRITON_DECODE_MAX_BS and (triton := attention.triton_decode_graph_wrapper(bs, pages)) is not None:
                wrappers["triton"] = triton
            batch = ForwardBatch(self.input_ids[:bs], self.rows[0, :bs], self.rows[1 : 1 + k, :bs].T, scratch.pad(no_sequences(), bs, bs))
            captured = {}
            for name, wrapper in wrappers.items():
                attention.prepare(batch.meta, wrapper)
                graph, logits = capture(lambda bs=bs, batch=batch: forward(bs, batch), self.pool)
                self.pool = graph.pool()
                captured[name] = (graph, logits, wrapper)
            name = "flashinfer"
            if len(captured) > 1:
                context = context_meta(bs, min(TIMING_CONTEXT, max_pages_per_seq * self.page_size), attention.pool)
                for wrapper in wrappers.values():
                    attention.prepare(context, wrapper)
                name = self.attention_kernels[bs] = fastest({name: graph for name, (graph, _, _) in captured.items()})
                attention.prepare(batch.meta, wrappers[name])  # back to its capture plan, as the padding choice times every size
            self.graphs[bs], self.logits[bs], self.wrappers[bs] = captured[name]
            if name != "flashinfer":
                in_order = attention.triton_decode_graph_wrapper(bs, pages, rotates=False)
                assert in_order is not None  # the rotating one was built
                attention.prepare(batch.meta, in_order)
                graph, logits = capture(lambda bs=bs, batch=batch: forward(bs, batch), self.pool)
                self.in_order[bs] = (graph, logits, in_order)
        torch.cuda.synchronize()
        # each size's replay at its capture plan (one-page contexts): a step's part that is not its KV stream
        self.replay_ms = best_times(self.graphs)
        self.replay_size = padding_choice(self.replay_ms)

    def fits(self, batch_size: int) -> bool:
        return 0 < batch_size <= self.sizes[-1]

    def replay(
        self,
        meta: AttentionMeta,
        positions: np.ndarray,
        rows_kv: np.ndarray,
        sources: np.ndarray,
        tokens: np.ndarray | None = None,
        drafted: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [n, vocab] of a step of n rows, and their token sources on the device. `tokens`: the rows'
        own (a chunk's), where `sources` points past the slots; `drafted`: (rows, tokens) on the device that
        replace those rows' tokens (a draft model's, not read back)."""
        n = len(positions)
        bs = self.replay_size[self.sizes[bisect.bisect_left(self.sizes, n)]]
        k = self.kv_width
        pinned = self.staging.take().view(3 + k, -1)
        self.attention.wait_for_sent(pinned)  # its last copy may wait behind steps still in the stream
        staged = pinned.numpy()
        staged[:, n:bs] = 0
        staged[1 : 1 + k, n:bs] = self.scratch.rows[:, None]  # padding rows write to the scratch page
        staged[0, :n], staged[1 : 1 + k, :n], staged[1 + k, :n] = positions, rows_kv.T, sources
        staged[2 + k, :n] = 0 if tokens is None else tokens
        if bs > n:
            meta = self.scratch.pad(meta, bs, bs)
        graph, logits, wrapper = self.graphs[bs], self.logits[bs], self.wrappers[bs]
        if tokens is not None and bs in self.in_order:
            graph, logits, wrapper = self.in_order[bs]
        self.attention.prepare(meta, wrapper, copies=[(pinned, self.rows)])  # with the plan's, one kernel
        if drafted is not None:
            self.rows[2 + k].index_put_(drafted[:1], drafted[1])
        graph.replay()
        return logits[:n], self.rows[1 + k, :n]


PREFILL_GRAPH_TOKENS = (128, 256, 512, 1024, 1536, 2048, 3072)
PREFILL_GRAPH_SEQS = (2, 4, 8)  # the padding sequence included


class PrefillGraphs:
    """An eager prefill is launch-bound below a few thousand tokens: its host launches take longer
    than its kernels. A step with prefill chunks pads to the smallest captured shape (tokens,
    sequences) with room for its rows and one padding sequence more, and replays it; the engine then
    takes the logits of the rows it samples. flashinfer's graph-mode prefill keeps one launch grid for
    any rows up to the captured count, splitting the KV of long sequences across blocks as needed."""

    @torch.inference_mode()
    def __init__(
        self,
        model: nn.Module,
        attention: GraphAttention,
        max_tokens: int,
        max_pages_per_seq: int,
        scratch: Scratch,
        device: torch.device,
        pool: Pool | None = None,
    ) -> None:
        shapes = [(t, s) for t in PREFILL_GRAPH_TOKENS if t <= max_tokens for s in PREFILL_GRAPH_SEQS]
        self.attention, self.scratch = attention, scratch
        self.page_size = attention.pool.page_size
        most = max((t for t, _ in shapes), default=0)
        self.input_ids = torch.zeros(most, dtype=torch.int64, device=device)
        self.positions = torch.zeros(most, dtype=torch.int64, device=device)
        self.scratch_rows = torch.from_numpy(scratch.rows).to(device)
        self.rows = self.scratch_rows.repeat(most, 1)  # [T, 2] (or 4), the layout of eager steps (one Triton variant)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.wrappers: dict[tuple[int, int], GraphWrapper] = {}
        self.hidden: dict[tuple[int, int], torch.Tensor] = {}
        for tokens, seqs in sorted(shapes, reverse=True):  # largest first: the rest reuse its memory
            wrapper = attention.prefill_graph_wrapper(seqs, seqs * max_pages_per_seq + tokens // self.page_size + 1)
            batch = ForwardBatch(
                self.input_ids[:tokens], self.positions[:tokens], self.rows[:tokens], scratch.pad(no_sequences(), tokens, seqs)
            )
            try:
                attention.prepare(batch.meta, wrapper)
            except Exception as error:  # flashinfer's plan refuses, e.g. split-KV partials beyond its workspace
                log.warning("prefill_graph_skipped", tokens=tokens, seqs=seqs, error=str(error)[:200])
                continue
            self.graphs[tokens, seqs], self.hidden[tokens, seqs] = capture(lambda batch=batch: model(batch, attention), pool)
            pool = self.graphs[tokens, seqs].pool()
            self.wrappers[tokens, seqs] = wrapper
        torch.cuda.synchronize()
        self.shapes = sorted(self.graphs)

    def fit(self, tokens: int, seqs: int) -> tuple[int, int] | None:
        """The smallest captured shape with room for the step and one padding sequence, if any."""
        return next(((t, s) for t, s in self.shapes if seqs < s and tokens + s - seqs <= t), None)

    def replay(self, shape: tuple[int, int], batch: ForwardBatch) -> torch.Tensor:
        """Final-norm hidden states [T, hidden] of the step's rows."""
        tokens, seqs = shape
        n = len(batch.input_ids)
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.rows[:n].copy_(batch.kv_rows)
        self.rows[n:tokens].copy_(self.scratch_rows.expand(tokens - n, -1))  # a larger step's rows may linger there
        self.attention.prepare(self.scratch.pad(batch.meta, tokens, seqs), self.wrappers[shape])
        self.graphs[shape].replay()
        return self.hidden[shape][:n]
