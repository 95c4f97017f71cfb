"""Offline throughput on random weights: `ringllm bench offline`.

The workload is mini-sglang's offline bench, so figures compare with its published ones: 256
requests, input and output lengths uniform in [100, 1024] (seed 0), token ids below 10,000,
temperature 0.6, ignore_eos, after a warm-up. The workload runs --rounds times (default
OFFLINE_ROUNDS), each on an empty prefix cache, its figure the best, as mini-sglang's reference figures were taken. `--single`
adds one request of 512 greedy tokens after a prompt of SINGLE_PROMPT ids, run SINGLE_REPEATS times,
its figure the median. Throughput is output tokens over wall time.

By default the requests go through the whole serving pipeline: a `ringllm serve` with
--dummy-weights, fed over HTTP (/v1/completions with token-id prompts, all at once).
`--in-process` drives the scheduler and engine directly instead, so the pipeline's cost is the
ratio of the two. The engine flags are `ringllm serve`'s own (EngineConfig's), passed on as one
config. Results are appended to --out as
{"runs": [{"model", "mode", "workload", "tok_per_s", "command", "startup_s", "date", ...}]}, where
startup_s is the wait from launch until the server answers /health (or the `LLM` is built). Each
run holds every engine setting as the engine ran it: the server's own report (GET /server_info,
its serving settings under "serve"), or the `LLM`'s config; never this command's arguments.

    ringllm bench offline --model benchmarks/models/qwen3-0.6b --single [--in-process]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import orjson

from actors.pipeline import ServeConfig
from benchmarks.provenance import provenance
from benchmarks.server import API_WORKERS, connector, free_port, server_config, start_server, stop_server, wait_healthy
from runtime.config import EngineConfig

DEFAULT_OUT = Path(__file__).parent / "results" / "h200-offline.json"
WARMUP = 16
OFFLINE_ROUNDS = 2  # mini-sglang's figures are the best of two timed runs (shared/gpu/README.md)
MINI_SGLANG_VOCAB = 151_643  # Qwen3's tokenizer.vocab_size, the range of mini-sglang's prompt draws
SINGLE_PROMPT = 886  # ids of the --single request's prompt (the first prompt's first): the length of all earlier figures
SINGLE_REPEATS = 3  # one request lasts about half a second on the H200; three such windows, each from a server of its
# own, gave 991, 1,110 and 1,074 tok/s (Qwen3-0.6B through the pipeline, benchmarks/results/h200-probe-session14.log)
# the serving settings a pipeline run takes (a node past the first of a group is a `ringllm serve --node-rank` of its own)
SERVE_FLAGS = ("api_workers", "data_parallel_size", "dp_policy", "nnodes", "node_rank", "dist_init_addr")


def workload(
    count: int, input_len: tuple[int, int] = (100, 1024), output_len: tuple[int, int] = (100, 1024), seed: int = 0
) -> tuple[list[list[int]], list[int]]:
    """mini-sglang's own sample, so its published figures and these run the same requests: its
    benchmark/offline/bench.py draws from Python's random (seed 0) each prompt's length and then its
    ids over Qwen3's vocabulary, then every output length. The ids are folded below 10,000 after
    the draw, which keeps the stream, and so the lengths, mini-sglang's."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, MINI_SGLANG_VOCAB - 1) % 10_000 for _ in range(rng.randint(*input_len))] for _ in range(count)]
    return prompts, [rng.randint(*output_len) for _ in range(count)]


def versions() -> dict[str, str]:
    """Versions of the modules that shape the figures (read from the modules: the GPU kit puts
    some on the path without installing them)."""
    found = {}
    for module in ("torch", "flashinfer", "sgl_kernel", "transformers"):
        try:
            found[module] = importlib.import_module(module).__version__
        except ImportError:
            continue
    return found


