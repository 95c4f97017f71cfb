"""FP8 weights. Checkpoints in the block-quantized format of DeepSeek-V3 and Qwen3-*-FP8: each
projection's weight stored as float8_e4m3fn, with `weight_scale_inv` holding one fp32 scale per block
of weight_block_size (128 x 128) rows and columns, the last blocks of a dimension that is not a
multiple of the block being partial; embeddings, norms and the LM head stay unquantized. Dequantized,
a weight is fp8 · scale_inv of its block. And, for other checkpoints, online FP8 as vLLM offers it,
with a scale per row rather than per tensor: each projection's rows quantized (max |w| / 448) at load."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import safe_open

from runtime.attention.pool import FP8_MAX

SCALE_SUFFIX = "weight_scale_inv"
# the decoder's projections and the experts' stacked ones; not embeddings, norms, the LM head or a router
QUANTIZED = ("qkv_proj.weight", "o_proj.weight", "gate_up_proj.weight", "down_proj.weight", "experts.gate_up_proj", "experts.down_proj")
KV_SCALE = re.compile(r"layers\.(\d+)\.self_attn\.([kv])_scale$")  # vLLM's names for an FP8 KV cache's scales


def scale_name(weight_name: str) -> str:
    """The checkpoint name of a quantized weight's block scales."""
    return weight_name.removesuffix("weight") + SCALE_SUFFIX


def dequantize_blockwise(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """[rows, cols] fp32 from an FP8 weight and its [ceil(rows/block), ceil(cols/block)] scales."""
    rows, cols = weight.shape
    expected = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"block scales of shape {tuple(scale_inv.shape)} for a {rows}x{cols} weight in blocks of {block}: not {expected}")
    scales = scale_inv.float().repeat_interleave(block[0], dim=0)[:rows].repeat_interleave(block[1], dim=1)[:, :cols]
    return weight.float() * scales


def kv_scales(model_dir: Path, num_layers: int) -> list[tuple[float, float]]:
    """Each layer's (K, V) scales for an FP8 KV cache: the checkpoint's k_scale / v_scale, else 1.0."""
    scales = [[1.0, 1.0] for _ in range(num_layers)]
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if found := KV_SCALE.search(name):
                    scales[int(found[1])][found[2] == "v"] = float(f.get_tensor(name).float().item())
    return [(k, v) for k, v in scales]


def per_channel_round_trip(weight: torch.Tensor) -> torch.Tensor:
    """What `weight` ([..., rows, cols]) becomes as FP8 with one scale per row, dequantized."""
    scale = weight.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    return ((weight.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale).to(weight.dtype)


@torch.no_grad()
def quantize_per_channel(model: torch.nn.Module) -> int:
    """Round every projection of `model` through per-row FP8, in place; returns how many. The rounded
    weights run in the model's dtype (README, FP8)."""
    names = [name for name, _ in model.named_parameters() if name.endswith(QUANTIZED)]
    params = dict(model.named_parameters())
    for name in names:
        params[name].copy_(per_channel_round_trip(params[name]))
    return len(names)
