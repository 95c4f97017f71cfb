"""Pinned host memory to device memory by a kernel, which reads it through the unified address space:
a cudaMemcpyAsync hands the stream to a copy engine and back, and the chip idles at each hand-over."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit(do_not_specialize=["words0", "words1"])  # page lists vary in length: one variant
def _copy_kernel(src0, dst0, words0, src1, dst1, words1, BLOCK: tl.constexpr):
    which, block = tl.program_id(0), tl.program_id(1)
    offsets = block * BLOCK + tl.arange(0, BLOCK)
    if which == 0:
        inside = offsets < words0
        tl.store(dst0 + offsets, tl.load(src0 + offsets, mask=inside), mask=inside)
    else:
        inside = offsets < words1
        tl.store(dst1 + offsets, tl.load(src1 + offsets, mask=inside), mask=inside)


def _words(tensor: torch.Tensor) -> torch.Tensor:
    assert tensor.is_contiguous() and tensor.numel() * tensor.element_size() % 4 == 0
    return tensor.view(-1).view(torch.int32)


def send(copies: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copies one or two pinned host tensors to the device in one launch; sources stay untouched until it has run."""
    assert 0 < len(copies) <= 2
    words = [(_words(src), _words(dst)) for src, dst in copies]
    assert all(src.numel() == dst.numel() and not src.is_cuda and dst.is_cuda for src, dst in words)
    (src0, dst0), (src1, dst1) = words[0], words[-1]
    copy1 = src1.numel() if len(words) == 2 else 0
    most = max(src.numel() for src, _ in words)
    _copy_kernel[(2, triton.cdiv(most, BLOCK))](src0, dst0, src0.numel(), src1, dst1, copy1, BLOCK=BLOCK)
