"""The pipeline served over HTTP: greedy parity with transformers through every process, 64
concurrent streams through two api workers, a dropped client freeing its pages, and a clean stop."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import aiohttp
import orjson
import pytest

from tests.conftest import launch, log_events, wait_for, with_tokenizer
from tests.test_parity import NEW_TOKENS, greedy_matches, prompts_for, reference
from transport.segment import list_segments, server_prefix

pytestmark = pytest.mark.slow  # SmolLM2 servers, dozens of concurrent streams and killed actors

QUESTIONS = [
    "What is the capital of France?",
    "Name three colors.",
    "What is 2 + 2?",
    "Say hello in French.",
    "Who wrote Hamlet?",
    "What is the largest planet?",
    "Give me a synonym for happy.",
    "What color is the sky?",
]


async def complete_ids(
    base_url: str, model: str, prompts: list[list[int]], max_tokens: int = NEW_TOKENS, sampling: dict | None = None
) -> list[list[int]]:
    """Completions of token-id prompts, all in flight at once, greedy unless `sampling` says otherwise (request
    fields: temperature, seed); returns the generated ids."""
    body = dict(model=model, max_tokens=max_tokens, temperature=0, ignore_eos=True, return_token_ids=True) | (sampling or {})
    async with aiohttp.ClientSession(base_url) as http:

        async def one(prompt: list[int]) -> list[int]:
            async with http.post("/v1/completions", json={**body, "prompt": prompt}) as reply:
                assert reply.status == 200, await reply.text()
                return (await reply.json())["choices"][0]["token_ids"]

        return await asyncio.gather(*map(one, prompts))


def assert_parity(ids: list[list[int]], model_dir) -> int:
    return sum(greedy_matches(ours, ref_ids, ref_logprobs) for ours, (ref_ids, ref_logprobs) in zip(ids, reference(model_dir)))


# the pipeline is the same for every architecture (each is checked in-process in tests/test_parity.py): over
# HTTP, Llama (llama3 rope) and Qwen2 (biases, tied embeddings) here, Qwen3 under --tp 2 and Qwen3-MoE elsewhere
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_model_parity_through_every_process_and_clean_sigint(arch, tiny_model, smollm2, tmp_path):
    served = with_tokenizer(tiny_model(arch), smollm2, tmp_path / "model")
    server = launch(served, tmp_path / "serve.log", "--page-size", "16", "--max-prefill-tokens", "24")
    try:
        prompts = [list(p) for p in prompts_for(tiny_model(arch))]
        near_ties = assert_parity(asyncio.run(complete_ids(server.base_url, server.model, prompts)), tiny_model(arch))
        print(f"{arch} over HTTP: near-ties {near_ties}")
    finally:
        took = server.stop()  # SIGINT, as a terminal's Ctrl-C
    print(f"{arch}: SIGINT to exit {took:.2f} s")
    assert server.proc.returncode == 0 and took < 5, f"exit {server.proc.returncode} after {took:.1f} s"
    assert not list_segments(server_prefix(str(server.port)))


def test_smollm2_parity_through_every_process(smol_server, smollm2):
    prompts = [list(p) for p in prompts_for(smollm2)]
    assert assert_parity(asyncio.run(complete_ids(smol_server.base_url, smol_server.model, prompts)), smollm2) == 0


async def stream_chat(http: aiohttp.ClientSession, model: str, question: str) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": 24, "temperature": 0, "stream": True}
    text, finishes = [], []
    async with http.post("/v1/chat/completions", json=body) as reply:
        assert reply.status == 200, await reply.text()
        async for line in reply.content:
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                for choice in orjson.loads(line[6:])["choices"]:
                    text.append(choice["delta"].get("content", ""))
                    finishes.append(choice["finish_reason"])
    assert [f for f in finishes if f] in (["stop"], ["length"])
    return "".join(text)


async def _load(base_url: str, model: str) -> tuple[dict[str, str], list[str]]:
    async with aiohttp.ClientSession(base_url, connector=aiohttp.TCPConnector(limit=0, force_close=True)) as http:
        alone = {q: await stream_chat(http, model, q) for q in QUESTIONS}
        together = await asyncio.gather(*(stream_chat(http, model, QUESTIONS[i % len(QUESTIONS)]) for i in range(64)))
    return alone, together


def test_64_concurrent_streams_through_two_api_workers(smol_server):
    started = time.monotonic()
    alone, together = asyncio.run(_load(smol_server.base_url, smol_server.model))
    print(f"8 streams one by one, then 64 at once: {time.monotonic() - started:.1f} s")
    assert "Paris" in alone[QUESTIONS[0]]
    assert together == [alone[QUESTIONS[i % len(QUESTIONS)]] for i in range(64)]  # batching changed nothing


async def _drop_mid_stream(base_url: str, model: str) -> None:
    body = {
        "model": model,
        "prompt": "Once upon a time, in a land far away,",
        "max_tokens": 2000,
        "ignore_eos": True,
        "temperature": 0.8,
        "stream": True,
    }
    async with aiohttp.ClientSession(base_url) as http:
        async with http.post("/v1/completions", json=body) as reply:
            chunks = 0
            async for line in reply.content:
                chunks += line.startswith(b"data: ")
                if chunks == 40:  # well into decoding: the request holds pages now
                    break
    # leaving the blocks closes the connection mid-stream


def test_dropped_client_frees_its_pages_within_a_second(smol_server):
    baseline = smol_server.used_pages()
    asyncio.run(_drop_mid_stream(smol_server.base_url, smol_server.model))
    dropped_at = time.monotonic()
    wait_for(lambda: smol_server.used_pages() == baseline, 5, "the pages to come back", interval=0.01)
    took = time.monotonic() - dropped_at
    print(f"pages back to the baseline of {baseline} {took * 1000:.0f} ms after the client dropped")
    assert took < 1.0
    assert smol_server.get("/server_info")["scheduler"]["running"] == 0


async def _flush(server) -> tuple[int, dict]:
    async with aiohttp.ClientSession(server.base_url) as http, http.post("/flush_cache", json={}) as reply:
        return reply.status, await reply.json()


def test_flush_cache_evicts_the_prefix_cache_through_every_actor(smol_server):
    """The flush reaches the scheduler, and its answer the api worker that asked: the prompt's cached
    pages go, and the same prompt then gives the same text from a cold cache and caches them again."""
    from openai import OpenAI

    client = OpenAI(base_url=smol_server.base_url + "/v1", api_key="none")
    prompt = " ".join(f"word{i}" for i in range(120))  # several full pages

    def run() -> str:
        return client.completions.create(model=smol_server.model, prompt=prompt, max_tokens=4, temperature=0).choices[0].text

    def cached_pages() -> int:
        return smol_server.get("/server_info")["scheduler"]["cached_pages"]

    assert asyncio.run(_flush(smol_server))[0] == 200  # what earlier tests left
    assert cached_pages() == 0
    first = run()
    cached = cached_pages()
    assert cached >= 2
    assert asyncio.run(_flush(smol_server)) == (200, {"flushed_pages": cached})
    assert cached_pages() == 0
    assert asyncio.run(_flush(smol_server)) == (200, {"flushed_pages": 0})
    assert run() == first
    assert cached_pages() == cached


async def _long_generation_while_watching(server) -> list[float]:
    """Stream a long completion; meanwhile read every actor's heartbeat age from `ringllm status`."""
    from tests.conftest import ringllm

    body = {"model": server.model, "prompt": "Once upon a time", "max_tokens": 160, "ignore_eos": True, "temperature": 0, "stream": True}
    ages: list[float] = []

    async def watch() -> None:
        while True:
            await asyncio.sleep(0.5)
            rows = orjson.loads((await asyncio.to_thread(ringllm, "status", "--json", "--port", str(server.port))).stdout)
            ages.extend(row["heartbeat_age_s"] for row in rows)

    async with aiohttp.ClientSession(server.base_url) as http:
        watcher = asyncio.create_task(watch())
        async with http.post("/v1/completions", json=body) as reply:
            async for _ in reply.content:
                pass
        watcher.cancel()
    return ages


