"""Where one request's decode step goes on the GPU: torch.profiler over `--tokens` greedy steps of one
request (random weights, `LLM(tensor_parallel_size=N)`, rank 0's kernels), grouped by kernel.

A step is the kernels up to and including its sampling kernel. For each kernel name: calls a step and
its exclusive time, the time no earlier kernel of the step already covers (PDL lets a kernel start
before its predecessor ends, so plain durations overlap). `gaps_us` is the step's span less the union
of its kernels: launch and dependency gaps inside the graph.

    python -m benchmarks.decode_profile --model benchmarks/models/qwen3-8b --tp 2 --out benchmarks/results/decode-profile.json
"""

from __future__ import annotations

import argparse
import collections
import gzip
import statistics
import sys
import tempfile
import time
from pathlib import Path

import orjson
import torch
from torch.profiler import ProfilerActivity, profile

from runtime import LLM, SamplingParams

PROMPT = list(range(1000, 1032))
SAMPLE_KERNEL = "gumbel"


def _steps(kernels: list[dict]) -> list[list[dict]]:
    """Kernel events in start order, cut after each sampling kernel; the first (prefill) dropped."""
    steps, current = [], []
    for event in sorted(kernels, key=lambda e: e["ts"]):
        current.append(event)
        if SAMPLE_KERNEL in event["name"]:
            steps.append(current)
            current = []
    return steps[1:]


def _breakdown(step: list[dict]) -> tuple[float, float, dict[str, list[float]]]:
    """(span µs, busy µs, {kernel name: [calls, exclusive µs]}) of one step."""
    covered_to, busy = step[0]["ts"], 0.0
    by_name: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for event in step:
        start, end = event["ts"], event["ts"] + event["dur"]
        exclusive = max(0.0, end - max(start, covered_to))
        covered_to = max(covered_to, end)
        busy += exclusive
        entry = by_name[event["name"][:80]]
        entry[0] += 1
        entry[1] += exclusive
    return covered_to - step[0]["ts"], busy, by_name


def profile_decode(model: str, tp: int, tokens: int, **options) -> dict:
    llm = LLM(model, device="cuda", dtype="bfloat16", dummy_weights=True, tensor_parallel_size=tp, **options)
    steps = 256
    greedy = SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True)
    llm.generate([PROMPT], greedy)  # warm-up
    start = time.perf_counter()
    llm.generate([PROMPT], greedy)
    tok_per_s = steps / (time.perf_counter() - start)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate([PROMPT], SamplingParams(max_tokens=tokens + 1, temperature=0, ignore_eos=True))
    llm.close()
    with tempfile.NamedTemporaryFile(suffix=".json") as trace:
        prof.export_chrome_trace(trace.name)
        events = orjson.loads(Path(trace.name).read_bytes())["traceEvents"]
    steps = [_breakdown(step) for step in _steps([e for e in events if e.get("cat") == "kernel"])]
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for _, _, by_name in steps:
        for name, (calls, exclusive) in by_name.items():
            totals[name][0] += calls / len(steps)
            totals[name][1] += exclusive / len(steps)
    span = statistics.median(s for s, _, _ in steps)
    busy = statistics.median(b for _, b, _ in steps)
    return {
        "gpu": torch.cuda.get_device_name(),
        "tensor_parallel_size": tp,
        "one_request_tok_per_s": round(tok_per_s, 1),
        "steps_profiled": len(steps),
        "step_us": round(span, 1),
        "gaps_us": round(span - busy, 1),
        "kernels": [
            {"name": name, "calls": round(calls, 1), "exclusive_us": round(us, 1)}
            for name, (calls, us) in sorted(totals.items(), key=lambda t: -t[1][1])
        ],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.decode_profile", description=__doc__.splitlines()[0])  # pyright: ignore[reportOptionalMemberAccess]
    parser.add_argument("--model", required=True, help="a folder with config.json (weights are random)")
    parser.add_argument("--tp", type=int, nargs="+", default=[1], help="tensor-parallel sizes, profiled in turn")
    parser.add_argument("--tokens", type=int, default=48, help="decode steps profiled")
    parser.add_argument("--custom-all-reduce", action="store_true")
    parser.add_argument("--out", type=Path, help="write the profiles as JSON (gzipped if the name ends in .gz)")
    args = parser.parse_args(argv)
    profiles = [profile_decode(args.model, tp, args.tokens, custom_all_reduce=args.custom_all_reduce) for tp in args.tp]
    for found in profiles:
        tp, rate = found["tensor_parallel_size"], found["one_request_tok_per_s"]
        print(f"tp{tp}: {rate} tok/s, step {found['step_us']} µs, gaps {found['gaps_us']} µs")
        for kernel in found["kernels"][:12]:
            print(f"  {kernel['exclusive_us']:8.1f} µs  {kernel['calls']:5.0f}x  {kernel['name']}")
    if args.out:
        command = " ".join(["python -m benchmarks.decode_profile", *(sys.argv[1:] if argv is None else argv)])
        data = orjson.dumps({"command": command, "profiles": profiles}, option=orjson.OPT_INDENT_2)
        args.out.write_bytes(gzip.compress(data) if args.out.suffix == ".gz" else data + b"\n")


if __name__ == "__main__":
    main()
