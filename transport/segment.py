"""Named POSIX shared-memory segments, all under one prefix per server.

We map `/dev/shm` files ourselves rather than use `multiprocessing.shared_memory`: its resource
tracker unlinks a segment when any process that attached to it exits, which is exactly wrong for
actors that crash and restart while the segment must live on. Here only the creator unlinks.
"""

from __future__ import annotations

import mmap
import os
import shutil
from pathlib import Path

SHM_DIR = Path("/dev/shm")
PREFIX = "ringllm"


def server_prefix(server: str) -> str:
    """Every segment of one server starts with this, so a crash sweep can find them all."""
    return f"{PREFIX}-{server}-"


class Segment:
    """A mapped segment; `buf` is a writable memoryview of the whole mapping."""

    def __init__(self, name: str, mapping: mmap.mmap, owner: bool) -> None:
        self.name = name
        self.owner = owner
        self._mmap = mapping
        self.buf = memoryview(mapping)

    @classmethod
    def create(cls, name: str, size: int) -> Segment:
        fd = os.open(SHM_DIR / name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            return cls(name, mmap.mmap(fd, size), owner=True)
        except BaseException:
            os.unlink(SHM_DIR / name)
            raise
        finally:
            os.close(fd)

    @classmethod
    def attach(cls, name: str) -> Segment:
        fd = os.open(SHM_DIR / name, os.O_RDWR)
        try:
            return cls(name, mmap.mmap(fd, os.fstat(fd).st_size), owner=False)
        finally:
            os.close(fd)

    @property
    def size(self) -> int:
        return len(self.buf)

    def close(self) -> None:
        """Unmap, and unlink if we created it. Views still held elsewhere keep the pages alive."""
        try:
            self.buf.release()
            self._mmap.close()
        except BufferError:
            pass  # a numpy or ctypes view still exports it: the mapping goes when they do
        if self.owner:
            unlink_segment(self.name)
            self.owner = False


def unlink_segment(name: str) -> None:
    """A segment, or a folder under the prefix (the server's metrics)."""
    try:
        os.unlink(SHM_DIR / name)
    except FileNotFoundError:
        pass
    except IsADirectoryError:
        shutil.rmtree(SHM_DIR / name, ignore_errors=True)


def list_segments(prefix: str = PREFIX) -> list[str]:
    return sorted(p.name for p in SHM_DIR.glob(f"{prefix}*"))


def remove_segments(prefix: str) -> list[str]:
    """Unlink every segment under `prefix`; the supervisor's sweep after a crash."""
    names = list_segments(prefix)
    for name in names:
        unlink_segment(name)
    return names
