"""Batch-invariant projections for deterministic inference. BLAS libraries pick a GEMM's kernel, tiling
and split-K by its row count, so a row's rounding depends on how many rows share its step. Here every
projection runs on blocks of exactly `rows` rows (the last one zero-padded): each row meets one kernel
and one reduction order, whatever else the step holds."""

from __future__ import annotations

import torch
from torch import nn

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")
BLOCK_ROWS = {"cuda": 64, "cpu": 8}  # a decode batch's block: one weight pass for up to this many rows


class BatchInvariantLinear(nn.Module):
    """`inner` (a linear module of any kind) on fixed-size blocks of rows."""

    def __init__(self, inner: nn.Module, rows: int) -> None:
        super().__init__()
        self.inner, self.rows = inner, rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        count = x.shape[0]
        padded = -(-count // self.rows) * self.rows
        if padded != count:
            x = torch.cat([x, x.new_zeros(padded - count, *x.shape[1:])])
        blocks = [self.inner(block) for block in x.split(self.rows)]
        return (blocks[0] if len(blocks) == 1 else torch.cat(blocks))[:count]


def make_batch_invariant(model: nn.Module, device: torch.device) -> int:
    """Wraps every projection of `model` in place; returns the block's row count."""
    rows = BLOCK_ROWS[device.type]
    for parent in list(model.modules()):
        for name in PROJECTIONS:
            if isinstance(child := getattr(parent, name, None), nn.Module) and not isinstance(child, BatchInvariantLinear):
                setattr(parent, name, BatchInvariantLinear(child, rows))
    return rows