def test_busy_actors_keep_their_heartbeat(smol_server):
    ages = asyncio.run(_long_generation_while_watching(smol_server))
    assert len(ages) >= 10 and max(ages) < 3.0, ages  # the hang threshold is 30 s; a busy loop must not near it


async def _stream_text(server, victim_pid: int | None = None) -> tuple[str, float | None]:
    """A seeded, sampled stream's text; with a victim, SIGKILL it after the 20th event and time the
    pause until the next one."""
    body = {
        "model": server.model,
        "prompt": [5, 6, 7],
        "max_tokens": 300,
        "ignore_eos": True,
        "stream": True,
        "temperature": 0.8,
        "seed": 11,
    }
    async with aiohttp.ClientSession(server.base_url) as http:
        async with http.post("/v1/completions", json=body) as reply:
            texts, killed_at, pause = [], None, None
            async for line in reply.content:
                if not line.startswith(b"data: {"):
                    continue
                if killed_at is not None and pause is None:
                    pause = time.monotonic() - killed_at
                event = orjson.loads(line[6:])
                assert "error" not in event, event
                texts.append(event["choices"][0]["text"])
                if len(texts) == 20 and victim_pid is not None:
                    os.kill(victim_pid, signal.SIGKILL)
                    killed_at = time.monotonic()
            return "".join(texts), pause


