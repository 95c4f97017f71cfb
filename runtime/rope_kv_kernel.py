"""Rotary embedding, Qwen3's per-head q/k RMSNorm (where the model has one) and the KV write as one
Triton pass over a step's qkv rows: q is rotated in place, K and V go straight to their pool rows.

Before, these were two kernels: sgl-kernel's fused q/k norm + rope (67 us a layer for an 8k-token
prefill of Qwen3-0.6B on the H200, computing every angle in the kernel) and a row copy into the
pool (17 us). This one reads the angles from the fp32 cos/sin cache and moves each byte once.

A program handles one token: part 0 its q heads, part 1 its K and V heads. Triton compiles a variant
per argument class (an integer equal to 1 or a multiple of 16, a pointer aligned to 16 bytes or not);
no argument depends on the step's token count, so eager steps reuse the variant the engine's warm-up
compiled, and CUDA graphs theirs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime import pdl


@triton.jit
def rope_angles(cos_sin_ptr, pos, d, DIM: tl.constexpr):
    """cos and signed sin of position `pos` at columns `d` of a head (zero past DIM): an element's sin is
    negated in the first half, where its partner half a head away is subtracted."""
    in_dim = d < DIM
    angle = cos_sin_ptr + pos.to(tl.int64) * DIM + d % (DIM // 2)
    cos = tl.load(angle, mask=in_dim, other=0.0)
    signed_sin = tl.load(angle + DIM // 2, mask=in_dim, other=0.0) * tl.where(d < DIM // 2, -1.0, 1.0)
    return cos, signed_sin


@triton.jit
def normed_rotated(row, heads, live, d, cos, signed_sin, norm_ptr, eps, DIM: tl.constexpr, NORM: tl.constexpr):
    """Heads `heads` of a raw qkv row, [heads, d] in fp32, after their RMSNorm (where NORM) and the half-split
    rotation: each element pairs with the one half a head away. The decode attention kernel uses it too."""
    in_dim = d < DIM
    partner = (d + DIM // 2) % DIM
    mask = live[:, None] & in_dim[None, :]
    x = tl.load(row + heads[:, None] * DIM + d[None, :], mask=mask, other=0.0).to(tl.float32)
    y = tl.load(row + heads[:, None] * DIM + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    if NORM:
        rstd = tl.rsqrt(tl.sum(x * x, 1) / DIM + eps)[:, None]
        x = x * rstd * tl.load(norm_ptr + d, mask=in_dim, other=0.0).to(tl.float32)[None, :]
        y = y * rstd * tl.load(norm_ptr + partner, mask=in_dim, other=0.0).to(tl.float32)[None, :]
    return x * cos[None, :] + y * signed_sin[None, :]


@triton.jit
def _rope_kv_kernel(qkv_ptr, qkv_stride, pos_ptr, cos_sin_ptr, q_norm_ptr, k_norm_ptr, rows_ptr, rows_token_stride,
                    rows_part_stride, pool_ptr, eps, HEADS: tl.constexpr, KV_HEADS: tl.constexpr, DIM: tl.constexpr,
                    Q_BLOCK: tl.constexpr, KV_BLOCK: tl.constexpr, DIM_BLOCK: tl.constexpr, NORM: tl.constexpr,
                    PDL: tl.constexpr):
    pdl.wait_for_previous_kernel(PDL, True)
    token, part = tl.program_id(0), tl.program_id(1)
    d = tl.arange(0, DIM_BLOCK)
    cos, signed_sin = rope_angles(cos_sin_ptr, tl.load(pos_ptr + token), d, DIM)
    row = qkv_ptr + token.to(tl.int64) * qkv_stride
    if part == 0:  # q, rotated in place
        q_heads = tl.arange(0, Q_BLOCK)
        q_live = q_heads < HEADS
        q = normed_rotated(row, q_heads, q_live, d, cos, signed_sin, q_norm_ptr, eps, DIM, NORM)
        tl.store(row + q_heads[:, None] * DIM + d[None, :], q.to(row.dtype.element_ty),
                 mask=q_live[:, None] & (d < DIM)[None, :])
    else:  # K, rotated, and V, as it is, to their pool rows
        kv_heads = tl.arange(0, KV_BLOCK)
        kv_live = kv_heads < KV_HEADS
        kv_mask = kv_live[:, None] & (d < DIM)[None, :]
        in_row = kv_heads[:, None] * DIM + d[None, :]
        k = normed_rotated(row + HEADS * DIM, kv_heads, kv_live, d, cos, signed_sin, k_norm_ptr, eps, DIM, NORM)
        rows = rows_ptr + token * rows_token_stride
        tl.store(pool_ptr + tl.load(rows) * (KV_HEADS * DIM) + in_row, k.to(row.dtype.element_ty), mask=kv_mask)
        v = tl.load(row + (HEADS + KV_HEADS) * DIM + in_row, mask=kv_mask)
        tl.store(pool_ptr + tl.load(rows + rows_part_stride) * (KV_HEADS * DIM) + in_row, v, mask=kv_mask)


def rope_kv_write(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, q_norm: torch.Tensor | None,
                  k_norm: torch.Tensor | None, eps: float, pool_rows: torch.Tensor, rows: torch.Tensor, heads: int,
                  kv_heads: int) -> None:
    """qkv [T, (heads + 2 kv heads) · dim], contiguous rows; positions [T]; cos_sin [max position, dim]
    fp32 (cos halves, then sin halves); q_norm and k_norm [dim] or both None; pool_rows [pool rows,
    kv heads · dim]; rows [T, 2] int64 (any strides): where each token's K and V go."""
    tokens, dim = qkv.shape[0], cos_sin.shape[1]
    if tokens == 0:
        return
    assert qkv.stride(1) == 1 and qkv.shape[1] == (heads + 2 * kv_heads) * dim and pool_rows.shape[1] == kv_heads * dim
    norm = q_norm is not None
    _rope_kv_kernel[(tokens, 2)](
        qkv, qkv.stride(0), positions, cos_sin, q_norm if norm else cos_sin, k_norm if norm else cos_sin, rows,
        rows.stride(0), rows.stride(1), pool_rows, eps, HEADS=heads, KV_HEADS=kv_heads, DIM=dim,
        Q_BLOCK=triton.next_power_of_2(heads), KV_BLOCK=triton.next_power_of_2(kv_heads),
        DIM_BLOCK=triton.next_power_of_2(dim), NORM=norm, num_warps=4, **pdl.launch(qkv.device))
