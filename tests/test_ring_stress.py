"""1,000,000 checksummed frames of random sizes (8 B to 64 KiB) from one process to another
through a 100 kB ring: constant wrap-around, and tens of thousands of frames larger than half the
ring. None may be lost, reordered or corrupted."""

from __future__ import annotations

import multiprocessing as mp
import struct
import time
import zlib

import numpy as np
import pytest

from transport.ring import Ring, RingHandle, RingReader, RingWriter, frame_size
from transport.segment import server_prefix

pytestmark = pytest.mark.slow  # a million frames between two processes

FRAMES = 1_000_000
CAPACITY = 100_000  # not a power of two, and smaller than two of the largest frames
SEED = 1234
POOL = np.random.default_rng(SEED).bytes(1 << 17)
STAMP = struct.Struct("<II")  # crc32 of the rest of the payload, sequence number


def frame_sizes() -> list[int]:
    """Log-uniform in [8, 65536]: mostly small frames, a long tail of large ones."""
    rng = np.random.default_rng(SEED)
    return np.exp(rng.uniform(np.log(8), np.log(65536), FRAMES)).astype(np.int64).tolist()


def write_all(handle: RingHandle) -> None:
    """The producer process: every frame is built in place in the ring."""
    writer = RingWriter(handle)
    pool = memoryview(POOL)
    for seq, size in enumerate(frame_sizes()):
        view = writer.reserve(size)
        start = (seq * 7919) % (len(POOL) - size)
        view[STAMP.size :] = pool[start : start + size - STAMP.size]
        struct.pack_into("<I", view, 4, seq)
        struct.pack_into("<I", view, 0, zlib.crc32(view[4:]))
        writer.commit(kind=1, rid=seq)
    writer.close()


def test_million_frames_between_processes_arrive_whole_and_in_order(server):
    sizes = frame_sizes()
    ring = Ring(f"{server_prefix(server)}stress", CAPACITY)
    producer = mp.get_context("spawn").Process(target=write_all, args=(ring.handle,))
    reader = RingReader(ring.handle)
    problems: list[str] = []
    started = time.monotonic()
    producer.start()
    try:
        for seq, size in enumerate(sizes):
            frame = reader.recv(timeout=60)
            assert frame is not None, f"frame {seq} never arrived"
            payload = frame.payload
            crc, stamped = STAMP.unpack_from(payload)
            if frame.rid != seq or stamped != seq or len(payload) != size or zlib.crc32(payload[4:]) != crc:
                problems.append(f"frame {seq}: rid {frame.rid} stamp {stamped} len {len(payload)}/{size}")
        del frame, payload
        assert reader.recv(timeout=0.5) is None, "a frame arrived that was never sent"
        producer.join(30)
        assert producer.exitcode == 0
    finally:
        if producer.is_alive():
            producer.kill()
            producer.join()
        reader.close()
        ring.close()
    elapsed = time.monotonic() - started
    total = sum(frame_size(n) for n in sizes)
    print(f"{FRAMES} frames, {total / 1e9:.2f} GB in {elapsed:.1f} s: {FRAMES / elapsed:,.0f} frames/s")
    assert problems == [], problems[:10]
    assert sum(n > CAPACITY // 2 for n in sizes) > 10_000  # frames larger than half the ring
    assert total > 10_000 * CAPACITY  # the ring wrapped around tens of thousands of times
