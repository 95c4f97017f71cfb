"""One-row linears for batch-1 decode (cuBLAS streams one row well below bandwidth): y = x·Wᵀ (+ residual),
x the row, its RMSNorm or SiLU(gate)·up; each program owns a few columns and sweeps the whole K. An FP8
weight is widened in registers and scaled by its blocks' scales (W8A16: the row stays as it is)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.kernels.triton import pdl

PLAIN, NORM, ADD_NORM, SILU = 0, 1, 2, 3


@triton.jit
def _activation(x_ptr, res_ptr, norm_ptr, new_res_ptr, k, K, write_res, PROLOGUE: tl.constexpr):
    if PROLOGUE == 3:  # SILU: gate in the row's first K columns, up in the next K
        gate = tl.load(x_ptr + k).to(tl.float32)
        a = gate / (1.0 + tl.exp(-gate)) * tl.load(x_ptr + K + k).to(tl.float32)
    else:
        a = tl.load(x_ptr + k).to(tl.float32)
    if PROLOGUE == 2:  # ADD_NORM: x + residual, which program 0 also stores as the next residual
        added = (a + tl.load(res_ptr + k).to(tl.float32)).to(new_res_ptr.dtype.element_ty)
        tl.store(new_res_ptr + k, added, mask=write_res)
        a = added.to(tl.float32)  # as stored: Hugging Face adds in the model's dtype
    squares = a * a
    if PROLOGUE == 1 or PROLOGUE == 2:
        a = a * tl.load(norm_ptr + k).to(tl.float32)
    return a, squares


@triton.jit
def _gemv_kernel(
    x_ptr,
    res_ptr,
    norm_ptr,
    new_res_ptr,
    w_ptr,
    scale_ptr,
    bias_ptr,
    add_ptr,
    out_ptr,
    eps,
    K,
    scale_cols,
    PROLOGUE: tl.constexpr,
    SCALE_N: tl.constexpr,
    SCALE_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ADD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    LINE: tl.constexpr,
    PDL: tl.constexpr,
    SHORT: tl.constexpr,
):
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + n[:, None].to(tl.int64) * K
    if PDL and SHORT:  # while the kernel before finishes, the first weight tile heads for L2
        pdl.prefetch_l2(w_rows + tl.arange(0, BLOCK_K // LINE)[None, :] * LINE)
    pdl.wait_for_previous_kernel(PDL, SHORT)
    w_tile = w_rows + k[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        w = tl.load(w_tile + start).to(tl.float32)
        if SCALE_N and BLOCK_K <= SCALE_K:  # an FP8 weight, the K tile within one block of scales
            w *= tl.load(scale_ptr + (n // SCALE_N) * scale_cols + start // SCALE_K)[:, None]
        elif SCALE_N:  # a K tile across blocks: each column's scale (repeats, so from L1)
            w *= tl.load(scale_ptr + (n // SCALE_N)[:, None] * scale_cols + ((start + k) // SCALE_K)[None, :])
        a, sq = _activation(x_ptr, res_ptr, norm_ptr, new_res_ptr, start + k, K, pid == 0, PROLOGUE)
        squares += sq
        acc += w * a[None, :]
    y = tl.sum(acc, 1)
    if PROLOGUE == 1 or PROLOGUE == 2:
        y *= tl.rsqrt(tl.sum(squares, 0) / K + eps)
    if HAS_BIAS:
        y += tl.load(bias_ptr + n).to(tl.float32)
    if ADD:
        y = y.to(out_ptr.dtype.element_ty).to(tl.float32) + tl.load(add_ptr + n).to(tl.float32)
    tl.store(out_ptr + n, y.to(out_ptr.dtype.element_ty))


TILES = ((4, 1024), (8, 256), (8, 512), (2, 1024))  # (columns a program, K tile); start-up times them per shape


def tiles(n: int, k: int) -> list[tuple[int, int]]:
    """The TILES a weight [n, k] takes, each K tile halved until it divides k."""
    found = []
    for block_n, block_k in TILES:
        while k % block_k:
            block_k //= 2
        if n % block_n == 0 and block_k >= 16 and (block_n, block_k) not in found:
            found.append((block_n, block_k))
    return found


FP8_TILES = ((4, 128), (8, 128), (16, 128), (32, 128), (4, 512), (8, 512), (16, 256), (8, 1024))


def fp8_tiles(n: int, k: int) -> list[tuple[int, int]]:
    """The FP8_TILES a weight [n, k] takes (its K tile dividing k)."""
    return [(bn, bk) for bn, bk in FP8_TILES if n % bn == 0 and k % bk == 0]


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    tile: tuple[int, int],
    *,
    prologue: int = PLAIN,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    add: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    scale_block: tuple[int, int] = (0, 0),
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(y [1, N], the new residual for ADD_NORM else None); x and weight contiguous, tile from `tiles`
    (for an FP8 weight with `scale` per `scale_block`, from `fp8_tiles`)."""
    (n, k), (block_n, block_k) = weight.shape, tile
    assert x.shape[0] == 1 and x.is_contiguous() and weight.is_contiguous() and n % block_n == 0 and k % block_k == 0
    out = x.new_empty(1, n)
    new_residual = x.new_empty(1, k) if prologue == ADD_NORM else None
    _gemv_kernel[(n // block_n,)](
        x,
        residual if residual is not None else x,
        norm_weight if norm_weight is not None else weight,
        new_residual if new_residual is not None else out,
        weight,
        scale if scale is not None else weight,
        bias if bias is not None else weight,
        add if add is not None else out,
        out,
        eps,
        k,
        0 if scale is None else scale.shape[1],
        PROLOGUE=prologue,
        SCALE_N=scale_block[0] if scale is not None else 0,
        SCALE_K=scale_block[1] if scale is not None else 0,
        HAS_BIAS=bias is not None,
        ADD=add is not None,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        LINE=min(block_k, 128 // weight.element_size()),
        SHORT=pdl.fits_half_l2(weight),
        num_warps=4,
        num_stages=3,
        **pdl.launch(x.device),
    )
    return out, new_residual


def norm_linear(
    h: torch.Tensor, residual: torch.Tensor | None, norm: torch.nn.Module, linear: torch.nn.Module, tile: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """linear(RMSNorm(h + residual)) and the new residual (h where there was none), in one kernel.
    The `pyright: ignore`s here and below: torch types a Module's attributes as Tensor | Module, and
    gemv returns the new residual whenever it is given one."""
    if residual is None:
        return gemv(h, linear.weight, linear.bias, tile, prologue=NORM, norm_weight=norm.weight, eps=norm.eps)[0], h  # pyright: ignore[reportArgumentType]
    return gemv(h, linear.weight, linear.bias, tile, prologue=ADD_NORM, residual=residual, norm_weight=norm.weight, eps=norm.eps)  # pyright: ignore[reportArgumentType, reportReturnType]


def silu_linear(gate_up: torch.Tensor, linear: torch.nn.Module, add: torch.Tensor | None = None, *, tile: tuple[int, int]) -> torch.Tensor:
    """linear(SiLU(gate) · up) (+ add), in one kernel."""
    return gemv(gate_up, linear.weight, linear.bias, tile, prologue=SILU, add=add)[0]  # pyright: ignore[reportArgumentType]


def linear_add(x: torch.Tensor, linear: torch.nn.Module, add: torch.Tensor, *, tile: tuple[int, int]) -> torch.Tensor:
    return gemv(x, linear.weight, linear.bias, tile, add=add)[0]  # pyright: ignore[reportArgumentType]
