"""Hostile clients at full size against one `ringllm serve` (loopback only, bounded in time and count),
each scenario beside a well-behaved client whose every request is timed:

- slowloris: 5,000 sockets from 127.0.0.2 and 5,000 from 127.0.0.3 that send a request line and then
  one header line every 10 s, reopened when the server closes them;
- slow readers: 4 streams (n=64, logprobs=20) whose sockets are never read, for 60 s;
- greedy: `{"prompt": ["a"] * 20, "n": 64}`, then eight requests of 4 x 64 completions from one
  address (as many as it is let in run), and 20 other clients (other addresses) meanwhile.

The server runs on all cores but the last, the clients on the last, as attackers elsewhere would not
share the server's cores. It reports the well-behaved client's worst latency and failures, the api workers' most open file
descriptors and their memory growth, how long the server took to close a socket that never
finished its headers, and the statuses each client got. The last line printed is one JSON object.

    python -m benchmarks.hardened_edges [--model PATH] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import orjson
import psutil

from benchmarks.chaos import Server
from benchmarks.provenance import provenance
from benchmarks.server import API_WORKERS, connector, free_port, server_config, wait_healthy

SLOWLORIS_PER_ADDRESS = 5000
SLOWLORIS_S = 40.0
TRICKLE_S = 10.0  # between the slow headers' lines
REFUSED_BACKOFF_S = 5.0  # before a socket refused over a cap tries again
SLOW_READERS = 4
SLOW_READING_S = 60.0
OTHER_CLIENTS = 20
SCENARIOS = ["slowloris", "slow_readers", "greedy"]


class Probe:
    """The well-behaved client: one small completion after another, each timed."""

    def __init__(self, http: aiohttp.ClientSession) -> None:
        self.http, self.latencies, self.failures = http, [], []
        self.started = time.monotonic()

    async def run(self, until: float) -> None:
        while time.monotonic() < until:
            started = time.monotonic()
            try:
                async with self.http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2}) as reply:
                    await reply.read()
                    if reply.status != 200:
                        self.failures.append(reply.status)
            except aiohttp.ClientError as exc:
                self.failures.append(type(exc).__name__)
            self.latencies.append((started - self.started, time.monotonic() - started))
            await asyncio.sleep(0.2)

    def summary(self) -> dict:
        """Its requests, failures, worst latency, and when into the scenario the worst ones were sent."""
        worst = sorted(self.latencies, key=lambda sent_took: -sent_took[1])[:3]
        return {
            "requests": len(self.latencies),
            "failures": self.failures,
            "max_latency_s": round(worst[0][1], 3),
            "worst_sent_at_s": [round(sent, 1) for sent, _ in worst],
        }


class Workers:
    """The api workers' processes: their most open descriptors and their memory, sampled."""

    def __init__(self, server: Server) -> None:
        self.procs = [psutil.Process(pid) for pid in server.actors()["api"]]
        self.most_fds = 0

    def cpu_s(self) -> float:
        return sum(sum(p.cpu_times()[:2]) for p in self.procs)

    def rss_mb(self) -> list[float]:
        return [round(p.memory_info().rss / 2**20, 1) for p in self.procs]

    async def sample(self, until: float) -> None:
        while time.monotonic() < until:
            self.most_fds = max(self.most_fds, *(p.num_fds() for p in self.procs))
            await asyncio.sleep(0.5)


