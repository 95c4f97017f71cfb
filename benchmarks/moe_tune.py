"""Tune the fused-MoE Triton tiles for one model shape on this GPU, as SGLang tunes and ships its
fused_moe configs: for each token count, time both expert GEMMs (with sgl-kernel's alignment and
SiLU-and-mul; each configuration a CUDA graph, the graphs alternated) at every tile configuration
that fits, keep the fastest, and write the table the engine reads (runtime/kernels/triton/moe_tiles/).

    python -m benchmarks.moe_tune --model benchmarks/models/qwen3-30b-a3b [--tp 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import os
from pathlib import Path

import orjson
import torch
from triton.runtime.errors import OutOfResources

from runtime.config import ModelConfig
from runtime.engine.cuda_graph import best_times, capture
from runtime.kernels.triton.fused_moe import TUNED, Tiles, default_tiles, fused_experts, table_name
from runtime.models.layers import torch_silu_and_mul

TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
SPACE = dict(block_m=(16, 32, 64, 128), block_n=(32, 64, 128, 256), block_k=(64, 128), num_stages=(3, 4))
GEMV_SPACE = dict(block_n=(2, 4, 8, 16), block_k=(128, 256, 512))
GEMV_MAX_TOKENS = 16  # past this, pairs share experts and sorting them pays


def candidates(tokens: int, top_k: int, experts: int, hidden: int, intermediate: int) -> list[Tiles]:
    """Every configuration of SPACE whose block is at most four times an expert's mean share of the
    pairs, 8 warps for tiles larger than 64x128; and for a few tokens, the unsorted GEMV path at
    every tile of GEMV_SPACE that divides both expert GEMMs."""
    share = tokens * top_k / experts
    gemms = [
        Tiles(m, n, k, num_warps=4 if m * n <= 64 * 128 else 8, num_stages=stages)
        for m, n, k, stages in itertools.product(*SPACE.values())
        if m <= max(16, 4 * share)
    ]
    gemvs = [
        Tiles(1, n, k, kernel="gemv")
        for n, k in itertools.product(*GEMV_SPACE.values())
        if tokens <= GEMV_MAX_TOKENS and hidden % n == intermediate % n == hidden % k == intermediate % k == 0
    ]
    return gemms + gemvs


def tune(cfg: ModelConfig, tp: int, token_counts: list[int], path: Path) -> dict:
    """Tune each token count in turn, rewriting the table at `path` after each (a run cut short keeps
    what it has tuned)."""
    moe = cfg.moe
    assert moe is not None, "not a mixture-of-experts model"
    experts, hidden, intermediate = moe.num_experts, cfg.hidden_size, moe.intermediate_size // tp
    device = torch.device("cuda")
    gate_up = torch.randn(experts, 2 * intermediate, hidden, device=device, dtype=torch.bfloat16) * 0.02
    down = torch.randn(experts, hidden, intermediate, device=device, dtype=torch.bfloat16) * 0.02
    table, report = {}, []
    for tokens in token_counts:
        x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
        weights, ids = torch.randn(tokens, experts, device=device).softmax(-1).topk(moe.top_k, dim=-1)
        ids = ids.int()
        graphs = {}
        for tiles in candidates(tokens, moe.top_k, experts, hidden, intermediate):
            try:
                graphs[tiles] = capture(functools.partial(fused_experts, x, gate_up, down, weights, ids, torch_silu_and_mul, tiles))[0]
            except OutOfResources:  # more shared memory than the GPU has
                continue
        timed = {tiles: ms * 1e3 for tiles, ms in best_times(graphs).items()}
        best = min(timed, key=timed.__getitem__)
        default = timed.get(default_tiles(tokens * moe.top_k))
        table[tokens] = dataclasses.asdict(best)
        report.append(
            {"tokens": tokens, "best_us": round(timed[best], 1), "default_us": default and round(default, 1), "tiles": table[tokens]}
        )
        print(report[-1], flush=True)
        partial = path.with_name(path.name + ".partial")  # the engine reads the table: never half of one
        partial.write_bytes(orjson.dumps({str(k): v for k, v in sorted(table.items())}, option=orjson.OPT_INDENT_2) + b"\n")
        os.replace(partial, path)
    return {"table": table, "report": report}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.moe_tune", description=__doc__.splitlines()[0])  # pyright: ignore[reportOptionalMemberAccess]
    parser.add_argument("--model", type=Path, required=True, help="a folder with a Qwen3-MoE config.json")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks: each holds 1/tp of every expert")
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS), help="token counts, tuned in this order")
    parser.add_argument("--out", type=Path, help="also write the timings here")
    args = parser.parse_args(argv)
    cfg = ModelConfig.load(args.model)
    assert cfg.moe is not None, f"{args.model} is not a MoE model"
    name = table_name(cfg.moe.num_experts, cfg.moe.intermediate_size // args.tp, cfg.moe.top_k, torch.cuda.get_device_name())
    TUNED.mkdir(exist_ok=True)
    found = tune(cfg, args.tp, args.tokens, TUNED / name)
    print(f"wrote {TUNED / name}")
    if args.out:
        timings = {"gpu": torch.cuda.get_device_name(), **found}
        args.out.write_bytes(orjson.dumps(timings, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS) + b"\n")


if __name__ == "__main__":
    main()
