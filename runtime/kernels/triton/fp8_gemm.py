"""x · Wᵀ for an FP8 weight with block scales. W8A16: each weight tile is widened to the activation
dtype in registers and each K tile's partial product scaled by its blocks' scales, so the weight
crosses memory at one byte a value and the activations need no quantization pass (few rows, where
the weight's bytes are the cost). W8A8: the activations are first quantized per row and group of
GROUP_K columns, and the tiles meet on FP8 tensor cores, twice bf16's rate (many rows, where the
FLOPs are). Weight scales cover blocks of SCALE_N rows x SCALE_K columns (128 x 128 for
block-quantized checkpoints; 1 x K for a scale per row); a K tile never straddles two blocks."""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl


class Tiles(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int


# candidates the start-up timing chooses among, by the rows a call has (runtime.engine.gemm_tuner)
FEW_ROW_TILES = (Tiles(16, 32, 128, 4, 4), Tiles(16, 64, 128, 4, 4), Tiles(16, 16, 128, 4, 5))
MANY_ROW_TILES = (Tiles(64, 128, 128, 4, 3), Tiles(128, 128, 64, 8, 3), Tiles(128, 64, 128, 4, 3))
GROUP_K = 128  # columns an activation scale covers (W8A8)


def default_tiles(rows: int) -> Tiles:
    return FEW_ROW_TILES[0] if rows <= 16 else MANY_ROW_TILES[0]


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, K, x_stride, groups, GROUP: tl.constexpr):
    """One row's one group of GROUP columns to float8 with the scale max |x| / 448."""
    row, group = tl.program_id(0), tl.program_id(1)
    k = group * GROUP + tl.arange(0, GROUP)
    x = tl.load(x_ptr + row.to(tl.int64) * x_stride + k, mask=k < K, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), 0), 1e-10) / 448.0
    tl.store(q_ptr + row.to(tl.int64) * K + k, (x / scale).to(q_ptr.dtype.element_ty), mask=k < K)
    tl.store(scale_ptr + row * groups + group, scale)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] as float8_e4m3fn, and its fp32 scales [M, ceil(K / GROUP_K)]."""
    m, k = x.shape
    groups = triton.cdiv(k, GROUP_K)
    quantized = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(m, groups, dtype=torch.float32, device=x.device)
    if m:
        _quantize_rows_kernel[(m, groups)](x, quantized, scales, k, x.stride(0), groups, GROUP=GROUP_K, num_warps=1)
    return quantized, scales


@triton.jit
def _fp8_gemm_kernel(
    x_ptr,
    x_scale_ptr,
    w_ptr,
    scale_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    x_stride,
    x_scale_stride,
    out_stride,
    scale_stride,
    SCALE_N: tl.constexpr,
    SCALE_K: tl.constexpr,
    A_FP8: tl.constexpr,
    GROUP_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    grid_m, grid_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    width = GROUP_M * grid_n  # programs of GROUP_M row blocks run together and share the weight tiles in L2
    first_m = (pid // width) * GROUP_M
    group_rows = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_rows
    pid_n = (pid % width) // group_rows
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    live_m, live_n = rm < M, rn < N
    x_rows = x_ptr + rm[:, None].to(tl.int64) * x_stride
    x_scale_rows = x_scale_ptr + rm * x_scale_stride
    w_cols = w_ptr + rn[None, :].to(tl.int64) * K
    scale_rows = scale_ptr + (rn // SCALE_N) * scale_stride
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        live_k = k < K
        x = tl.load(x_rows + k[None, :], mask=live_m[:, None] & live_k[None, :], other=0.0)
        w = tl.load(w_cols + k[:, None], mask=live_k[:, None] & live_n[None, :], other=0.0)
        scale = tl.load(scale_rows + k0 // SCALE_K, mask=live_n, other=0.0)
        if A_FP8:  # GROUP_K is a multiple of BLOCK_K: one activation scale per row a tile
            x_scale = tl.load(x_scale_rows + k0 // GROUP_K, mask=live_m, other=0.0)
            acc += tl.dot(x, w) * (x_scale[:, None] * scale[None, :])
        else:
            acc += tl.dot(x, w.to(x.dtype)) * scale[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=live_n, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rm[:, None].to(tl.int64) * out_stride + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=live_m[:, None] & live_n[None, :])


def fp8_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    bias: torch.Tensor | None,
    tiles: Tiles,
    fp8_activations: bool = False,
) -> torch.Tensor:
    """x [M, K] (bf16/fp16) · dequantized weightᵀ + bias -> [M, N] in x's dtype; weight [N, K] float8_e4m3fn,
    scale [ceil(N / block[0]), ceil(K / block[1])] fp32 (a weight value is fp8 · its block's scale).
    With fp8_activations, x is quantized per row and GROUP_K columns first (W8A8)."""
    m, k = x.shape
    n = weight.shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    assert block[1] >= k or block[1] % tiles.block_k == 0, "a K tile must not straddle two scale blocks"
    assert not fp8_activations or GROUP_K % tiles.block_k == 0, "nor two activation groups"
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    operand, x_scale = quantize_rows(x) if fp8_activations else (x, scale)
    grid = (triton.cdiv(m, tiles.block_m) * triton.cdiv(n, tiles.block_n),)
    _fp8_gemm_kernel[grid](
        operand,
        x_scale,
        weight,
        scale,
        bias if bias is not None else scale,
        out,
        m,
        n,
        k,
        operand.stride(0),
        x_scale.stride(0),
        out.stride(0),
        scale.stride(0),
        SCALE_N=block[0],
        SCALE_K=block[1],
        A_FP8=fp8_activations,
        GROUP_K=GROUP_K,
        HAS_BIAS=bias is not None,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        GROUP_M=8,
        num_warps=tiles.warps,
        num_stages=tiles.stages,
    )
    return out
