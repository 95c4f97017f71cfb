"""What the CPU path needs beyond plain torch: which dtype suits the processor, and linear layers
whose GEMMs suit the row count.

A decode step on CPU streams every weight from memory for a handful of rows, and `F.linear`
re-packs the weight on each call. Prepacked by oneDNN, the same GEMMs ran 1.3-1.5x faster on a
2-core Sapphire Rapids, in fp32 and in bf16; with AMX, bf16 prefill GEMMs ran 3x faster than fp32
ones. In fp32 on AVX2, ringllm's own kernel (runtime.cpu_kernels) streams the weights of a step of
up to SKINNY_ROWS rows faster still: a 4-row pass over SmolLM2-135M's layers took 15.4 ms against
oneDNN's 27.2 on a 2-core EPYC (benchmarks/results/cpu-kernels-session10.txt).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import structlog
import torch
from torch import nn

from runtime import cpu_kernels
from runtime.layers import linear_slots

log = structlog.get_logger()

PACKED_DTYPES = (torch.float32, torch.bfloat16)
SKINNY_ROWS = 12  # ringllm's kernel against oneDNN's packed GEMM over SmolLM2's layers: 1.77x at 4 rows, 1.24x at 8, 0.97x at 16
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


class SkinnyLinear(PackedLinear):
    """A PackedLinear that hands steps of up to SKINNY_ROWS rows to ringllm's streaming kernel, which
    reads the plain weight: it keeps both layouts, a second copy of the weights bought for decode speed.
    An lm_head tied to the embedding shares the embedding's weight and is not packed: only sampled rows
    reach it."""

    def __init__(self, linear: nn.Linear, tied: bool) -> None:
        nn.Module.__init__(self)
        self.weight = linear.weight.detach()
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.packed = None if tied else torch.ops.mkldnn._reorder_linear_weight(self.weight, BATCH_HINT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None or x.numel() <= SKINNY_ROWS * x.shape[-1]:
            return torch.ops.ringllm_cpu.skinny_linear(x, self.weight, self.bias)
        return super().forward(x)


def prepack_linears(model: nn.Module, dtype: torch.dtype) -> str:
    """Swap every nn.Linear of a loaded CPU model for a faster module where one runs; -> which: `skinny`
    (fp32 where ringllm's kernels build), `onednn`, or `torch` (plain nn.Linear). A tied lm_head of a
    oneDNN model gets its own packed copy; the embedding keeps the plain weight."""
    if dtype not in PACKED_DTYPES or not torch.backends.mkldnn.is_available():
        return "torch"
    skinny = dtype == torch.float32 and cpu_kernels.available() and all(
        linear.in_features % 8 == 0 for _, _, linear in linear_slots(model))
    embeddings = {m.weight.data_ptr() for m in model.modules() if isinstance(m, nn.Embedding)}
    try:
        for parent, name, linear in linear_slots(model):
            tied = linear.weight.data_ptr() in embeddings
            setattr(parent, name, SkinnyLinear(linear, tied) if skinny else PackedLinear(linear))
    except (RuntimeError, AttributeError) as exc:  # a torch without these oneDNN ops: plain linears still work
        log.warning("prepack_failed", error=str(exc))
        return "torch"
    return "skinny" if skinny else "onednn"
