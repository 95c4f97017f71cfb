"""Few-row kernels for CUDA decode, chosen per weight shape and row count by timing at start-up.

cuBLAS's heuristics pick poor kernels for some few-row shapes. On the H200, Qwen3-0.6B's o_proj
(2048 -> 1024) took 12.3 us at 1-4 rows under cuBLAS and 3.6 us under flashinfer's `tinygemm_bf16`
(TensorRT-LLM's latency GEMM), and ringllm's one-row GEMV (runtime.gemv_kernel) beat cuBLAS on every
Qwen3 decode shape at one row, Qwen3-8B's o_proj at 3.3 TB/s against 2.7. No kernel is right
everywhere (tinygemm loses on wide outputs and past 16 rows), so each shape's linears are timed every
way, all layers in one CUDA graph as decode runs them, at the graph batch sizes; a kernel replaces
cuBLAS only at the row counts where it won.

At one row, the GEMV can also fold in the kernel before the projection: a decoder layer's RMSNorm
(with the residual add) before qkv_proj and gate_up_proj, and SiLU-and-mul before down_proj. Each
such pair is timed fused against the pair as chosen above, over all layers, and fused where that won:
Qwen3-8B's gate_up (24576 x 4096) streamed faster alone, its norm a kernel apart.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Callable, Iterable

import structlog
import torch
import torch.nn.functional as F
from torch import nn

from runtime import cuda_graph
from runtime.layers import linear_slots
from runtime.models.dense import DecoderLayer, OneRowFusion

log = structlog.get_logger()

Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (x, weight, bias) -> x·weightᵀ + bias

MAX_ROWS = 16  # one or two of tinygemm's 8-row tiles; past that it lost on every shape measured
MAX_K = 4096  # tinygemm hung on Qwen3-8B's down_proj (K = 12288) with flashinfer 0.6.6: larger K is never tried
MARGIN = 0.97  # a kernel must beat cuBLAS by 3% (best of three alternated rounds), so noise does not flip a choice


def load_tinygemm(device: torch.device, dtype: torch.dtype) -> Callable | None:
    """flashinfer's tinygemm_bf16, on Hopper (sm90) in bf16: where MAX_K was established. Other
    architectures build the kernel with fewer pipeline stages, whose safe K was never measured."""
    if device.type != "cuda" or dtype != torch.bfloat16 or torch.cuda.get_device_capability(device)[0] != 9:
        return None
    try:
        from flashinfer.gemm import tinygemm_bf16
    except ImportError:
        return None
    return tinygemm_bf16


def _gemv_kernels(device: torch.device, dtype: torch.dtype):
    """runtime.gemv_kernel where Triton imports, on CUDA in half precision; else None."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return None
    try:
        from runtime import gemv_kernel
    except ImportError:
        return None
    return gemv_kernel


def _candidates(weight: torch.Tensor, rows: int, tinygemm: Callable | None, gemv_kernel) -> dict[str, Kernel]:
    """The kernels that may run x·weightᵀ at `rows` rows. Each takes a bias (zeros where the linear has none)."""
    n, k = weight.shape
    kernels: dict[str, Kernel] = {"cublas": lambda x, w, b: F.linear(x, w, b)}
    if tinygemm is not None and k <= MAX_K and k % 64 == 0 and n % 16 == 0:  # tinygemm's tiling needs K % 64 and N % 16
        def run_tinygemm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            out = x.new_empty(x.shape[0], w.shape[0])
            tinygemm(x.contiguous(), w, out, b)
            return out

        kernels["tinygemm"] = run_tinygemm
    for tile in gemv_kernel.tiles(n, k) if gemv_kernel is not None and rows == 1 else ():
        kernels["gemv{}x{}".format(*tile)] = lambda x, w, b, tile=tile: gemv_kernel.gemv(x.contiguous(), w, b, tile)[0]
    return kernels


