"""The `ringllm` command line: serve, router, status, chat, trace, bench and golden."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import shutil
import sys
from pathlib import Path

import orjson

from actors import router
from actors.control import STATUS_KEYS, ControlBlock, pid_alive
from actors.pipeline import ServeConfig, engine_units, kv_pool_segment, pipeline
from actors.shadow import plan
from actors.supervisor import Supervisor, SupervisorConfig
from actors.topology import DEFAULT_PORT
from runtime.obs import trace
from runtime.obs.logs import LOG_FORMATS
from transport import env
from transport.segment import SHM_DIR

SHM_RING_ROOM = 256 << 20  # what /dev/shm keeps for the rings, the control block and the metrics beside the KV pools


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
    from runtime.obs.logs import configure_logging

    env.set_log_format(args.log_format)  # every actor inherits it
    configure_logging("supervisor")
    try:
        config = ServeConfig.from_cli_args(args)
        supervisor = SupervisorConfig.from_cli_args(args)
        if config.engine.tensor_parallel_size > 1 or engine_units(config) > 1:  # torch only for a split or replicas
            from runtime.config import ModelConfig
            from runtime.distributed import check_parallel

            check_parallel(ModelConfig.load(Path(config.model_dir)), config.engine, engine_units(config), config.nnodes)
        if kv_pool_segment(config, 0) is not None and (short := _shm_shortfall(config)):
            if config.engine.pd:  # its decode engine maps the prefill engine's kept pool
                raise ValueError(short)
            print(f"ringllm serve: warning: {short}", file=sys.stderr)
            config = dataclasses.replace(config, shared_kv_pool=False)
    except (ValueError, OSError) as exc:  # before any process starts (OSError: an unreadable --warm-prefixes)
        print(f"ringllm serve: error: {exc}", file=sys.stderr)
        return 2
    shadow = plan(config, [*supervisor.to_cli_args(), "--log-format", args.log_format]) if config.shadow_engine else None
    return Supervisor(pipeline(config, shadow), supervisor).run()


def _shm_shortfall(config: ServeConfig) -> str | None:
    """Why /dev/shm cannot hold every replica's KV pool beside the rings (a container's default 64 MB
    cannot), or None when it can."""
    from runtime.config import ModelConfig

    need = engine_units(config) * config.engine.cpu_pool_bytes(ModelConfig.load(Path(config.model_dir))) + SHM_RING_ROOM
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


def build_parser() -> argparse.ArgumentParser:
    """The whole command line; `ringllm serve`'s flags are its configs' own (runtime.cli_args)."""
    parser = argparse.ArgumentParser(prog="ringllm", description="ringllm: an LLM serving engine on shared-memory rings")
    commands = parser.add_subparsers(dest="command", required=True)

    s = commands.add_parser("serve", help="serve a model with an OpenAI-compatible API")
    ServeConfig.add_cli_args(s)
    SupervisorConfig.add_cli_args(s)
    s.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default="json",
        help="json: one object per line (what `ringllm trace` reads); console: aligned text (default: %(default)s)",
    )

    router.RouterConfig.add_cli_args(commands.add_parser("router", help="one OpenAI-compatible front over many servers (SGLang's router)"))

    st = commands.add_parser("status", help="list the actors of a running server")
    st.add_argument("--port", type=int, default=DEFAULT_PORT)
    st.add_argument("--json", action="store_true", help=f"a JSON list of objects with keys {', '.join(STATUS_KEYS)}")

    trace.add_arguments(commands.add_parser("trace", help="one request's timeline across actors, from a server's JSON logs"))

    c = commands.add_parser("chat", help="chat with a running server in the terminal")
    c.add_argument("--url", default=f"http://127.0.0.1:{DEFAULT_PORT}")
    c.add_argument("--temperature", type=float, help="sampling temperature (default: the server's)")

    b = commands.add_parser(
        "bench",
        help="benchmarks: offline throughput, a load test of a running server, or multi-turn conversations "
        "(see `ringllm bench offline --help`, `ringllm bench serve --help`, `ringllm bench multiturn --help`)",
    )
    b.add_argument("workload", choices=["offline", "serve", "multiturn"])
    b.add_argument("options", nargs=argparse.REMAINDER, help="the benchmark's own flags")

    g = commands.add_parser(
        "golden",
        help="golden traces: record a server's answers to request bodies, or check a server against a recording "
        "(see `ringllm golden record --help`, `ringllm golden check --help`)",
    )
    g.add_argument("action", choices=["record", "check"])
    g.add_argument("options", nargs=argparse.REMAINDER, help="the action's own flags")
    return parser


def _client_tool(module: str, argv: list[str]) -> int | None:
    """A client tool of benchmarks/, imported only when run: the layers below it never import benchmarks."""
    import importlib

    return importlib.import_module(f"benchmarks.{module}").main(argv)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "bench":
        _client_tool(args.workload, args.options)
        return 0
    if args.command == "golden":
        return _client_tool("golden", [args.action, *args.options]) or 0
    if args.command == "serve":
        return serve(args)
    if args.command == "trace":
        return trace.run(args)
    if args.command == "router":
        return router.run(args)
    if args.command == "chat":
        return asyncio.run(_chat(args.url, args.temperature))
    return status(args.port, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
