"""Single-producer single-consumer ring of variable-size frames in one shared-memory segment.

Layout: a control block (each index on its own cache line) and a data region. A frame is a
24-byte header (kind, epoch, request id, payload length) and its payload, padded to 8 bytes.
A frame never straddles the end of the region: the writer pads to the start instead, so every
payload is contiguous and the reader can hand out a zero-copy view of it (`Frame.int32()`).

Positions are byte counters that only grow; the offset is the position modulo the capacity.
The writer alone stores the write position and the reader alone the read position.

Memory ordering: the writer stores header and payload, then the write position; the reader loads
the write position, then header and payload. Correctness needs stores kept in order and loads
kept in order, which x86-64 (TSO) guarantees and Python cannot request with a fence. Weaker CPUs
(Arm, POWER) reorder both, so the ring refuses to run there rather than hand out torn frames.
"""

from __future__ import annotations

import asyncio
import ctypes
import itertools
import platform
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from transport.segment import Segment
from transport.wakeup import Doorbell, ring_if_asleep, wait_until, wait_until_async

HEADER = struct.Struct("<IIQI4x")  # kind, epoch, rid, payload length
PAD = 0  # frame kind reserved for the filler that skips to the start of the region
MAGIC = 0x52494E474C4C4D31  # "RINGLLM1"

_WRITE_POS, _CAPACITY, _MAGIC = 0, 8, 16
_READ_POS = 64
_READER_ASLEEP = 128
_WRITER_ASLEEP = 192
_DATA = 256

_TSO_MACHINES = {"x86_64", "amd64", "i386", "i686"}
_rotation = itertools.count()


def frame_size(length: int) -> int:
    return (HEADER.size + length + 7) & ~7


class PayloadTooLarge(ValueError):
    """A payload no wait could make room for: its frame is larger than the whole ring."""


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


class FrameReleased(RuntimeError):
    """A frame read after its reader's next receive gave its space back to the writer."""


class Frame:
    """One received frame. `payload` views ring memory and is valid until the reader's next receive
    (or `release`); after that it refuses to be read, since the writer may have reused the space.
    Copy or decode what must outlive it, arrays taken from the payload included. A frame without a
    reader owns its bytes (one that came over a socket) and stays readable."""

    __slots__ = ("kind", "epoch", "rid", "_view", "_reader", "_generation")

    def __init__(self, kind: int, epoch: int, rid: int, view: memoryview, reader: RingReader | None = None) -> None:
        self.kind, self.epoch, self.rid, self._view = kind, epoch, rid, view
        self._reader, self._generation = reader, 0 if reader is None else reader.generation

    @property
    def released(self) -> bool:
        return self._reader is not None and self._generation != self._reader.generation

    @property
    def payload(self) -> memoryview:
        if self.released:
            raise FrameReleased(f"{self!r} was read after its reader's next receive released it")
        return self._view

    def int32(self) -> np.ndarray:
        """The payload as little-endian int32, in place (no copy)."""
        return np.frombuffer(self.payload, dtype="<i4")

    def __repr__(self) -> str:
        return f"Frame(kind={self.kind}, epoch={self.epoch}, rid={self.rid}, len={len(self._view)})"


@dataclass(frozen=True)
class RingHandle:
    """What a process needs to open one end of a ring; picklable into spawned children."""

    name: str
    capacity: int
    data_bell: Doorbell  # the writer rings it when the reader sleeps
    space_bell: Doorbell  # the reader rings it when the writer sleeps


class Ring:
    """The owner's side: creates the segment and the doorbells, unlinks the segment on close."""

    def __init__(self, name: str, capacity: int) -> None:
        if capacity % 8 or capacity < frame_size(0) * 2:
            raise ValueError(f"ring capacity must be a multiple of 8 and at least 64 bytes, got {capacity}")
        _check_memory_model()
        self.segment = Segment.create(name, _DATA + capacity)
        struct.pack_into("<QQ", self.segment.buf, _CAPACITY, capacity, MAGIC)
        self.handle = RingHandle(name, capacity, Doorbell(), Doorbell())

    def occupancy(self) -> float:
        """The share of its bytes written and not yet read."""
        written, read = (struct.unpack_from("<Q", self.segment.buf, at)[0] for at in (_WRITE_POS, _READ_POS))
        return (written - read) / self.handle.capacity

    def close(self) -> None:
        self.segment.close()
        self.handle.data_bell.close()
        self.handle.space_bell.close()


