"""The keeper: holds a replica's KV pool, so that the pool outlives the engine that writes it.

It runs no model code. An engine asks it over a Unix socket (SHM_DIR/{prefix}keeper{replica}.sock,
this user's only) for the pool's bytes. On CPU the keeper lays the pool in a shared segment it
creates zero-filled; on CUDA it allocates zeroed device memory and hands out a CUDA IPC handle
(torch.multiprocessing's reductions). The same size asked again gets the same memory, pages and all:
a replacement engine, or a warm spare, maps the pool the dead engine wrote (every engine after the
first sizes it from the scheduler's page count, so asks for the same bytes). A keeper's death takes
the pool with it: the supervisor restarts its engine too (ActorSpec.needs), and the new epoch
recomputes every request, as if there were no keeper.

Under --enable-hierarchical-cache the keeper holds the host tier too (runtime.engine.kv_tiers), in a shared
segment on CPU and CUDA alike, asked for and kept as the pool is: an engine's or a scheduler's death keeps
the tier, a keeper's loses it and nothing else.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from multiprocessing.connection import Client, Listener
from typing import Any

import structlog
import torch
from torch.multiprocessing.reductions import reduce_tensor

from actors.base import Actor
from actors.pipeline import keeper_socket, kv_host_segment, kv_pool_segment
from runtime.distributed import rank_device
from transport.segment import SHM_DIR, Segment, server_prefix, unlink_segment

log = structlog.get_logger()
CONNECT_WAIT_S = 60.0  # how long an engine waits for its keeper to listen (a keeper restarting with it)


def keeper_address(server: str, replica: int) -> str:
    return str(SHM_DIR / (server_prefix(server) + keeper_socket(replica)))


class PoolKeeper:
    """A keeper's pool and its answers, apart from the actor (a test runs one in a process of its own)."""

    def __init__(self, address: str, device: torch.device, segment_name: str | None, host_segment_name: str | None = None) -> None:
        """`segment_name`: where the pool lies on CPU (a dead keeper's is unlinked first); None on CUDA.
        `host_segment_name`: where the host tier lies (likewise), where there is one."""
        self.device, self.segment_name, self.host_segment_name = device, segment_name, host_segment_name
        if device.type == "cuda":  # the context now: the engine sizes its pool from what is free after it
            torch.cuda.set_device(device)
            torch.cuda.init()
            torch.empty(1, device=device)
        self.pool: torch.Tensor | None = None  # CUDA
        self.pages = 0  # the pool's pages, as the engine that asked for it first said them
        self.segments: dict[str, Segment] = {}  # by name: the pool's on CPU, the host tier's
        for name in (segment_name, host_segment_name):
            if name is not None:
                unlink_segment(name)  # a dead keeper's pool and tier: its engines died with it
        if os.path.exists(address):  # a dead keeper's socket
            os.unlink(address)
        umask = os.umask(0o077)  # the socket is this user's, as the segments are
        try:
            self.listener = Listener(address, "AF_UNIX")
        finally:
            os.umask(umask)

    def answer_forever(self) -> None:
        """One question per connection: ("pool" or "host", size in bytes, the pool's pages), answered with where it
        is; or ("pages", 0, 0), answered with the pages of the pool held (0: none yet)."""
        while True:
            with self.listener.accept() as conn:
                try:
                    what, size, pages = conn.recv()
                except EOFError:  # an engine that only waited for this keeper to listen
                    continue
                if what == "pages":
                    conn.send(self.pages)
                    continue
                answer = self._pool(size) if what == "pool" else self._host(size)
                if what == "pool" and answer[0] != "error" and not self.pages:
                    self.pages = pages
                conn.send(answer)

    def _pool(self, size: int) -> tuple[Any, ...]:
        """("shm", segment name) on CPU, ("cuda", rebuild, args) on CUDA, ("error", why) for another size than
        the pool's: made by the first question, then the same bytes for every engine."""
        if self.segment_name is not None:
            return self._shared(self.segment_name, size, "KV pool", "kv_pool_made")
        if self.pool is not None and self.pool.numel() != size:
            return ("error", f"the keeper holds a KV pool of {self.pool.numel()} bytes, not the {size} asked for")
        if self.pool is None:
            self.pool = torch.zeros(size, dtype=torch.uint8, device=self.device)
            torch.cuda.synchronize(self.device)
            log.info("kv_pool_made", bytes=size, device=str(self.device))
        return ("cuda", *reduce_tensor(self.pool))

    def _host(self, size: int) -> tuple[Any, ...]:
        """("shm", segment name) of the host tier, made by the first question; ("error", why) where there is none."""
        if self.host_segment_name is None:
            return ("error", "this keeper holds no host tier")
        return self._shared(self.host_segment_name, size, "host tier", "kv_host_tier_made")

    def _shared(self, name: str, size: int, what: str, made: str) -> tuple[Any, ...]:
        """("shm", name) of the segment that holds `what`, made by the first question; ("error", why) for another size."""
        segment = self.segments.get(name)
        if segment is None:
            segment = self.segments[name] = Segment.create(name, size)
            segment.owner = False  # the supervisor unlinks it at stop (Topology.kept)
            log.info(made, bytes=size, segment=name)
        elif segment.size != size:
            return ("error", f"the keeper holds a {what} of {segment.size} bytes, not the {size} asked for")
        return ("shm", name)


class KeeperActor(Actor):
    async def setup(self) -> None:
        serve, replica = self.options["serve"], self.options["replica"]
        segment, host = kv_pool_segment(serve, replica), kv_host_segment(serve, replica)
        prefix = server_prefix(self.ctx.server)
        self.keeper = PoolKeeper(
            keeper_address(self.ctx.server, replica),
            rank_device(serve.engine.device, replica),
            None if segment is None else prefix + segment,
            None if host is None else prefix + host,
        )
        # the thread answers (and ends with the process); the loop only beats, until a stop
        threading.Thread(target=self.keeper.answer_forever, name="keeper", daemon=True).start()

    async def run(self) -> None:
        await asyncio.Event().wait()


def kept_pages(address: str) -> int:
    """The pages of the pool the keeper holds (0: none yet). An engine that died in its start-up, after the pool
    was made and before it told the scheduler the pool's pages, leaves them here: its replacement sizes its pool from
    them, since on CUDA the memory free to size one from is now the kept pool's."""
    with Client(address, "AF_UNIX") as conn:
        conn.send(("pages", 0, 0))
        return conn.recv()


def wait_for_keeper(address: str) -> None:
    """Until the keeper listens (it may be starting beside this engine)."""
    deadline = time.monotonic() + CONNECT_WAIT_S
    while True:
        try:
            Client(address, "AF_UNIX").close()
            return
        except (FileNotFoundError, ConnectionRefusedError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def map_kept_pool(address: str, size: int, what: str = "pool", pages: int = 0) -> tuple[Segment | None, torch.Tensor]:
    """The keeper's pool (or `what` "host": its host tier) of `size` bytes as a uint8 tensor, and where it is a
    shared segment, the segment that must stay mapped under it. `pages`: the pool's, which the keeper remembers."""
    with Client(address, "AF_UNIX") as conn:
        conn.send((what, size, pages))
        where, *answer = conn.recv()
    if where == "error":
        raise ValueError(answer[0])
    if where == "cuda":
        rebuild, args = answer
        return None, rebuild(*args)
    segment = Segment.attach(answer[0])
    return segment, torch.frombuffer(segment.buf, dtype=torch.uint8)
