"""The engine actor: executes step plans in order and answers with the sampled tokens.

It keeps the device one step ahead: a plan that arrives while the previous step still runs is
queued behind it at once, and a step's results are sent as soon as the device has them.
"""

from __future__ import annotations

import asyncio
from collections import deque
from pathlib import Path

from actors.base import Actor
from actors.kinds import Kind
from runtime.engine import Engine, PendingStep
from runtime.scheduler import MAX_IN_FLIGHT
from runtime.step import plan_from_wire, results_to_wire
from transport.codec import unpack


class EngineActor(Actor):
    async def setup(self) -> None:
        serve = self.options["serve"]
        self.engine = Engine(Path(serve.model_dir), serve.engine)
        self.in_flight: deque[tuple[int, PendingStep]] = deque()
        self.slot["gauges"][0] = self.engine.num_pages  # the scheduler sizes its page table from this

    def on_epoch(self, epoch: int) -> None:
        self.engine.reset()
        self.in_flight.clear()

    async def run(self) -> None:
        while True:
            await self.yield_if_due()
            got = self.poll_frame() if self.in_flight else await self.next_frame()
            if got is not None:
                plan = plan_from_wire(*unpack(got[1]))
                self.in_flight.append((plan.step, self.engine.launch(plan)))
                if len(self.in_flight) < MAX_IN_FLIGHT:
                    continue
            elif not self.in_flight[0][1].ready():
                await asyncio.sleep(0)  # the device is busy and no plan is waiting: look again
                continue
            step, pending = self.in_flight.popleft()
            meta, arrays = results_to_wire(step, pending.result())
            await self.send("scheduler", Kind.SAMPLED, step, meta, arrays)
