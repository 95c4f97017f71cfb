"""The engine actor: executes step plans in order and answers with the sampled tokens."""

from __future__ import annotations

from pathlib import Path

from actors.base import Actor
from actors.kinds import Kind
from runtime.engine import Engine
from runtime.step import plan_from_wire, results_to_wire
from transport.codec import unpack


class EngineActor(Actor):
    async def setup(self) -> None:
        serve = self.options["serve"]
        self.engine = Engine(Path(serve.model_dir), serve.engine)

    def on_epoch(self, epoch: int) -> None:
        self.engine.slots.clear()

    async def run(self) -> None:
        while True:
            _, frame = await self.next_frame()
            plan = plan_from_wire(*unpack(frame))
            meta, arrays = results_to_wire(plan.step, self.engine.execute(plan))
            await self.send("scheduler", Kind.SAMPLED, plan.step, meta, arrays)
