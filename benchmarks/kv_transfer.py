"""The floor under the KV tiers on a card: how fast pages move between the device pool and the host tier.

It lays a device pool and a host tier of a model's KV layout (runtime.engine.kv_tiers.HostTier, as the
engine does), fills the pool with random bytes, and times storing `--pages` pages to the host tier and
loading them back into other device pages, checking that every byte came back: scattered pages (each a
gather or scatter), then runs of pages in a row (each run a plain copy). Beside
it, the card's plain pinned-memory copy rate in each direction, one contiguous buffer of the same
bytes: what no page copy can beat. It reports GB/s, the bytes a cached token moves, and so the
microseconds a hit token costs to load. The last line printed is one JSON object; --out writes it.

    python -m benchmarks.kv_transfer --model .gpu-models/qwen3-8b --pages 2048 [--out FILE]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import orjson
import torch

from benchmarks.provenance import provenance
from runtime.attention.pool import KVPool
from runtime.config import ModelConfig
from runtime.engine.kv_tiers import HostTier
from runtime.step import KVMove


def _timed(run, device: torch.device, repeats: int) -> float:
    """The best of `repeats` runs' seconds."""
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - started)
    return best


def _page_lists(pages: int, scattered: bool) -> tuple[list[int], list[int], list[int]]:
    """Device pages to store, the host pages they go to, and the device pages they load back into: a random
    order on each side (as eviction may leave them), or runs of 64 pages in a row, the runs in a random order
    (as the allocators hand a node's pages out)."""
    generator = torch.Generator().manual_seed(0)
    if scattered:
        return tuple(torch.randperm(pages, generator=generator).tolist() for _ in range(3))  # pyright: ignore[reportReturnType]
    runs = [[run * 64 + i for i in range(64)] for run in range(pages // 64)]
    return tuple(sum((runs[i] for i in torch.randperm(len(runs), generator=generator).tolist()), []) for _ in range(3))  # pyright: ignore[reportReturnType]


def measure(cfg: ModelConfig, pages: int, page_size: int, dtype: torch.dtype, device: torch.device, repeats: int, scattered: bool) -> dict:
    pool = KVPool(cfg.num_layers, 2 * pages + 1, page_size, cfg.num_kv_heads, cfg.head_dim, dtype, device)
    for layer in pool.kv:
        layer.view(torch.uint8).random_(0, 256)
    tier = HostTier(pool, pages, None, None)
    source, host, target = _page_lists(pages, scattered)
    target = [pages + p for p in target]
    store = [KVMove("store", source, host, [bytes(16)] * len(host), bytes(16), 0, [0] * (len(host) * page_size))]
    load = [KVMove("load", target, host)]
    page_bytes = tier.page_bytes
    store_s = _timed(lambda: tier.run(store), device, repeats)
    load_s = _timed(lambda: tier.run(load), device, repeats)
    intact = all(torch.equal(layer[source], layer[target]) for layer in (kv.view(torch.uint8) for kv in pool.kv))
    moved = len(host) * page_bytes
    flat = torch.empty(moved, dtype=torch.uint8, device=device)
    pinned = torch.empty(moved, dtype=torch.uint8, pin_memory=device.type == "cuda")
    d2h_s = _timed(lambda: pinned.copy_(flat, non_blocking=True), device, repeats)
    h2d_s = _timed(lambda: flat.copy_(pinned, non_blocking=True), device, repeats)
    token_bytes = page_bytes // page_size
    load_rate = moved / load_s
    return {
        "pages": len(host),
        "layout": "scattered" if scattered else "runs of 64",
        "page_bytes": page_bytes,
        "token_bytes": token_bytes,
        "bytes": moved,
        "copies": tier.copies,
        "store_gb_s": round(moved / store_s / 1e9, 2),
        "load_gb_s": round(load_rate / 1e9, 2),
        "pinned_d2h_gb_s": round(moved / d2h_s / 1e9, 2),
        "pinned_h2d_gb_s": round(moved / h2d_s / 1e9, 2),
        "load_us_per_token": round(token_bytes / load_rate * 1e6, 4),
        "floor_us_per_token": round(token_bytes / (moved / h2d_s) * 1e6, 4),
        "intact": intact,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kv_transfer", description=__doc__.split("\n\n")[0])  # pyright: ignore[reportOptionalMemberAccess]
    parser.add_argument("--model", type=Path, required=True, help="a model folder (its config.json gives the KV layout)")
    parser.add_argument("--pages", type=int, default=2048, help="pages moved each way (the device pool holds twice as many)")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    cfg = ModelConfig.load(args.model)
    record = {
        **provenance(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "model": args.model.name,
        "layouts": [
            measure(cfg, args.pages, args.page_size, getattr(torch, args.dtype), device, args.repeats, scattered)
            for scattered in (True, False)
        ],
    }
    line = orjson.dumps(record).decode()
    print(line)
    if args.out:
        args.out.write_text(line + "\n")


if __name__ == "__main__":
    main()
