"""What an engine kill costs streams afterwards, while the promoted spare's successor sets up.

It serves the default model (or --model), runs a steady load of streaming completions, SIGKILLs the
engine, and reports the streams' inter-token gaps before the kill and after it, past the kill's own
pause: the successor spare starts `--spare-delay` (5 s) after the promotion and sets up beside the
live engine, on the same cores where there are few. The last line printed is one JSON object.

    python -m benchmarks.spare_stall [--model PATH] [--streams 8] [--seconds 35]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp
import orjson

from benchmarks.chaos import Server
from benchmarks.server import free_port, steady_stream, wait_healthy

SETTLE_S = 12.0  # past start-up and the first spares' set-up (5 s after start-up)
KILL_AT_S = 5.0  # into the load
KILL_PAUSE_S = 1.5  # after the kill: the promotion's own pause, not counted as the successor's


def _ms(seconds: float) -> int:
    return round(seconds * 1e3)


async def _run(args: argparse.Namespace) -> dict:
    port = free_port()
    server = Server(args.model, port, Path(tempfile.mkdtemp(prefix="ringllm-spare-stall-")) / "serve.log", ["--hang-timeout", "30"])
    gaps: list[tuple[float, float]] = []
    try:
        async with aiohttp.ClientSession(server.base_url) as http:
            await wait_healthy(http, 300, server.proc)
            await asyncio.sleep(SETTLE_S)
            until = time.monotonic() + args.seconds
            load = [asyncio.create_task(steady_stream(http, i, until, gaps)) for i in range(args.streams)]
            await asyncio.sleep(KILL_AT_S)
            killed = time.monotonic()
            os.kill(server.actors()["engine"][0], signal.SIGKILL)
            await asyncio.gather(*load)
    finally:
        server.stop()
    before = [gap for at, gap in gaps if at < killed]
    after = [(at - killed, gap) for at, gap in gaps if at > killed + KILL_PAUSE_S]
    worst_at, worst = max(after, key=lambda item: item[1])
    return {
        "gap_ms_before": {"p50": _ms(statistics.median(before)), "max": _ms(max(before))},
        "gap_ms_after": {"p50": _ms(statistics.median(gap for _, gap in after)), "max": _ms(worst)},
        "max_at_s_after_kill": round(worst_at, 1),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.spare_stall", description=__doc__.splitlines()[0])  # pyright: ignore[reportOptionalMemberAccess]
    parser.add_argument("--model", help="a model folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=35.0, help="of load, the kill 5 s into it")
    args = parser.parse_args(argv)
    if args.model is None:
        from runtime.models.source import default_model_dir

        args.model = str(default_model_dir())
    summary = asyncio.run(_run(args))
    print(orjson.dumps(summary).decode())
    return summary


if __name__ == "__main__":
    main()
