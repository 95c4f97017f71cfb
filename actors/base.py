"""The actor base: one pipeline stage per OS process, running on asyncio (uvloop).

An actor is forked by the supervisor's forkserver (torch and transformers already imported
there, so a start or a restart skips those imports) and handed to the supervisor as its child
(actors.forkserver). It runs `setup`, attaches to its rings, reports ready, then runs `run`
beside a tick that writes its heartbeat, follows the epoch and watches for a stop request. Every
frame it reads goes through `admit`, the one epoch filter: frames of an older epoch are dropped,
and a newer epoch resets soft state first.

A warm spare (ActorSpec.spare) runs `setup`, writes its pid in the row's `spare_pid` and then sleeps,
touching neither the rest of the row nor its rings, until the supervisor promotes it in place of the
actor that died: it then takes up the row, the rings (at the first frame not yet consumed) and the
current epoch, and goes on as a fresh start would.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.synchronize import Event
from typing import Any, overload

import structlog
import uvloop

from actors.control import ActorState, ControlBlock
from actors.frames import Payload
from actors.topology import ActorSpec
from runtime.obs.gc_pauses import freeze_startup_heap, log_long_pauses
from runtime.obs.logs import bind_process, configure_logging
from transport import codec
from transport.ring import Frame, RingHandle, RingReader, RingWriter, recv_any_async
from transport.wakeup import Doorbell

log = structlog.get_logger()
YIELD_S = 0.01


@dataclass(frozen=True)
class ActorContext:
    """What a child process is started with; pickling it passes the eventfds along."""

    spec: ActorSpec
    server: str
    index: int  # the actor's row in the control block
    inputs: dict[str, RingHandle]  # keyed by the peer that writes
    outputs: dict[str, RingHandle]  # keyed by the peer that reads
    doorbell: Doorbell  # the supervisor rings it to announce a stop request or a new epoch
    heartbeat_s: float
    rendezvous: str | None = None  # a group member's meeting file (ActorSpec.group)
    standby: Standby | None = None  # a warm spare's: set up, then wait to be promoted


@dataclass(frozen=True)
class Standby:
    """A warm spare's two signals: `ready` (set by the spare once set up) and `promoted` (set by the supervisor)."""

    ready: Event
    promoted: Event