def _check_memory_model() -> None:
    if platform.machine().lower() not in _TSO_MACHINES:
        raise RuntimeError(
            f"ringllm's rings rely on x86-64 store and load ordering (TSO); {platform.machine()} "
            "reorders them and Python cannot fence, so frames could be read half-written"
        )


class _End:
    """One attached end of a ring; the control words are ctypes views of shared memory."""

    def __init__(self, handle: RingHandle) -> None:
        _check_memory_model()
        self.handle = handle
        self.segment = Segment.attach(handle.name)
        buf = self.segment.buf
        capacity, magic = struct.unpack_from("<QQ", buf, _CAPACITY)
        if magic != MAGIC or capacity != handle.capacity:
            raise ValueError(f"{handle.name} is not a ringllm ring of capacity {handle.capacity}")
        self.capacity = capacity
        self._write_pos = ctypes.c_uint64.from_buffer(buf, _WRITE_POS)
        self._read_pos = ctypes.c_uint64.from_buffer(buf, _READ_POS)
        self._reader_asleep = ctypes.c_uint32.from_buffer(buf, _READER_ASLEEP)
        self._writer_asleep = ctypes.c_uint32.from_buffer(buf, _WRITER_ASLEEP)
        self._data = buf[_DATA:]
        self.closed = False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        del self._write_pos, self._read_pos, self._reader_asleep, self._writer_asleep
        self._data.release()
        self.segment.close()


class RingWriter(_End):
    """The producer end. A full ring blocks the writer (backpressure): nothing is ever dropped."""

    def __init__(self, handle: RingHandle) -> None:
        super().__init__(handle)
        self._wpos = self._write_pos.value  # a restarted writer resumes after the last published frame
        self._read_seen = self._read_pos.value
        self._reserved: tuple[int, int, int] | None = None
        self._space_lock: asyncio.Lock | None = None

    def _has_room(self, size: int) -> bool:
        """Reload the reader's position only when the cached one says no: fewer cross-core misses."""
        if self.capacity - (self._wpos - self._read_seen) >= size:
            return True
        self._read_seen = self._read_pos.value
        return self.capacity - (self._wpos - self._read_seen) >= size

    def _try_reserve(self, length: int) -> bool:
        size = frame_size(length)
        offset = self._wpos % self.capacity
        tail = self.capacity - offset
        if size > tail:  # would straddle the end: fill the tail and start over at offset 0
            if not self._has_room(tail):
                return False
            if tail >= HEADER.size:
                HEADER.pack_into(self._data, offset, PAD, 0, 0, tail - HEADER.size)
            self._wpos += tail
            self._write_pos.value = self._wpos  # publish the filler so the reader frees the tail
            ring_if_asleep(self._reader_asleep, self.handle.data_bell)
            offset = 0
        if not self._has_room(size):
            return False
        self._reserved = (offset, length, size)
        return True

    def _reserved_view(self) -> memoryview:
        assert self._reserved is not None  # called only once _try_reserve has succeeded
        offset, length, _ = self._reserved
        start = offset + HEADER.size
        return self._data[start : start + length]

    def _check_fits(self, length: int) -> None:
        if frame_size(length) > self.capacity:
            raise PayloadTooLarge(f"a {length}-byte payload cannot fit a {self.capacity}-byte ring")

    def reserve(self, length: int, timeout: float | None = None) -> memoryview:
        """Space for a payload, written in place; publish it with `commit`."""
        self._check_fits(length)
        if not wait_until(lambda: self._try_reserve(length), (self._writer_asleep,), (self.handle.space_bell,), timeout):
            raise TimeoutError(f"ring {self.handle.name} stayed full for {timeout} s")
        return self._reserved_view()

    async def reserve_async(self, length: int, timeout: float | None = None) -> memoryview:
        """Tasks of one loop may share this end: those that must wait for space queue on a lock, as
        only one waiter can own the space doorbell's reader callback at a time. Reserve and commit
        with no await between them."""
        self._check_fits(length)
        if self._try_reserve(length):
            return self._reserved_view()
        if self._space_lock is None:
            self._space_lock = asyncio.Lock()
        async with self._space_lock:
            ready = lambda: self._try_reserve(length)  # noqa: E731
            if not await wait_until_async(ready, (self._writer_asleep,), (self.handle.space_bell,), timeout):
                raise TimeoutError(f"ring {self.handle.name} stayed full for {timeout} s")
            return self._reserved_view()

    def commit(self, kind: int, rid: int, epoch: int = 0) -> None:
        assert self._reserved is not None, "commit without a reserve"
        offset, length, size = self._reserved
        self._reserved = None
        HEADER.pack_into(self._data, offset, kind, epoch, rid, length)
        self._wpos += size
        self._write_pos.value = self._wpos  # TSO: header and payload stores are visible first
        ring_if_asleep(self._reader_asleep, self.handle.data_bell)

    def send(self, kind: int, rid: int, payload=b"", epoch: int = 0, timeout: float | None = None) -> None:
        """Copy any contiguous buffer (bytes, a numpy array) into one frame."""
        data = memoryview(payload).cast("B")
        view = self._reserved_view() if self._try_reserve(data.nbytes) else self.reserve(data.nbytes, timeout)
        view[:] = data
        self.commit(kind, rid, epoch)

    async def send_async(self, kind: int, rid: int, payload=b"", epoch: int = 0, timeout: float | None = None) -> None:
        data = memoryview(payload).cast("B")
        (await self.reserve_async(data.nbytes, timeout))[:] = data
        self.commit(kind, rid, epoch)


