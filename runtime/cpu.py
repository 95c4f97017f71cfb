"""What the CPU path needs beyond plain torch: which dtype suits the processor, and linear layers
whose weights oneDNN has laid out for its GEMM once, at load time.

A decode step on CPU streams every weight from memory for a handful of rows, and `F.linear`
re-packs the weight on each call. Prepacked, the same GEMMs ran 1.3-1.5x faster on the 2-core
development machine (Sapphire Rapids), in fp32 and in bf16; with AMX, bf16 prefill GEMMs ran
3x faster than fp32 ones.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import structlog
import torch
from torch import nn

from runtime.layers import linear_slots

log = structlog.get_logger()

PACKED_DTYPES = (torch.float32, torch.bfloat16)
BATCH_HINT = 8  # the row count oneDNN tunes the layout for: decode batches; prefill rows lose nothing measurable


def cpuinfo(field: str) -> str:
    """The first processor's `field` in /proc/cpuinfo ('' where there is none)."""
    try:
        line = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith(field))
    except (OSError, StopIteration):
        return ""
    return line.partition(":")[2].strip()


@cache
def has_amx_bf16() -> bool:
    """AMX tiles with bf16: oneDNN's bf16 GEMMs there outrun fp32 ones (elsewhere bf16 is emulated
    and slower). Read from the kernel's CPU flags, as torch offers no public query."""
    return "amx_bf16" in cpuinfo("flags").split()


def default_dtype() -> torch.dtype:
    return torch.bfloat16 if has_amx_bf16() else torch.float32


class PackedLinear(nn.Module):
    """`nn.Linear` on a oneDNN-prepacked weight (y = x W^T + b)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), BATCH_HINT)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [None], "")


def prepack_linears(model: nn.Module, dtype: torch.dtype) -> bool:
    """Swap every nn.Linear of a loaded CPU model for a PackedLinear, where oneDNN can run it.
    A tied lm_head gets its own packed copy; the embedding keeps the plain weight."""
    if dtype not in PACKED_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    try:
        for parent, name, linear in linear_slots(model):
            setattr(parent, name, PackedLinear(linear))
    except (RuntimeError, AttributeError) as exc:  # a torch without these oneDNN ops: plain linears still work
        log.warning("prepack_failed", error=str(exc))
        return False
    return True