class Actor:
    # True: the epoch moves on only when a frame of a newer one arrives, so that actors reading copies of
    # one stream of frames (tensor-parallel ranks) drop and reset at the same point of it
    epochs_from_frames = False

    def __init__(self, ctx: ActorContext) -> None:
        self.ctx = ctx
        self.name = ctx.spec.name
        self.options: dict[str, Any] = ctx.spec.options
        self.control = ControlBlock.attach(ctx.server)
        self.slot = self.control.slots[ctx.index]  # a view: writes land in shared memory
        self.epoch = self.control.epoch
        self.inputs: dict[str, RingReader] = {}
        self.outputs: dict[str, RingWriter] = {}
        self._peers: list[str] = []
        self._readers: list[RingReader] = []
        self._yielded = time.monotonic()
        self._parent = os.getppid()  # the supervisor

    async def setup(self) -> None:
        """Slow start-up work (weights, tokenizer) goes here, before the actor reports ready."""

    async def run(self) -> None:
        raise NotImplementedError

    async def teardown(self) -> None:
        """Release outside resources (sockets) on the way out."""

    def on_epoch(self, epoch: int) -> None:
        """Forget soft state: requests of older epochs will be replayed by their owners."""

    def on_tick(self) -> None:
        """Each heartbeat, and whenever the supervisor rings: a look at the control block."""

    def admit(self, frame: Frame) -> bool:
        if frame.epoch < self.epoch:
            return False
        if frame.epoch > self.epoch:
            self._enter_epoch(frame.epoch)
        return True

    @overload
    async def next_frame(self, timeout: None = None) -> tuple[str, Frame]: ...
    @overload
    async def next_frame(self, timeout: float | None) -> tuple[str, Frame] | None: ...
    async def next_frame(self, timeout: float | None = None) -> tuple[str, Frame] | None:
        """The next admitted frame from any input, and the peer it came from; None on timeout."""
        await self.yield_if_due()
        while (got := await recv_any_async(self._readers, timeout)) is not None:
            index, frame = got
            if self.admit(frame):
                return self._peers[index], frame
        return None

    async def yield_if_due(self) -> None:
        """A busy actor always finds a frame waiting and would never give the loop a turn: yield
        every YIELD_S so the tick (heartbeat, epoch, stop) and other tasks still run."""
        if (now := time.monotonic()) - self._yielded > YIELD_S:
            self._yielded = now
            await asyncio.sleep(0)

    def poll_frame(self) -> tuple[str, Frame] | None:
        """An admitted frame that has already arrived, without waiting."""
        for peer, reader in zip(self._peers, self._readers):
            while (frame := reader.try_recv()) is not None:
                if self.admit(frame):
                    return peer, frame
        return None

    async def send(self, peer: str, payload: Payload, rid: int = 0, epoch: int | None = None) -> None:
        """`epoch`: that of the frame this output comes from. The actor may have moved to a newer
        epoch while it worked (across an await); output of a gone epoch is dropped here rather
        than stamped as new."""
        await self.send_all((peer,), payload, rid, epoch)

    async def send_all(self, peers: Sequence[str], payload: Payload, rid: int = 0, epoch: int | None = None) -> None:
        """One payload to each of `peers`, or to none: copies of one stream (tensor-parallel ranks)
        must not part, even if the epoch moves on while a full ring makes a write wait."""
        epoch = self.epoch if epoch is None else epoch
        if epoch < self.epoch:
            return
        meta, arrays = payload.to_wire()
        for peer in peers:
            await codec.send(self.outputs[peer], payload.KIND, rid, meta, arrays, epoch=epoch)

    def epoch_moved_on(self) -> bool:
        """Whether the supervisor has started a newer epoch than this actor's (ranks follow frames instead)."""
        return self.control.epoch > self.epoch and not self.epochs_from_frames

    def catch_up_epoch(self) -> None:
        if self.epoch_moved_on():
            self._enter_epoch(self.control.epoch)

    def _enter_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.slot["epoch"] = epoch
        bind_process(epoch=epoch)
        self.on_epoch(epoch)
        log.info("epoch_advanced")

    def beat(self) -> None:
        self.slot["heartbeat"] = time.monotonic()

    async def _tick(self) -> None:
        """Heartbeat from inside the loop, so a blocked loop reads as hung."""
        while not self.slot["stop"]:
            self.beat()
            self.catch_up_epoch()
            self.on_tick()
            if os.getppid() != self._parent:
                log.warning("supervisor_gone")
                return
            await self.ctx.doorbell.sleep_async(self.ctx.heartbeat_s)

    def _attach_rings(self) -> None:
        """Each ring end resumes where the last one left it: a reader at the first unconsumed frame."""
        self.inputs = {peer: RingReader(handle) for peer, handle in self.ctx.inputs.items()}
        self.outputs = {peer: RingWriter(handle) for peer, handle in self.ctx.outputs.items()}
        self._peers, self._readers = list(self.inputs), list(self.inputs.values())

    async def serve(self) -> None:
        standby = self.ctx.standby
        if standby is None:
            self.slot["epoch"] = self.epoch
        bind_process(epoch=self.epoch)
        await self.setup()
        frozen = freeze_startup_heap()  # a spare's before it sleeps: a promotion does not wait for it
        if standby is not None:  # sleep until promoted (a spare no longer needed is killed)
            self.slot["spare_pid"] = os.getpid()
            standby.ready.set()
            log.info("standing_by")
            standby.promoted.wait()
        self._attach_rings()
        if standby is not None:  # the soft state built so far belongs to no epoch yet
            self._enter_epoch(self.control.epoch)
            log.info("promoted")
        log_long_pauses()
        self.beat()
        self.slot["state"] = ActorState.READY
        log.info("ready", gc_frozen=frozen)
        tasks = {asyncio.create_task(self.run(), name="run"), asyncio.create_task(self._tick(), name="tick")}
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        self.slot["state"] = ActorState.STOPPING
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await self.teardown()
        for task in done:
            task.result()  # re-raise a crash of run(): the process exits non-zero
        log.info("stopped")

    def close(self) -> None:
        for end in (*self.inputs.values(), *self.outputs.values()):
            end.close()
        del self.slot
        self.control.close()


def actor_main(ctx: ActorContext) -> None:
    """The target of every actor process, run by the forkserver's fork once this process is the supervisor's
    child and dies with it (actors.forkserver): an actor never outlives its supervisor."""
    if not ctx.spec.torch_threads:
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"
        if (torch := sys.modules.get("torch")) is not None:  # preloaded by the forkserver
            torch.set_num_threads(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the supervisor stops us
    configure_logging(ctx.spec.name)
    actor = ctx.spec.load_class()(ctx)
    try:
        uvloop.run(actor.serve())
    finally:
        actor.close()
    sys.stderr.flush()
    os._exit(0)  # everything is released: skip the interpreter's slow teardown of torch and friends
