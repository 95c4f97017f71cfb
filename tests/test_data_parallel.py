"""Data-parallel replicas on CPU: `ringllm serve --dp 2` places repeats of a prefix on the replica
that caches it and spreads distinct prompts over both; a replica whose engine is SIGKILLed mid-stream
loses and changes no stream, its requests going on at once on the other replica."""

from __future__ import annotations

import asyncio
import os
import signal
import urllib.request

import aiohttp
import orjson
import pytest

from tests.conftest import launch, log_events, ringllm, wait_for, with_tokenizer

PREFIX = [(7 * i) % 500 + 3 for i in range(96)]  # six 16-token blocks
STREAMS = [[5, 6, 7], [9, 10, 11, 12], [13, 14], [40, 41, 42, 43, 44]]


@pytest.fixture(scope="module")
def server(tiny_model, smollm2, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dp")
    served = with_tokenizer(tiny_model("llama"), smollm2, tmp / "model")
    running = launch(served, tmp / "serve.log", "--dp", "2", "--page-size", "16")
    yield running
    assert running.stop() < 5


def taken(server) -> list[int]:
    return [replica["taken"] for replica in server.get("/server_info")["replicas"]]


async def _complete(server, prompt: list[int]) -> dict:
    body = {"model": server.model, "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    async with aiohttp.ClientSession(server.base_url) as http:
        async with http.post("/v1/completions", json=body) as reply:
            assert reply.status == 200, await reply.text()
            return await reply.json()


@pytest.mark.slow
def test_repeats_of_a_prefix_land_on_the_replica_that_caches_it_and_new_prompts_spread(server):
    rows = orjson.loads(ringllm("status", "--json", "--port", str(server.port)).stdout)
    assert [r["name"] for r in rows if r["kind"] in ("scheduler", "engine")] == ["scheduler0", "scheduler1", "engine0", "engine1"]
    before = taken(server)
    cached = [asyncio.run(_complete(server, PREFIX + [n]))["usage"]["prompt_tokens_details"]["cached_tokens"] for n in range(1, 6)]
    after = taken(server)
    assert cached[0] == 0 and all(c >= 80 for c in cached[1:]), cached
    assert sorted(a - b for a, b in zip(after, before)) == [0, 5]  # all five on one replica

    for n in range(8):  # no prefix in common, idle replicas: they take turns
        asyncio.run(_complete(server, [(11 * n + 3 * i) % 400 + 50 for i in range(40)]))
    spread = [a - b for a, b in zip(taken(server), after)]
    assert min(spread) >= 3, spread
    info = server.get("/server_info")
    assert info["scheduler"]["taken"] == sum(r["taken"] for r in info["replicas"])

    with urllib.request.urlopen(server.base_url + "/metrics", timeout=30) as reply:
        metrics = reply.read().decode()
    assert 'replica="0"' in metrics and 'replica="1"' in metrics


async def _streams(server, victim: int | None = None) -> list[str]:
    """Seeded, sampled streams, all at once; with a victim, SIGKILL it after the first stream's 20th event."""
    async with aiohttp.ClientSession(server.base_url) as http:
        events = asyncio.Event()

        async def one(index: int, prompt: list[int]) -> str:
            body = {"model": server.model, "prompt": prompt, "max_tokens": 200, "ignore_eos": True}
            async with http.post("/v1/completions", json={**body, "stream": True, "temperature": 0.8, "seed": index}) as reply:
                texts = []
                async for line in reply.content:
                    if line.startswith(b"data: {"):
                        event = orjson.loads(line[6:])
                        assert "error" not in event, event
                        texts.append(event["choices"][0]["text"])
                        if index == 0 and len(texts) == 20:
                            events.set()
                return "".join(texts)

        async def kill() -> None:
            await events.wait()
            if victim is not None:
                os.kill(victim, signal.SIGKILL)

        *texts, _ = await asyncio.gather(*(one(i, p) for i, p in enumerate(STREAMS)), kill())
        return texts


@pytest.mark.slow
def test_a_dead_replica_loses_and_changes_no_stream(server):
    """Last of the module: it stops the shared server itself, since the restart leaves new processes."""
    reference = asyncio.run(_streams(server))
    rows = orjson.loads(ringllm("status", "--json", "--port", str(server.port)).stdout)
    engine0 = next(r["pid"] for r in rows if r["name"] == "engine0")
    assert asyncio.run(_streams(server, engine0)) == reference
    events = log_events(server.log)
    replays = [e["actor"] for e in events if e["event"] == "queued" and e["generated"]]
    resyncs = [e["actor"] for e in events if e["event"] == "engine_resync"]
    # on CPU a replica's KV pool outlives its engine: its own scheduler reopens its requests over it, nothing is replayed
    assert resyncs == ["scheduler0"] and not replays, (resyncs, replays)
    wait_for(lambda: server.get("/health")["status"] == "ok", 30, "the replica to be back")
    rows = orjson.loads(ringllm("status", "--json", "--port", str(server.port)).stdout)
    assert {r["name"]: r["restarts"] for r in rows if r["kind"] == "engine"} == {"engine0": 1, "engine1": 0}
    assert server.stop() < 5


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--dp", "0"), "data_parallel_size must be at least 1"),
        (("--dp", "2", "--tp", "2", "--device", "cuda"), "2 replicas of 2 tensor-parallel ranks need 4 GPUs"),
        (("--dp", "2", "--dp-policy", "nearest"), "invalid choice: 'nearest'"),
    ],
)
def test_replicas_that_cannot_run_are_refused_before_anything_loads(tiny_model, flags, message):
    done = ringllm("serve", "--model", str(tiny_model("llama")), "--port", "1", *flags, check=False, timeout=60)
    assert done.returncode == 2 and message in done.stderr, done.stderr[-2000:]
