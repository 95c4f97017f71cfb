"""Small actors that exercise the spine before the engine exists: a numbered, checksummed
stream (Source), a forwarder (Echo) and a verifier (Checksum) that reports what it saw."""

from __future__ import annotations

import asyncio
import os
import random
import struct
import tempfile
import time
import zlib
from collections import Counter
from collections.abc import Callable

import orjson

from actors.base import Actor
from actors.gauges import PROGRESS_GAUGE
from actors.topology import ActorSpec, Edge, Topology
from transport.ring import Frame

KIND_DATA = 1
_STAMP = struct.Struct("<IQ")  # crc32 of the rest, sequence number
_POOL = random.Random(0).randbytes(1 << 16)


def make_payload(seq: int, size: int) -> bytes:
    start = (seq * 7919) % (len(_POOL) - size)
    body = seq.to_bytes(8, "little") + _POOL[start : start + size]
    return zlib.crc32(body).to_bytes(4, "little") + body


def check_payload(payload: memoryview) -> int | None:
    """The sequence number if the checksum holds, else None."""
    crc, seq = _STAMP.unpack_from(payload)
    return seq if zlib.crc32(payload[4:]) == crc else None


def report_path(server: str) -> str:
    return os.path.join(os.environ.get("RINGLLM_PROBE_DIR", tempfile.gettempdir()), f"probe-{server}.json")


class Source(Actor):
    """Sends frames numbered from 0 in every epoch, as fast as the ring takes them."""

    seq = 0

    def on_epoch(self, epoch: int) -> None:
        self.seq = 0

    async def run(self) -> None:
        (out,) = self.outputs.values()
        sizes = random.Random(self.ctx.index)
        while True:
            epoch, seq = self.epoch, self.seq
            await out.send_async(KIND_DATA, seq, make_payload(seq, sizes.randint(0, 2048)), epoch=epoch)
            if self.epoch == epoch:
                self.seq = seq + 1


class Echo(Actor):
    """Forwards each frame of the current epoch to its one output."""

    async def run(self) -> None:
        (inp,) = self.inputs.values()
        (out,) = self.outputs.values()
        while True:
            frame = await inp.recv_async()
            if self.admit(frame):
                await out.send_async(frame.kind, frame.rid, frame.payload, epoch=frame.epoch)


class Checksum(Actor):
    """Verifies checksums and per-epoch sequence, slowly (to keep a backlog), and reports."""

    async def setup(self) -> None:
        self.expected = 0
        self.accepted: Counter[int] = Counter()
        self.stale = 0
        self.errors: list[str] = []
        self._reported = 0.0

    def on_epoch(self, epoch: int) -> None:
        self.expected = 0

    def _check(self, frame: Frame) -> None:
        seq = check_payload(frame.payload)
        if seq is None or seq != frame.rid or seq != self.expected:
            self.errors.append(f"epoch {frame.epoch}: got seq {seq} rid {frame.rid}, expected {self.expected}")
        self.expected = frame.rid + 1
        self.accepted[frame.epoch] += 1

    def _report(self) -> None:
        path = report_path(self.ctx.server)
        record = {"pid": os.getpid(), "epoch": self.epoch, "accepted": self.accepted, "stale": self.stale, "errors": self.errors}
        with open(path + ".tmp", "wb") as f:
            f.write(orjson.dumps(record, option=orjson.OPT_NON_STR_KEYS))
        os.replace(path + ".tmp", path)
        self._reported = time.monotonic()

    async def run(self) -> None:
        (inp,) = self.inputs.values()
        delay = self.options.get("delay_s", 0.0)
        while True:
            frame = await inp.recv_async(timeout=0.1)
            if frame is not None:
                if self.admit(frame):
                    self._check(frame)
                else:
                    self.stale += 1
                inp.release()
                await asyncio.sleep(delay)
            if time.monotonic() - self._reported > 0.05:
                self._report()


class Stall(Actor):
    """In the first epoch, stamps progress once and then makes none, its heartbeat still beating: a
    step stuck on the device. Later epochs (after its restart) stay idle."""

    async def setup(self) -> None:
        self.slot["gauges"][PROGRESS_GAUGE] = 0.0  # a stamp left by the one it replaces

    async def run(self) -> None:
        if self.epoch == 1:
            self.slot["gauges"][PROGRESS_GAUGE] = time.monotonic()
        await asyncio.Event().wait()


class Flaky(Echo):
    """An echo whose set-up dies (exit 1) its first `deaths` times on a server; -1: every time."""

    async def setup(self) -> None:
        path = f"{report_path(self.ctx.server)}.{self.name}-starts"
        with open(path, "a+b") as starts:
            starts.write(b".")
            starts.seek(0)
            count = len(starts.read())
        if self.options["deaths"] < 0 or count <= self.options["deaths"]:
            raise RuntimeError(f"{self.name} dies in its set-up, start {count}")


def _spec(name: str, cls: str, watchdog_s: float | None = None, spare: bool = False, **options) -> ActorSpec:
    return ActorSpec(name=name, kind=name, entry=f"tests.probe_actors:{cls}", options=options, watchdog_s=watchdog_s, spare=spare)


def chain(server: str) -> Topology:
    """source → echo → sink, with rings that hold a backlog of a few hundred frames."""
    return Topology(
        server=server,
        actors=(_spec("source", "Source"), _spec("echo", "Echo"), _spec("sink", "Checksum", delay_s=0.001)),
        edges=(Edge("source", "echo", 256 << 10), Edge("echo", "sink", 256 << 10)),
    )


def spared_chain(server: str) -> Topology:
    """The chain with a warm spare for echo."""
    return Topology(
        server=server,
        actors=(_spec("source", "Source"), _spec("echo", "Echo", spare=True), _spec("sink", "Checksum", delay_s=0.001)),
        edges=(Edge("source", "echo", 256 << 10), Edge("echo", "sink", 256 << 10)),
    )


def idle_pair(server: str) -> Topology:
    """Two echo actors wired in a loop with nothing to forward: the idle-cost probe."""
    return Topology(
        server=server,
        actors=(_spec("ping", "Echo"), _spec("pong", "Echo")),
        edges=(Edge("ping", "pong", 1 << 20), Edge("pong", "ping", 1 << 20)),
    )


def watched_chain(server: str) -> Topology:
    """The chain with a long watchdog (60 s) on echo: a frozen echo must still go after --hang-timeout."""
    return Topology(
        server=server,
        actors=(_spec("source", "Source"), _spec("echo", "Echo", watchdog_s=60.0), _spec("sink", "Checksum", delay_s=0.001)),
        edges=(Edge("source", "echo", 256 << 10), Edge("echo", "sink", 256 << 10)),
    )


def stalled(server: str) -> Topology:
    """One actor whose step makes no progress, under a short watchdog (1.5 s)."""
    return Topology(server=server, actors=(_spec("stall", "Stall", watchdog_s=1.5),))


def flaky_chain(deaths: int) -> Callable[[str], Topology]:
    def topology(server: str) -> Topology:
        return Topology(
            server=server,
            actors=(_spec("source", "Source"), _spec("echo", "Flaky", deaths=deaths), _spec("sink", "Checksum", delay_s=0.001)),
            edges=(Edge("source", "echo", 256 << 10), Edge("echo", "sink", 256 << 10)),
        )

    return topology


def twice_flaky_chain(server: str) -> Topology:
    """The chain whose echo dies in its set-up twice, then starts."""
    return flaky_chain(2)(server)


def doomed_chain(server: str) -> Topology:
    """The chain whose echo dies in its set-up every time."""
    return flaky_chain(-1)(server)
