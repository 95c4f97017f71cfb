"""The actor base: one pipeline stage per OS process, running on asyncio (uvloop).

An actor is started by the supervisor with the spawn method. It attaches to its rings, runs
`setup`, reports ready, then runs `run` beside a tick that writes its heartbeat, follows the
epoch and watches for a stop request. Every frame it reads goes through `admit`, the one epoch
filter: frames of an older epoch are dropped, and a newer epoch resets soft state first.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import time
from dataclasses import dataclass
from typing import Any

import structlog
import uvloop

from actors.control import ActorState, ControlBlock
from actors.topology import ActorSpec
from runtime.logs import bind_process, configure_logging
from transport.ring import Frame, RingHandle, RingReader, RingWriter
from transport.wakeup import Doorbell

log = structlog.get_logger()
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class ActorContext:
    """What a child process is started with; pickling it passes the eventfds along."""

    spec: ActorSpec
    server: str
    index: int  # the actor's row in the control block
    inputs: dict[str, RingHandle]  # keyed by the peer that writes
    outputs: dict[str, RingHandle]  # keyed by the peer that reads
    doorbell: Doorbell  # the supervisor rings it to announce a stop request or a new epoch
    supervisor_pid: int
    heartbeat_s: float


class Actor:
    def __init__(self, ctx: ActorContext) -> None:
        self.ctx = ctx
        self.name = ctx.spec.name
        self.options: dict[str, Any] = ctx.spec.options
        self.control = ControlBlock.attach(ctx.server)
        self.slot = self.control.slots[ctx.index]  # a view: writes land in shared memory
        self.epoch = self.control.epoch
        self.inputs = {peer: RingReader(handle) for peer, handle in ctx.inputs.items()}
        self.outputs = {peer: RingWriter(handle) for peer, handle in ctx.outputs.items()}

    async def setup(self) -> None:
        """Slow start-up work (weights, tokenizer) goes here, before the actor reports ready."""

    async def run(self) -> None:
        raise NotImplementedError

    def on_epoch(self, epoch: int) -> None:
        """Forget soft state: requests of older epochs will be replayed by their owners."""

    def admit(self, frame: Frame) -> bool:
        if frame.epoch < self.epoch:
            return False
        if frame.epoch > self.epoch:
            self._advance(frame.epoch)
        return True

    def _advance(self, epoch: int) -> None:
        self.epoch = epoch
        self.slot["epoch"] = epoch
        bind_process(epoch=epoch)
        self.on_epoch(epoch)
        log.info("epoch_advanced")

    def _beat(self) -> None:
        self.slot["heartbeat"] = time.monotonic()

    async def _tick(self) -> None:
        """Heartbeat from inside the loop, so a blocked loop reads as hung."""
        while not self.slot["stop"]:
            self._beat()
            if self.control.epoch > self.epoch:
                self._advance(self.control.epoch)
            if os.getppid() != self.ctx.supervisor_pid:
                log.warning("supervisor_gone")
                return
            await self.ctx.doorbell.sleep_async(self.ctx.heartbeat_s)

    async def serve(self) -> None:
        self.slot["epoch"] = self.epoch
        bind_process(epoch=self.epoch)
        await self.setup()
        self._beat()
        self.slot["state"] = ActorState.READY
        log.info("ready")
        tasks = {asyncio.create_task(self.run(), name="run"), asyncio.create_task(self._tick(), name="tick")}
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        self.slot["state"] = ActorState.STOPPING
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for task in done:
            task.result()  # re-raise a crash of run(): the process exits non-zero
        log.info("stopped")

    def close(self) -> None:
        for end in (*self.inputs.values(), *self.outputs.values()):
            end.close()
        del self.slot
        self.control.close()


def _die_with_parent(supervisor_pid: int) -> None:
    """An actor must never outlive its supervisor: the kernel kills it when the supervisor dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != supervisor_pid:  # it died before prctl took effect
        os._exit(1)


def actor_main(ctx: ActorContext) -> None:
    """The spawn target of every actor process."""
    _die_with_parent(ctx.supervisor_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the supervisor stops us
    configure_logging(ctx.spec.name)
    actor = ctx.spec.load_class()(ctx)
    try:
        uvloop.run(actor.serve())
    finally:
        actor.close()
