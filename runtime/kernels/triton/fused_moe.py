"""A mixture-of-experts layer's expert GEMMs on CUDA, in the design SGLang and vLLM share: the (token,
expert) pairs are sorted by expert and padded to whole blocks of BLOCK_M rows (sgl-kernel's
moe_align_block_size); one Triton program multiplies one block's rows, gathered from the input, by a
BLOCK_N-column tile of that block's expert's weight, scales them by the pairs' routing weights where
asked, and scatters them to the pairs' rows of the output. Blocks past the padded total return at
once, so the grid is fixed and CUDA graphs replay it at any batch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import orjson
import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class Tiles:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    kernel: str = "gemm"  # or "gemv": expert_gemv's unsorted path for a few tokens (block_m unused)


TUNED = Path(__file__).with_name("moe_tiles")  # benchmarks/moe_tune.py writes one table per shape and device


def default_tiles(pairs: int) -> Tiles:
    """Untuned tiles by the number of (token, expert) pairs: narrow blocks for decode."""
    if pairs <= 64:
        return Tiles(16, 64, 128, num_warps=4, num_stages=4)
    if pairs <= 1024:
        return Tiles(32, 64, 64, num_warps=4, num_stages=4)
    return Tiles(64, 128, 64, num_warps=8, num_stages=3)


def table_name(experts: int, intermediate: int, top_k: int, device: str) -> str:
    return f"E={experts},I={intermediate},K={top_k},device={device.replace(' ', '_')}.json"


@cache
def tuned_table(name: str) -> dict[int, Tiles]:
    """{tokens: tiles} from a tuned table, empty where none was tuned for this shape and device."""
    path = TUNED / name
    if not path.exists():
        return {}
    return {int(tokens): Tiles(**tiles) for tokens, tiles in orjson.loads(path.read_bytes()).items()}


def tiles_for(tokens: int, experts: int, intermediate: int, top_k: int, device: torch.device) -> Tiles:
    """The tuned tiles of the smallest tuned token count at or above `tokens` (the largest past them),
    else default_tiles."""
    table = tuned_table(table_name(experts, intermediate, top_k, torch.cuda.get_device_name(device)))
    if not table:
        return default_tiles(tokens * top_k)
    above = [count for count in table if count >= tokens]
    return table[min(above) if above else max(table)]


@triton.jit
def _expert_gemm_kernel(
    a_ptr,
    w_ptr,
    c_ptr,
    weights_ptr,
    load_ptr,
    sorted_pairs_ptr,
    block_experts_ptr,
    padded_ptr,
    N,
    K,
    pairs,
    stride_am,
    stride_we,
    stride_wn,
    stride_cm,
    TOP_K: tl.constexpr,
    ROWS_ARE_PAIRS: tl.constexpr,
    MUL_WEIGHTS: tl.constexpr,
    COUNT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    block, tile = tl.program_id(1), tl.program_id(0)
    if block * BLOCK_M >= tl.load(padded_ptr):
        return
    pair = tl.load(sorted_pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    live = pair < pairs
    row = pair if ROWS_ARE_PAIRS else pair // TOP_K
    expert = tl.load(block_experts_ptr + block).to(tl.int64)
    if expert < 0:  # a block of dropped pairs (id -1): none are made here
        return
    if COUNT and tile == 0:  # each block's first program counts its live pairs toward its expert's load
        tl.atomic_add(load_ptr + expert, tl.sum(live.to(tl.int32)))
    n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    a = a_ptr + row.to(tl.int64)[:, None] * stride_am + k[None, :]
    w = w_ptr + expert * stride_we + n.to(tl.int64)[None, :] * stride_wn + k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        in_k = k < K - start
        a_tile = tl.load(a, mask=live[:, None] & in_k[None, :], other=0.0)
        w_tile = tl.load(w, mask=in_k[:, None] & (n[None, :] < N), other=0.0)
        acc = tl.dot(a_tile, w_tile, acc)
        a += BLOCK_K
        w += BLOCK_K
    if MUL_WEIGHTS:
        acc *= tl.load(weights_ptr + pair, mask=live, other=0.0).to(tl.float32)[:, None]
    c = c_ptr + pair.to(tl.int64)[:, None] * stride_cm + n[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=live[:, None] & (n[None, :] < N))


def expert_gemm(
    a: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    sorted_pairs: torch.Tensor,
    block_experts: torch.Tensor,
    padded: torch.Tensor,
    top_k: int,
    tiles: Tiles,
    routing_weights: torch.Tensor | None = None,
    load: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[pair] = a[row of pair] @ weight[expert of pair].T (· the pair's routing weight), for every
    pair of the sorted blocks; `load` (int32 [experts]) counts each expert's pairs. a's rows are tokens
    (out has top_k rows each) or, where it has as many rows as out, the pairs themselves."""
    pairs, n = out.shape
    k = weight.shape[2]
    assert a.stride(1) == 1 and weight.stride(2) == 1 and out.stride(1) == 1 and a.shape[1] == k
    grid = (triton.cdiv(n, tiles.block_n), min(block_experts.numel(), pairs))  # each live block holds a pair at least
    _expert_gemm_kernel[grid](
        a,
        weight,
        out,
        routing_weights if routing_weights is not None else out,
        load if load is not None else block_experts,
        sorted_pairs,
        block_experts,
        padded,
        n,
        k,
        pairs,
        a.stride(0),
        weight.stride(0),
        weight.stride(1),
        out.stride(0),
        TOP_K=top_k,
        ROWS_ARE_PAIRS=a.shape[0] == pairs,
        MUL_WEIGHTS=routing_weights is not None,
        COUNT=load is not None,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return out


@triton.jit
def _expert_gate_up_gemv_kernel(
    x_ptr,
    w_ptr,
    ids_ptr,
    out_ptr,
    load_ptr,
    HIDDEN,
    INTER,
    TOP_K: tl.constexpr,
    COUNT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[pair, n] = SiLU(gate) · up of x[token] against rows n and INTER + n of its expert's gate_up."""
    pair, tile = tl.program_id(0), tl.program_id(1)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    if COUNT and tile == 0:
        tl.atomic_add(load_ptr + expert, 1)
    n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    gate_rows = w_ptr + expert * 2 * INTER * HIDDEN + n.to(tl.int64)[:, None] * HIDDEN + k[None, :]
    up_rows = gate_rows + INTER * HIDDEN
    x = x_ptr + (pair // TOP_K).to(tl.int64) * HIDDEN + k
    gate = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for start in range(0, HIDDEN, BLOCK_K):
        a = tl.load(x + start).to(tl.float32)[None, :]
        gate += tl.load(gate_rows + start).to(tl.float32) * a
        up += tl.load(up_rows + start).to(tl.float32) * a
    dtype = out_ptr.dtype.element_ty
    g = tl.sum(gate, 1).to(dtype).to(tl.float32)  # rounded as the GEMM's output would be
    u = tl.sum(up, 1).to(dtype).to(tl.float32)
    tl.store(out_ptr + pair.to(tl.int64) * INTER + n, (g / (1.0 + tl.exp(-g)) * u).to(dtype))


@triton.jit
def _expert_down_gemv_kernel(
    h_ptr, w_ptr, ids_ptr, weights_ptr, out_ptr, HIDDEN, INTER, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
):
    """out[token, n] = Σ over the token's pairs of routing weight · h[pair] against row n of the pair's
    expert's down: the weighted sum in the same program, so no pair's output is stored."""
    token, tile = tl.program_id(0), tl.program_id(1)
    n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    y = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        pair = token.to(tl.int64) * TOP_K + j
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        rows = w_ptr + expert * HIDDEN * INTER + n.to(tl.int64)[:, None] * INTER + k[None, :]
        h = h_ptr + pair * INTER + k
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for start in range(0, INTER, BLOCK_K):
            acc += tl.load(rows + start).to(tl.float32) * tl.load(h + start).to(tl.float32)[None, :]
        y += tl.load(weights_ptr + pair).to(tl.float32) * tl.sum(acc, 1)
    tl.store(out_ptr + token.to(tl.int64) * HIDDEN + n, y.to(out_ptr.dtype.element_ty))


def expert_gemv(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    routing_weights: torch.Tensor,
    ids: torch.Tensor,
    tiles: Tiles,
    load: torch.Tensor | None = None,
) -> torch.Tensor:
    """fused_experts for a few tokens without sorting the pairs: one GEMV per pair against its expert's
    gate_up with SiLU-and-mul in its epilogue, then one per token summing its experts' weighted down
    rows. Each weight row is read once per pair that picks it, which is what sorting would save: a win
    only while few pairs share an expert (moe_tune decides)."""
    tokens, top_k = ids.shape
    hidden, intermediate = x.shape[1], down.shape[2]
    assert x.is_contiguous() and gate_up.is_contiguous() and down.is_contiguous() and ids.is_contiguous()
    assert intermediate % tiles.block_n == 0 and hidden % tiles.block_n == 0
    assert hidden % tiles.block_k == 0 and intermediate % tiles.block_k == 0
    hidden_states = torch.empty(tokens * top_k, intermediate, dtype=x.dtype, device=x.device)
    _expert_gate_up_gemv_kernel[(tokens * top_k, intermediate // tiles.block_n)](
        x,
        gate_up,
        ids,
        hidden_states,
        load if load is not None else ids,
        hidden,
        intermediate,
        TOP_K=top_k,
        COUNT=load is not None,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    out = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
    _expert_down_gemv_kernel[(tokens, hidden // tiles.block_n)](
        hidden_states,
        down,
        ids,
        routing_weights.contiguous(),
        out,
        hidden,
        intermediate,
        TOP_K=top_k,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return out


def sgl_align(ids: torch.Tensor, experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pair indices sorted by expert, padded per expert to whole blocks with out-of-range pairs; each
    block's expert; the padded total), by sgl-kernel's one-kernel alignment. Its kernel counts expert
    e in bucket e + 1 (bucket 0 takes the id -1 of a dropped pair), so it is told of experts + 1
    buckets, with a cumsum of experts + 2, as SGLang's own caller does."""
    import sgl_kernel

    most = ids.numel() + (experts + 1) * (block_m - 1)
    sorted_pairs = torch.empty(most, dtype=torch.int32, device=ids.device)
    block_experts = torch.empty(triton.cdiv(most, block_m), dtype=torch.int32, device=ids.device)
    padded = torch.empty(1, dtype=torch.int32, device=ids.device)
    cumsum = torch.empty(experts + 2, dtype=torch.int32, device=ids.device)
    sgl_kernel.moe_align_block_size(ids, experts + 1, block_m, sorted_pairs, block_experts, padded, cumsum, True)
    return sorted_pairs, block_experts, padded


def fused_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    routing_weights: torch.Tensor,
    ids: torch.Tensor,
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor],
    tiles: Tiles | None = None,
    load: torch.Tensor | None = None,
) -> torch.Tensor:
    """Σ over each token's top_k experts of weight · down[e] @ silu_and_mul(gate_up[e] @ x): [T, H].
    gate_up [E, 2·I, H] (gate rows first), down [E, H, I], routing_weights and ids [T, top_k]; `load`
    (int32 [E]) gains each expert's pairs."""
    tokens, top_k = ids.shape
    tiles = tiles or tiles_for(tokens, gate_up.shape[0], down.shape[2], top_k, x.device)
    if tiles.kernel == "gemv":
        return expert_gemv(x, gate_up, down, routing_weights, ids, tiles, load)
    sorted_pairs, block_experts, padded = sgl_align(ids, gate_up.shape[0], tiles.block_m)
    pairs = tokens * top_k
    hidden = torch.empty(pairs, gate_up.shape[1], dtype=x.dtype, device=x.device)
    expert_gemm(x, gate_up, hidden, sorted_pairs, block_experts, padded, top_k, tiles, load=load)
    out = torch.empty(pairs, down.shape[1], dtype=x.dtype, device=x.device)
    expert_gemm(silu_and_mul(hidden), down, out, sorted_pairs, block_experts, padded, top_k, tiles, routing_weights)
    return out.view(tokens, top_k, -1).sum(dim=1)


def moe_forward(
    x: torch.Tensor,
    logits: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    top_k: int,
    renormalise: bool,
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor],
    load: torch.Tensor,
    routed: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """A sparse block from the router's logits: output [T, H], each expert's pairs added to `load`;
    sgl-kernel's fused softmax-top-k, then fused_experts. `routed`: (weights, ids) [T, top_k] of the
    model's own router (DeepSeek's groups) in place of the softmax."""
    if routed is not None:
        weights, ids = routed[0].float(), routed[1].to(torch.int32)
    else:
        import sgl_kernel

        weights = torch.empty(x.shape[0], top_k, dtype=torch.float32, device=x.device)
        ids = torch.empty(x.shape[0], top_k, dtype=torch.int32, device=x.device)
        sgl_kernel.topk_softmax(weights, ids, logits.float(), renormalise)
    return fused_experts(x, gate_up, down, weights, ids, silu_and_mul, load=load)
