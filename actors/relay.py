"""Plans for the ranks on other machines (multi-node tensor parallelism): engine rank 0 hands every frame it
reads from its ring to them, by a broadcast over a gloo group of its own, and they read those frames as if
from a ring of theirs, so every rank runs the same steps in the same order. Ranks on node 0 keep reading
their own rings. A follower's frames arrive on a thread that waits in the broadcast; the engine's loop
takes them from a queue, and a broken broadcast (rank 0 gone) ends the engine, whose group then restarts."""

from __future__ import annotations

import asyncio
import threading
from datetime import timedelta
from typing import cast

import torch
import torch.distributed as dist

from runtime.distributed import TensorParallel
from transport.ring import Frame

IDLE_WAIT = timedelta(days=365)  # a follower waits for the next frame as long as the server is idle


class FrameRelay:
    def __init__(self, tp: TensorParallel, nnodes: int) -> None:
        """Every rank of the group calls it (a new process group is made by all ranks): rank 0 and the ranks
        past node 0's belong."""
        per_node = tp.size // nnodes
        # on a rank outside it (node 0's past rank 0) a marker, never used
        self.group = cast("dist.ProcessGroup", dist.new_group([0, *range(per_node, tp.size)], timeout=IDLE_WAIT, backend="gloo"))
        self.leads, self.follows = tp.rank == 0, tp.rank >= per_node
        self._frames: asyncio.Queue[Frame | BaseException] = asyncio.Queue()
        if self.follows:
            loop = asyncio.get_running_loop()
            threading.Thread(target=self._receive, args=(loop,), name="relay", daemon=True).start()

    def forward(self, frame: Frame) -> None:
        """Rank 0: a frame it read, to every follower."""
        payload = frame.payload
        dist.broadcast(torch.tensor([frame.kind, frame.epoch, frame.rid, len(payload)]), 0, group=self.group)
        if len(payload):
            dist.broadcast(torch.frombuffer(payload, dtype=torch.uint8), 0, group=self.group)

    def _receive(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            while True:
                head = torch.empty(4, dtype=torch.int64)
                dist.broadcast(head, 0, group=self.group)
                kind, epoch, rid, length = head.tolist()
                data = torch.empty(length, dtype=torch.uint8)
                if length:
                    dist.broadcast(data, 0, group=self.group)
                loop.call_soon_threadsafe(self._frames.put_nowait, Frame(kind, epoch, rid, data.numpy().data))
        except Exception as exc:  # rank 0 is gone
            loop.call_soon_threadsafe(self._frames.put_nowait, exc)

    async def next(self, timeout: float | None) -> Frame | None:
        """A follower's next frame, waiting up to `timeout` (0: only one that is there)."""
        try:
            got = self._frames.get_nowait() if timeout == 0 else await asyncio.wait_for(self._frames.get(), timeout)
        except (asyncio.QueueEmpty, TimeoutError):
            return None
        if isinstance(got, BaseException):
            raise RuntimeError("engine rank 0 stopped relaying frames") from got
        return got
