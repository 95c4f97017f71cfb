"""FP8 weights. Checkpoints in the block-quantized format of DeepSeek-V3 and Qwen3-*-FP8: each
projection's weight stored as float8_e4m3fn, with `weight_scale_inv` holding one fp32 scale per block
of weight_block_size (128 x 128) rows and columns, the last blocks of a dimension that is not a
multiple of the block being partial; embeddings, norms and the LM head stay unquantized. Dequantized,
a weight is fp8 · scale_inv of its block. And, for other checkpoints, online FP8 as vLLM offers it,
with a scale per row rather than per tensor: each projection's rows quantized (max |w| / 448) at load.

On CPU the projections run in the model's dtype, FP8-rounded. On CUDA they become Fp8Linear: one byte
a weight, multiplied by runtime.kernels.triton.fp8_gemm (or flashinfer's block-scaled GEMM where
start-up timing chose it)."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from runtime.attention.pool import FP8_MAX

SCALE_SUFFIX = "weight_scale_inv"
# the decoder's projections and the experts' stacked ones; not embeddings, norms, the LM head or a router
QUANTIZED = ("qkv_proj.weight", "o_proj.weight", "gate_up_proj.weight", "down_proj.weight", "experts.gate_up_proj", "experts.down_proj")
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # the dense ones, which run FP8 GEMMs on CUDA
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
    weights run in the model's dtype (docs/fp8.md)."""
    names = [name for name, _ in model.named_parameters() if name.endswith(QUANTIZED)]
    params = dict(model.named_parameters())
    for name in names:
        params[name].copy_(per_channel_round_trip(params[name]))
    return len(names)


def quantize_blockwise(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` [rows, cols] as float8_e4m3fn and its fp32 scales, one per block (max |w| / 448), the last
    blocks partial: dequantize_blockwise's inverse."""
    rows, cols = weight.shape
    padded = torch.zeros(-(-rows // block[0]) * block[0], -(-cols // block[1]) * block[1], dtype=torch.float32, device=weight.device)
    padded[:rows, :cols] = weight
    blocks = padded.view(padded.shape[0] // block[0], block[0], padded.shape[1] // block[1], block[1])
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    quantized = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return quantized.view(padded.shape)[:rows, :cols].contiguous(), scale


Fp8Kernel = Callable[[torch.Tensor, "Fp8Linear"], torch.Tensor]


class Fp8Linear(nn.Module):
    """A projection whose weight is FP8 with block scales. `kernels` maps a call's rows (a power of
    two, the most 512) to the kernel start-up timing chose there; the Triton GEMM runs the rest."""

    weight: torch.Tensor  # buffers, registered in __init__
    weight_scale: torch.Tensor

    def __init__(self, linear: nn.Linear, block: tuple[int, int]) -> None:
        super().__init__()
        from runtime.kernels.triton.fp8_gemm import default_tiles, fp8_gemm

        weight, scale = quantize_blockwise(linear.weight.detach(), block)
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", scale)
        self.bias = linear.bias
        self.block = block
        self.out_features, self.in_features = weight.shape
        self.kernels: dict[int, Fp8Kernel] = {}
        self._gemm, self._tiles = fp8_gemm, default_tiles

    def triton(self, x: torch.Tensor, tiles=None, fp8_activations: bool = False) -> torch.Tensor:
        """The Triton GEMM (W8A16 unless fp8_activations) at `tiles`, else its default for x's rows."""
        return self._gemm(x, self.weight, self.weight_scale, self.block, self.bias, tiles or self._tiles(x.shape[0]), fp8_activations)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = self.kernels.get(min(512, 1 << (x.shape[0] - 1).bit_length()))
        return kernel(x, self) if kernel is not None else self.triton(x)


@torch.no_grad()
def use_fp8_linears(model: nn.Module, block: tuple[int, int] | None) -> int:
    """Replace every dense projection by an Fp8Linear with `block` scales (None: one per row); returns how many."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if name in PROJECTIONS and isinstance(child, nn.Linear):
                setattr(parent, name, Fp8Linear(child, block or (1, child.in_features)))
                swapped += 1
    return swapped
