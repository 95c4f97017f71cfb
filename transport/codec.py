"""Frame payloads of the pipeline: a small orjson header, then int32 arrays in place.

Layout: u32 header length, the header (the JSON of [meta, array lengths]), zero padding to 4
bytes, then each array's int32 values back to back. The reader's arrays are views of the ring (no
copy): copy what must outlive the next receive.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
import orjson

from transport.ring import Frame, RingWriter

_LEN = struct.Struct("<I")
IntArray = Sequence[int] | np.ndarray


def _head_span(length: int) -> int:
    return (_LEN.size + length + 3) & ~3


async def send(writer: RingWriter, kind: int, rid: int, meta: Any, arrays: Sequence[IntArray] = (), epoch: int = 0) -> None:
    """`meta`: anything orjson writes (dataclasses included)."""
    ints = [np.asarray(a, dtype="<i4") for a in arrays]
    header = orjson.dumps([meta, [len(a) for a in ints]])
    head = _head_span(len(header))
    view = await writer.reserve_async(head + 4 * sum(len(a) for a in ints))
    _LEN.pack_into(view, 0, len(header))
    view[_LEN.size : _LEN.size + len(header)] = header
    offset = head
    for a in ints:
        # numpy's stubs declare ndarray a buffer only from Python 3.12 (PEP 688), though it is one in 3.11 too
        view[offset : offset + a.nbytes] = a.view(np.uint8)  # pyright: ignore[reportCallIssue, reportArgumentType]
        offset += a.nbytes
    writer.commit(kind, rid, epoch)


def unpack(frame: Frame) -> tuple[Any, list[np.ndarray]]:
    payload = frame.payload
    (length,) = _LEN.unpack_from(payload)
    meta, lens = orjson.loads(payload[_LEN.size : _LEN.size + length])
    arrays, offset = [], _head_span(length)
    for n in lens:
        arrays.append(np.frombuffer(payload, dtype="<i4", count=n, offset=offset))
        offset += 4 * n
    return meta, arrays
