"""The CPU decode step with ringllm's kernels (runtime.kernels.cpu.build) and without, side by side.

Why: on CPU a decode step streams every weight for a few rows and reads every sequence's KV pages;
the kernels replace oneDNN's GEMM for steps of up to 12 rows and the page gather + SDPA of decode
attention. Each side runs in its own process (RINGLLM_CPU_KERNELS=1 or 0, so that nothing of one
lingers in the other), the sides alternating for `--rounds` rounds, on the default model in the
default dtype. A round generates, for 4 sequences of `--short` and of `--long` prompt tokens
(vs_hf's concurrency and its short and long prompts), 1 and then 1 + `--tokens` greedy tokens;
the difference of the two wall times over `--tokens` is the decode step. The figure per side is
the minimum over rounds: the machine drifts between them.

    python -m benchmarks.cpu_decode [--rounds 3] [--tokens 64] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import orjson

from benchmarks import write_result
from benchmarks.provenance import provenance

DEFAULT_OUT = Path(__file__).parent / "results" / "cpu-decode-kernels.json"
SEQUENCES = 4


def side(short: int, long: int, tokens: int) -> dict[str, float]:
    """In this process: ms per decode step at each prompt length."""
    from runtime import LLM, SamplingParams

    llm = LLM()
    steps = {}
    for name, length in (("short", short), ("long", long)):
        prompts = [[i] + list(range(1000, 1000 + length - 1)) for i in range(SEQUENCES)]
        walls = []
        for n in (1, 1 + tokens):
            llm.flush_cache()  # both runs prefill the prompts afresh
            started = time.perf_counter()
            llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
            walls.append(time.perf_counter() - started)
        steps[name] = round((walls[1] - walls[0]) / tokens * 1e3, 2)
    return steps


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cpu_decode", description=__doc__.splitlines()[0])  # pyright: ignore[reportOptionalMemberAccess]
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64, help="decode steps timed per prompt length")
    parser.add_argument("--short", type=int, default=46, help="prompt tokens (vs_hf's short prompts: 46 in the template)")
    parser.add_argument("--long", type=int, default=542, help="prompt tokens (vs_hf's long prompts: 542)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--side", action="store_true", help=argparse.SUPPRESS)  # one side, in a child process
    args = parser.parse_args(argv)
    if args.side:
        print(orjson.dumps(side(args.short, args.long, args.tokens)).decode())
        return {}

    from runtime.models.cpu_linears import cpuinfo

    child = [
        sys.executable,
        "-m",
        "benchmarks.cpu_decode",
        "--side",
        "--tokens",
        str(args.tokens),
        "--short",
        str(args.short),
        "--long",
        str(args.long),
    ]
    rounds: dict[str, list[dict]] = {"kernels": [], "torch": []}
    for r in range(args.rounds):
        order = ("kernels", "torch") if r % 2 == 0 else ("torch", "kernels")
        for name in order:
            env = {**os.environ, "RINGLLM_CPU_KERNELS": "1" if name == "kernels" else "0"}
            out = subprocess.run(child, env=env, capture_output=True, text=True, check=True).stdout
            rounds[name].append(orjson.loads(out.strip().splitlines()[-1]))
            print(f"round {r + 1} {name}: ms per decode step {rounds[name][-1]}", flush=True)
    best = {name: {size: min(r[size] for r in runs) for size in ("short", "long")} for name, runs in rounds.items()}
    result = {
        "ms_per_step": best,
        "speedup": {size: round(best["torch"][size] / best["kernels"][size], 2) for size in ("short", "long")},
        "rounds": rounds,
        "sequences": SEQUENCES,
        "prompt_tokens": {"short": args.short, "long": args.long},
        "command": " ".join(["python -m benchmarks.cpu_decode", *(sys.argv[1:] if argv is None else argv)]),
        **provenance(),
        "cpu_model": cpuinfo("model name"),
        "cpu_count": os.cpu_count(),
    }
    for size in ("short", "long"):
        print(f"{size}: {best['kernels'][size]} ms with the kernels, {best['torch'][size]} ms without: {result['speedup'][size]}x")
    write_result(args.out, result)
    return result


if __name__ == "__main__":
    main()
