"""The Gumbel-max draw as one Triton kernel: per row, hash the noise, add it and reduce, reading
the logits once. Its hash is the one `runtime.sampling.gumbel_noise` computes in torch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _mix32(x):
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & 0xFFFFFFFF
    x = ((x ^ (x >> 15)) * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


@triton.jit
def _gumbel_argmax_kernel(scores_ptr, stride, temperatures_ptr, keys_ptr, out_ptr, vocab, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    temperature = tl.load(temperatures_ptr + row)
    hot = temperature > 0
    inv_t = 1.0 / tl.where(hot, temperature, 1.0)
    key0 = tl.load(keys_ptr + 2 * row).to(tl.uint64)
    key1 = tl.load(keys_ptr + 2 * row + 1).to(tl.uint64)
    best = tl.full((), float("-inf"), tl.float32)
    best_id = tl.full((), 0, tl.int64)
    for start in range(0, vocab, BLOCK):
        ids = start + tl.arange(0, BLOCK)
        inside = ids < vocab
        x = tl.load(scores_ptr + row * stride + ids, mask=inside, other=float("-inf")).to(tl.float32)
        h = _mix32(_mix32(ids.to(tl.uint64) ^ key0) ^ key1)
        u = ((h >> 8).to(tl.float32) + 0.5) * 5.9604644775390625e-08
        noisy = tl.where(hot, x * inv_t - tl.log(-tl.log(u)), x)
        noisy = tl.where(inside, noisy, float("-inf"))
        block_best = tl.max(noisy, axis=0)
        block_id = tl.argmax(noisy, axis=0).to(tl.int64) + start
        better = block_best > best
        best_id = tl.where(better, block_id, best_id)
        best = tl.where(better, block_best, best)
    tl.store(out_ptr + row, best_id)


def gumbel_argmax(scores: torch.Tensor, temperatures: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    scores = scores.contiguous()
    out = torch.empty(scores.shape[0], dtype=torch.int64, device=scores.device)
    _gumbel_argmax_kernel[(scores.shape[0],)](scores, scores.stride(0), temperatures, keys, out, scores.shape[1], BLOCK=4096)
    return out
