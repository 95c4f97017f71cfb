"""MXFP4 (OCP microscaling): blocks of 32 values, each a 4-bit e2m1 float, sharing a power-of-two scale, as GPT-OSS
ships its experts (`*_blocks`: two values a byte, the low nibble first; `*_scales`: the exponent biased by 127).
They are dequantized as they load: the engine holds the experts in its dtype."""

from __future__ import annotations

import torch

MXFP4_BLOCKS, MXFP4_SCALES = "_blocks", "_scales"
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # by code: sign, 2 exponent, 1 mantissa


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks [..., rows, G, 16] uint8 and scales [..., rows, G] uint8 -> [..., rows, 32·G] float32."""
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2).long()  # [..., G, 32], in order
    values = torch.tensor(E2M1, dtype=torch.float32)[codes]
    return torch.ldexp(values, scales.to(torch.int32)[..., None] - 127).flatten(-2)
