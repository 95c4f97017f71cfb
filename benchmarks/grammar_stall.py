"""What grammars that are slow to compile cost the streams beside them.

It serves the default model (or --model) on this machine and runs `--streams` plain streams of
completions back to back (stream i starts i x `--stagger` s in, so that their completions do not all
end and start again in one step). `--settle` s after the last one started, it sends `--grammars`
requests, one every `--interval` s, each held to a schema of its own: `--depth` nested objects, each
with an integer property beside the nested one (125 deep, as deep as a request may nest, builds a
1 MB grammar; the nested property's name differs each time, so no compile is cached). It reports the
plain streams' inter-token gaps before the grammars and while they are in play (from the first one
sent to a second past the last one answered), each stream's longest, and how the grammar requests
ended (one still unanswered when the load ends counts as such). With `--grammars 0`, a control: the
plain streams alone over the rest of the load, where a new completion's prefill step holds the
others' decodes. Loopback only, bounded in time (`--seconds` of load at most). The last line printed
is one JSON object; --out writes it to a file too.

    python -m benchmarks.grammar_stall [--model PATH] [--streams 16] [--grammars 20] [--out FILE] [-- SERVER FLAGS]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp
import orjson

from benchmarks.provenance import machine, provenance
from benchmarks.server import (
    emit,
    free_port,
    gap_ms,
    gap_summary,
    parse_load_args,
    server_config,
    start_server,
    start_streams,
    stop_server,
    stream_load_parser,
    wait_healthy,
)
from runtime.structured.grammars import build_grammar


def nested_schema(depth: int, name: str) -> dict:
    """Objects `depth` deep, each with the next in its optional property `name` and an optional integer beside it."""
    schema: dict = {}
    for _ in range(depth):
        schema = {"type": "object", "properties": {name: schema, "n": {"type": "integer"}}}
    return schema


async def _guided(http: aiohttp.ClientSession, index: int, depth: int, answers: list[dict]) -> None:
    schema = nested_schema(depth, f"field_{index}_{os.getpid()}")
    fmt = {"type": "json_schema", "json_schema": {"name": "nested", "schema": schema}}
    body = {"prompt": "Some JSON:", "max_tokens": 16, "temperature": 0, "response_format": fmt}
    sent = time.monotonic()
    async with http.post("/v1/completions", json=body) as reply:
        answer = await reply.json(loads=orjson.loads)
    error = answer.get("error", {}).get("message") if reply.status != 200 else None
    answers.append({"status": reply.status, "sent": sent, "answered": time.monotonic(), "error": error})


async def _run(args: argparse.Namespace) -> dict:
    port = free_port()
    log = Path(tempfile.mkdtemp(prefix="ringllm-grammar-stall-")) / "serve.log"
    flags = ["--model", args.model, "--port", str(port), "--no-warm-spares", *args.server_flags]
    with open(log, "wb") as out:
        server = start_server(flags, stdout=out, stderr=out)
    per_stream: list[list[tuple[float, float]]] = [[] for _ in range(args.streams)]  # (arrival, gap) of each token
    answers: list[dict] = []
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}", timeout=aiohttp.ClientTimeout(total=args.seconds + 60)) as http:
            await wait_healthy(http, 300, server)
            config = await server_config(http)
            started = time.monotonic()
            until = started + args.seconds
            load = await start_streams(http, args.streams, args.stagger, until, per_stream)
            all_started = time.monotonic()
            await asyncio.sleep(args.settle)
            first_sent = time.monotonic()
            guided = []
            for i in range(args.grammars):
                guided.append(asyncio.create_task(_guided(http, i, args.depth, answers)))
                await asyncio.sleep(args.interval)
            if guided:  # none: a control run, whose window is the rest of the load
                await asyncio.wait(guided, timeout=max(0.0, until - time.monotonic()))
            for task in guided:  # unanswered when the load ends: counted as such
                task.cancel()
            await asyncio.gather(*guided, return_exceptions=True)
            window_end = min(until, max((a["answered"] for a in answers), default=until) + 1.0)
            await asyncio.gather(*load)
    finally:
        stop_server(server)
    gaps = [(stream, at, gap) for stream, arrivals in enumerate(per_stream) for at, gap in arrivals]
    before = [gap for _, at, gap in gaps if all_started + 2.0 < at < first_sent]  # past the streams' first prefills
    during = [(stream, gap) for stream, at, gap in gaps if first_sent < at < window_end]
    longest = [max((gap for stream, gap in during if stream == i), default=0.0) for i in range(args.streams)]
    refused = [a for a in answers if a["status"] != 200]
    return {
        **provenance(),
        "machine": machine(),
        "command": "python -m benchmarks.grammar_stall " + " ".join(args.argv),
        "streams": args.streams,
        "grammars": args.grammars,
        "depth": args.depth,
        "grammar_mb": round(len(build_grammar("json_schema", orjson.dumps(nested_schema(args.depth, "x")).decode())) / 2**20, 2),
        "interval_s": args.interval,
        "gap_ms_before": gap_summary(before),
        "gap_ms_during": gap_summary([gap for _, gap in during]),
        "longest_gap_ms_per_stream": [gap_ms(gap) for gap in longest],
        # the longest gaps of all, each with when it ended, in seconds from the first grammar request
        "longest_gaps": [[gap_ms(gap), round(at - first_sent, 1)] for _, at, gap in sorted(gaps, key=lambda g: -g[2])[:5]],
        "window_s": round(window_end - first_sent, 1),
        "grammar_answers": {
            "ok": len(answers) - len(refused),
            "refused": len(refused),
            "unanswered": args.grammars - len(answers),
            "errors": sorted({a["error"] for a in refused}),
        },
        "grammar_latency_s": {
            "p50": round(statistics.median(a["answered"] - a["sent"] for a in answers), 2) if answers else None,
            "max": round(max(a["answered"] - a["sent"] for a in answers), 2) if answers else None,
        },
        "config": config,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = stream_load_parser("python -m benchmarks.grammar_stall", __doc__ or "", 16, 90.0, "the first grammar")
    parser.add_argument("--grammars", type=int, default=20)
    parser.add_argument("--depth", type=int, default=125, help="of each schema's nested objects (at most 125: JSON nested 251 deep)")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between two grammar requests")
    args = parse_load_args(parser, argv)
    return emit(asyncio.run(_run(args)), args.out)


if __name__ == "__main__":
    main()
