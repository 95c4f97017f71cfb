"""Programmatic dependent launch (PDL, Hopper and later) for the Triton kernels of a decode step.

A one-sequence decode step is a chain of about 200 small kernels, and between two of them the chip
idles: the last programs of one drain, then the next launches and starts its loads. A kernel launched
with PDL may start before the kernel ahead of it has finished. It does the work that depends on no
other kernel, such as pulling its first weight tile toward L2, and then waits for that kernel. A kernel
launched this way must wait before it reads or writes anything that another kernel writes or reads.
`RINGLLM_PDL=0` turns PDL off.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@functools.cache
def enabled(device_index: int) -> bool:
    """Whether kernels on this CUDA device launch with PDL (compute capability 9 and up)."""
    return os.environ.get("RINGLLM_PDL", "1") != "0" and torch.cuda.get_device_capability(device_index)[0] >= 9


def launch(device: torch.device) -> dict[str, bool]:
    """A ringllm kernel's launch options: its PDL constexpr (whether it waits) and Triton's launch_pdl,
    always equal, since a kernel launched with PDL that did not wait would race."""
    on = enabled(device.index)
    return {"PDL": on, "launch_pdl": on}


@functools.cache
def l2_bytes(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).L2_cache_size


def fits_half_l2(tensor: torch.Tensor) -> bool:
    """Whether a GEMV over this weight is short: its first tiles can wait in L2 while the kernel before
    ends, and the next kernel may launch early. Qwen3-0.6B's layers fit on the H200, Qwen3-8B's do not."""
    return tensor.numel() * tensor.element_size() <= l2_bytes(tensor.device.index) // 2


@triton.jit
def wait_for_previous_kernel(PDL: tl.constexpr, SHORT: tl.constexpr):
    """Blocks until the kernel before this one has finished and its writes are visible. A SHORT kernel
    then lets the next one launch at once, so that the next one's programs wait in free slots. A long
    GEMV lets it launch only as its own programs exit: programs waiting early had taken slots from its
    later waves (Qwen3-8B's down_proj, 25 -> 36 us a layer on the H200)."""
    if PDL:
        gdc_wait()
        if SHORT:
            gdc_launch_dependents()


@triton.jit
def prefetch_l2(pointers):
    """Starts loading the 128-byte lines at `pointers` into L2. A hint that changes no value: every
    multiprocessor's loads and stores meet in L2, so a line another kernel is still writing stays right."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // dummy $0", "=r,l", [pointers], dtype=tl.int32,
                              is_pure=False, pack=1)
