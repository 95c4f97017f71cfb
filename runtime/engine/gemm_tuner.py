"""Few-row kernels for CUDA decode, chosen per weight shape and row count by timing at start-up.

cuBLAS's heuristics pick poor kernels for some few-row shapes. Two kernels may stand in: flashinfer's
`tinygemm_bf16` (TensorRT-LLM's latency GEMM) and, at one row, ringllm's GEMV
(runtime.kernels.triton.gemv). Neither is right everywhere (tinygemm loses on wide outputs and past
16 rows), so each shape's linears are timed every way, all layers in one CUDA graph as decode runs
them, at the graph batch sizes; a kernel replaces cuBLAS only at the row counts where it won.

At one row, the GEMV can also fold in the kernel before the projection: a decoder layer's RMSNorm
(with the residual add) before qkv_proj and gate_up_proj, and SiLU-and-mul before down_proj. Each
such pair is timed fused against the pair as chosen above, over all layers, and fused where that
won. Last, the summed stream (every pair fused, the residual adds moved into o_proj's and
down_proj's epilogues, no norm kernel left) is timed against those choices: it trades a step's norm
kernels for the norm weights' loads inside the GEMVs, which pays on some models and not on others.

FP8 projections (runtime.models.fp8.Fp8Linear) are timed likewise, at each power of two of rows up
to 512: the Triton GEMM at each of its tiles (W8A16, and past 16 rows W8A8 too), and flashinfer's
block-scaled FP8 GEMM (DeepGEMM on Hopper, activations quantized per 128 columns) where the weight's
blocks are 128 x 128. A kernel whose output strays from the W8A16 GEMM's is not a candidate.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import structlog
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from runtime.engine import cuda_graph
from runtime.models.decoder import MLP, DecoderLayer
from runtime.models.fp8 import Fp8Kernel, Fp8Linear
from runtime.models.layers import OneRowFusion, linear_slots

log = structlog.get_logger()

Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]  # (x, weight, bias) -> x·weightᵀ + bias

MAX_ROWS = 16  # one or two of tinygemm's 8-row tiles; past that it lost on every shape measured
MAX_K = 4096  # tinygemm has hung at larger K: it is never tried there
MARGIN = 0.97  # a kernel must beat cuBLAS by 3% (best of three alternated rounds), so noise does not flip a choice
STREAM_MARGIN = 0.99  # the summed stream must win by 1%: all layers' projections together time steadier than one


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
    """runtime.kernels.triton.gemv where Triton imports, on CUDA in half precision; else None."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return None
    try:
        from runtime.kernels.triton import gemv as gemv_kernel
    except ImportError:
        return None
    return gemv_kernel


def _candidates(weight: torch.Tensor, rows: int, tinygemm: Callable | None, gemv_kernel) -> dict[str, Kernel]:
    """The kernels that may run x·weightᵀ (+ bias) at `rows` rows, for any weight of this one's shape."""
    n, k = weight.shape
    kernels: dict[str, Kernel] = {"cublas": F.linear}
    if tinygemm is not None and k <= MAX_K and k % 64 == 0 and n % 16 == 0:  # tinygemm's tiling needs K % 64 and N % 16
        zero_bias = weight.new_zeros(n)  # tinygemm always adds one; made here, outside any graph capture

        def run_tinygemm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
            out = x.new_empty(x.shape[0], w.shape[0])
            tinygemm(x.contiguous(), w, out, zero_bias if b is None else b)
            return out

        kernels["tinygemm"] = run_tinygemm
    # the checker does not narrow gemv_kernel inside the loop, which runs only with one
    for tile in gemv_kernel.tiles(n, k) if gemv_kernel is not None and rows == 1 else ():
        kernels["gemv{}x{}".format(*tile)] = lambda x, w, b, tile=tile: gemv_kernel.gemv(x.contiguous(), w, b, tile)[0]  # pyright: ignore[reportOptionalMemberAccess]
    return kernels


