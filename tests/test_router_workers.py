"""`ringllm router` (SGLang's router) over three real `ringllm serve` workers: repeated prefixes go where they are
cached, unique prompts spread, and a worker killed mid-load costs no request that had not started streaming, and
rejoins when it returns."""

from __future__ import annotations

import asyncio
import random
import signal
import string
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import psutil
import pytest

from benchmarks.server import server_config, stop_with_parent
from tests.conftest import ROOT, Server, free_port, launch, wait_for
from transport.segment import remove_segments, server_prefix

pytest.importorskip("sglang_router")
pytestmark = pytest.mark.slow  # three servers and a router

WORKERS = 3


class Router:
    def __init__(self, workers: list[Server], log: Path) -> None:
        self.port = free_port()
        urls = [w.base_url for w in workers]
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "actors.cli", "router", "--worker-urls", *urls, "--port", str(self.port), "--log-level", "info"],
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
                preexec_fn=stop_with_parent,
            )
        self.url = f"http://127.0.0.1:{self.port}"

    def workers(self) -> list[dict]:
        import urllib.request

        import orjson

        with urllib.request.urlopen(self.url + "/workers", timeout=5) as reply:
            return orjson.loads(reply.read())["workers"]

    def healthy(self) -> int:
        try:
            return sum(w["is_healthy"] for w in self.workers())
        except OSError:
            return 0


class Fleet:
    """Three workers and the router over them; stop() also sweeps each worker's segments, which one killed with
    its whole process tree leaves behind (its restart at the same port sweeps them too)."""

    def __init__(self, model: Path, folder: Path) -> None:
        self.model, self.folder = model, folder
        self.workers: list[Server] = []
        self.router: Router | None = None

    def start(self) -> Router:
        self.workers = [launch(self.model, self.folder / f"worker{i}.log", ready=False) for i in range(WORKERS)]
        for w in self.workers:
            ready(w)
        router = self.router = Router(self.workers, self.folder / "router.log")
        wait_for(lambda: router.healthy() == WORKERS, 60, "the router and its workers")
        return router

    @property
    def started(self) -> Router:
        assert self.router is not None
        return self.router

    def stop(self) -> None:
        if self.router is not None:
            self.router.proc.send_signal(signal.SIGINT)
            self.router.proc.wait(15)
        for w in self.workers:
            w.stop()
            remove_segments(server_prefix(str(w.port)))


def ready(worker: Server) -> None:
    wait_for(lambda: worker.proc.poll() is not None or b'"topology_ready"' in worker.log.read_bytes(), 180, "a worker")
    assert worker.proc.poll() is None, worker.log.read_text()[-3000:]


@pytest.fixture(scope="module")
def fleet(tiny_smol: Path, tmp_path_factory) -> Iterator[Fleet]:
    fleet = Fleet(tiny_smol, tmp_path_factory.mktemp("router"))
    try:
        fleet.start()
        yield fleet
    finally:
        fleet.stop()


