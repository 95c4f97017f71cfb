"""What the benchmarks that drive a real `ringllm serve` share: starting it, a free port,
waiting for health, and reading a streamed response's events."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import TypeVar

import aiohttp
import orjson

from actors.pipeline import ServeConfig
from transport.lifetime import on_parent_death

T = TypeVar("T")
API_WORKERS = 2  # of a server a benchmark starts, unless told otherwise (`ringllm serve` alone starts one)


def connector() -> aiohttp.TCPConnector:
    """A client's connections, unlimited, each dropped after idling half the server's header timeout: the server
    closes a keep-alive connection idle for that long, and a request sent on one it has just closed fails with
    ServerDisconnectedError (aiohttp's own idle limit, 15 s, is longer than the server's 10)."""
    return aiohttp.TCPConnector(limit=0, keepalive_timeout=ServeConfig.header_timeout / 2)


def stop_with_parent() -> None:
    """In the server's process: SIGINT (a clean stop) when the benchmark or test run that started it
    dies, so a killed one leaves no server behind."""
    on_parent_death(signal.SIGINT)


def start_server(args: list[str], **popen) -> subprocess.Popen:
    """`ringllm serve ARGS` in its own session (a terminal's Ctrl-C is the benchmark's to handle)."""
    return subprocess.Popen(
        [sys.executable, "-m", "actors.cli", "serve", *args], start_new_session=True, preexec_fn=stop_with_parent, **popen
    )


def stop_server(server: subprocess.Popen, timeout: float = 60) -> None:
    """SIGINT (a clean stop that removes its segments), then SIGKILL if it does not go in time; nothing where no
    process of its group is left (a server that failed to start)."""
    try:
        os.killpg(server.pid, signal.SIGINT)
    except ProcessLookupError:
        return
    try:
        server.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


async def sse_events(reply: aiohttp.ClientResponse) -> AsyncIterator[dict]:
    """The JSON events of a streamed response, in order ([DONE] and anything not an object skipped)."""
    async for line in reply.content:
        if line.startswith(b"data: {"):
            yield orjson.loads(line[6:])


async def steady_stream(http: aiohttp.ClientSession, index: int, until: float, gaps: list[tuple[float, float]]) -> None:
    """Streamed completions one after another until `until`: each token's (arrival, gap since the token before
    it in the same completion)."""
    while time.monotonic() < until:
        prompt = f"Count slowly from {index} to a thousand:"
        body = {"prompt": prompt, "max_tokens": 200, "temperature": 0, "stream": True, "ignore_eos": True}
        last = None
        async with http.post("/v1/completions", json=body) as reply:
            async for _ in sse_events(reply):
                now = time.monotonic()
                if last is not None:
                    gaps.append((now, now - last))
                last = now


async def start_streams(
    http: aiohttp.ClientSession, count: int, stagger: float, until: float, per_stream: list[list[tuple[float, float]]]
) -> list[asyncio.Task]:
    """`count` steady streams until `until`, started `stagger` s apart, stream i recording into per_stream[i]."""
    load = []
    for i in range(count):
        load.append(asyncio.create_task(steady_stream(http, i, until, per_stream[i])))
        await asyncio.sleep(stagger)
    return load


async def bounded(concurrency: int, jobs: Sequence[Callable[[], Awaitable[T]]]) -> list[T]:
    """Every job's result, in order, at most `concurrency` running at once."""
    gate = asyncio.Semaphore(concurrency)

    async def one(job: Callable[[], Awaitable[T]]) -> T:
        async with gate:
            return await job()

    return await asyncio.gather(*(one(job) for job in jobs))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def server_config(http: aiohttp.ClientSession, base_url: str = "") -> dict | None:
    """Every setting the server at `base_url` runs with (GET /server_info's "config"), so that a record holds
    what ran rather than what its client asked for; behind `ringllm router` (SGLang's router, whose /workers lists
    its workers) each worker's, by URL; None from a server that reports none."""
    if (info := await _get_json(http, f"{base_url}/server_info")) is not None and "config" in info:
        return info["config"]
    if (listed := await _get_json(http, f"{base_url}/workers")) is None or "workers" not in listed:
        return None
    return {"router_workers": {w["url"]: await server_config(http, w["url"]) for w in listed["workers"]}}


async def _get_json(http: aiohttp.ClientSession, url: str) -> dict | None:
    """The JSON body of a GET that answers 200 with a JSON object (SGLang's router labels some text/plain), else None."""
    try:
        async with http.get(url) as reply:
            body = await reply.json(loads=orjson.loads, content_type=None) if reply.status == 200 else None
    except (aiohttp.ClientError, orjson.JSONDecodeError):
        return None
    return body if isinstance(body, dict) else None


class ServerExited(RuntimeError):
    pass


async def wait_healthy(http: aiohttp.ClientSession, timeout: float, server: subprocess.Popen | None = None) -> None:
    """Until GET /health answers 200: every actor up and a ping through the whole pipeline. Raises
    ServerExited at once if `server` (the process serving `http`) has exited meanwhile."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server is not None and server.poll() is not None:
            raise ServerExited(f"the server exited with code {server.returncode} before it was healthy")
        try:
            async with http.get("/health") as reply:
                if reply.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.1)
    raise TimeoutError(f"the server did not become healthy in {timeout} s")


def gap_ms(seconds: float) -> float:
    return round(seconds * 1e3, 2)


def gap_summary(gaps: list[float]) -> dict:
    """Inter-token gaps in milliseconds: how many, the median, the 99th percentile and the longest."""
    ordered = sorted(gaps)
    if not ordered:
        return {"tokens": 0}
    return {
        "tokens": len(ordered),
        "p50": gap_ms(statistics.median(ordered)),
        "p99": gap_ms(ordered[int(0.99 * (len(ordered) - 1))]),
        "max": gap_ms(ordered[-1]),
    }


def stream_load_parser(prog: str, doc: str, streams: int, seconds: float, settle: str) -> argparse.ArgumentParser:
    """The flags of a benchmark that runs plain streams beside something else (a stall benchmark): the model, the
    streams and their stagger, the settling time (`settle`: before what), the load's length, --out and, after --,
    `ringllm serve` flags."""
    parser = argparse.ArgumentParser(prog=prog, description=doc.splitlines()[0])
    parser.add_argument("--model", help="a model folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--streams", type=int, default=streams)
    parser.add_argument("--stagger", type=float, default=0.25, help="seconds between two plain streams' starts")
    parser.add_argument("--settle", type=float, default=6.0, help=f"seconds of all plain streams before {settle}")
    parser.add_argument("--seconds", type=float, default=seconds, help="of load at most")
    parser.add_argument("--out", help="also write the record to this file")
    parser.add_argument("server_flags", nargs="*", help="after --: more `ringllm serve` flags")
    return parser


def parse_load_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The parsed flags, with the command line as given (args.argv) and the default model's folder filled in."""
    args = parser.parse_args(argv)
    args.argv = list(argv) if argv is not None else sys.argv[1:]
    if args.model is None:
        from runtime.models.source import default_model_dir

        args.model = str(default_model_dir())
    return args


def emit(record: dict, out: str | None) -> dict:
    """A benchmark's record as its last line printed, and into `out` where given."""
    line = orjson.dumps(record).decode()
    if out:
        Path(out).write_text(line + "\n")
    print(line)
    return record