class FewRowLinear(nn.Module):
    """A linear that runs its own kernel at the row counts in `kernels` and cuBLAS otherwise."""

    def __init__(self, linear: nn.Linear, kernels: dict[int, Kernel]) -> None:
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.get(x.shape[0], F.linear)(x, self.weight, self.bias)


def _fastest(times: dict[str, float]) -> str:
    return min(times, key=times.__getitem__)


def _winner(times: dict[str, float], baseline: str, margin: float = MARGIN) -> str:
    """The fastest, where it beat the baseline by the margin; else the baseline."""
    best = _fastest(times)
    return best if times[best] < margin * times[baseline] else baseline


def _fastest_kernels(
    linears: list[nn.Linear], row_counts: Iterable[int], tinygemm: Callable | None, gemv_kernel
) -> dict[int, tuple[str, Kernel]]:
    """Row count -> the kernel (not cuBLAS), by name, that ran these linears (one weight shape, each with
    its own bias or none) fastest there."""
    weight = linears[0].weight
    won = {}
    for rows in row_counts:
        kernels = _candidates(weight, rows, tinygemm, gemv_kernel)
        if len(kernels) == 1:
            continue
        x = torch.randn(rows, weight.shape[1], dtype=weight.dtype, device=weight.device)
        times = cuda_graph.time_captured(
            {name: lambda run=run, x=x: [run(x, linear.weight, linear.bias) for linear in linears] for name, run in kernels.items()}
        )
        name = _winner(times, "cublas")
        if name != "cublas":
            won[rows] = (name, kernels[name])
    return won


@torch.inference_mode()
def use_few_row_gemms(model: nn.Module, row_counts: Iterable[int], device: torch.device, dtype: torch.dtype) -> dict[str, dict[int, str]]:
    """Swap in FewRowLinear where a kernel beat cuBLAS; returns {"out x in": {rows: kernel}} of what was swapped."""
    tinygemm, gemv_kernel = load_tinygemm(device, dtype), _gemv_kernels(device, dtype)
    row_counts = sorted(r for r in row_counts if r <= MAX_ROWS)
    if (tinygemm is None and gemv_kernel is None) or not row_counts:
        return {}
    by_shape: dict[tuple[int, ...], list[tuple[nn.Module, str, nn.Linear]]] = defaultdict(list)
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
            kernels = {rows: kernel for rows, (_, kernel) in won.items()}
            for parent, name, linear in members:
                setattr(parent, name, FewRowLinear(linear, kernels))
            chosen[f"{n}x{k}"] = {rows: kernel_name for rows, (kernel_name, _) in won.items()}
    return chosen


# way -> (all layers' calls, the fused kernel; None for the pair as it stands)
Ways = dict[str, tuple[Callable[[], object], Callable | None]]


@dataclass(frozen=True)
class OneRowCandidates:
    """Every way to run each pair over all layers at one row, and the rows they run on."""

    pairs: dict[str, Ways]  # "qkv", "gate_up", "down" -> the pair as it stands ("pair") and the fused kernel at each tile
    o_adds: Ways  # o_proj with the residual add in its epilogue, at each tile
    h: torch.Tensor
    attended: torch.Tensor  # an attention output, o_proj's input


