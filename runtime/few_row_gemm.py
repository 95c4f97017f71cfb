"""Few-row GEMMs for CUDA decode, chosen per weight shape and row count by timing at start-up.

cuBLAS's heuristics pick poor kernels for some few-row shapes. On the H200, Qwen3-0.6B's o_proj
(2048 -> 1024) took 12.3 us at 1-4 rows under cuBLAS and 3.6 us under flashinfer's `tinygemm_bf16`
(TensorRT-LLM's latency GEMM); its down_proj took 6.6 against 4.2. tinygemm loses on wide outputs
(gate_up, lm_head) and past 16 rows, so neither kernel is right everywhere: each shape's linears are
timed both ways, all layers in one CUDA graph as decode runs them, at the graph batch sizes, and
take tinygemm only at the row counts where it won.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable

import structlog
import torch
import torch.nn.functional as F
from torch import nn

from runtime.cuda_graph import replay_ms
from runtime.layers import linear_slots

log = structlog.get_logger()

MAX_ROWS = 16  # one or two of tinygemm's 8-row tiles; past that it lost on every shape measured
MAX_K = 4096  # tinygemm hung on Qwen3-8B's down_proj (K = 12288) with flashinfer 0.6.6: larger K is never tried
MARGIN = 0.9  # tinygemm must beat cuBLAS by 10%, so timing noise does not flip a choice


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


class FewRowLinear(nn.Module):
    """A linear that runs tinygemm at the row counts in `rows` and cuBLAS otherwise."""

    def __init__(self, linear: nn.Linear, rows: frozenset[int], tinygemm: Callable) -> None:
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.rows, self.tinygemm = rows, tinygemm
        if linear.bias is None:  # tinygemm always adds a bias
            self.register_buffer("zero_bias", linear.weight.new_zeros(linear.out_features), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] not in self.rows:
            return F.linear(x, self.weight, self.bias)
        out = x.new_empty(x.shape[0], self.weight.shape[0])
        self.tinygemm(x.contiguous(), self.weight, out, self.bias if self.bias is not None else self.zero_bias)
        return out


def _graph_ms(calls: Callable[[], None]) -> float:
    calls()  # lazy initialisation stays out of the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls()
    return replay_ms(graph, repeats=5)


def _tinygemm_rows(linears: list[nn.Linear], row_counts: Iterable[int], tinygemm: Callable) -> frozenset[int]:
    """The row counts at which tinygemm ran these linears (one weight shape) faster than cuBLAS."""
    weight = linears[0].weight
    bias = weight.new_zeros(weight.shape[0])
    won = set()
    for rows in row_counts:
        x = torch.randn(rows, weight.shape[1], dtype=weight.dtype, device=weight.device)
        out = x.new_empty(rows, weight.shape[0])
        times = {"cublas": [], "tiny": []}
        for _ in range(3):  # alternated, best of three: a clock still ramping up favours neither
            times["cublas"].append(_graph_ms(lambda: [torch.mm(x, lin.weight.t(), out=out) for lin in linears]))
            times["tiny"].append(_graph_ms(lambda: [tinygemm(x, lin.weight, out, bias) for lin in linears]))
        if min(times["tiny"]) < MARGIN * min(times["cublas"]):
            won.add(rows)
    return frozenset(won)


@torch.inference_mode()
def use_few_row_gemms(model: nn.Module, row_counts: Iterable[int], device: torch.device, dtype: torch.dtype) -> dict[str, list[int]]:
    """Swap in FewRowLinear where tinygemm won; returns {"out x in": rows} of what was swapped."""
    tinygemm = load_tinygemm(device, dtype)
    row_counts = sorted(r for r in row_counts if r <= MAX_ROWS)
    if tinygemm is None or not row_counts:
        return {}
    by_shape: dict[tuple[int, int], list[tuple[nn.Module, str, nn.Linear]]] = defaultdict(list)
    for slot in linear_slots(model):
        by_shape[tuple(slot[2].weight.shape)].append(slot)
    chosen = {}
    for (n, k), members in by_shape.items():
        if k > MAX_K or k % 64 or n % 16:  # tinygemm's tiling needs K % 64 and N % 16
            continue
        try:
            rows = _tinygemm_rows([linear for _, _, linear in members], row_counts, tinygemm)
        except RuntimeError as exc:  # a kernel that fails to build or launch here: cuBLAS keeps the shape
            log.warning("tinygemm_unusable", shape=f"{n}x{k}", error=str(exc)[:200])
            continue
        if rows:
            for parent, name, linear in members:
                setattr(parent, name, FewRowLinear(linear, rows, tinygemm))
            chosen[f"{n}x{k}"] = sorted(rows)
    return chosen
