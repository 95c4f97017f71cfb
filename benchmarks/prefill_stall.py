"""What bursts of long prompts cost the streams decoding beside them, one server layout against another in one run.

For each `--layout` (a string of `ringllm serve` flags, e.g. "--pd" and "--dp 2"), it serves --model on this
machine and runs `--streams` plain streams of completions back to back (steady_stream, staggered by `--stagger`
s). `--settle` s after the last one started, every `--interval` s it sends a burst of `--burst` prompts of
`--prompt-tokens` random token ids each, answered with `--burst-output` tokens, until `--seconds` of load have
passed. It reports the plain streams' inter-token gaps (their time per output token) before the bursts and while
they run, every token served in the burst window a second (throughput), the bursts' times to their first token,
and under --pd what the KV copies moved and took (ringllm:pd_transfer_*), per 1k prompt tokens. The last line
printed is one JSON object: a record per layout, each with the configuration its server reported; --out writes
it to a file too.

    python -m benchmarks.prefill_stall --model DIR --layout=--pd --layout="--dp 2" [--out FILE] [-- SERVER FLAGS]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shlex
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp

from benchmarks.provenance import machine, provenance
from benchmarks.server import (
    emit,
    free_port,
    gap_summary,
    parse_load_args,
    server_config,
    sse_events,
    start_server,
    start_streams,
    stop_server,
    stream_load_parser,
    wait_healthy,
)


async def _long_prompt(http: aiohttp.ClientSession, prompt: list[int], max_tokens: int, answers: list[dict]) -> None:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    sent, first, tokens = time.monotonic(), None, 0
    async with http.post("/v1/completions", json=body) as reply:
        async for _ in sse_events(reply):
            first = first or time.monotonic()
            tokens += 1
    answers.append({"status": reply.status, "sent": sent, "first": first, "done": time.monotonic(), "tokens": tokens})


async def _pd_transfers(http: aiohttp.ClientSession) -> tuple[float, float]:
    """(bytes, seconds) the decode engine has copied so far under --pd (0, 0 otherwise)."""
    async with http.get("/metrics") as reply:
        text = await reply.text()
    samples = {name: float(value) for name, _, value in (line.partition(" ") for line in text.splitlines()) if not name.startswith("#")}
    return samples.get("ringllm:pd_transfer_bytes_total", 0.0), samples.get("ringllm:pd_transfer_seconds_sum", 0.0)


async def _layout(args: argparse.Namespace, layout: str) -> dict:
    port = free_port()
    log = Path(tempfile.mkdtemp(prefix="ringllm-prefill-stall-")) / "serve.log"
    flags = ["--model", args.model, "--port", str(port), "--no-warm-spares", *shlex.split(layout), *args.server_flags]
    with open(log, "wb") as out:
        server = start_server(flags, stdout=out, stderr=out)
    per_stream: list[list[tuple[float, float]]] = [[] for _ in range(args.streams)]
    answers: list[dict] = []
    rng = random.Random(args.seed)
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}", timeout=aiohttp.ClientTimeout(total=args.seconds + 120)) as http:
            await wait_healthy(http, 900, server)
            config = await server_config(http)
            until = time.monotonic() + args.seconds
            load = await start_streams(http, args.streams, args.stagger, until, per_stream)
            all_started = time.monotonic()
            await asyncio.sleep(args.settle)
            moved_before = await _pd_transfers(http)
            first_sent, bursts = time.monotonic(), []
            while time.monotonic() + args.interval < until:
                for _ in range(args.burst):
                    prompt = [rng.randrange(100, 20_000) for _ in range(args.prompt_tokens)]
                    bursts.append(asyncio.create_task(_long_prompt(http, prompt, args.burst_output, answers)))
                await asyncio.sleep(args.interval)
            await asyncio.gather(*load)
            window_end = time.monotonic()
            await asyncio.gather(*bursts)
            moved = [after - before for after, before in zip(await _pd_transfers(http), moved_before)]
    finally:
        stop_server(server)
    gaps = [(at, gap) for arrivals in per_stream for at, gap in arrivals]
    before = [gap for at, gap in gaps if all_started + 2.0 < at < first_sent]  # past the streams' first prefills
    during = [gap for at, gap in gaps if first_sent < at < window_end]
    served = len(during) + sum(a["tokens"] for a in answers if a["done"] < window_end)
    window = window_end - first_sent
    prompt_tokens = args.prompt_tokens * len(answers)
    return {
        "layout": layout,
        "tpot_ms_before": gap_summary(before),
        "tpot_ms_during": gap_summary(during),
        "tokens_per_s_during": round(served / window, 1),
        "bursts_sent": len(answers),
        "burst_ttft_s": {
            "p50": round(statistics.median(a["first"] - a["sent"] for a in answers), 3) if answers else None,
            "max": round(max(a["first"] - a["sent"] for a in answers), 3) if answers else None,
        },
        "burst_errors": sum(a["status"] != 200 for a in answers),
        "pd_transfer": {
            "bytes_per_1k_prompt_tokens": round(moved[0] / prompt_tokens * 1e3) if prompt_tokens else None,
            "ms_per_1k_prompt_tokens": round(moved[1] / prompt_tokens * 1e6, 3) if prompt_tokens else None,
            "gb_per_s": round(moved[0] / moved[1] / 1e9, 1) if moved[1] else None,
        },
        "window_s": round(window, 1),
        "config": config,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = stream_load_parser("python -m benchmarks.prefill_stall", __doc__ or "", 8, 60.0, "the first burst")
    parser.add_argument(
        "--layout", action="append", help='`ringllm serve` flags of one layout, as --layout="--dp 2" (repeat: each runs in turn)'
    )
    parser.add_argument("--burst", type=int, default=2, help="long prompts a burst")
    parser.add_argument("--prompt-tokens", type=int, default=1024, help="tokens of each long prompt")
    parser.add_argument("--burst-output", type=int, default=8, help="tokens each long prompt is answered with")
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between two bursts")
    parser.add_argument("--seed", type=int, default=0, help="of the long prompts' tokens")
    args = parse_load_args(parser, argv)

    async def run() -> list[dict]:
        return [await _layout(args, layout) for layout in args.layout or [""]]

    command = "python -m benchmarks.prefill_stall " + shlex.join(args.argv)
    return emit({**provenance(), "machine": machine(), "command": command, "layouts": asyncio.run(run())}, args.out)


if __name__ == "__main__":
    main()
