"""What the benchmarks that drive a real `ringllm serve` share: a free port, and waiting for health."""

from __future__ import annotations

import asyncio
import socket
import time

import aiohttp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def wait_healthy(http: aiohttp.ClientSession, timeout: float) -> None:
    """Until GET /health answers 200: every actor up and a ping through the whole pipeline."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            async with http.get("/health") as reply:
                if reply.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.1)
    raise TimeoutError(f"the server did not become healthy in {timeout} s")
