"""The Gumbel-max draw (gumbel_noise's hash, in 32-bit lanes) as one Triton launch: a row's vocabulary
is cut into chunks, one program each, so one row fills the GPU; the row's last program picks the best."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

BLOCK = 2048
FEW_ROWS = 16  # up to this many rows a chunk is one block, else four
MAX_CHUNKS: tl.constexpr = tl.constexpr(256)


@triton.jit
def _mix32(x):
    x = (x ^ (x >> 16)) * 0x7FEB352D
    x = (x ^ (x >> 15)) * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit(do_not_specialize_on_alignment=["last_tokens_ptr", "slots_ptr", "host_ptr"])  # no new variant mid-serving
def _gumbel_argmax_kernel(
    scores_ptr,
    stride,
    temperatures_ptr,
    keys_ptr,
    best_ptr,
    best_id_ptr,
    arrivals_ptr,
    tokens_ptr,
    last_tokens_ptr,
    slots_ptr,
    host_ptr,
    vocab,
    chunks,
    NOISE: tl.constexpr,
    FEEDBACK: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCKS_PER_CHUNK: tl.constexpr,
):
    row, chunk = tl.program_id(0), tl.program_id(1)
    if NOISE:
        temperature = tl.load(temperatures_ptr + row)
        hot = temperature > 0
        inv_t = 1.0 / tl.where(hot, temperature, 1.0)
        key0 = tl.load(keys_ptr + 2 * row).to(tl.uint32)
        key1 = tl.load(keys_ptr + 2 * row + 1).to(tl.uint32)
    best = tl.full((), float("-inf"), tl.float32)
    best_id = tl.full((), 0, tl.int32)
    for block in range(BLOCKS_PER_CHUNK):
        ids = (chunk * BLOCKS_PER_CHUNK + block) * BLOCK + tl.arange(0, BLOCK)
        inside = ids < vocab
        x = tl.load(scores_ptr + row.to(tl.int64) * stride + ids, mask=inside, other=float("-inf")).to(tl.float32)
        if NOISE:
            h = _mix32(_mix32(ids.to(tl.uint32) ^ key0) ^ key1)
            u = ((h >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 23 bits: u < 1 exactly in fp32
            x = tl.where(inside, tl.where(hot, x * inv_t - tl.log(-tl.log(u)), x), float("-inf"))
        block_best = tl.max(x, axis=0)
        block_id = tl.argmax(x, axis=0) + (chunk * BLOCKS_PER_CHUNK + block) * BLOCK
        better = block_best > best
        best_id = tl.where(better, block_id, best_id)
        best = tl.where(better, block_best, best)
    tl.store(best_ptr + row * chunks + chunk, best)
    tl.store(best_id_ptr + row * chunks + chunk, best_id)
    tl.debug_barrier()  # the chunk's best before its arrival, which one thread counts (with release)
    if tl.atomic_add(arrivals_ptr + row, 1, sem="acq_rel") == chunks - 1:  # the row's last: its best chunk, first wins ties
        tl.debug_barrier()
        each = tl.arange(0, MAX_CHUNKS)
        values = tl.load(best_ptr + row * chunks + each, mask=each < chunks, other=float("-inf"), cache_modifier=".cg")
        winner = tl.argmax(values, axis=0)
        token = tl.load(best_id_ptr + row * chunks + winner, cache_modifier=".cg").to(tl.int64)
        tl.store(tokens_ptr + row, token)
        if FEEDBACK:
            tl.store(last_tokens_ptr + tl.load(slots_ptr + row), token)
            tl.store(host_ptr + row, token)
        tl.store(arrivals_ptr + row, 0)


@functools.cache
def _arrivals(device: torch.device, rows: int) -> torch.Tensor:
    return torch.zeros(rows, dtype=torch.int32, device=device)


def gumbel_argmax(
    scores: torch.Tensor,
    temperatures: torch.Tensor | None,
    keys: torch.Tensor | None,
    feedback: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """scores [B, vocab] -> [B] int64, greedy without temperatures; feedback as in sampling.Feedback."""
    rows, vocab = scores.shape
    blocks_per_chunk = 1 if rows <= FEW_ROWS else 4
    while triton.cdiv(vocab, BLOCK * blocks_per_chunk) > MAX_CHUNKS:
        blocks_per_chunk *= 2
    chunks = triton.cdiv(vocab, BLOCK * blocks_per_chunk)
    best = torch.empty(rows, chunks, dtype=torch.float32, device=scores.device)
    best_id = torch.empty(rows, chunks, dtype=torch.int32, device=scores.device)
    tokens = torch.empty(rows, dtype=torch.int64, device=scores.device)
    arrivals = _arrivals(scores.device, triton.next_power_of_2(rows))
    noise = temperatures is not None
    fed = feedback if feedback is not None else (tokens, tokens, tokens)
    _gumbel_argmax_kernel[(rows, chunks)](
        scores,
        scores.stride(0),
        temperatures if noise else scores,
        keys if noise else scores,
        best,
        best_id,
        arrivals,
        tokens,
        *fed,
        vocab,
        chunks,
        NOISE=noise,
        FEEDBACK=feedback is not None,
        BLOCK=BLOCK,
        BLOCKS_PER_CHUNK=blocks_per_chunk,
    )
    return tokens