def _one_row_candidates(layers: list[DecoderLayer], gemv_kernel, device: torch.device, dtype: torch.dtype) -> OneRowCandidates:
    """Builds the fused forms of each pair (norm→qkv, norm→gate_up, SiLU→down) and of o_proj with its
    residual add, at each GEMV tile of the linear's shape, beside the pairs as they stand. Dense layers only
    (use_one_row_fusion checks): the `pyright: ignore`s below are for `layer.mlp`, typed MLP | SparseMoe, and
    for attributes torch types as Tensor | Module."""
    first = layers[0]
    assert isinstance(first.mlp, MLP)
    hidden, inter = first.mlp.gate_up_proj.weight.shape[1], first.mlp.down_proj.weight.shape[1]
    h, residual = (torch.randn(1, hidden, dtype=dtype, device=device) for _ in range(2))
    gate_up = torch.randn(1, 2 * inter, dtype=dtype, device=device)
    attended = torch.randn(1, first.self_attn.o_proj.weight.shape[1], dtype=dtype, device=device)

    def tiled(
        prefix: str, kernel: Callable, linear: Callable[[DecoderLayer], nn.Module], call: Callable[[Callable, DecoderLayer], object]
    ) -> Ways:
        """The kernel at each tile of the linear's shape."""
        found: Ways = {}
        for tile in gemv_kernel.tiles(*linear(first).weight.shape):  # pyright: ignore[reportGeneralTypeIssues]
            tiled_kernel = functools.partial(kernel, tile=tile)
            found[prefix + "{}x{}".format(*tile)] = (lambda k=tiled_kernel: [call(k, layer) for layer in layers], tiled_kernel)
        return found

    def ways(
        pair: Callable[[DecoderLayer], object],
        kernel: Callable,
        linear: Callable[[DecoderLayer], nn.Module],
        fused_call: Callable[[Callable, DecoderLayer], object],
    ) -> Ways:
        """The pair as it stands, and the fused kernel at each tile of the linear's shape."""
        return {"pair": (lambda: [pair(layer) for layer in layers], None), **tiled("fused", kernel, linear, fused_call)}

    def norm_ways(norm: Callable[[DecoderLayer], nn.Module], linear: Callable[[DecoderLayer], nn.Module]) -> Ways:
        x, r = h.clone(), residual.clone()  # the pair's norm adds and normalises in place
        return ways(
            lambda layer: linear(layer)(norm(layer)(x, r)[0]),
            gemv_kernel.norm_linear,
            linear,
            lambda fused, layer: fused(h, residual, norm(layer), linear(layer)),
        )

    pairs = {
        "qkv": norm_ways(lambda layer: layer.input_layernorm, lambda layer: layer.self_attn.qkv_proj),
        "gate_up": norm_ways(lambda layer: layer.post_attention_layernorm, lambda layer: layer.mlp.gate_up_proj),  # pyright: ignore[reportArgumentType]
        "down": ways(
            lambda layer: layer.mlp.down_proj(layer.mlp.ops.silu_and_mul(gate_up)),  # pyright: ignore[reportCallIssue]
            gemv_kernel.silu_linear,
            lambda layer: layer.mlp.down_proj,  # pyright: ignore[reportArgumentType]
            lambda fused, layer: fused(gate_up, layer.mlp.down_proj),
        ),
    }
    o_adds = tiled(
        "add",
        gemv_kernel.linear_add,
        lambda layer: layer.self_attn.o_proj,  # the residual add in o_proj's epilogue
        lambda o_add, layer: o_add(attended, layer.self_attn.o_proj, residual),
    )
    return OneRowCandidates(pairs, o_adds, h, attended)


def _time_one_row_fusion(
    layers: list[DecoderLayer], candidates: OneRowCandidates, allow_summed: bool
) -> tuple[OneRowFusion, dict[str, str]] | None:
    """Times each pair's fused forms against the pair as it stands and keeps the winners; then, if
    `allow_summed`, times all layers under those choices against the summed stream (each pair's and
    o_proj's fastest fused form) and keeps the stream where it won. Returns the fusion and {pair: way}
    ("pair": as it stands); None where a GEMV fails to build or launch here."""
    pairs, o_adds = candidates.pairs, candidates.o_adds
    try:
        times = {
            name: cuda_graph.time_captured({way: run for way, (run, _) in ways.items()})
            for name, ways in ({**pairs, "o_proj": o_adds} if allow_summed else pairs).items()
        }
    except RuntimeError as exc:
        log.warning("one_row_fusion_unusable", error=str(exc)[:200])
        return None
    chosen = {name: _winner(times[name], "pair") for name in pairs}
    fusion = OneRowFusion(**{name: pairs[name][way][1] for name, way in chosen.items() if way != "pair"})
    if allow_summed:
        best = {name: _fastest({way: t for way, t in ways.items() if way != "pair"}) for name, ways in times.items()}
        summed = OneRowFusion(**{name: pairs[name][best[name]][1] for name in pairs}, o_proj=o_adds[best["o_proj"]][1])
        h, attended = candidates.h, candidates.attended
        layer_times = cuda_graph.time_captured(
            {way: lambda f=f: _layer_projections(layers, f, h, attended) for way, f in (("as chosen", fusion), ("fused stream", summed))}
        )
        log.info("one_row_layers_timed", **{way: f"{ms * 1e3:.1f} us" for way, ms in layer_times.items()})
        if _winner(layer_times, "as chosen", STREAM_MARGIN) != "as chosen":
            fusion, chosen = summed, {**best, "stream": "summed"}
    return fusion, chosen


