"""All-reduce latency between GPUs at decode sizes: NCCL against torch's symmetric-memory one-shot
all-reduce (each rank reads its peers' buffers over NVLink and sums), both replayed in CUDA graphs
as the engine replays them. Tensor parallelism all-reduces [tokens, hidden] bf16 twice per layer.

    python -m benchmarks.allreduce --gpus 2 --hidden 4096 --out benchmarks/results/allreduce.json
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import orjson
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
REPLAYS, PER_GRAPH = 20, 50


def _graph_us(run, stream: torch.cuda.Stream) -> float:
    """Microseconds per call of `run`, PER_GRAPH calls captured in one graph and replayed."""
    with torch.cuda.stream(stream):
        for _ in range(3):
            run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(PER_GRAPH):
            run()
    graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (REPLAYS * PER_GRAPH)


def _measure(count: int, hidden: int, shared: torch.Tensor, group: str, stream: torch.cuda.Stream) -> dict:
    """One size: NCCL in place (as the engine calls it) against a copy into the symmetric buffer and
    a one-shot all-reduce out of it."""
    x = torch.randn(count, hidden, dtype=torch.bfloat16, device=shared.device)
    expected = x.clone()
    dist.all_reduce(expected)
    view = shared[: count * hidden].view(count, hidden)
    result = torch.empty_like(x)

    def one_shot() -> None:
        view.copy_(x)
        torch.ops.symm_mem.one_shot_all_reduce_out(view, "sum", group, result)

    one_shot()
    torch.cuda.synchronize()
    equal = bool(torch.equal(result, expected))
    nccl = _graph_us(lambda: dist.all_reduce(x), stream)
    symm = _graph_us(one_shot, stream)
    return {"rows": count, "bytes": count * hidden * 2, "nccl_us": round(nccl, 2), "one_shot_us": round(symm, 2), "equal": equal}


def _rank(rank: int, size: int, rendezvous: str, hidden: int, out: str) -> None:
    import torch.distributed._symmetric_memory as symm_mem

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"file://{rendezvous}", rank=rank, world_size=size, device_id=device)
    group = dist.group.WORLD.group_name  # pyright: ignore[reportOptionalMemberAccess]  # set: the group is initialized
    if hasattr(symm_mem, "enable_symm_mem_for_group"):
        symm_mem.enable_symm_mem_for_group(group)
    stream = torch.cuda.Stream()
    shared = symm_mem.empty(max(ROWS) * hidden, dtype=torch.bfloat16, device=device)
    symm_mem.rendezvous(shared, group)
    rows = [_measure(count, hidden, shared, group, stream) for count in ROWS]
    if rank == 0:
        figures = {"gpus": size, "hidden": hidden, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
        Path(out).write_bytes(orjson.dumps(figures, option=orjson.OPT_INDENT_2) + b"\n")
        for row in rows:
            print(row)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.allreduce", description=__doc__.splitlines()[0])  # pyright: ignore[reportOptionalMemberAccess]
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--out", default="benchmarks/results/allreduce.json")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        rendezvous = os.path.join(tmp, "rendezvous")
        # spawn is public, though torch.multiprocessing's __all__ leaves it out
        mp.spawn(_rank, (args.gpus, rendezvous, args.hidden, os.path.abspath(args.out)), nprocs=args.gpus)  # pyright: ignore[reportPrivateImportUsage]


if __name__ == "__main__":
    main()
