"""Split-KV decode attention over the paged pool for a few sequences, as two Triton passes: each
program attends one KV head's query group to one slice of a sequence's tokens, then one program a
query head merges the slices by their log-sum-exp.

At batch 1 flashinfer's decode took 11.0 us a layer on the H200 over 1,024 tokens of Qwen3-0.6B
context, whose K and V (4 MB) stream in about 1 us: one sequence's few KV heads leave most of the
chip idle. Here a step runs about PROGRAMS programs (sequences x KV heads x splits); a slice's length
follows its sequence's length on the device, so one launch grid serves every length and a CUDA graph
of it replays at any context.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime import pdl
from runtime.attention import Rope

PROGRAMS = 512  # the split count aims at this many programs a step: 8 KV heads, 32 splits at batch 1, 8 at 8
MAX_SPLITS = 32
BLOCK_T = 32


@triton.jit
def _k_rows(kv_indices_ptr, first_page, t, live_t, kv_head, PAGE: tl.constexpr, KV_HEADS: tl.constexpr,
            DIM: tl.constexpr):
    """Element offsets in the pool of tokens `t`'s K rows for this KV head; their V rows are PAGE rows on."""
    page = tl.load(kv_indices_ptr + first_page + t // PAGE, mask=live_t, other=0).to(tl.int64)
    return (page * (2 * PAGE) + t % PAGE) * (KV_HEADS * DIM) + kv_head * DIM


@triton.jit
def _normed_rotated(row, heads, live, d, cos, signed_sin, norm_ptr, eps, DIM: tl.constexpr, NORM: tl.constexpr):
    """Heads `heads` of a raw qkv row, [heads, DIM] in fp32, after their RMSNorm (where NORM) and the half-split
    rotation: each element pairs with the one half a head away, sin signed by the half it sits in. Whole
    heads, as the dot below takes them; runtime.rope_kv_kernel rotates half against half, as this form cost
    its pass 4-53% on the H200 (benchmarks/results/h200-probe-session20.log, call 12)."""
    partner = (d + DIM // 2) % DIM
    x = tl.load(row + heads[:, None] * DIM + d[None, :], mask=live[:, None], other=0.0).to(tl.float32)
    y = tl.load(row + heads[:, None] * DIM + partner[None, :], mask=live[:, None], other=0.0).to(tl.float32)
    if NORM:
        rstd = tl.rsqrt(tl.sum(x * x, 1) / DIM + eps)[:, None]
        x = x * rstd * tl.load(norm_ptr + d).to(tl.float32)[None, :]
        y = y * rstd * tl.load(norm_ptr + partner).to(tl.float32)[None, :]
    return x * cos[None, :] + y * signed_sin[None, :]


@triton.jit
def _split_kernel(q_ptr, q_stride, pool_ptr, kv_indptr_ptr, kv_indices_ptr, kv_lens_ptr, part_out_ptr, part_lse_ptr,
                  scale, cos_sin_ptr, q_norm_ptr, k_norm_ptr, eps, HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
                  DIM: tl.constexpr, PAGE: tl.constexpr, GROUP_BLOCK: tl.constexpr, SPLITS: tl.constexpr,
                  BLOCK_T: tl.constexpr, LINE: tl.constexpr, ROPE: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr):
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
    if PDL:  # the page list comes from the host, the slice's first K and V rows from earlier steps: they can
        # head for L2 now (the first block only, so that long contexts do not overflow it)
        t = start + t0
        k_lines = _k_rows(kv_indices_ptr, first_page, t, t < end, kv_head, PAGE, KV_HEADS, DIM)
        k_lines = pool_ptr + k_lines[:, None] + tl.arange(0, DIM // LINE)[None, :] * LINE
        pdl.prefetch_l2(k_lines)
        pdl.prefetch_l2(k_lines + v_offset)
    if ROPE:  # the new token sits at kv_len - 1; its angles, like the lengths, came from the host before the step
        pos = kv_len - 1
        angle = cos_sin_ptr + pos.to(tl.int64) * DIM + d % (DIM // 2)
        cos = tl.load(angle)
        signed_sin = tl.load(angle + DIM // 2) * tl.where(d < DIM // 2, -1.0, 1.0)
    pdl.wait_for_previous_kernel(PDL, True)  # q, and the step's own K and V, come from the kernel before
    row = q_ptr + seq.to(tl.int64) * q_stride
    if ROPE:  # q from the raw qkv row; the program whose slice ends the sequence writes the new K and V first
        q = _normed_rotated(row, heads, live_g, d, cos, signed_sin, q_norm_ptr, eps, DIM, NORM).to(q_ptr.dtype.element_ty)
        if (start <= pos) & (pos < end):
            new = pos + tl.arange(0, 1)
            k = _normed_rotated(row + HEADS * DIM, kv_head + tl.arange(0, 1), new >= 0, d, cos, signed_sin, k_norm_ptr,
                                eps, DIM, NORM)
            at = pool_ptr + _k_rows(kv_indices_ptr, first_page, new, new >= 0, kv_head, PAGE, KV_HEADS, DIM)[:, None] + d[None, :]
            tl.store(at, k.to(pool_ptr.dtype.element_ty))
            tl.store(at + v_offset, tl.load(row + (HEADS + KV_HEADS + kv_head) * DIM + d)[None, :])
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
        k = tl.load(pool_ptr + k_row[:, None] + d[None, :], mask=live_t[:, None], other=0.0)
        v = tl.load(pool_ptr + k_row[:, None] + v_offset + d[None, :], mask=live_t[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale
        s = tl.where(live_t[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    some = l_i > 0  # a slice past the sequence's end holds nothing: weight zero in the merge
    out = tl.where(some[:, None], acc / tl.where(some, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(some, m_i + tl.log(tl.where(some, l_i, 1.0)), float("-inf"))
    at = (seq * HEADS + heads) * SPLITS + split
    tl.store(part_out_ptr + at[:, None] * DIM + d[None, :], out, mask=live_g[:, None])
    tl.store(part_lse_ptr + at, lse, mask=live_g)


@triton.jit
def _merge_kernel(part_out_ptr, part_lse_ptr, out_ptr, out_stride, HEADS: tl.constexpr, DIM: tl.constexpr,
                  SPLITS: tl.constexpr, PDL: tl.constexpr):
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


def decode_attention(q: torch.Tensor, pool: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                     kv_lens: torch.Tensor, scale: float, out: torch.Tensor, rope: Rope | None = None) -> torch.Tensor:
    """Writes and returns `out` [B, heads, dim]. q [B, heads, dim] (rows of any stride, heads contiguous);
    pool [pages, 2, page size, kv heads, dim]; kv_indptr [B + 1], kv_indices, kv_lens [B] int32 on the device.
    With `rope`, q is the step's raw qkv [B, heads + 2 kv heads, dim] of decode tokens (each at position
    kv_len - 1): the kernel norms and rotates q, and writes each token's K and V to the pool, as
    runtime.rope_kv_kernel would have before it."""
    batch, _, dim = q.shape
    _, _, page, kv_heads, _ = pool.shape
    heads = q.shape[1] - 2 * kv_heads if rope is not None else q.shape[1]
    assert q.stride(2) == 1 and q.stride(1) == dim and pool.is_contiguous() and out.is_contiguous()
    splits = max(4, min(MAX_SPLITS, triton.next_power_of_2(PROGRAMS // (batch * kv_heads))))
    part_out = torch.empty(batch, heads, splits, dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(batch, heads, splits, dtype=torch.float32, device=q.device)
    norm = rope is not None and rope.q_norm is not None
    _split_kernel[(batch, kv_heads, splits)](
        q, q.stride(0), pool, kv_indptr, kv_indices, kv_lens, part_out, part_lse, scale,
        rope.cos_sin if rope is not None else part_out, rope.q_norm if norm else part_out, rope.k_norm if norm else part_out,
        rope.eps if rope is not None else 0.0, HEADS=heads, KV_HEADS=kv_heads, DIM=dim, PAGE=page,
        GROUP_BLOCK=max(16, triton.next_power_of_2(heads // kv_heads)), SPLITS=splits, BLOCK_T=BLOCK_T,
        LINE=min(dim, 128 // pool.element_size()), ROPE=rope is not None, NORM=norm, num_warps=4, **pdl.launch(q.device))
    _merge_kernel[(batch, heads)](part_out, part_lse, out, out.stride(0), HEADS=heads, DIM=dim, SPLITS=splits,
                                  num_warps=4, **pdl.launch(q.device))
    return out