@torch.inference_mode()
def use_one_row_fusion(layers: list[DecoderLayer], device: torch.device, dtype: torch.dtype, allow_summed: bool = True) -> dict[str, str]:
    """Fuse each of a decoder layer's norm→qkv, norm→gate_up and SiLU→down pairs at one row where a
    fused GEMV ran all layers' pairs faster than the pair as it stands (after use_few_row_gemms); then,
    if `allow_summed` (not under tensor parallelism, whose all-reduce must come before the residual add),
    the summed stream (OneRowFusion.o_proj), every pair fused and the adds in o_proj's and down_proj's
    epilogues, where its layers ran faster than those choices. Returns {pair: the fused kernel and its tile}."""
    gemv_kernel = _gemv_kernels(device, dtype)
    if gemv_kernel is None or not layers or not all(isinstance(layer.mlp, MLP) and layer.one_row_fusable for layer in layers):
        return {}
    projections = (layers[0].self_attn.qkv_proj, layers[0].self_attn.o_proj, layers[0].mlp.gate_up_proj, layers[0].mlp.down_proj)
    if any(isinstance(p, Fp8Linear) for p in projections):  # FP8 runs kernels of its own
        return {}
    timed = _time_one_row_fusion(layers, _one_row_candidates(layers, gemv_kernel, device, dtype), allow_summed)
    if timed is None:  # every pair stays as it is
        return {}
    fusion, chosen = timed
    for layer in layers:
        layer.one_row = fusion
    return {name: way for name, way in chosen.items() if way != "pair"}


def _layer_projections(layers: list[DecoderLayer], fusion: OneRowFusion, h: torch.Tensor, attended: torch.Tensor) -> None:
    """All layers' projections and norms at one row as decode runs them under `fusion`, each layer's
    attention output fixed (attention is the same either way), so only those kernels count."""
    residual = None
    for layer in layers:
        h, residual = layer.forward_with(h, residual, lambda qkv: attended, fusion)


FP8_ROW_BUCKETS = tuple(1 << i for i in range(10))  # Fp8Linear.forward's keys: 1, 2, .., 512
FP8_TIMED_LINEARS = 8  # of a shape's linears, those timed: each candidate's graph keeps its outputs, after the KV pool took its share
# relative error allowed between a candidate's output and the W8A16 GEMM's: quantizing the activations
# alone moves random inputs' products ~3%, a misread scale by far more
FP8_AGREEMENT = 6e-2


def _flashinfer_block_scaled(linear: Fp8Linear) -> Fp8Kernel | None:
    """flashinfer's SM90 block-scaled GEMM, where it applies: 128 x 128 blocks, K % 128, N % 64, no bias."""
    shape_fits = linear.block == (128, 128) and linear.in_features % 128 == 0 and linear.out_features % 64 == 0
    if not shape_fits or linear.bias is not None or torch.cuda.get_device_capability(linear.weight.device)[0] != 9:
        return None
    try:
        from flashinfer.gemm import fp8_blockscale_gemm_sm90
    except ImportError:
        return None
    return lambda x, layer: fp8_blockscale_gemm_sm90(x.contiguous(), layer.weight, None, layer.weight_scale)  # it assumes rows of K


