"""RMSNorm, SiLU-and-mul and rope behind fused-op sets chosen at start-up: sgl_kernel or flashinfer
(CUDA), ringllm_cpu (fp32 CPU), and `torch`, the reference, whose math follows Hugging Face's. Also
the one-row fusions a decoder layer, dense or sparse, may be handed (OneRowFusion)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from runtime.config import RopeConfig

Tensor = torch.Tensor


def torch_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """One call, not seven; Hugging Face's values in fp32 (half precision may differ by a rounding)."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def torch_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    residual = x + residual
    return torch_rms_norm(residual, weight, eps), residual


def torch_silu_and_mul(gate_up: Tensor) -> Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def torch_gelu_tanh_and_mul(gate_up: Tensor) -> Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def torch_rope_tables(positions: Tensor, cos_sin: Tensor) -> tuple[Tensor, Tensor]:
    """Full-width cos, and sin with its first half negated, so that rotate_half(x)·sin is roll(x, half)·sin."""
    cos, sin = cos_sin[positions].chunk(2, dim=-1)
    return torch.cat((cos, cos), -1)[:, None, :], torch.cat((-sin, sin), -1)[:, None, :]


def torch_rope(positions: Tensor, qk: Tensor, heads: int, tables: tuple[Tensor, Tensor]) -> None:
    """Half-split rotation of q and k heads together, in place, with Hugging Face's arithmetic."""
    cos, sin = tables
    qk.copy_(qk * cos + qk.roll(qk.shape[-1] // 2, -1) * sin)


def _whole_cache(positions: Tensor, cos_sin: Tensor) -> Tensor:
    return cos_sin  # the CUDA rope kernels index the cache by position themselves


@dataclass(frozen=True)
class FusedOps:
    """The kernels a decoder layer calls. In-place kernels return their (mutated) inputs."""

    rms_norm: Callable[[Tensor, Tensor, float], Tensor]
    add_rms_norm: Callable[[Tensor, Tensor, Tensor, float], tuple[Tensor, Tensor]]  # (normed, new residual)
    silu_and_mul: Callable[[Tensor], Tensor]
    rope: Callable[[Tensor, Tensor, int, Any], None]  # in place: (positions, qk [T, heads + kv heads, dim], heads, tables)
    # q/k norms, rope and the KV write in one pass (runtime.kernels.triton.rope_kv), where available
    rope_kv_write: Callable[..., None] | None = None
    rope_cache_fp32: bool = False
    rope_tables: Callable[[Tensor, Tensor], Any] = _whole_cache
    # a sparse block from its router logits, on CUDA: (x, logits, gate_up, down, top_k, renormalise, silu_and_mul,
    # load, routed) -> output, each expert's pairs added to load (runtime.kernels.triton.fused_moe)
    fused_moe: Callable[..., Tensor] | None = None
    gelu_tanh_and_mul: Callable[[Tensor], Tensor] = torch_gelu_tanh_and_mul  # Gemma's GeGLU


def _rows(kernel: Callable) -> Callable[[Tensor, Tensor, float], Tensor]:
    """The CUDA norm kernels take [rows, hidden]; q/k norms come as [tokens, heads, head_dim]."""

    def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
        return kernel(x.reshape(-1, x.shape[-1]).contiguous(), weight, eps).view(x.shape)

    return rms_norm


def _in_place_add_norm(kernel: Callable) -> Callable[[Tensor, Tensor, Tensor, float], tuple[Tensor, Tensor]]:
    def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        kernel(x, residual, weight, eps)  # residual += x; x = norm(residual)
        return x, residual

    return add_rms_norm


def _triton_rope_kv_write() -> Callable[..., None] | None:
    try:
        from runtime.kernels.triton.rope_kv import rope_kv_write
    except ImportError:
        return None
    return rope_kv_write


def _triton_fused_moe() -> Callable[..., Tensor] | None:
    """The CUDA sparse block (Triton GEMMs over sgl-kernel's routing), where both import: every op
    set carries it, as the per-expert CPU path syncs with the host and CUDA graphs cannot capture it."""
    try:
        import sgl_kernel  # noqa: F401

        from runtime.kernels.triton.fused_moe import moe_forward
    except (ImportError, OSError, RuntimeError):
        return None
    return moe_forward


def _sgl_kernel() -> FusedOps:
    import sgl_kernel

    def rope(positions: Tensor, qk: Tensor, heads: int, cos_sin: Tensor) -> None:
        q, k = qk[:, :heads].view(len(qk), -1), qk[:, heads:].view(len(qk), -1)
        sgl_kernel.rotary_embedding(positions, q, k, qk.shape[-1], cos_sin, True)

    fused = _triton_rope_kv_write()  # its cache is fp32; sgl-kernel's rope wants the activation dtype
    return FusedOps(
        _rows(sgl_kernel.rmsnorm),
        _in_place_add_norm(sgl_kernel.fused_add_rmsnorm),
        sgl_kernel.silu_and_mul,
        rope,
        fused,
        rope_cache_fp32=fused is not None,
        fused_moe=_triton_fused_moe(),
        gelu_tanh_and_mul=sgl_kernel.gelu_tanh_and_mul,
    )


def _flashinfer() -> FusedOps:
    import flashinfer

    def rope(positions: Tensor, qk: Tensor, heads: int, cos_sin: Tensor) -> None:
        q, k = qk[:, :heads].view(len(qk), -1), qk[:, heads:].view(len(qk), -1)
        flashinfer.rope.apply_rope_with_cos_sin_cache_inplace(positions, q, k, qk.shape[-1], cos_sin, True)

    return FusedOps(
        _rows(flashinfer.norm.rmsnorm),
        _in_place_add_norm(flashinfer.norm.fused_add_rmsnorm),
        flashinfer.activation.silu_and_mul,
        rope,
        _triton_rope_kv_write(),
        rope_cache_fp32=True,
        fused_moe=_triton_fused_moe(),
        gelu_tanh_and_mul=flashinfer.activation.gelu_tanh_and_mul,
    )


def _ringllm_cpu() -> FusedOps:
    from runtime.kernels.cpu import build as cpu_kernels

    if not cpu_kernels.available():
        raise ImportError("ringllm's CPU kernels are not built here")
    ops = torch.ops.ringllm_cpu
    return FusedOps(ops.rms_norm, _in_place_add_norm(ops.add_rms_norm), ops.silu_and_mul, torch_rope, rope_tables=torch_rope_tables)


FUSED_OPS: dict[str, Callable[[], FusedOps]] = {
    "sgl_kernel": _sgl_kernel,
    "flashinfer": _flashinfer,
    "ringllm_cpu": _ringllm_cpu,
    "torch": lambda: FusedOps(
        torch_rms_norm, torch_add_rms_norm, torch_silu_and_mul, torch_rope, rope_tables=torch_rope_tables, fused_moe=_triton_fused_moe()
    ),
}


def select_fused_ops(device: torch.device, dtype: torch.dtype, prefer: str | None = None) -> tuple[str, FusedOps]:
    """`prefer`, else the first set that loads for the device and dtype, torch last."""
    if prefer is not None:
        return prefer, FUSED_OPS[prefer]()
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        candidates = ("sgl_kernel", "flashinfer")
    elif device.type == "cpu" and dtype == torch.float32:
        candidates = ("ringllm_cpu",)
    else:
        candidates = ()
    for name in candidates:
        try:
            return name, FUSED_OPS[name]()
        except (ImportError, AttributeError, RuntimeError, OSError):
            continue
    return "torch", FUSED_OPS["torch"]()


def linear_slots(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    return [(parent, name, child) for parent in model.modules() for name, child in parent.named_children() if isinstance(child, nn.Linear)]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, ops: FusedOps) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.ops = ops

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


def norm_then_linear(h: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm, linear: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """linear(norm(h + residual)) and the new residual (h where there is none yet)."""
    if residual is None:
        return linear(norm(h)), h
    h, summed = norm(h, residual)
    return linear(h), summed


NormLinear = Callable[[Tensor, Tensor | None, RMSNorm, nn.Module], tuple[Tensor, Tensor]]


@dataclass(frozen=True)
class OneRowFusion:
    """One-row kernels fusing a norm or SiLU-and-mul into the projection after it (gemm_tuner sets the winners).
    With `o_proj` set, o_proj and down_proj add the residual themselves and the layer hands on the sum."""

    qkv: NormLinear | None = None
    gate_up: NormLinear | None = None
    down: Callable[[Tensor, nn.Module, Tensor | None], Tensor] | None = None
    o_proj: Callable[[Tensor, nn.Module, Tensor], Tensor] | None = None


NO_FUSION = OneRowFusion()


def rope_inv_freq(head_dim: int, rope: RopeConfig, divisors: tuple[float, ...] = ()) -> Tensor:
    """Each rotated pair's angle per position; `divisors`: LongRoPE's factors, one a pair."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
    if divisors:
        inv_freq = inv_freq / torch.tensor(divisors, dtype=torch.float32)
    if rope.kind == "linear":  # positions divided by `factor` (Gemma 3's full layers)
        inv_freq = inv_freq / rope.factor
    if rope.kind == "yarn":  # interpolated by `factor` below beta_slow rotations in the pretraining length, kept above beta_fast
        low, high = (
            head_dim * math.log(rope.original_max_position / (b * 2 * math.pi)) / (2 * math.log(rope.theta))
            for b in (rope.beta_fast, rope.beta_slow)
        )
        if rope.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001)).clamp(0, 1)
        inv_freq = inv_freq / rope.factor * ramp + inv_freq * (1 - ramp)
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


def rope_cos_sin_cache(max_position: int, head_dim: int, rope: RopeConfig) -> Tensor:
    """[max_position, head_dim] fp32: cos of each half's angles, then sin (sgl-kernel's layout). LongRoPE's is
    twice as long, all scaled by its attention factor: row p holds the short factors below the pretraining length
    and the long ones from there on (a request whose prompt fits that length: the keys it wrote before passing it
    keep the short ones, as in vLLM and SGLang); row max_position + p the long ones (a request whose prompt is
    longer, every position: Engine._host_step picks the row)."""
    positions = torch.arange(max_position, dtype=torch.int64).float()[:, None]
    if rope.kind != "longrope":
        freqs = positions * rope_inv_freq(head_dim, rope)[None, :]
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
        return cache * rope.attention_factor if rope.attention_factor != 1.0 else cache  # YaRN's
    switch = rope.original_max_position
    short, long = (rope_inv_freq(head_dim, rope, factors)[None, :] for factors in (rope.short_factor, rope.long_factor))
    freqs = torch.cat((positions[:switch] * short, positions[switch:] * long, positions * long))
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1) * rope.attention_factor
