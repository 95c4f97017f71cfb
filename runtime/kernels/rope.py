"""What the fused rope kernels take to norm and rotate q and the new K themselves."""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor


class Rope(NamedTuple):
    cos_sin: Tensor  # [max position, dim] fp32, cos halves then sin halves
    q_norm: Tensor | None
    k_norm: Tensor | None
    eps: float
