"""The scheduler actor: runtime.Scheduler over rings, with up to two steps in flight.

It plans step i+1 while the engine runs step i (the engine feeds decodes their own last sampled
token), then turns each step's results into one TOKENS frame for the detokenizer.
"""

from __future__ import annotations

import asyncio
from collections import deque
from pathlib import Path

from actors.base import Actor
from actors.kinds import Kind
from actors.pipeline import POOL_GAUGE
from runtime.config import ModelConfig
from runtime.sampling_params import SamplingParams
from runtime.scheduler import MAX_IN_FLIGHT, Request, Scheduler
from runtime.step import plan_to_wire, results_from_wire
from transport.codec import unpack
from transport.ring import Frame


class SchedulerActor(Actor):
    async def setup(self) -> None:
        serve = self.options["serve"]
        model = ModelConfig.load(Path(serve.model_dir))
        self.engine_config = serve.engine
        self.eos, self.max_position = model.eos_token_ids, model.max_position
        engine = self.control.slots[self.control.index("engine")]
        while not engine["gauges"][POOL_GAUGE]:  # the engine sizes the KV pool once its weights are in place
            await asyncio.sleep(0.05)
        self.num_pages = int(engine["gauges"][POOL_GAUGE])
        self.on_epoch(self.epoch)

    def on_epoch(self, epoch: int) -> None:
        self.core = Scheduler(self.engine_config, self.num_pages, self.eos, self.max_position)
        self.announce: dict[int, dict] = {}  # what the detokenizer needs with a request's first tokens
        self.in_flight: deque[int] = deque()

    async def run(self) -> None:
        while True:
            while (got := self.poll_frame()) is not None:
                await self._handle(*got)
            epoch = self.epoch  # what the plan below belongs to, should the epoch move on meanwhile
            plan = self.core.schedule() if len(self.in_flight) < MAX_IN_FLIGHT else None
            if ended := self.core.take_ended():
                await self._emit(ended, with_token=False, epoch=epoch)
            if plan:
                meta, arrays = plan_to_wire(plan)
                await self.send("engine", Kind.STEP, plan.step, meta, arrays, epoch=epoch)
                if epoch == self.epoch:  # else it was dropped, and the new epoch starts with none in flight
                    self.in_flight.append(plan.step)
                self._publish_gauges()
                continue
            await self._handle(*await self.next_frame())

    async def _handle(self, peer: str, frame: Frame) -> None:
        meta, arrays = unpack(frame)
        if frame.kind == Kind.REQUEST:
            params = SamplingParams(**meta["params"])
            generated = arrays[1].tolist()
            try:
                self.core.add(frame.rid, arrays[0].tolist(), params, generated)
            except ValueError as exc:
                await self.send("detokenizer", Kind.ERROR, frame.rid, {"message": str(exc), "status": 400})
                return
            self.announce[frame.rid] = {**meta["detok"], "generated": generated}
        elif frame.kind == Kind.PING:
            await self.send("engine" if peer == "tokenizer" else "detokenizer", Kind.PING, frame.rid, {})
        elif frame.kind == Kind.ABORT:
            if (request := self.core.abort(frame.rid)) is not None:
                await self._emit([request])
        elif frame.kind == Kind.ERROR:
            await self.send("detokenizer", Kind.ERROR, frame.rid, meta)
        elif frame.kind == Kind.SAMPLED:
            self.in_flight.remove(meta["step"])
            await self._emit(self.core.update(meta["step"], results_from_wire(meta, arrays)))
        self._publish_gauges()

    async def _emit(self, requests: list[Request], with_token: bool = True, epoch: int | None = None) -> None:
        """One frame per step: each request's newest token, and its finish reason if it finished
        (without a token: it was aborted, or outgrew the KV pool while being planned)."""
        if not requests:
            return
        items, tokens = [], []
        for request in requests:
            item = {"rid": request.rid, "finish": request.finish_reason}
            if request.rid in self.announce:  # first tokens: what the detokenizer must know
                item.update(detok=self.announce.pop(request.rid), prompt_tokens=len(request.prompt_ids),
                            cached_tokens=request.cached_tokens)
            if request.finish_reason == "abort" or not with_token:
                item["n"] = 0
            else:
                item["n"] = 1
                tokens.append(request.output_ids[-1])
                if request.params.logprobs is not None:
                    item["logprobs"] = list(request.logprobs[-1].items())
            items.append(item)
        await self.send("detokenizer", Kind.TOKENS, 0, {"items": items}, [tokens], epoch=epoch)

    def _publish_gauges(self) -> None:
        core = self.core
        self.slot["gauges"][:5] = (core.used_pages(), core.allocator.num_pages, len(core.running), len(core.waiting),
                                   core.cache.cached_pages if core.cache else 0)