def run_in_process(
    model: str, engine: EngineConfig, rounds: int, prompts: list[list[int]], lengths: list[int], single: list[int] | None
) -> tuple[dict[str, list[float]], float, dict]:
    import torch

    from runtime import LLM, SamplingParams

    launched = time.perf_counter()
    llm = LLM(model, engine)
    startup_s = time.perf_counter() - launched

    def timed(batch: list[list[int]], params: list[SamplingParams]) -> float:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        started = time.perf_counter()
        outputs = llm.generate(batch, params)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return sum(len(o.token_ids) for o in outputs) / (time.perf_counter() - started)

    # the server's defaults under what the workload sets, as a request to the server gets them
    defaults = llm.get_default_sampling_params()
    warm = prompts[:WARMUP]
    timed(warm, [dataclasses.replace(defaults, max_tokens=32, temperature=0.6, ignore_eos=True)] * len(warm))
    params = [dataclasses.replace(defaults, max_tokens=n, temperature=0.6, ignore_eos=True, seed=i) for i, n in enumerate(lengths)]
    figures = {"offline": []}
    for _ in range(rounds):
        llm.flush_cache()
        figures["offline"].append(timed(prompts, params))
    if single:
        figures["single"] = [
            timed([single], [dataclasses.replace(defaults, max_tokens=512, temperature=0, ignore_eos=True)]) for _ in range(SINGLE_REPEATS)
        ]
    return figures, startup_s, {"engine": dataclasses.asdict(llm.config)}


async def _drive(
    server: subprocess.Popen,
    launched: float,
    base_url: str,
    rounds: int,
    prompts: list[list[int]],
    lengths: list[int],
    single: list[int] | None,
) -> tuple[dict[str, list[float]], float, dict]:
    """The timed rounds measure the server, not this client: bodies are JSON-encoded beforehand, and
    the warm-up opens as many connections as the offline round uses. (Built inside the round, 256
    requests reached the server over 210 ms on the H200, while the in-process engine had
    prefilled half of them.) Also returns the configuration the server reports."""
    import aiohttp

    async with aiohttp.ClientSession(base_url, connector=connector(), timeout=aiohttp.ClientTimeout(total=3600)) as http:
        await wait_healthy(http, 900, server)  # start-up loads weights and captures CUDA graphs
        startup_s = time.perf_counter() - launched
        if (config := await server_config(http)) is None:
            raise RuntimeError("the server reports no configuration (GET /server_info)")

        def body(ids: list[int], max_tokens: int, temperature: float, seed: int) -> bytes:
            return orjson.dumps(
                {"model": "bench", "prompt": ids, "max_tokens": max_tokens, "temperature": temperature, "ignore_eos": True, "seed": seed}
            )

        async def complete(request: bytes) -> int:
            async with http.post("/v1/completions", data=request, headers={"Content-Type": "application/json"}) as reply:
                answer = await reply.json(loads=orjson.loads)
                if reply.status != 200:
                    raise RuntimeError(f"the server answered {reply.status}: {answer}")
                return answer["usage"]["completion_tokens"]

        async def timed(requests: list[bytes]) -> float:
            started = time.perf_counter()
            counts = await asyncio.gather(*(complete(r) for r in requests))
            return sum(counts) / (time.perf_counter() - started)

        warm = [body(p, 32, 0.6, i) for i, p in enumerate(prompts[:WARMUP])]
        await timed(warm + [body([i % 10_000 + 1], 1, 0.6, i) for i in range(len(prompts) - WARMUP)])  # + idle connections
        figures = {"offline": []}
        for _ in range(rounds):
            async with http.post("/flush_cache", json={}) as reply:  # POST routes take application/json only
                reply.raise_for_status()
            figures["offline"].append(await timed([body(p, n, 0.6, i) for i, (p, n) in enumerate(zip(prompts, lengths))]))
        if single:
            figures["single"] = [await timed([body(single, 512, 0.0, 0)]) for _ in range(SINGLE_REPEATS)]
        return figures, startup_s, config


