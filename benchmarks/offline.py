"""Offline throughput in process: scheduler and engine with no actors, on random weights.

The workload is mini-sglang's offline bench, so figures compare with its published ones: 256
requests, input and output lengths uniform in [100, 1024] (seed 0), token ids below 10,000,
temperature 0.6, ignore_eos, after a warm-up. `--single` adds one request of 512 greedy tokens.
Throughput is output tokens over wall time. Results are appended to --out as
{"runs": [{"model", "mode", "workload", "tok_per_s", "command", "date"}]}.

    python -m benchmarks.offline --model benchmarks/models/qwen3-0.6b --device cuda --single
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

import numpy as np
import orjson
import torch

from runtime import LLM, SamplingParams

DEFAULT_OUT = Path(__file__).parent / "results" / "h200-offline.json"


def workload(count: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(seed)
    inputs, outputs = rng.integers(100, 1025, count), rng.integers(100, 1025, count)
    return [rng.integers(0, 10_000, n).tolist() for n in inputs], outputs.tolist()


def timed(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> float:
    """Output tokens per second of one generate call."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return sum(len(o.token_ids) for o in outputs) / (time.perf_counter() - started)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.offline", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a folder with config.json (weights are random)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--attention-backend", default="flashinfer" if torch.cuda.is_available() else "torch")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--kv-tokens", type=int, default=600_000, help="KV pool size in tokens")
    parser.add_argument("--single", action="store_true", help="also one request of 512 greedy tokens")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)

    llm = LLM(args.model, dummy_weights=True, device=args.device, attention_backend=args.attention_backend,
              page_size=args.page_size, num_pages=args.kv_tokens // args.page_size, max_running_requests=args.requests,
              enable_prefix_cache=False)
    prompts, lengths = workload(args.requests)
    params = [SamplingParams(max_tokens=n, temperature=0.6, ignore_eos=True, seed=i) for i, n in enumerate(lengths)]
    warm = prompts[:16]
    timed(llm, warm, [SamplingParams(max_tokens=32, temperature=0.6, ignore_eos=True)] * len(warm))
    figures = {"offline": timed(llm, prompts, params)}
    if args.single:
        figures["single"] = timed(llm, prompts[:1], [SamplingParams(max_tokens=512, temperature=0, ignore_eos=True)])
    command = " ".join(["python -m benchmarks.offline", *(sys.argv[1:] if argv is None else argv)])
    date = datetime.date.today().isoformat()
    runs = [{"model": Path(args.model).name, "mode": "in-process", "workload": name, "tok_per_s": round(value, 1),
             "command": command, "date": date, "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
             "attention_backend": args.attention_backend, "fused_ops": llm.engine.model.fused_ops} for name, value in figures.items()]
    for run in runs:
        print(f"{run['model']} {run['workload']}: {run['tok_per_s']:,.0f} output tok/s")
    previous = orjson.loads(args.out.read_bytes())["runs"] if args.out.exists() else []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(orjson.dumps({"runs": previous + runs}, option=orjson.OPT_INDENT_2) + b"\n")


if __name__ == "__main__":
    main()
