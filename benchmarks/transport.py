"""The shared-memory ring against pyzmq PUSH/PULL over ipc://, process to process.

Why: the ring is what ringllm's actors talk through, and zmq is the usual alternative; this
shows what the ring buys on 16 B, 1 KiB and 64 KiB payloads. Every measurement runs between
this process and a freshly spawned one, with the same payloads and the same loops for both
transports (only the small send/recv adapters differ):

- round trip: we send a frame, an echo child sends one of the same size back. p50 and p99 in
  µs, warm-up excluded; lower is better. `rtt_p50_speedup` is zmq ÷ ring.
- throughput: we send N frames back to back, a receiver checks each frame's 8-byte sequence
  number; frames/s and bytes/s from just before the first send to the last receipt.
  `throughput_speedup` is ring ÷ zmq frames/s.

A speedup above 1 means the ring wins. zmq runs in its best mode per size (zero-copy send and
recv at 64 KiB, copying below) with SNDHWM = RCVHWM = 1000 frames; each ring holds 1 MiB.
Both ends are Python: for small frames the per-frame cost of the calls sets the pace, and the
ring's send/recv are pure Python where pyzmq's are compiled, so that is where zmq can keep up.

Usage: python -m benchmarks.transport [--quick] [--out PATH]. A full run writes its JSON to
benchmarks/results/transport-cpu.json; --quick writes only where --out says.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import platform
import signal
import struct
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import ExitStack, closing, contextmanager
from dataclasses import dataclass
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Protocol

import numpy as np
import orjson
import zmq

from benchmarks.provenance import provenance
from transport.ring import Ring, RingHandle, RingReader, RingWriter

SIZES = (16, 1024, 65536)
RING_CAPACITY = 1 << 20
HWM = 1000
POOL = 2 * HWM  # send buffers in rotation: zero-copy zmq holds at most ~SNDHWM of them unsent
STALL_S = 30.0  # a peer silent this long has died: fail instead of hanging
LINGER_MS = 1000  # how long closing a zmq end may wait to deliver what it still holds
KIND = 1
SEQ = struct.Struct("<Q")
DEFAULT_OUT = Path(__file__).parent / "results" / "transport-cpu.json"

# what either transport sends and receives; the stubs call none of these a buffer before Python 3.12 (PEP 688),
# hence the `pyright: ignore`s where they are handed on
Buffer = bytes | bytearray | memoryview | zmq.Frame
Send = Callable[[Buffer], object]
Recv = Callable[[], Buffer]


@dataclass(frozen=True)
class Plan:
    rounds: int
    warmup: int
    frames: dict[int, int]


QUICK = Plan(rounds=3_000, warmup=300, frames={16: 100_000, 1024: 100_000, 65536: 20_000})
FULL = Plan(rounds=12_000, warmup=1_000, frames={16: 400_000, 1024: 400_000, 65536: 80_000})


class Channel(Protocol):
    """A picklable description of one end of a one-way link; each process opens its own."""

    def open_send(self, stack: ExitStack) -> Send: ...

    def open_recv(self, stack: ExitStack) -> Recv: ...


@dataclass(frozen=True)
class RingChannel:
    handle: RingHandle

    def open_send(self, stack: ExitStack) -> Send:
        writer = stack.enter_context(closing(RingWriter(self.handle)))
        return partial(writer.send, KIND, 0, timeout=STALL_S)  # pyright: ignore[reportReturnType]

    def open_recv(self, stack: ExitStack) -> Recv:
        reader = stack.enter_context(closing(RingReader(self.handle)))

        def recv() -> memoryview:
            if (frame := reader.recv(STALL_S)) is None:
                raise TimeoutError(f"nothing on {self.handle.name} for {STALL_S} s")
            return frame.payload  # zero-copy: valid until the next recv

        return recv


@dataclass(frozen=True)
class ZmqChannel:
    address: str
    copy: bool
    bind: bool  # the parent's end binds, the child's connects

    def _socket(self, stack: ExitStack, kind: int) -> zmq.Socket:
        context = stack.enter_context(zmq.Context())  # its exit waits for queued frames to go out
        sock = stack.enter_context(context.socket(kind))
        sock.linger = LINGER_MS
        sock.sndhwm = sock.rcvhwm = HWM
        sock.sndtimeo = sock.rcvtimeo = int(STALL_S * 1000)
        (sock.bind if self.bind else sock.connect)(self.address)
        return sock

    def open_send(self, stack: ExitStack) -> Send:
        return partial(self._socket(stack, zmq.PUSH).send, copy=self.copy)  # pyright: ignore[reportReturnType]

    def open_recv(self, stack: ExitStack) -> Recv:
        return partial(self._socket(stack, zmq.PULL).recv, copy=self.copy)


Factory = Callable[[ExitStack, str, int], tuple[Channel, Channel]]  # -> (our end, the child's)


def ring_channel(stack: ExitStack, label: str, size: int) -> tuple[Channel, Channel]:
    ring = Ring(f"ringllm-bench{os.getpid()}-{label}", RING_CAPACITY)
    stack.callback(ring.close)
    return RingChannel(ring.handle), RingChannel(ring.handle)


def zmq_channel(stack: ExitStack, label: str, size: int) -> tuple[Channel, Channel]:
    folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="ringllm-bench"))
    address, copy = f"ipc://{folder}/{label}", size < zmq.COPY_THRESHOLD  # zero-copy only from 64 KiB
    return ZmqChannel(address, copy, bind=True), ZmqChannel(address, copy, bind=False)


TRANSPORTS: dict[str, Factory] = {"ring": ring_channel, "zmq": zmq_channel}


def _child(target: Callable[..., None], *args: object) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it stops us on its way out
    target(*args)


@contextmanager
def _spawned(target: Callable[..., None], *args: object) -> Iterator[None]:
    """Run `target(*args)` in a spawned process for the duration of the block; never leave it behind."""
    child = multiprocessing.get_context("spawn").Process(target=_child, args=(target, *args), daemon=True)
    child.start()
    try:
        yield
    finally:
        child.join(2)
        if child.is_alive():
            child.terminate()
            child.join(2)
            if child.is_alive():
                child.kill()
                child.join()


def _echo(inbound: Channel, outbound: Channel, rounds: int) -> None:
    with ExitStack() as stack:
        recv, send = inbound.open_recv(stack), outbound.open_send(stack)
        for _ in range(rounds):
            send(recv())


def _drain(conn: Connection, inbound: Channel, frames: int) -> None:
    with conn, ExitStack() as stack:
        recv = inbound.open_recv(stack)
        recv()  # the sender's hello: the link is up
        conn.send(None)
        for expected in range(frames):
            (seq,) = SEQ.unpack_from(recv())  # pyright: ignore[reportArgumentType]
            if seq != expected:
                raise RuntimeError(f"frame {expected} arrived as {seq}")
        conn.send(time.perf_counter_ns())  # CLOCK_MONOTONIC: comparable with the parent's clock


def round_trips(factory: Factory, size: int, plan: Plan) -> np.ndarray:
    """Round-trip times in µs, warm-up dropped."""
    payload, total, clock = bytearray(size), plan.warmup + plan.rounds, time.perf_counter_ns
    took = np.empty(total, np.int64)
    with ExitStack() as stack:
        ping, ping_theirs = factory(stack, "ping", size)
        pong, pong_theirs = factory(stack, "pong", size)
        send, recv = ping.open_send(stack), pong.open_recv(stack)
        stack.enter_context(_spawned(_echo, ping_theirs, pong_theirs, total))
        for i in range(total):
            start = clock()
            send(payload)
            recv()
            took[i] = clock() - start
    return took[plan.warmup :] / 1e3


def throughput(factory: Factory, size: int, frames: int) -> float:
    """Frames per second from just before the first send to the receiver's last receipt."""
    pool = [bytearray(size) for _ in range(min(POOL, frames))]
    with ExitStack() as stack:
        ours, theirs = factory(stack, "stream", size)
        send = ours.open_send(stack)
        conn, child_conn = multiprocessing.get_context("spawn").Pipe()
        stack.enter_context(conn)
        with child_conn:  # our copy goes once the child has its own, so its death reads as EOFError
            stack.enter_context(_spawned(_drain, child_conn, theirs, frames))
        send(pool[0])  # hello
        if not conn.poll(STALL_S):
            raise TimeoutError(f"receiver not ready after {STALL_S} s")
        conn.recv()
        start = time.perf_counter_ns()
        for seq in range(frames):
            buf = pool[seq % len(pool)]
            SEQ.pack_into(buf, 0, seq)
            send(buf)
        if not conn.poll(STALL_S):
            raise TimeoutError(f"receiver silent for {STALL_S} s")
        return frames * 1e9 / (conn.recv() - start)