class FewRowLinear(nn.Module):
    """A linear that runs its own kernel at the row counts in `kernels` and cuBLAS otherwise."""

    def __init__(self, linear: nn.Linear, kernels: dict[int, Kernel]) -> None:
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.kernels = kernels
        if linear.bias is None:  # tinygemm always adds a bias
            self.register_buffer("zero_bias", linear.weight.new_zeros(linear.out_features), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = self.kernels.get(x.shape[0])
        if kernel is None:
            return F.linear(x, self.weight, self.bias)
        return kernel(x, self.weight, self.bias if self.bias is not None else self.zero_bias)


def _graph(calls: Callable[[], object]) -> torch.cuda.CUDAGraph:
    calls()  # lazy initialisation (and Triton's compile) stays out of the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls()
    return graph


def _winner(times: dict[str, float], baseline: str) -> str:
    """The fastest, where it beat the baseline by the margin; else the baseline."""
    best = min(times, key=times.__getitem__)
    return best if times[best] < MARGIN * times[baseline] else baseline


def _fastest_kernels(linears: list[nn.Linear], row_counts: Iterable[int], tinygemm: Callable | None,
                     gemv_kernel) -> dict[int, str]:
    """Row count -> the kernel (not cuBLAS) that ran these linears (one weight shape) fastest there."""
    weight = linears[0].weight
    bias = weight.new_zeros(weight.shape[0])
    won = {}
    for rows in row_counts:
        kernels = _candidates(weight, rows, tinygemm, gemv_kernel)
        if len(kernels) == 1:
            continue
        x = torch.randn(rows, weight.shape[1], dtype=weight.dtype, device=weight.device)
        graphs = {name: _graph(lambda run=run: [run(x, linear.weight, bias) for linear in linears]) for name, run in kernels.items()}
        name = _winner(cuda_graph.best_times(graphs), "cublas")
        if name != "cublas":
            won[rows] = name
    return won


@torch.inference_mode()
def use_few_row_gemms(model: nn.Module, row_counts: Iterable[int], device: torch.device, dtype: torch.dtype) -> dict[str, dict[int, str]]:
    """Swap in FewRowLinear where a kernel beat cuBLAS; returns {"out x in": {rows: kernel}} of what was swapped."""
    tinygemm, gemv_kernel = load_tinygemm(device, dtype), _gemv_kernels(device, dtype)
    row_counts = sorted(r for r in row_counts if r <= MAX_ROWS)
    if (tinygemm is None and gemv_kernel is None) or not row_counts:
        return {}
    by_shape: dict[tuple[int, int], list[tuple[nn.Module, str, nn.Linear]]] = defaultdict(list)
    for slot in linear_slots(model):
        by_shape[tuple(slot[2].weight.shape)].append(slot)
    chosen = {}
    for (n, k), members in by_shape.items():
        try:
            won = _fastest_kernels([linear for _, _, linear in members], row_counts, tinygemm, gemv_kernel)
        except RuntimeError as exc:  # a kernel that fails to build or launch here: cuBLAS keeps the shape
            log.warning("few_row_kernel_unusable", shape=f"{n}x{k}", error=str(exc)[:200])
            continue
        if won:
            for parent, name, linear in members:
                rows_kernels = {rows: _candidates(linear.weight, rows, tinygemm, gemv_kernel)[kernel] for rows, kernel in won.items()}
                setattr(parent, name, FewRowLinear(linear, rows_kernels))
            chosen[f"{n}x{k}"] = won
    return chosen


@torch.inference_mode()
def use_one_row_fusion(layers: list[DecoderLayer], device: torch.device, dtype: torch.dtype) -> dict[str, str]:
    """Fuse each of a decoder layer's norm→qkv, norm→gate_up and SiLU→down pairs at one row where a
    fused GEMV ran all layers' pairs faster than the pair as it stands (after use_few_row_gemms);
    returns {pair: the fused kernel and its tile}."""
    gemv_kernel = _gemv_kernels(device, dtype)
    if gemv_kernel is None or not layers:
        return {}
    first = layers[0]
    hidden, inter = first.mlp.gate_up_proj.weight.shape[1], first.mlp.down_proj.weight.shape[1]
    h, residual = (torch.randn(1, hidden, dtype=dtype, device=device) for _ in range(2))
    gate_up = torch.randn(1, 2 * inter, dtype=dtype, device=device)

    Ways = dict[str, tuple[Callable[[], object], Callable | None]]  # way -> (all layers' calls, the fused kernel)

    def norm_pair(norm: Callable[[DecoderLayer], nn.Module], linear: Callable[[DecoderLayer], nn.Module]) -> Ways:
        x, r = h.clone(), residual.clone()  # the pair's norm adds and normalises in place

        def pair() -> None:
            for layer in layers:
                linear(layer)(norm(layer)(x, r)[0])

        ways = {"pair": (pair, None)}
        for tile in gemv_kernel.tiles(*linear(first).weight.shape):
            fused = functools.partial(gemv_kernel.norm_linear, tile=tile)
            ways["fused{}x{}".format(*tile)] = (lambda fused=fused: [fused(h, residual, norm(layer), linear(layer)) for layer in layers], fused)
        return ways

    down: Ways = {"pair": (lambda: [layer.mlp.down_proj(layer.mlp.ops.silu_and_mul(gate_up)) for layer in layers], None)}
    for tile in gemv_kernel.tiles(*first.mlp.down_proj.weight.shape):
        fused = functools.partial(gemv_kernel.silu_linear, tile=tile)
        down["fused{}x{}".format(*tile)] = (lambda fused=fused: [fused(gate_up, layer.mlp.down_proj) for layer in layers], fused)
    pairs = {
        "qkv": norm_pair(lambda layer: layer.input_layernorm, lambda layer: layer.self_attn.qkv_proj),
        "gate_up": norm_pair(lambda layer: layer.post_attention_layernorm, lambda layer: layer.mlp.gate_up_proj),
        "down": down,
    }
    try:
        chosen = {name: _winner(cuda_graph.best_times({way: _graph(run) for way, (run, _) in ways.items()}), "pair")
                  for name, ways in pairs.items()}
    except RuntimeError as exc:  # the GEMV fails to build or launch here: every pair stays as it is
        log.warning("one_row_fusion_unusable", error=str(exc)[:200])
        return {}
    fusion = OneRowFusion(**{name: pairs[name][way][1] for name, way in chosen.items() if way != "pair"})
    for layer in layers:
        layer.one_row = fusion
    return {name: way for name, way in chosen.items() if way != "pair"}
