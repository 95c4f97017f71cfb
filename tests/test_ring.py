"""The ring in one process: framing, wrap-around, zero-copy views, backpressure, sleeping and
waking, asyncio ends, and ends that restart mid-stream."""

from __future__ import annotations

import asyncio
import os
import random
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from transport.ring import HEADER, FrameReleased, Ring, RingReader, RingWriter, frame_size
from transport.segment import SHM_DIR, server_prefix
from transport.wakeup import spin_budget_ns


@pytest.fixture
def make_ring(server: str) -> Iterator:
    rings: list[Ring] = []
    ends: list = []

    def make(capacity: int) -> tuple[Ring, RingWriter, RingReader]:
        ring = Ring(f"{server_prefix(server)}r{len(rings)}", capacity)
        rings.append(ring)
        writer, reader = RingWriter(ring.handle), RingReader(ring.handle)
        ends.extend((writer, reader))
        return ring, writer, reader

    yield make
    for end in ends:
        end.close()
    for ring in rings:
        ring.close()


def _background(target) -> threading.Thread:
    thread = threading.Thread(target=target, daemon=True)  # a failing test must not hang on it
    thread.start()
    return thread


def _payload(i: int, n: int) -> bytes:
    return bytes((i + k) % 251 for k in range(min(n, 64))) * (n // 64) + bytes(n % 64)


def test_frames_keep_header_and_payload_across_wraps(make_ring):
    _, writer, reader = make_ring(1000)
    rng = random.Random(7)
    sizes = [rng.choice([0, 1, 7, 8, 100, 450, 520, 700, 1000 - HEADER.size]) for _ in range(3000)]
    _background(lambda: [writer.send(i % 5 + 1, i, _payload(i, n), epoch=i % 3) for i, n in enumerate(sizes)])
    for i, n in enumerate(sizes):
        frame = reader.recv(timeout=5)
        assert (frame.kind, frame.rid, frame.epoch) == (i % 5 + 1, i, i % 3)
        assert bytes(frame.payload) == _payload(i, n)
    assert sum(frame_size(n) for n in sizes) > 100 * 1000  # wrapped around many times
    assert max(sizes) + HEADER.size == 1000  # including frames that need the whole ring


def test_payload_larger_than_ring_is_refused(make_ring):
    _, writer, _ = make_ring(1024)
    with pytest.raises(ValueError):
        writer.send(1, 0, bytes(1024))


def test_int32_arrays_are_written_and_read_in_place(make_ring):
    _, writer, reader = make_ring(4096)
    ids = np.arange(100, dtype=np.int32)
    view = writer.reserve(ids.nbytes)
    np.frombuffer(view, dtype=np.int32)[:] = ids  # built directly in ring memory
    writer.commit(kind=3, rid=9)
    frame = reader.recv()
    got = frame.int32()
    assert np.array_equal(got, ids)
    mapping = np.frombuffer(reader.segment.buf, dtype=np.uint8)
    assert np.shares_memory(got, mapping)  # the reader's array is a view of the shared segment
    del got, frame, mapping


def test_full_ring_blocks_the_writer_and_drops_nothing(make_ring):
    _, writer, reader = make_ring(frame_size(100) * 3)
    with pytest.raises(TimeoutError):
        for i in range(4):
            writer.send(1, i, bytes(100), timeout=0.1)
    assert i == 3  # three fitted, the fourth timed out
    sent = threading.Event()
    blocked = _background(lambda: (writer.send(1, 3, bytes(100)), sent.set()))
    assert not sent.wait(0.3)  # still blocked: backpressure, not a drop
    assert [reader.recv(timeout=5).rid for _ in range(4)] == [0, 1, 2, 3]
    blocked.join(5)
    assert sent.is_set()


def test_sleeping_reader_is_woken_by_the_writer(make_ring):
    _, writer, reader = make_ring(4096)
    got = []
    thread = _background(lambda: got.append(reader.recv(timeout=10)))
    time.sleep(0.2)
    assert reader._reader_asleep.value == 1  # past the spin, asleep on the eventfd
    sent_at = time.monotonic()
    writer.send(1, 42, b"wake")
    thread.join(5)
    assert got[0].rid == 42 and time.monotonic() - sent_at < 0.5
    assert reader._reader_asleep.value == 0


async def test_asyncio_ends_exchange_through_a_small_ring(make_ring):
    _, writer, reader = make_ring(512)
    payloads = [os.urandom(random.Random(i).randint(0, 400)) for i in range(2000)]

    async def produce():
        for i, p in enumerate(payloads):
            await writer.send_async(2, i, p, timeout=5)

    async def consume():
        for i, p in enumerate(payloads):
            frame = await reader.recv_async(timeout=5)
            assert frame.rid == i and bytes(frame.payload) == p

    await asyncio.gather(produce(), consume())
    assert await reader.recv_async(timeout=0.05) is None


def test_restarted_ends_resume_at_the_published_positions(make_ring):
    ring, writer, reader = make_ring(4096)
    writer.send(1, 1, b"published")
    writer.reserve(100)[:] = bytes(100)  # the writer dies before committing this one
    writer.close()
    writer = RingWriter(ring.handle)
    writer.send(1, 2, b"after restart")
    assert bytes(reader.recv(timeout=1).payload) == b"published"  # held, not yet released
    reader.close()  # the reader dies while holding a frame: it was never consumed
    reader = RingReader(ring.handle)
    assert [reader.recv(timeout=1).rid, reader.recv(timeout=1).rid] == [1, 2]
    assert reader.recv(timeout=0.05) is None
    writer.close()
    reader.close()


def test_segments_carry_the_server_prefix_and_close_unlinks(server):
    ring = Ring(f"{server_prefix(server)}edge", 4096)
    path = SHM_DIR / f"ringllm-{server}-edge"
    assert path.exists()
    ring.close()
    assert not path.exists()


def test_spin_adapts_to_the_core_count(monkeypatch):
    monkeypatch.delenv("RINGLLM_SPIN_US", raising=False)
    assert spin_budget_ns(1) == 0  # on one core a spinning waiter only delays its peer
    assert 0 < spin_budget_ns(2) == spin_budget_ns(64)  # longer spins on many cores slowed the engine's host work


async def test_tasks_sharing_a_writer_all_get_through_a_full_ring(make_ring):
    _, writer, reader = make_ring(frame_size(100) * 2)
    senders = [asyncio.create_task(writer.send_async(1, i, bytes(100), timeout=10)) for i in range(20)]
    await asyncio.sleep(0.05)  # most of them now wait for space
    received = []
    while len(received) < 20:
        frame = await reader.recv_async(timeout=5)
        assert frame is not None, f"stalled after {len(received)} frames"
        received.append(frame.rid)
    await asyncio.gather(*senders)
    assert sorted(received) == list(range(20))


def test_a_frame_held_across_a_receive_refuses_to_be_read_once_the_writer_wraps(make_ring):
    """A batch that keeps frames past the next receive would read whatever the writer put there
    since (another request's bytes): the released frame raises instead."""
    _, writer, reader = make_ring(frame_size(96) * 2)
    writer.send(1, 1, b"a" * 96)
    held = reader.recv(timeout=1)
    writer.send(1, 2, b"b" * 96)
    assert reader.recv(timeout=1).rid == 2  # releases frame 1: its space is the writer's again
    writer.send(1, 3, b"c" * 96, timeout=1)  # wraps into frame 1's bytes
    assert held.released
    with pytest.raises(FrameReleased):
        bytes(held.payload)
    with pytest.raises(FrameReleased):
        held.int32()
    assert bytes(reader.recv(timeout=1).payload) == b"c" * 96  # the live frame reads as sent