def _row(test: str, who: str, payload: str, result: str) -> None:
    print(f"{test:<10} {who:<9} {payload:>8}  {result}", flush=True)


def _size_label(size: int) -> str:
    return f"{size // 1024} KiB" if size >= 1024 else f"{size} B"


def run(plan: Plan) -> dict[str, dict[str, float]]:
    found: dict[str, dict[str, float]] = defaultdict(dict)
    _row("test", "transport", "payload", "result")
    for size in SIZES:
        for name, factory in TRANSPORTS.items():
            p50, p99 = np.percentile(round_trips(factory, size, plan), [50, 99])
            found[f"{name}_rtt_p50_us"][str(size)], found[f"{name}_rtt_p99_us"][str(size)] = p50, p99
            _row("rtt", name, _size_label(size), f"p50 {p50:8.1f} µs   p99 {p99:8.1f} µs")
    for size in SIZES:
        for name, factory in TRANSPORTS.items():
            fps = throughput(factory, size, plan.frames[size])
            found[f"{name}_frames_per_s"][str(size)], found[f"{name}_bytes_per_s"][str(size)] = fps, fps * size
            _row("one-way", name, _size_label(size), f"{fps:12,.0f} frames/s  {fps * size / 1e9:7.3f} GB/s")
    for size in SIZES:
        key = str(size)
        found["rtt_p50_speedup"][key] = found["zmq_rtt_p50_us"][key] / found["ring_rtt_p50_us"][key]
        found["throughput_speedup"][key] = found["ring_frames_per_s"][key] / found["zmq_frames_per_s"][key]
        speedups = f"rtt p50 x{found['rtt_p50_speedup'][key]:.2f}   throughput x{found['throughput_speedup'][key]:.2f}"
        _row("speedup", "ring/zmq", _size_label(size), speedups)
    return {metric: {size: float(value) for size, value in by_size.items()} for metric, by_size in found.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.transport", description=__doc__.splitlines()[0])  # pyright: ignore[reportOptionalMemberAccess]
    parser.add_argument("--quick", action="store_true", help="fewer samples; writes nothing unless --out is given")
    parser.add_argument("--out", type=Path, help=f"where the JSON goes (default for full runs: {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    found = run(plan)
    result = {
        **found,
        "throughput_speedup_65536": found["throughput_speedup"]["65536"],
        "quick": args.quick,
        "cores": os.cpu_count(),
        "command": " ".join(["python -m benchmarks.transport", *(sys.argv[1:] if argv is None else argv)]),
        **provenance(),
        "python": platform.python_version(),
        "pyzmq": zmq.__version__,
        "libzmq": zmq.zmq_version(),
        "zmq_hwm": HWM,
        "ring_capacity": RING_CAPACITY,
        "round_trips": plan.rounds,
        "warmup_round_trips": plan.warmup,
        "frames": {str(size): n for size, n in plan.frames.items()},
    }
    out = args.out or (None if args.quick else DEFAULT_OUT)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2) + b"\n")
        print(f"wrote {out}", flush=True)
    print(orjson.dumps(result).decode(), flush=True)


if __name__ == "__main__":
    main()