async def complete(session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int = 4) -> dict:
    """A completion through the router: its usage."""
    body = {"model": "model", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    async with session.post(url + "/v1/completions", json=body) as reply:
        assert reply.status == 200, await reply.text()
        return (await reply.json())["usage"]


async def stream(session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int, streaming: list[int]) -> dict:
    """A streamed completion through the router: the tokens it gave and whether it ended with [DONE]; `streaming`
    counts the streams that have begun."""
    body = {"model": "model", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    tokens, done = 0, False
    try:
        async with session.post(url + "/v1/completions", json=body) as reply:
            assert reply.status == 200, await reply.text()
            async for line in reply.content:
                streaming[0] += tokens == 0 and line.startswith(b"data: {")
                tokens += line.startswith(b"data: {")
                done = done or line.startswith(b"data: [DONE]")
    except (aiohttp.ClientError, AssertionError) as exc:
        return {"tokens": tokens, "done": False, "error": repr(exc)[:300]}
    return {"tokens": tokens, "done": done}


def taken(workers: list[Server]) -> list[int]:
    return [w.get("/server_info")["scheduler"]["taken"] for w in workers]


def test_a_benchmark_through_the_router_records_each_workers_config(fleet):
    async def read() -> dict | None:
        async with aiohttp.ClientSession() as session:
            return await server_config(session, fleet.started.url)

    config = asyncio.run(read())
    assert config is not None and set(config["router_workers"]) == {w.base_url for w in fleet.workers}
    assert all(worker["port"] == int(url.rsplit(":", 1)[1]) for url, worker in config["router_workers"].items())


def test_repeated_prefixes_reach_the_worker_that_caches_them(fleet):
    router = fleet.started
    prefixes = [f"Document {i}: " + " ".join(f"word{i * 37 + j}" for j in range(60)) for i in range(9)]

    async def run() -> list[int]:
        async with aiohttp.ClientSession() as session:
            for prefix in prefixes:  # each prefix once: it is cached where it went
                await complete(session, router.url, prefix + " First question?")
            repeats = [await complete(session, router.url, f"{prefix} Question {k}?") for k in range(3) for prefix in prefixes]
            return [usage["prompt_tokens_details"]["cached_tokens"] for usage in repeats]

    cached = asyncio.run(run())
    hits = sum(tokens > 0 for tokens in cached)
    print(f"repeats that found their prefix cached: {hits} of {len(cached)}")
    assert hits >= 0.9 * len(cached), cached


def test_unique_prompts_spread_within_a_fifth_of_even(fleet):
    router, workers = fleet.started, fleet.workers
    generator = random.Random(0)  # prompts that share no beginning: no prefix to follow
    prompts = [" ".join("".join(generator.choices(string.ascii_lowercase, k=6)) for _ in range(8)) for _ in range(60)]
    before = taken(workers)

    async def run() -> None:
        async with aiohttp.ClientSession() as session:
            await asyncio.gather(*(complete(session, router.url, prompt) for prompt in prompts))

    asyncio.run(run())
    counts = [after - b for after, b in zip(taken(workers), before)]
    print(f"unique prompts by worker: {counts}")
    assert sum(counts) == 60 and all(abs(c - 20) <= 4 for c in counts), counts


def test_a_killed_worker_loses_no_request_that_had_not_started_and_rejoins(fleet):
    router, workers = fleet.started, fleet.workers
    victim = workers[0]

    async def run() -> list[dict]:
        streaming = [0]
        async with aiohttp.ClientSession() as session:
            load = [asyncio.create_task(stream(session, router.url, f"Load {i}: tell a story", 64, streaming)) for i in range(36)]
            await asyncio.to_thread(wait_for, lambda: streaming[0] >= 12, 30, "the load to stream")
            for proc in [psutil.Process(victim.proc.pid), *psutil.Process(victim.proc.pid).children(recursive=True)]:
                proc.send_signal(signal.SIGKILL)  # the whole server at once, as a machine dies
            late = [await stream(session, router.url, f"After {i}: tell a story", 8, streaming) for i in range(6)]
            return [*await asyncio.gather(*load), *late]

    results = asyncio.run(run())
    victim.proc.wait(10)
    cut = [r for r in results if not r["done"]]
    print(f"streams cut short: {len(cut)} of {len(results)}")
    # streams the dead worker had begun end short, and only those: every request it had not begun completes elsewhere
    assert cut and all(r["tokens"] > 0 for r in cut), cut
    assert len(cut) <= 36 // WORKERS + 2, cut
    wait_for(lambda: router.healthy() == WORKERS - 1, 20, "the router to drop the dead worker")
    workers[0] = launch(fleet.model, fleet.folder / "worker0-back.log", port=victim.port)  # the same URL
    wait_for(lambda: router.healthy() == WORKERS, 30, "the router to take the worker back")
    before = taken(workers)

    async def more() -> None:
        async with aiohttp.ClientSession() as session:
            await asyncio.gather(*(complete(session, router.url, f"Back {i}: a new topic {i * 31}") for i in range(24)))

    asyncio.run(more())
    after = taken(workers)
    workers[0].stop()  # started by this test: the leak guard wants it gone by its end
    print(f"after the return, by worker: {[a - b for a, b in zip(after, before)]}")
    assert after[0] - before[0] >= 4, (before, after)