class RingReader(_End):
    """The consumer end. A frame handed out stays valid until the next receive releases it; each
    release starts a new generation, and frames of an older one refuse to be read."""

    def __init__(self, handle: RingHandle) -> None:
        super().__init__(handle)
        self._rpos = self._read_pos.value  # a restarted reader resumes at the first unconsumed frame
        self._write_seen = self._rpos
        self._held = 0
        self.generation = 0

    def _readable(self) -> bool:
        """Reload the writer's position only once the cached one is used up."""
        if self._write_seen == self._rpos:
            self._write_seen = self._write_pos.value  # TSO: frame loads that follow stay after this one
        return self._write_seen != self._rpos

    def _consume(self, size: int) -> None:
        self._rpos += size
        self._read_pos.value = self._rpos
        ring_if_asleep(self._writer_asleep, self.handle.space_bell)

    def release(self) -> None:
        """Give the last frame's space back to the writer now rather than at the next receive."""
        if self._held:
            self.generation += 1  # before the writer can see the space: the frame is dead first
            self._consume(self._held)
            self._held = 0

    def try_recv(self) -> Frame | None:
        """Release the frame handed out last, then return the next one, or None if there is none."""
        self.release()
        while self._readable():
            offset = self._rpos % self.capacity
            tail = self.capacity - offset
            if tail >= HEADER.size:
                kind, epoch, rid, length = HEADER.unpack_from(self._data, offset)
                if kind != PAD:
                    self._held = frame_size(length)
                    start = offset + HEADER.size
                    return Frame(kind, epoch, rid, self._data[start : start + length], self)
            self._consume(tail)  # filler up to the end of the region
        return None

    def recv(self, timeout: float | None = None) -> Frame | None:
        """The next frame, waiting up to `timeout` seconds (None: forever); None on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (frame := self.try_recv()) is None:
            if not wait_until(self._readable, (self._reader_asleep,), (self.handle.data_bell,), _left(deadline)):
                return None
        return frame

    async def recv_async(self, timeout: float | None = None) -> Frame | None:
        got = await recv_any_async((self,), timeout)
        return None if got is None else got[1]


async def recv_any_async(readers: Sequence[RingReader], timeout: float | None = None) -> tuple[int, Frame] | None:
    """The next frame from any of `readers`, taken round-robin from where the last call stopped;
    returns (index of its reader, frame), or None on timeout."""
    start = next(_rotation)
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        for turn in range(len(readers)):
            index = (start + turn) % len(readers)
            if (frame := readers[index].try_recv()) is not None:
                return index, frame
        ready = lambda: any(r._readable() for r in readers)  # noqa: E731
        flags = [r._reader_asleep for r in readers]
        if not await wait_until_async(ready, flags, [r.handle.data_bell for r in readers], _left(deadline)):
            return None
