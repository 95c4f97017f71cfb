"""The CPU path's dtype and linears: weights prepacked by oneDNN once (`F.linear` re-packs per call),
and in fp32 on AVX2 steps of up to SKINNY_ROWS rows on ringllm's kernel, which streams faster still."""

from __future__ import annotations

from functools import cache

import structlog
import torch
from torch import nn

from runtime.kernels.cpu import build as cpu_kernels
from runtime.kernels.cpu.build import cpuinfo
from runtime.models.layers import linear_slots

log = structlog.get_logger()

PACKED_DTYPES = (torch.float32, torch.bfloat16)
SKINNY_ROWS = 12  # ringllm's kernel beats oneDNN's up to about this many rows
BATCH_HINT = 8  # the row count oneDNN tunes the layout for: decode batches


@cache
def has_amx_bf16() -> bool:
    """AMX bf16 tiles, from /proc/cpuinfo (torch has no public query); elsewhere bf16 is emulated."""
    return "amx_bf16" in cpuinfo("flags").split()


def default_dtype() -> torch.dtype:
    return torch.bfloat16 if has_amx_bf16() else torch.float32


class PackedLinear(nn.Module):
    """`nn.Linear` on a oneDNN-prepacked weight."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), BATCH_HINT)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [None], "")


class SkinnyLinear(PackedLinear):
    """Also keeps the plain weight for steps of up to SKINNY_ROWS rows; a tied lm_head is not packed."""

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
    """Swap every nn.Linear for a faster module; returns which: `skinny`, `onednn` or `torch` (none)."""
    if dtype not in PACKED_DTYPES or not torch.backends.mkldnn.is_available():
        return "torch"
    skinny = dtype == torch.float32 and cpu_kernels.available() and all(linear.in_features % 8 == 0 for _, _, linear in linear_slots(model))
    embeddings = {m.weight.data_ptr() for m in model.modules() if isinstance(m, nn.Embedding)}
    try:
        for parent, name, linear in linear_slots(model):
            tied = linear.weight.data_ptr() in embeddings
            setattr(parent, name, SkinnyLinear(linear, tied) if skinny else PackedLinear(linear))
    except (RuntimeError, AttributeError) as exc:
        log.warning("prepack_failed", error=str(exc))
        return "torch"
    return "skinny" if skinny else "onednn"
