"""Batch invariance for deterministic inference. Libraries pick a kernel, tiling and split of a row-wise
op by how many rows it has (a GEMM's split-K, a reduction's threads per row), so a row's rounding depends
on what else shares its step. Here such ops run on blocks of exactly `rows` rows (the last one
zero-padded): each row meets one kernel and one reduction order, whatever else the step holds."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")
BLOCK_ROWS = {"cuda": 64, "cpu": 8}  # a decode batch's block: one weight pass for up to this many rows


def in_blocks(op: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, rows: int) -> torch.Tensor:
    """op(x), run on blocks of exactly `rows` of x's rows: a row's result does not depend on how many there are."""
    count = x.shape[0]
    padded = -(-count // rows) * rows
    x = torch.cat([x, x.new_zeros(padded - count, *x.shape[1:])]) if padded != count else x.contiguous()
    blocks = [op(block) for block in x.split(rows)]
    return (blocks[0] if len(blocks) == 1 else torch.cat(blocks))[:count]


class BatchInvariantLinear(nn.Module):
    """`inner` (a linear module of any kind) on fixed-size blocks of rows."""

    def __init__(self, inner: nn.Module, rows: int) -> None:
        super().__init__()
        self.inner, self.rows = inner, rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return in_blocks(self.inner, x, self.rows)


def make_batch_invariant(model: nn.Module, device: torch.device) -> int:
    """Wraps every projection of `model` in place; returns the block's row count."""
    rows = BLOCK_ROWS[device.type]
    for parent in list(model.modules()):
        for name in PROJECTIONS:
            if isinstance(child := getattr(parent, name, None), nn.Module) and not isinstance(child, BatchInvariantLinear):
                setattr(parent, name, BatchInvariantLinear(child, rows))
    return rows