def run_pipeline(
    serve: ServeConfig, rounds: int, prompts: list[list[int]], lengths: list[int], single: list[int] | None
) -> tuple[dict[str, list[float]], float, dict]:
    launched = time.perf_counter()
    server = start_server(serve.to_cli_args())
    try:
        return asyncio.run(_drive(server, launched, f"http://127.0.0.1:{serve.port}", rounds, prompts, lengths, single))
    finally:
        stop_server(server)


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, EngineConfig, ServeConfig | None]:
    """The benchmark's own flags, `ringllm serve`'s engine flags (EngineConfig's, random weights by default) and
    the serving settings of SERVE_FLAGS; the engine's config, and the server's for a pipeline run (None in-process)."""
    parser = argparse.ArgumentParser(prog="ringllm bench offline", description=__doc__.splitlines()[0])  # pyright: ignore[reportOptionalMemberAccess]
    parser.add_argument("--model", required=True, help="a folder with config.json and a tokenizer (weights are random)")
    parser.add_argument("--in-process", action="store_true", help="drive the engine directly, without the actor pipeline")
    parser.add_argument("--single", action="store_true", help="also one request of 512 greedy tokens")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=OFFLINE_ROUNDS, help="timed runs of the workload; the figure is the best")
    parser.add_argument("--input-len", type=int, nargs=2, default=(100, 1024), metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=(100, 1024), metavar=("MIN", "MAX"))
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    EngineConfig.add_cli_args(parser)
    ServeConfig.add_cli_args(parser, only=SERVE_FLAGS)
    parser.set_defaults(device="cuda" if _cuda_available() else "cpu", dummy_weights=True, api_workers=API_WORKERS)
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.in_process and args.data_parallel_size > 1:
        parser.error("--dp needs the pipeline: replicas are placed by its tokenizer")
    if args.in_process and args.nnodes > 1:
        parser.error("--nnodes needs the pipeline: node 0's supervisor meets the other nodes")
    try:
        engine = EngineConfig.from_cli_args(args)
        return args, engine, None if args.in_process else _server(args, engine)
    except ValueError as exc:
        parser.error(str(exc))


def _server(args: argparse.Namespace, engine: EngineConfig) -> ServeConfig:
    """The server a pipeline run starts: on a free port, without warm spares (their one-off set-up would
    compete with the timed rounds for the cores)."""
    serving = {name: getattr(args, name) for name in SERVE_FLAGS}
    return ServeConfig(model_dir=args.model, served_model_name="bench", port=free_port(), warm_spares=False, engine=engine, **serving)


def main(argv: list[str] | None = None) -> None:
    args, engine, serve = parse_args(argv)
    prompts, lengths = workload(args.requests, tuple(args.input_len), tuple(args.output_len))
    mode = "in-process" if args.in_process else "pipeline"
    single = prompts[0][:SINGLE_PROMPT] if args.single else None
    sizes = {"offline": {"prompt_tokens": sum(map(len, prompts)), "output_tokens": sum(lengths)}}  # tell samples apart
    if single:
        sizes["single"] = {"prompt_tokens": len(single), "output_tokens": 512}
    if serve is None:
        figures, startup_s, ran = run_in_process(args.model, engine, args.rounds, prompts, lengths, single)
    else:
        figures, startup_s, ran = run_pipeline(serve, args.rounds, prompts, lengths, single)
    engine_ran = ran.pop("engine")
    command = " ".join(["ringllm bench offline", *(sys.argv[1:] if argv is None else argv)])
    figure = {"offline": max, "single": statistics.median}
    runs = [
        {
            "model": Path(args.model).name,
            "mode": mode,
            "workload": name,
            "tok_per_s": round(figure[name](values), 1),
            **({"timed_runs": [round(v, 1) for v in values]} if len(values) > 1 else {}),
            **sizes[name],
            "command": command,
            "startup_s": round(startup_s, 1),
            **provenance(),
            **engine_ran,
            **({"serve": ran} if ran else {}),
            "gpu": _device_name(engine_ran["device"]),
            "versions": versions(),
        }
        for name, values in figures.items()
    ]
    print(f"{Path(args.model).name} {mode} start-up: {startup_s:.1f} s")
    for run in runs:
        print(f"{run['model']} {mode} {run['workload']}: {run['tok_per_s']:,.0f} output tok/s")
    previous = orjson.loads(args.out.read_bytes())["runs"] if args.out.exists() else []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(orjson.dumps({"runs": previous + runs}, option=orjson.OPT_INDENT_2) + b"\n")


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _device_name(device: str) -> str:
    import torch

    return torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"


if __name__ == "__main__":
    main()
