"""The Gumbel-max draw as Triton kernels: hash the noise, add it and reduce, reading the logits
once, in their own dtype. Its hash is the one `runtime.sampling.gumbel_noise` computes in torch.

Each row's vocabulary is cut into chunks, one program each, so even one row fills the GPU; a
second pass picks each row's best chunk. The hash runs in 32-bit lanes (64-bit multiplies are
several instructions each on the GPU), which wrap exactly like the torch twin's masked math.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048
BLOCKS_PER_CHUNK = 4


@triton.jit
def _mix32(x):
    x = (x ^ (x >> 16)) * 0x7FEB352D
    x = (x ^ (x >> 15)) * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _chunk_best_kernel(scores_ptr, stride, temperatures_ptr, keys_ptr, best_ptr, best_id_ptr, vocab, chunks,
                       BLOCK: tl.constexpr, BLOCKS_PER_CHUNK: tl.constexpr):
    row, chunk = tl.program_id(0), tl.program_id(1)
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
        h = _mix32(_mix32(ids.to(tl.uint32) ^ key0) ^ key1)
        u = ((h >> 8).to(tl.float32) + 0.5) * 5.9604644775390625e-08
        noisy = tl.where(hot, x * inv_t - tl.log(-tl.log(u)), x)
        noisy = tl.where(inside, noisy, float("-inf"))
        block_best = tl.max(noisy, axis=0)
        block_id = tl.argmax(noisy, axis=0) + (chunk * BLOCKS_PER_CHUNK + block) * BLOCK
        better = block_best > best
        best_id = tl.where(better, block_id, best_id)
        best = tl.where(better, block_best, best)
    tl.store(best_ptr + row * chunks + chunk, best)
    tl.store(best_id_ptr + row * chunks + chunk, best_id)


def gumbel_argmax(scores: torch.Tensor, temperatures: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """scores [B, vocab] (any float dtype, unit stride along the vocabulary) -> [B] int64."""
    rows, vocab = scores.shape
    chunks = triton.cdiv(vocab, BLOCK * BLOCKS_PER_CHUNK)
    best = torch.empty(rows, chunks, dtype=torch.float32, device=scores.device)
    best_id = torch.empty(rows, chunks, dtype=torch.int32, device=scores.device)
    _chunk_best_kernel[(rows, chunks)](scores, scores.stride(0), temperatures, keys, best, best_id, vocab, chunks,
                                       BLOCK=BLOCK, BLOCKS_PER_CHUNK=BLOCKS_PER_CHUNK)
    return best_id.gather(1, best.argmax(dim=1, keepdim=True))[:, 0].long()
