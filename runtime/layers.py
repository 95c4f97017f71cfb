"""Building blocks of the dense decoder: RMSNorm, SiLU-and-mul and rotary embeddings.

Norm and activation sit behind a small registry of fused-op sets; `torch` is the reference
that runs everywhere. Rotary math follows the Hugging Face formulation (half-split rotation,
fp32 angles) so that outputs match transformers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from runtime.config import RopeConfig


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def torch_silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


@dataclass(frozen=True)
class FusedOps:
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    silu_and_mul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _flattened(kernel: Callable) -> Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]:
    """The CUDA norm kernels take [tokens, hidden]; q/k norms come as [tokens, heads, head_dim]."""
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return kernel(x.reshape(-1, x.shape[-1]).contiguous(), weight, eps).view(x.shape)

    return rms_norm


def _sgl_kernel() -> FusedOps:
    import sgl_kernel

    return FusedOps(_flattened(sgl_kernel.rmsnorm), torch_silu_and_mul)


def _flashinfer() -> FusedOps:
    import flashinfer.norm

    return FusedOps(_flattened(flashinfer.norm.rmsnorm), torch_silu_and_mul)


FUSED_OPS: dict[str, Callable[[], FusedOps]] = {"sgl_kernel": _sgl_kernel, "flashinfer": _flashinfer,
                                                "torch": lambda: FusedOps(torch_rms_norm, torch_silu_and_mul)}


def select_fused_ops(device: torch.device, dtype: torch.dtype) -> tuple[str, FusedOps]:
    """The first op set that loads: sgl-kernel, then flashinfer, then torch (CPU, fp32 or neither)."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return "torch", FUSED_OPS["torch"]()
    for name, load in FUSED_OPS.items():
        try:
            return name, load()
        except ImportError:
            continue
    raise AssertionError("the torch op set always loads")


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, ops: FusedOps) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
    if rope.kind == "llama3":  # stretch low frequencies by `factor`, blend the band in between
        low_wavelen = rope.original_max_position / rope.low_freq_factor
        high_wavelen = rope.original_max_position / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        blend = (rope.original_max_position / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - blend) * scaled / rope.factor + blend * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, 1, head_dim] cos and sin, computed in fp32."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)
