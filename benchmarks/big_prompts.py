"""Huge prompts against everyone else: how much other requests' time to first token rises, and
whether /health holds, while clients keep sending prompts of megabytes.

It starts `ringllm serve` (SmolLM2 on CPU, two api workers unless told otherwise), times short
streamed requests one after another on a quiet server, then again while `--attackers` clients
loop sending prompts of `--prompt-mib` MiB (refused for length) and prompts just under the
byte bound (refused by their head in the tokenizer), polling /health all the while. The last
line printed is one JSON object: TTFT p50/p90/max quiet and under attack, the rise, health
answers that were not 200, and attack requests sent.

    python -m benchmarks.big_prompts --out benchmarks/results/big-prompts-cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import orjson

from benchmarks.provenance import provenance
from benchmarks.server import API_WORKERS, connector, free_port, sse_events, start_server, stop_server, wait_healthy

SHORT = {"prompt": "The capital of France is", "max_tokens": 2, "temperature": 0, "stream": True}


async def _ttft(http: aiohttp.ClientSession, model: str) -> float:
    started = time.monotonic()
    async with http.post("/v1/completions", json={**SHORT, "model": model}) as reply:
        assert reply.status == 200, await reply.text()
        async for _ in sse_events(reply):
            return time.monotonic() - started
    raise RuntimeError("the stream ended without an event")


def _summary(times: list[float]) -> dict:
    ordered = sorted(times)
    return {
        "p50_ms": round(statistics.median(ordered) * 1e3, 2),
        "p90_ms": round(ordered[int(0.9 * (len(ordered) - 1))] * 1e3, 2),
        "max_ms": round(ordered[-1] * 1e3, 2),
    }


async def _attack(base_url: str, bodies: list[bytes], rate: float, stop_after: float) -> tuple[int, list[int]]:
    """Each body sent by its own client, `rate` requests a second in all (0: each client back to
    back), until `stop_after` seconds have passed."""
    deadline, statuses = time.monotonic() + stop_after, []
    headers = {"Content-Type": "application/json"}
    interval = len(bodies) / rate if rate else 0.0
    async with aiohttp.ClientSession(base_url, connector=connector()) as http:

        async def loop(body: bytes) -> None:
            due = time.monotonic()
            while (now := time.monotonic()) < deadline:
                await asyncio.sleep(max(0.0, due - now))
                due += interval
                async with http.post("/v1/completions", data=body, headers=headers) as reply:
                    await reply.read()
                    statuses.append(reply.status)

        await asyncio.gather(*map(loop, bodies))
    return len(statuses), sorted(set(statuses))


def _attacker(base_url: str, bodies: list[bytes], rate: float, stop_after: float, results) -> None:
    """In a process of its own, so that building and sending megabytes does not delay the timed client."""
    results.put(asyncio.run(_attack(base_url, bodies, rate, stop_after)))


async def measure(base_url: str, model: str, samples: int, attackers: int, rate: float, prompt_mib: float) -> dict:
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(base_url, timeout=timeout) as http:
        await wait_healthy(http, 300)
        for _ in range(5):  # warm-up
            await _ttft(http, model)
        quiet = [await _ttft(http, model) for _ in range(samples)]
        huge = {"model": model, "prompt": "word " * int(prompt_mib * (1 << 20) / 5), "max_tokens": 4}
        under = {"model": model, "prompt": "word " * 120_000, "max_tokens": 4}  # 600 kB: the tokenizer probes its head
        bodies = [orjson.dumps(huge if i % 2 == 0 else under) for i in range(attackers)]
        results = multiprocessing.get_context("spawn").Queue()
        attack_s = 2.0 + samples * 3 * max(quiet)
        attack = multiprocessing.get_context("spawn").Process(target=_attacker, args=(base_url, bodies, rate, attack_s, results))
        attack.start()
        health, attacked = [], []
        await asyncio.sleep(1.0)  # the attack is under way
        while len(attacked) < samples:
            async with http.get("/health") as reply:
                health.append(reply.status)
            attacked.append(await _ttft(http, model))
        sent, statuses = await asyncio.to_thread(results.get)
        attack.join()
    q, a = _summary(quiet), _summary(attacked)
    return {
        "quiet": q,
        "attacked": a,
        "p50_rise_ms": round(a["p50_ms"] - q["p50_ms"], 2),
        "p90_rise_ms": round(a["p90_ms"] - q["p90_ms"], 2),
        "health_not_200": sum(s != 200 for s in health),
        "health_polls": len(health),
        "attack_rate": rate,
        "attack_requests": sent,
        "attack_seconds": round(attack_s, 1),
        "attack_statuses": statuses,
    }


def _tree() -> str | None:
    """The commit measured, for results read later beside others."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent)
    return head.stdout.strip() or None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.big_prompts", description=__doc__.split("\n\n")[0])  # pyright: ignore[reportOptionalMemberAccess]
    parser.add_argument("--model", help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--api-workers", type=int, default=API_WORKERS)
    parser.add_argument("--samples", type=int, default=40, help="short requests timed in each phase")
    parser.add_argument("--attackers", type=int, default=4, help="clients sending huge prompts")
    parser.add_argument(
        "--rate", type=float, default=8.0, help="huge prompts a second, all clients together (0: a flood, each client sending back to back)"
    )
    parser.add_argument("--prompt-mib", type=float, default=3.0)
    parser.add_argument("--out", help="append the result to this JSON list")
    args = parser.parse_args(argv)
    port = free_port()
    model_args = ["--model", args.model] if args.model else []
    server = start_server(
        [*model_args, "--served-model-name", "bench", "--port", str(port), "--api-workers", str(args.api_workers)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        result = asyncio.run(measure(f"http://127.0.0.1:{port}", "bench", args.samples, args.attackers, args.rate, args.prompt_mib))
    finally:
        stop_server(server)
    result = {
        "command": " ".join(["python -m benchmarks.big_prompts", *(argv if argv is not None else sys.argv[1:])]),
        **provenance(),
        "tree": _tree(),
        **result,
    }
    if args.out:
        path = Path(args.out)
        runs = orjson.loads(path.read_bytes()) if path.exists() else []
        path.write_bytes(orjson.dumps([*runs, result], option=orjson.OPT_INDENT_2))
    print(orjson.dumps(result).decode())


if __name__ == "__main__":
    main()
