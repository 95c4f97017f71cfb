"""The `ringllm` command line: serve, status, chat, trace and bench."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import shutil
import sys
from pathlib import Path

import orjson

from actors.control import STATUS_KEYS, ControlBlock, pid_alive
from actors.pipeline import ServeConfig, kv_pool_segment, pipeline
from actors.supervisor import Supervisor, SupervisorConfig
from api.chat_output import REASONING_PARSERS, TOOL_CALL_PARSERS
from runtime.config import ATTENTION_BACKEND_NAMES, DEFAULT_KV_TOKENS, KV_CACHE_DTYPES, SCHEDULE_POLICIES, EngineConfig, device_defaults
from runtime.obs import trace
from runtime.obs.logs import LOG_FORMATS
from runtime.scheduler.router import POLICIES
from transport.segment import SHM_DIR

API_KEY_ENV = "RINGLLM_API_KEY"  # one more key for --api-key, kept out of the process list
SHM_RING_ROOM = 256 << 20  # what /dev/shm keeps for the rings, the control block and the metrics beside the KV pools

HELP = {  # the serve flags whose help is too long to sit beside them
    "body-timeout": "seconds a client may take to send a request's body; a body still incomplete then gets a 408 and its "
    "connection is closed (default: %(default)s)",
    "hang-timeout": "seconds without a heartbeat before an actor is restarted; the engine too, whatever its watchdog",
    "watchdog-timeout": "seconds an engine step may make no progress before the engine is restarted: the watchdog can only "
    "restart it sooner than --hang-timeout, never later",
    "shutdown-timeout": "on SIGTERM, seconds in-flight requests may take",
    "stats-interval": "seconds between each scheduler's stats line and, for a mixture-of-experts model, each engine's "
    "expert-load report (/server_info, ringllm:moe_expert_load_imbalance) (default: %(default)s)",
    "log-format": "json: one object per line (what `ringllm trace` reads); console: aligned text",
}


def status(port: int, as_json: bool) -> int:
    """Read the supervisor's control block of the server on `port` and list its actors."""
    try:
        control = ControlBlock.attach(str(port))
    except FileNotFoundError:
        print(f"no ringllm server on port {port}", file=sys.stderr)
        return 1
    try:
        if not pid_alive(control.supervisor_pid):
            print(
                f"the supervisor of port {port} (pid {control.supervisor_pid}) is gone; "
                "its segments are swept by the next server on that port",
                file=sys.stderr,
            )
            return 1
        rows = control.status()
    finally:
        control.close()
    if as_json:
        print(orjson.dumps(rows).decode())
        return 0
    table = [STATUS_KEYS] + [tuple("-" if row[k] is None else str(row[k]) for k in STATUS_KEYS) for row in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(STATUS_KEYS))]
    for line in table:
        print("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip())
    return 0


def serve(args: argparse.Namespace) -> int:
    from runtime.models.source import NAME, resolve_model_dir
    from runtime.obs.logs import configure_logging

    os.environ["RINGLLM_LOG_FORMAT"] = args.log_format  # every actor inherits it
    configure_logging("supervisor")
    try:
        if args.api_workers < 1:
            raise ValueError(f"api_workers must be at least 1, not {args.api_workers}")
        if not args.body_timeout > 0:
            raise ValueError(f"body_timeout must be more than 0 seconds, not {args.body_timeout}")
        engine = EngineConfig(
            page_size=args.page_size,
            num_pages=args.num_pages,
            max_prefill_tokens=args.max_prefill_tokens,
            max_running_requests=args.max_running_requests,
            enable_prefix_cache=not args.disable_prefix_cache,
            mixed_chunk=args.enable_mixed_chunk,
            schedule_policy=args.schedule_policy,
            dtype=args.dtype,
            device=args.device,
            dummy_weights=args.dummy_weights,
            attention_backend=args.attention_backend,
            mem_fraction=args.mem_fraction,
            cuda_graph_max_bs=args.cuda_graph_max_bs,
            cuda_graph_max_prefill_tokens=args.cuda_graph_max_prefill_tokens,
            steps_in_flight=args.steps_in_flight,
            tensor_parallel_size=args.tensor_parallel_size,
            custom_all_reduce=args.custom_all_reduce,
            kv_cache_dtype=args.kv_cache_dtype,
            quantization=args.quantization,
            standby_engine=args.standby_engine,
            deterministic=args.enable_deterministic_inference,
        )
        model_dir = resolve_model_dir(args.model)
        config = ServeConfig(
            model_dir=str(model_dir),
            served_model_name=args.served_model_name or args.model or NAME,
            host=args.host,
            port=args.port,
            api_workers=args.api_workers,
            engine=engine,
            max_queued_requests=args.max_queued_requests,
            request_timeout=args.request_timeout,
            body_timeout=args.body_timeout,
            watchdog_timeout=args.watchdog_timeout,
            stats_interval=args.stats_interval,
            data_parallel_size=args.data_parallel_size,
            dp_policy=args.dp_policy,
            warm_spares=args.warm_spares,
            api_keys=tuple(args.api_key or ()) + ((key,) if (key := os.environ.get(API_KEY_ENV)) else ()),
            tool_call_parser=args.tool_call_parser,
            reasoning_parser=args.reasoning_parser,
            warm_prefixes=tuple(orjson.loads(args.warm_prefixes.read_bytes())) if args.warm_prefixes else (),
        )
        if engine.tensor_parallel_size > 1 or config.data_parallel_size > 1:  # torch only for a split or replicas
            from runtime.config import ModelConfig
            from runtime.distributed import check_parallel

            check_parallel(ModelConfig.load(model_dir), engine, config.data_parallel_size)
        if kv_pool_segment(config, 0) is not None and (short := _shm_shortfall(config)):
            print(f"ringllm serve: warning: {short}", file=sys.stderr)
            config = dataclasses.replace(config, shared_kv_pool=False)
    except (ValueError, OSError) as exc:  # before any process starts (OSError: an unreadable --warm-prefixes)
        print(f"ringllm serve: error: {exc}", file=sys.stderr)
        return 2
    supervisor = SupervisorConfig(hang_timeout_s=args.hang_timeout, shutdown_timeout_s=args.shutdown_timeout)
    return Supervisor(pipeline(config), supervisor).run()


def _shm_shortfall(config: ServeConfig) -> str | None:
    """Why /dev/shm cannot hold every replica's KV pool beside the rings (a container's default 64 MB
    cannot), or None when it can."""
    from runtime.config import ModelConfig

    need = config.data_parallel_size * config.engine.cpu_pool_bytes(ModelConfig.load(Path(config.model_dir))) + SHM_RING_ROOM
    if (free := shutil.disk_usage(SHM_DIR).free) >= need:
        return None
    return (
        f"{SHM_DIR} has {free >> 20} MB free and the KV pool needs {need >> 20} MB there to outlive its engine; "
        "each engine keeps its pool to itself, and a restart recomputes its requests (give the container "
        "more shared memory: --shm-size or --ipc=host)"
    )


async def _chat(base_url: str, temperature: float | None) -> int:
    import aiohttp

    history: list[dict] = []
    async with aiohttp.ClientSession(base_url) as http:
        async with http.get("/v1/models") as reply:
            model = (await reply.json())["data"][0]["id"]
        print(f"chatting with {model} at {base_url}; /reset clears the history, Ctrl-D leaves")
        while True:
            try:
                line = input("> ").strip()
            except EOFError:
                print()
                return 0
            if line == "/reset":
                history.clear()
                print("(history cleared)")
                continue
            if not line:
                continue
            history.append({"role": "user", "content": line})
            answer = []
            body = {"model": model, "messages": history, "stream": True}
            if temperature is not None:
                body["temperature"] = temperature
            async with http.post("/v1/chat/completions", json=body) as reply:
                if reply.status != 200:
                    print(f"error {reply.status}: {(await reply.json())['error']['message']}")
                    history.pop()
                    continue
                async for raw in reply.content:
                    data = raw.decode().removeprefix("data: ").strip()
                    if not data or data == "[DONE]":
                        continue
                    for choice in orjson.loads(data).get("choices", []):
                        piece = choice["delta"].get("content") or ""
                        answer.append(piece)
                        print(piece, end="", flush=True)
            print()
            history.append({"role": "assistant", "content": "".join(answer)})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ringllm", description="ringllm: an LLM serving engine on shared-memory rings")
    commands = parser.add_subparsers(dest="command", required=True)

    s = commands.add_parser("serve", help="serve a model with an OpenAI-compatible API")
    s.add_argument("--model", help="a local Hugging Face folder or a hub id (default: SmolLM2-135M-Instruct)")
    s.add_argument("--served-model-name", help="the name clients pass as 'model' (default: --model)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument(
        "--api-key",
        action="append",
        help=f"a key clients must send as 'Authorization: Bearer KEY' to every route but /health, /health/live, /metrics and "
        f"/version (repeat for several; {API_KEY_ENV} adds one)",
    )
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-workers", type=int, default=1, help="HTTP worker processes sharing the port")
    s.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default="hermes",
        help="how the model writes tool calls: hermes and qwen3 <tool_call> tags (Qwen2.5, Qwen3, Hermes), llama3_json (Llama 3)",
    )
    s.add_argument(
        "--warm-prefixes",
        type=Path,
        help="a JSON list of prefixes (texts or token-id lists) prefilled at start-up and pinned in the prefix cache, as "
        "POST /warm_prefixes does",
    )
    s.add_argument(
        "--reasoning-parser",
        choices=tuple(REASONING_PARSERS),
        help="set <think>...</think> apart as reasoning_content (qwen3, deepseek_r1)",
    )
    engine, cuda, cpu = EngineConfig, device_defaults("cuda"), device_defaults("cpu")
    by_device = lambda name: f"default: {cuda[name]} on CUDA, {cpu[name]} on CPU"  # noqa: E731
    s.add_argument("--page-size", type=int, default=engine.page_size)
    s.add_argument(
        "--num-pages",
        type=int,
        help=f"KV pool size in pages (default: what --mem-fraction leaves on CUDA, {DEFAULT_KV_TOKENS} tokens on CPU)",
    )
    s.add_argument("--max-running-requests", type=int, default=engine.max_running_requests)
    s.add_argument("--max-prefill-tokens", type=int, help=f"the prefill chunk budget of one step ({by_device('max_prefill_tokens')})")
    s.add_argument("--disable-prefix-cache", action="store_true")
    s.add_argument(
        "--schedule-policy",
        choices=SCHEDULE_POLICIES,
        default=engine.schedule_policy,
        help="priority: requests carry a 'priority' (lower first, as vLLM); the queue and preemption follow it",
    )
    s.add_argument(
        "--enable-mixed-chunk",
        action="store_true",
        help="run decodes inside steps with prefill chunks (default: prefill first, as SGLang does)",
    )
    s.add_argument(
        "--dtype",
        default=engine.dtype,
        help="auto, float32, bfloat16 or float16 (auto: bfloat16 on CUDA and on CPUs with AMX bf16 tiles, else float32)",
    )
    s.add_argument("--device", default=engine.device)
    s.add_argument(
        "--quantization",
        choices=("fp8",),
        help="fp8: quantize a bf16/fp32 checkpoint's projections per output channel at load (an FP8 checkpoint needs no flag)",
    )
    s.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default=engine.kv_cache_dtype,
        help="auto: the model's dtype; fp8_e4m3 (fp8): float8 pages with a scale per layer, twice the tokens of bf16",
    )
    s.add_argument("--attention-backend", choices=ATTENTION_BACKEND_NAMES, help=by_device("attention_backend"))
    s.add_argument("--mem-fraction", type=float, default=engine.mem_fraction, help="CUDA: share of device memory for weights and KV cache")
    s.add_argument(
        "--cuda-graph-max-bs", type=int, default=engine.cuda_graph_max_bs, help="CUDA: largest decode batch replayed as a graph; 0: off"
    )
    s.add_argument(
        "--cuda-graph-max-prefill-tokens",
        type=int,
        default=engine.cuda_graph_max_prefill_tokens,
        help="CUDA: largest step with prefill chunks replayed as a graph (up to 7 sequences); 0: off",
    )
    s.add_argument(
        "--steps-in-flight", type=int, help=f"steps planned ahead of their results ({by_device('steps_in_flight')}; 1: no overlap)"
    )
    s.add_argument("--dummy-weights", action="store_true", help="random weights of the config's shape")
    s.add_argument(
        "--tp",
        "--tensor-parallel-size",
        dest="tensor_parallel_size",
        type=int,
        default=engine.tensor_parallel_size,
        help="engine processes that split the model, one device each (engine0..engineN-1 in `ringllm status`)",
    )
    s.add_argument(
        "--custom-all-reduce",
        action="store_true",
        help="CUDA, --tp > 1: all-reduces of up to 4 MiB through torch's symmetric-memory one-shot kernel instead of NCCL",
    )
    s.add_argument(
        "--dp",
        "--data-parallel-size",
        dest="data_parallel_size",
        type=int,
        default=ServeConfig.data_parallel_size,
        help="replicas, each a scheduler and engine(s) with its own KV cache, on --dp x --tp devices "
        "(scheduler0.., engine0.. or engine0.0.. in `ringllm status`)",
    )
    s.add_argument(
        "--dp-policy",
        choices=POLICIES,
        default=ServeConfig.dp_policy,
        help="how requests are placed on replicas: cache_aware (the replica holding the longest prefix, unless it is "
        "busier than the least loaded by a margin), round_robin, least_load (default: %(default)s)",
    )
    s.add_argument(
        "--max-queued-requests", type=int, default=ServeConfig.max_queued_requests, help="beyond running + queued, new requests get a 503"
    )
    s.add_argument("--request-timeout", type=float, help="seconds a request may take, queueing included (default: none)")
    s.add_argument("--body-timeout", type=float, default=ServeConfig.body_timeout, help=HELP["body-timeout"])
    s.add_argument("--hang-timeout", type=float, default=SupervisorConfig.hang_timeout_s, help=HELP["hang-timeout"])
    s.add_argument("--watchdog-timeout", type=float, default=ServeConfig.watchdog_timeout, help=HELP["watchdog-timeout"])
    s.add_argument("--stats-interval", type=float, default=ServeConfig.stats_interval, help=HELP["stats-interval"])
    s.add_argument(
        "--warm-spares",
        action=argparse.BooleanOptionalAction,
        default=ServeConfig.warm_spares,
        help="keep a set-up tokenizer, scheduler, detokenizer (and CPU engine) asleep to replace one that dies (default: on)",
    )
    s.add_argument(
        "--standby-engine",
        action="store_true",
        help="CUDA: a second engine process, set up over the kept KV pool with its own weights, takes over at once when the engine dies",
    )
    s.add_argument(
        "--enable-deterministic-inference",
        action="store_true",
        help="batch-invariant kernels: a request's output does not depend on what runs beside it (dense models; Hopper GPUs, fp32 CPUs)",
    )
    s.add_argument("--shutdown-timeout", type=float, default=SupervisorConfig.shutdown_timeout_s, help=HELP["shutdown-timeout"])
    s.add_argument("--log-format", choices=LOG_FORMATS, default="json", help=HELP["log-format"])

    st = commands.add_parser("status", help="list the actors of a running server")
    st.add_argument("--port", type=int, default=8000)
    st.add_argument("--json", action="store_true", help=f"a JSON list of objects with keys {', '.join(STATUS_KEYS)}")

    trace.add_arguments(commands.add_parser("trace", help="one request's timeline across actors, from a server's JSON logs"))

    c = commands.add_parser("chat", help="chat with a running server in the terminal")
    c.add_argument("--url", default="http://127.0.0.1:8000")
    c.add_argument("--temperature", type=float, help="sampling temperature (default: the server's)")

    b = commands.add_parser(
        "bench",
        help="benchmarks: offline throughput, or a load test of a running server "
        "(see `ringllm bench offline --help`, `ringllm bench serve --help`)",
    )
    b.add_argument("workload", choices=["offline", "serve"])
    b.add_argument("options", nargs=argparse.REMAINDER, help="the benchmark's own flags")

    args = parser.parse_args(argv)
    if args.command == "bench":
        import importlib

        importlib.import_module(f"benchmarks.{args.workload}").main(args.options)
        return 0
    if args.command == "serve":
        return serve(args)
    if args.command == "trace":
        return trace.run(args)
    if args.command == "chat":
        return asyncio.run(_chat(args.url, args.temperature))
    return status(args.port, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
