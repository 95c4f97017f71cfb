"""Rope, Qwen3's q/k norms and the KV write as one Triton pass over a step's qkv rows: q rotates in
place, K and V go straight to the pool (an FP8 pool gets each divided by its layer's scale). One
program per token and part (q heads; K and V heads)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.kernels.triton import pdl


@triton.jit
def _normed_rotated(at, half_cols, live, cos, sin, norm_ptr, eps, HALF: tl.constexpr, NORM: tl.constexpr):
    """Both halves of the heads at `at` ([heads, half] pointers to first halves), normed and rotated, in fp32."""
    x1 = tl.load(at, mask=live, other=0.0).to(tl.float32)
    x2 = tl.load(at + HALF, mask=live, other=0.0).to(tl.float32)
    if NORM:
        rstd = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)[:, None]
        in_half = half_cols < HALF
        x1 = x1 * rstd * tl.load(norm_ptr + half_cols, mask=in_half, other=0.0).to(tl.float32)[None, :]
        x2 = x2 * rstd * tl.load(norm_ptr + HALF + half_cols, mask=in_half, other=0.0).to(tl.float32)[None, :]
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def stored(x, inverse_scale, dst, QUANT: tl.constexpr):
    """x as the pool stores it: divided by the scale and saturated to float8's range where QUANT."""
    if QUANT:
        return tl.clamp(x.to(tl.float32) * inverse_scale, -448.0, 448.0).to(dst.dtype.element_ty)
    return x.to(dst.dtype.element_ty)


@triton.jit
def _rotate_q(row, cols, cos, sin, norm_ptr, eps, HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr, NORM: tl.constexpr):
    heads = tl.arange(0, BLOCK)
    live = (heads < HEADS)[:, None] & (cols < HALF)[None, :]
    at = row + heads[:, None] * (2 * HALF) + cols[None, :]
    o1, o2 = _normed_rotated(at, cols, live, cos, sin, norm_ptr, eps, HALF, NORM)
    tl.store(at, o1.to(row.dtype.element_ty), mask=live)
    tl.store(at + HALF, o2.to(row.dtype.element_ty), mask=live)


@triton.jit
def _write_kv(
    row,
    cols,
    cos,
    sin,
    norm_ptr,
    eps,
    k_dst,
    v_dst,
    k_inverse,
    v_inverse,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK: tl.constexpr,
    NORM: tl.constexpr,
    QUANT: tl.constexpr,
):
    heads = tl.arange(0, BLOCK)
    live = (heads < KV_HEADS)[:, None] & (cols < HALF)[None, :]
    at = row + (HEADS + heads)[:, None] * (2 * HALF) + cols[None, :]
    o1, o2 = _normed_rotated(at, cols, live, cos, sin, norm_ptr, eps, HALF, NORM)
    o1, o2 = o1.to(row.dtype.element_ty), o2.to(row.dtype.element_ty)  # rounded as the unfused rope's output is
    in_row = heads[:, None] * (2 * HALF) + cols[None, :]
    tl.store(k_dst + in_row, stored(o1, k_inverse, k_dst, QUANT), mask=live)
    tl.store(k_dst + in_row + HALF, stored(o2, k_inverse, k_dst, QUANT), mask=live)
    v_src = at + KV_HEADS * (2 * HALF)
    tl.store(v_dst + in_row, stored(tl.load(v_src, mask=live), v_inverse, v_dst, QUANT), mask=live)
    tl.store(v_dst + in_row + HALF, stored(tl.load(v_src + HALF, mask=live), v_inverse, v_dst, QUANT), mask=live)


@triton.jit
def _rope_kv_kernel(
    qkv_ptr,
    qkv_stride,
    pos_ptr,
    cos_sin_ptr,
    q_norm_ptr,
    k_norm_ptr,
    rows_ptr,
    rows_token_stride,
    rows_part_stride,
    pool_ptr,
    eps,
    k_inverse,
    v_inverse,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    Q_BLOCK: tl.constexpr,
    KV_BLOCK: tl.constexpr,
    HALF_BLOCK: tl.constexpr,
    NORM: tl.constexpr,
    QUANT: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.wait_for_previous_kernel(PDL, True)
    token, part = tl.program_id(0), tl.program_id(1)
    cols = tl.arange(0, HALF_BLOCK)
    angle = cos_sin_ptr + tl.load(pos_ptr + token) * (2 * HALF) + cols
    cos = tl.load(angle, mask=cols < HALF, other=0.0)[None, :]
    sin = tl.load(angle + HALF, mask=cols < HALF, other=0.0)[None, :]
    row = qkv_ptr + token.to(tl.int64) * qkv_stride
    if part == 0:
        _rotate_q(row, cols, cos, sin, q_norm_ptr, eps, HEADS, HALF, Q_BLOCK, NORM)
    else:
        rows = rows_ptr + token * rows_token_stride
        k_dst = pool_ptr + tl.load(rows) * (KV_HEADS * 2 * HALF)
        v_dst = pool_ptr + tl.load(rows + rows_part_stride) * (KV_HEADS * 2 * HALF)
        _write_kv(row, cols, cos, sin, k_norm_ptr, eps, k_dst, v_dst, k_inverse, v_inverse, HEADS, KV_HEADS, HALF, KV_BLOCK, NORM, QUANT)


def rope_kv_write(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    pool_rows: torch.Tensor,
    rows: torch.Tensor,
    heads: int,
    kv_heads: int,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> None:
    """qkv [T, (heads + 2 kv heads) · dim]; rows [T, 2]: each token's K and V row in pool_rows; an
    FP8 pool stores K / kv_scales[0] and V / kv_scales[1]."""
    tokens, dim = qkv.shape[0], cos_sin.shape[1]
    if tokens == 0:
        return
    assert qkv.stride(1) == 1 and qkv.shape[1] == (heads + 2 * kv_heads) * dim and pool_rows.shape[1] == kv_heads * dim
    norm = q_norm is not None
    _rope_kv_kernel[(tokens, 2)](
        qkv,
        qkv.stride(0),
        positions,
        cos_sin,
        q_norm if norm else cos_sin,
        k_norm if norm else cos_sin,
        rows,
        rows.stride(0),
        rows.stride(1),
        pool_rows,
        eps,
        1.0 / kv_scales[0],
        1.0 / kv_scales[1],
        HEADS=heads,
        KV_HEADS=kv_heads,
        HALF=dim // 2,
        Q_BLOCK=triton.next_power_of_2(heads),
        KV_BLOCK=triton.next_power_of_2(kv_heads),
        HALF_BLOCK=triton.next_power_of_2(dim // 2),
        NORM=norm,
        QUANT=pool_rows.dtype == torch.float8_e4m3fn,
        num_warps=4,
        **pdl.launch(qkv.device),
    )
