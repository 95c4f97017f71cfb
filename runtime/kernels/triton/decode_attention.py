"""Split-KV decode attention for a few sequences, whose few KV heads leave the chip idle unsplit: slices of
each sequence, then a log-sum-exp merge. Slices follow lengths on the device, so graphs replay at any length.
An FP8 pool's pages are read as K·k_scale and V·v_scale (the scales folded into the scores and the output)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.kernels.rope import Rope
from runtime.kernels.triton import pdl
from runtime.kernels.triton.rope_kv import stored

PROGRAMS = 512  # the split count aims at this many programs a step
MAX_SPLITS = 32
BLOCK_T = 32


@triton.jit
def _k_rows(kv_indices_ptr, first_page, t, live_t, kv_head, PAGE: tl.constexpr, KV_HEADS: tl.constexpr, DIM: tl.constexpr):
    """Pool offsets of tokens `t`'s K rows for this KV head; V rows are PAGE rows on."""
    page = tl.load(kv_indices_ptr + first_page + t // PAGE, mask=live_t, other=0).to(tl.int64)
    return (page * (2 * PAGE) + t % PAGE) * (KV_HEADS * DIM) + kv_head * DIM


@triton.jit
def _normed_rotated(row, heads, live, d, cos, signed_sin, norm_ptr, eps, DIM: tl.constexpr, NORM: tl.constexpr):
    """Heads of a raw qkv row, [heads, DIM] fp32, normed (where NORM) and rotated as whole heads."""
    partner = (d + DIM // 2) % DIM
    x = tl.load(row + heads[:, None] * DIM + d[None, :], mask=live[:, None], other=0.0).to(tl.float32)
    y = tl.load(row + heads[:, None] * DIM + partner[None, :], mask=live[:, None], other=0.0).to(tl.float32)
    if NORM:
        rstd = tl.rsqrt(tl.sum(x * x, 1) / DIM + eps)[:, None]
        x = x * rstd * tl.load(norm_ptr + d).to(tl.float32)[None, :]
        y = y * rstd * tl.load(norm_ptr + partner).to(tl.float32)[None, :]
    return x * cos[None, :] + y * signed_sin[None, :]


@triton.jit
def _split_kernel(
    q_ptr,
    q_stride,
    pool_ptr,
    kv_indptr_ptr,
    kv_indices_ptr,
    kv_lens_ptr,
    part_out_ptr,
    part_lse_ptr,
    scale,
    k_scale,
    v_scale,
    cos_sin_ptr,
    q_norm_ptr,
    k_norm_ptr,
    eps,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    DIM: tl.constexpr,
    PAGE: tl.constexpr,
    GROUP_BLOCK: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    LINE: tl.constexpr,
    ROPE: tl.constexpr,
    NORM: tl.constexpr,
    QUANT: tl.constexpr,
    PDL: tl.constexpr,
):
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    GROUP: tl.constexpr = HEADS // KV_HEADS
    kv_len = tl.load(kv_lens_ptr + seq)
    span = tl.cdiv(tl.cdiv(kv_len, SPLITS), BLOCK_T) * BLOCK_T
    start = split * span
    end = tl.minimum(start + span, kv_len)
    g = tl.arange(0, GROUP_BLOCK)
    d = tl.arange(0, DIM)
    heads = kv_head * GROUP + g
    live_g = g < GROUP
    first_page = tl.load(kv_indptr_ptr + seq)
    v_offset: tl.constexpr = PAGE * KV_HEADS * DIM
    t0 = tl.arange(0, BLOCK_T)
    if PDL:  # the slice's first K and V rows predate this step: start them toward L2 (one block, not to overflow it)
        t = start + t0
        k_lines = _k_rows(kv_indices_ptr, first_page, t, t < end, kv_head, PAGE, KV_HEADS, DIM)
        k_lines = pool_ptr + k_lines[:, None] + tl.arange(0, DIM // LINE)[None, :] * LINE
        pdl.prefetch_l2(k_lines)
        pdl.prefetch_l2(k_lines + v_offset)
    if ROPE:
        pos = kv_len - 1
        angle = cos_sin_ptr + pos.to(tl.int64) * DIM + d % (DIM // 2)
        cos = tl.load(angle)
        signed_sin = tl.load(angle + DIM // 2) * tl.where(d < DIM // 2, -1.0, 1.0)
    pdl.wait_for_previous_kernel(PDL, True)
    row = q_ptr + seq.to(tl.int64) * q_stride
    if ROPE:  # q from the raw qkv row; the program whose slice ends the sequence writes the new K and V first
        q = _normed_rotated(row, heads, live_g, d, cos, signed_sin, q_norm_ptr, eps, DIM, NORM).to(q_ptr.dtype.element_ty)
        if (start <= pos) & (pos < end):
            new = pos + tl.arange(0, 1)
            k = _normed_rotated(row + HEADS * DIM, kv_head + tl.arange(0, 1), new >= 0, d, cos, signed_sin, k_norm_ptr, eps, DIM, NORM)
            at = pool_ptr + _k_rows(kv_indices_ptr, first_page, new, new >= 0, kv_head, PAGE, KV_HEADS, DIM)[:, None] + d[None, :]
            k = k.to(q_ptr.dtype.element_ty)  # rounded as the rope pass's output is
            tl.store(at, stored(k, 1.0 / k_scale, pool_ptr, QUANT))
            tl.store(at + v_offset, stored(tl.load(row + (HEADS + KV_HEADS + kv_head) * DIM + d)[None, :], 1.0 / v_scale, pool_ptr, QUANT))
            tl.debug_barrier()  # the block loop below reads these rows back
    else:
        q = tl.load(row + heads[:, None] * DIM + d[None, :], mask=live_g[:, None], other=0.0)
    m_i = tl.full((GROUP_BLOCK,), float("-inf"), tl.float32)
    l_i = tl.zeros((GROUP_BLOCK,), tl.float32)
    acc = tl.zeros((GROUP_BLOCK, DIM), tl.float32)
    for block in range(start, end, BLOCK_T):
        t = block + t0
        live_t = t < end
        k_row = _k_rows(kv_indices_ptr, first_page, t, live_t, kv_head, PAGE, KV_HEADS, DIM)
        k = tl.load(pool_ptr + k_row[:, None] + d[None, :], mask=live_t[:, None], other=0.0).to(q.dtype)
        v = tl.load(pool_ptr + k_row[:, None] + v_offset + d[None, :], mask=live_t[:, None], other=0.0).to(q.dtype)
        s = tl.dot(q, tl.trans(k)) * (scale * k_scale)
        s = tl.where(live_t[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    some = l_i > 0  # a slice past the sequence's end holds nothing: weight zero in the merge
    out = tl.where(some[:, None], acc / tl.where(some, l_i, 1.0)[:, None] * v_scale, 0.0)
    lse = tl.where(some, m_i + tl.log(tl.where(some, l_i, 1.0)), float("-inf"))
    at = (seq * HEADS + heads) * SPLITS + split
    tl.store(part_out_ptr + at[:, None] * DIM + d[None, :], out, mask=live_g[:, None])
    tl.store(part_lse_ptr + at, lse, mask=live_g)


@triton.jit
def _merge_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, out_stride, HEADS: tl.constexpr, DIM: tl.constexpr, SPLITS: tl.constexpr, PDL: tl.constexpr
):
    pdl.wait_for_previous_kernel(PDL, True)
    seq, head = tl.program_id(0), tl.program_id(1)
    s = tl.arange(0, SPLITS)
    d = tl.arange(0, DIM)
    at = (seq * HEADS + head) * SPLITS + s
    lse = tl.load(part_lse_ptr + at)
    weight = tl.exp(lse - tl.max(lse, 0))
    parts = tl.load(part_out_ptr + at[:, None] * DIM + d[None, :])
    out = tl.sum(parts * weight[:, None], 0) / tl.sum(weight, 0)
    tl.store(out_ptr + seq.to(tl.int64) * out_stride + head * DIM + d, out.to(out_ptr.dtype.element_ty))


def decode_attention(
    q: torch.Tensor,
    pool: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    rope: Rope | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> torch.Tensor:
    """Writes and returns `out` [B, heads, dim]. With `rope`, q is the raw qkv and rope_kv's work is done
    here. An FP8 pool holds K / kv_scales[0] and V / kv_scales[1]."""
    batch, _, dim = q.shape
    _, _, page, kv_heads, _ = pool.shape
    heads = q.shape[1] - 2 * kv_heads if rope is not None else q.shape[1]
    assert q.stride(2) == 1 and q.stride(1) == dim and pool.is_contiguous() and out.is_contiguous()
    splits = max(4, min(MAX_SPLITS, triton.next_power_of_2(PROGRAMS // (batch * kv_heads))))
    part_out = torch.empty(batch, heads, splits, dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(batch, heads, splits, dtype=torch.float32, device=q.device)
    norm = rope is not None and rope.q_norm is not None
    _split_kernel[(batch, kv_heads, splits)](
        q,
        q.stride(0),
        pool,
        kv_indptr,
        kv_indices,
        kv_lens,
        part_out,
        part_lse,
        scale,
        *kv_scales,
        rope.cos_sin if rope is not None else part_out,
        rope.q_norm if norm else part_out,  # pyright: ignore[reportOptionalMemberAccess]  # norm: rope is set
        rope.k_norm if norm else part_out,  # pyright: ignore[reportOptionalMemberAccess]
        rope.eps if rope is not None else 0.0,
        HEADS=heads,
        KV_HEADS=kv_heads,
        DIM=dim,
        PAGE=page,
        GROUP_BLOCK=max(16, triton.next_power_of_2(heads // kv_heads)),
        SPLITS=splits,
        BLOCK_T=BLOCK_T,
        LINE=min(dim, 128 // pool.element_size()),
        ROPE=rope is not None,
        NORM=norm,
        QUANT=pool.dtype == torch.float8_e4m3fn,
        num_warps=4,
        **pdl.launch(q.device),
    )
    _merge_kernel[(batch, heads)](
        part_out, part_lse, out, out.stride(0), HEADS=heads, DIM=dim, SPLITS=splits, num_warps=4, **pdl.launch(q.device)
    )
    return out