def _fp8_candidates(linear: Fp8Linear, rows: int) -> dict[str, Fp8Kernel]:
    from runtime.kernels.triton.fp8_gemm import FEW_ROW_TILES, MANY_ROW_TILES

    found: dict[str, Fp8Kernel] = {}
    for tiles in FEW_ROW_TILES if rows <= 16 else MANY_ROW_TILES:
        if linear.block[1] < linear.in_features and linear.block[1] % tiles.block_k:
            continue
        name = "{}x{}x{}".format(*tiles[:3])
        found["w8a16-" + name] = lambda x, layer, tiles=tiles: layer.triton(x, tiles)
        if rows > 16:  # where the FLOPs, not the weight's bytes, bound the GEMM
            found["w8a8-" + name] = lambda x, layer, tiles=tiles: layer.triton(x, tiles, fp8_activations=True)
    if (block_scaled := _flashinfer_block_scaled(linear)) is not None:
        found["flashinfer"] = block_scaled
    if rows == 1 and (gemv_kernel := _gemv_kernels(linear.weight.device, torch.bfloat16)) is not None:
        for tile in gemv_kernel.fp8_tiles(linear.out_features, linear.in_features):
            found["gemv{}x{}".format(*tile)] = lambda x, layer, tile=tile: gemv_kernel.gemv(
                x.contiguous(), layer.weight, layer.bias, tile, scale=layer.weight_scale, scale_block=layer.block
            )[0]
    return found


def _agreeing(candidates: dict[str, Fp8Kernel], linear: Fp8Linear, x: torch.Tensor) -> dict[str, Fp8Kernel]:
    """The candidates that run here and give the Triton GEMM's output (a library kernel that fails to
    build, or reads the scales in another layout, drops out)."""
    reference = linear.triton(x).float()
    shape = f"{linear.out_features}x{linear.in_features}"
    agrees = []
    for name, kernel in candidates.items():
        try:
            error = float((kernel(x, linear).float() - reference).norm() / reference.norm().clamp(min=1e-12))
        except (RuntimeError, ValueError) as exc:
            log.warning("fp8_kernel_unusable", kernel=name, shape=shape, error=str(exc)[:200])
            error = float("inf")
        if error >= FP8_AGREEMENT and error != float("inf"):
            log.warning("fp8_kernel_disagrees", kernel=name, shape=shape, error=error)
        agrees.append(error < FP8_AGREEMENT)
    kept = torch.tensor(agrees, dtype=torch.int32, device=x.device)
    if dist.is_initialized():  # every rank must time the same candidates (cuda_graph averages their times)
        dist.all_reduce(kept, op=dist.ReduceOp.MIN)
    return {name: kernel for (name, kernel), keep in zip(candidates.items(), kept.tolist(), strict=True) if keep}


@torch.inference_mode()
def use_fp8_gemms(model: nn.Module, dtype: torch.dtype) -> dict[str, dict[int, str]]:
    """Give every Fp8Linear the fastest kernel at each row bucket; returns {"out x in": {rows: kernel}}."""
    by_shape: dict[tuple[int, int, tuple[int, int]], list[Fp8Linear]] = defaultdict(list)
    for module in model.modules():
        if isinstance(module, Fp8Linear):
            by_shape[(module.out_features, module.in_features, module.block)].append(module)
    chosen: dict[str, dict[int, str]] = {}
    for (n, k, _), members in by_shape.items():
        first, timings = members[0], {}
        for rows in FP8_ROW_BUCKETS:
            x = torch.randn(rows, k, dtype=dtype, device=first.weight.device)
            candidates = _agreeing(_fp8_candidates(first, rows), first, x)
            run_all = lambda kernel, x=x, timed=members[:FP8_TIMED_LINEARS]: [kernel(x, linear) for linear in timed]  # noqa: E731
            times = cuda_graph.time_captured({name: functools.partial(run_all, kernel) for name, kernel in candidates.items()})
            name = _fastest(times)
            for linear in members:
                linear.kernels[rows] = candidates[name]
            chosen.setdefault(f"{n}x{k}", {})[rows] = name
            timings[rows] = {candidate: round(ms * 1e3, 1) for candidate, ms in sorted(times.items(), key=lambda item: item[1])}
        log.info("fp8_kernel_times_us", shape=f"{n}x{k}", rows=timings)  # every candidate that agreed, fastest first
    return chosen