@pytest.mark.parametrize("victim", ["engine", "scheduler"])
def test_a_backend_killed_mid_stream_recomputes_nothing_and_the_stream_continues_unchanged(tiny_model, smollm2, tmp_path, victim):
    """An engine's replacement maps the KV pool it left (on CPU) and the epoch stays; a scheduler's starts a
    new epoch, whose scheduler adopts the KV the engine kept, and the replayed stream takes it back."""
    from tests.conftest import ringllm

    served = with_tokenizer(tiny_model("llama"), smollm2, tmp_path / "model")
    server = launch(served, tmp_path / "serve.log")
    try:
        reference, _ = asyncio.run(_stream_text(server))
        status = orjson.loads(ringllm("status", "--json", "--port", str(server.port)).stdout)
        pid = next(row["pid"] for row in status if row["name"] == victim)
        replayed, pause = asyncio.run(_stream_text(server, pid))
        assert replayed == reference and pause < 10
        print(f"{victim} SIGKILL mid-stream: the stream paused {pause * 1e3:.0f} ms and went on unchanged")
        wait_for(lambda: server.get("/health")["status"] == "ok", 30, "the pipeline to be healthy again")
        rows = orjson.loads(ringllm("status", "--json", "--port", str(server.port)).stdout)
        assert next(r["restarts"] for r in rows if r["name"] == victim) == 1
        events = log_events(server.log)
        if victim == "engine":
            assert {row["epoch"] for row in rows} == {1} and any(e["event"] == "engine_resync" for e in events)
        else:  # every actor followed the new epoch; the stream's KV (its prompt and ~20 tokens) was adopted
            assert {row["epoch"] for row in rows} == {2}
            adopted = [e for e in events if e["event"] == "adopted" and e["epoch"] == 2]
            assert len(adopted) == 1 and adopted[0]["requests"] == 1 and adopted[0]["tokens"] >= 20
            # the replay took it back: of its 3 + 20 tokens, at most the newest is fed again
            replay = next(e for e in events if e["event"] == "scheduled" and e["epoch"] == 2)
            assert replay["cached_tokens"] >= 22, replay
    finally:
        assert server.stop() < 5


def test_ringllm_chat_streams_keeps_history_and_resets(smol_server):
    from tests.conftest import ROOT

    session = "What is the capital of France?\nAnd of Italy?\n/reset\nWhat is the capital of Germany?\n"
    result = subprocess.run(
        [sys.executable, "-m", "actors.cli", "chat", "--url", smol_server.base_url, "--temperature", "0"],
        input=session,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert f"chatting with {smol_server.model}" in out and "(history cleared)" in out
    assert "Paris" in out and "Rome" in out and "Berlin" in out  # "And of Italy?" only makes sense with the history
