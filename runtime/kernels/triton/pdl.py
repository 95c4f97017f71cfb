"""Programmatic dependent launch (Hopper): a decode step's small kernels start before the one ahead
finishes, do their independent work, then wait before touching shared data. `RINGLLM_PDL=0`: off."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from transport import env


@functools.cache
def enabled(device_index: int) -> bool:
    """Whether kernels on this CUDA device launch with PDL (compute capability 9 and up)."""
    return env.pdl() and torch.cuda.get_device_capability(device_index)[0] >= 9


def launch(device: torch.device) -> dict[str, bool]:
    """A kernel's PDL constexpr (whether it waits) and Triton's launch_pdl: always equal, or it races."""
    on = enabled(device.index)
    return {"PDL": on, "launch_pdl": on}


@functools.cache
def l2_bytes(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).L2_cache_size


def fits_half_l2(tensor: torch.Tensor) -> bool:
    """Whether a GEMV over this weight is short enough to prefetch and let the next kernel launch early."""
    return tensor.numel() * tensor.element_size() <= l2_bytes(tensor.device.index) // 2


@triton.jit
def wait_for_previous_kernel(PDL: tl.constexpr, SHORT: tl.constexpr):
    """Waits for the previous kernel. SHORT kernels then let the next launch at once (waiting programs would
    take a long kernel's slots)."""
    if PDL:
        gdc_wait()
        if SHORT:
            gdc_launch_dependents()


@triton.jit
def prefetch_l2(pointers):
    """Starts loading the 128-byte lines at `pointers` into L2: a hint, safe since all SMs meet in L2."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // dummy $0", "=r,l", [pointers], dtype=tl.int32, is_pure=False, pack=1)