async def _slowloris_socket(port: int, source: str, until: float, lifetimes: list[float]) -> None:
    """One attacker's socket, reopened whenever the server closes it, until `until`."""
    loop = asyncio.get_running_loop()
    while time.monotonic() < until:
        data = None
        sock = socket.socket()
        sock.setblocking(False)
        try:
            sock.bind((source, 0))
            await loop.sock_connect(sock, ("127.0.0.1", port))
            opened = time.monotonic()
            await loop.sock_sendall(sock, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            while time.monotonic() < until:
                try:
                    data = await asyncio.wait_for(loop.sock_recv(sock, 4096), TRICKLE_S)
                except TimeoutError:
                    await loop.sock_sendall(sock, b"X-Slow: 1\r\n")
                    continue
                if not data or data.startswith(b"HTTP/1.1 503"):  # closed, or refused over a cap
                    if not data:
                        lifetimes.append(time.monotonic() - opened)
                    break
        except OSError:
            pass
        finally:
            sock.close()
        await asyncio.sleep(1.0 if data == b"" else REFUSED_BACKOFF_S)  # and then another


async def _attack(port: int, source: str, seconds: float) -> list[float]:
    """One address's slowloris sockets; how long the server let each one live."""
    until, lifetimes = time.monotonic() + seconds, []
    await asyncio.gather(*(_slowloris_socket(port, source, until, lifetimes) for _ in range(SLOWLORIS_PER_ADDRESS)))
    return lifetimes


async def _slowloris(server: Server, http: aiohttp.ClientSession, workers: Workers) -> dict:
    """Each address's attack in a process of its own, so that the probe's timing is not theirs."""
    until = time.monotonic() + SLOWLORIS_S
    attackers = [
        await asyncio.create_subprocess_exec(
            sys.executable, "-m", "benchmarks.hardened_edges", "--attack", source, str(server.port), stdout=asyncio.subprocess.PIPE
        )
        for source in ("127.0.0.2", "127.0.0.3")
    ]
    probe = Probe(http)
    busy = workers.cpu_s()
    await asyncio.gather(probe.run(until), workers.sample(until))
    busy = round(workers.cpu_s() - busy, 1)
    attackers_cpu = round(sum(sum(psutil.Process(a.pid).cpu_times()[:2]) for a in attackers), 1)  # the machine's cores are theirs too
    lifetimes = [t for attacker in attackers for t in orjson.loads((await attacker.communicate())[0])]
    return {
        **probe.summary(),
        "most_open_fds": workers.most_fds,
        "longest_held_s": round(max(lifetimes, default=0.0), 2),
        "cpu_s": {"api_workers": busy, "attackers": attackers_cpu, "of_wall": SLOWLORIS_S},
    }


STORY = {"prompt": "Write a long story.", "n": 64, "logprobs": 20, "max_tokens": 4000, "ignore_eos": True, "stream": True}


async def _readers(server: Server, http: aiohttp.ClientSession) -> dict:
    """The same load read as it comes, for as long: what the probe meets without slow clients."""
    until = time.monotonic() + SLOW_READING_S

    async def read() -> None:
        async with http.post("/v1/completions", json=STORY) as reply:
            async for _ in reply.content.iter_any():
                if time.monotonic() > until:
                    return

    probe = Probe(http)
    await asyncio.gather(probe.run(until), *(read() for _ in range(SLOW_READERS)))
    return probe.summary()


async def _slow_readers(server: Server, http: aiohttp.ClientSession, workers: Workers) -> dict:
    before = workers.rss_mb()
    body = orjson.dumps(STORY)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    readers = []
    for _ in range(SLOW_READERS):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", server.port))
        sock.sendall(head + body)  # and never read
        readers.append(sock)
    until = time.monotonic() + SLOW_READING_S
    probe = Probe(http)
    peak = list(before)

    async def watch() -> None:
        while time.monotonic() < until:
            peak[:] = [max(a, b) for a, b in zip(peak, workers.rss_mb())]
            await asyncio.sleep(0.5)

    await asyncio.gather(probe.run(until), watch())
    aborted = await _metric(http, "ringllm:slow_client_aborts_total")
    for sock in readers:
        sock.close()
    return {**probe.summary(), "rss_mb_before": before, "rss_mb_peak": peak, "slow_clients_cut_off": aborted}


async def _metric(http: aiohttp.ClientSession, name: str) -> float:
    async with http.get("/metrics") as reply:
        text = await reply.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


async def _greedy(server: Server, http: aiohttp.ClientSession) -> dict:
    async def post(session: aiohttp.ClientSession, body: dict) -> int:
        async with session.post("/v1/completions", json=body) as reply:
            await reply.read()
            return reply.status

    greedy = aiohttp.ClientSession(server.base_url, connector=aiohttp.TCPConnector(local_addr=("127.0.0.2", 0), limit=0))
    others = [
        aiohttp.ClientSession(server.base_url, connector=aiohttp.TCPConnector(local_addr=(f"127.0.1.{i + 1}", 0)))
        for i in range(OTHER_CLIENTS)
    ]
    try:
        whole = await post(greedy, {"prompt": ["a"] * 20, "n": 64, "max_tokens": 200})
        share = {"prompt": ["a"] * 4, "n": 64, "max_tokens": 10, "ignore_eos": True}
        taking = [asyncio.create_task(post(greedy, share)) for _ in range(8)]
        await asyncio.sleep(2.0)
        started = time.monotonic()
        served = await asyncio.gather(*(post(s, {"prompt": f"Hi {i}", "max_tokens": 4}) for i, s in enumerate(others)))
        others_s = time.monotonic() - started
        greedy_statuses = await asyncio.gather(*taking)
    finally:
        for session in (greedy, *others):
            await session.close()
    return {"whole_request": whole, "greedy_statuses": greedy_statuses, "others": served, "others_s": round(others_s, 2)}


def _split_cores() -> tuple[set[int], set[int]]:
    """The server's cores and the clients': attackers on the internet do not run on the server's cores,
    and a CPU engine's threads stall at every barrier for a core that another process holds."""
    cores = sorted(os.sched_getaffinity(0))
    return (set(cores[:-1]), {cores[-1]}) if len(cores) > 1 else (set(cores), set(cores))


async def _run(args: argparse.Namespace) -> dict:
    log = Path(tempfile.mkdtemp(prefix="ringllm-hardened-")) / "serve.log"
    server_cores, client_cores = _split_cores()
    os.sched_setaffinity(0, server_cores)  # the server inherits them
    server = Server(args.model, free_port(), log, ["--api-workers", str(API_WORKERS)])
    os.sched_setaffinity(0, client_cores)  # and this process, the attackers it starts with it, the rest
    try:
        async with aiohttp.ClientSession(server.base_url, connector=connector()) as http:
            await wait_healthy(http, 300, server.proc)
            workers = Workers(server)
            record = {"config": await server_config(http), "cores": {"server": sorted(server_cores), "clients": sorted(client_cores)}}
            if "slowloris" in args.scenarios:
                record["slowloris"] = await _slowloris(server, http, workers)
            if "slow_readers" in args.scenarios:
                record["readers"] = await _readers(server, http)
                await asyncio.sleep(5.0)  # the readers' requests aborted and gone
                record["slow_readers"] = await _slow_readers(server, http, workers)
            if "greedy" in args.scenarios:
                record["greedy"] = await _greedy(server, http)
    finally:
        with contextlib.suppress(Exception):
            server.stop()
    return record


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hardened_edges", description=__doc__.splitlines()[0])  # pyright: ignore[reportOptionalMemberAccess]
    parser.add_argument("--model", help="a model folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--out", type=Path, help="also write the record here")
    parser.add_argument(
        "--scenarios", type=lambda s: s.split(","), default=SCENARIOS, help="a comma-separated subset of " + ",".join(SCENARIOS)
    )
    parser.add_argument("--attack", nargs=2, metavar=("SOURCE", "PORT"), help=argparse.SUPPRESS)  # one address's slowloris
    args = parser.parse_args(argv)
    if args.attack is not None:
        lifetimes = asyncio.run(_attack(int(args.attack[1]), args.attack[0], SLOWLORIS_S))
        print(orjson.dumps(lifetimes).decode())
        return {}
    if args.model is None:
        from runtime.models.source import default_model_dir

        args.model = str(default_model_dir())
    record = {**provenance(), "command": "python -m benchmarks.hardened_edges", **asyncio.run(_run(args))}
    if args.out is not None:
        args.out.write_bytes(orjson.dumps(record, option=orjson.OPT_INDENT_2))
    print(orjson.dumps(record).decode())
    return record


if __name__ == "__main__":
    main()
