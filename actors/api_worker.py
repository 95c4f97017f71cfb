"""An api worker: the aiohttp server (uvloop) that owns client connections and their requests.

Several workers share one port through SO_REUSEPORT. Each request id carries the worker's index,
so the detokenizer routes deltas back to the worker that owns the connection.
"""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

from aiohttp import web

from actors.base import Actor
from actors.control import ActorState
from actors.kinds import Kind, make_rid
from api.app import build_app
from runtime.config import ModelConfig
from transport.codec import unpack

SCHEDULER_GAUGES = ("used_pages", "total_pages", "running", "waiting", "cached_pages")


class ApiWorker(Actor):
    async def setup(self) -> None:
        serve = self.options["serve"]
        self.worker = self.options["worker"]
        self.served_model = serve.served_model_name
        self.max_model_len = ModelConfig.load(Path(serve.model_dir)).max_position
        self.inboxes: dict[int, asyncio.Queue] = {}
        self._counter = itertools.count(1)
        self.runner = web.AppRunner(build_app(self), access_log=None, handler_cancellation=True)
        await self.runner.setup()
        await web.TCPSite(self.runner, serve.host, serve.port, reuse_port=True).start()

    def on_epoch(self, epoch: int) -> None:
        """A backend actor restarted and its requests are gone: fail them now rather than leave
        clients waiting. (Replaying them instead is the recovery work still to come.)"""
        for rid, inbox in self.inboxes.items():
            inbox.put_nowait({"rid": rid, "error": {"message": "the serving pipeline restarted; retry the request", "status": 503}})
        self.inboxes.clear()

    async def teardown(self) -> None:
        await self.runner.cleanup()

    async def run(self) -> None:
        while True:
            _, frame = await self.next_frame()
            meta, _ = unpack(frame)
            for delta in meta["deltas"]:
                if delta.get("abort"):
                    await self.send("tokenizer", Kind.ABORT, delta["rid"], {})
                inbox = self.inboxes.get(delta["rid"])
                if inbox is not None:
                    inbox.put_nowait(delta)
                    if "error" in delta or delta.get("finish") is not None:
                        del self.inboxes[delta["rid"]]

    # -- the Gateway the app talks to ---------------------------------------------------------

    async def submit(self, meta: dict, ids: list[int] | None, inbox: asyncio.Queue) -> int:
        rid = make_rid(self.worker, next(self._counter))
        self.inboxes[rid] = inbox
        await self.send("tokenizer", Kind.SUBMIT, rid, meta, [ids] if ids is not None else ())
        return rid

    async def abort(self, rid: int) -> None:
        self.inboxes.pop(rid, None)
        await self.send("tokenizer", Kind.ABORT, rid, {})

    def healthy(self) -> bool:
        return bool((self.control.slots["state"] == ActorState.READY).all())

    def server_info(self) -> dict:
        gauges = self.control.slots[self.control.index("scheduler")]["gauges"]
        return {"model": self.served_model, "max_model_len": self.max_model_len, "epoch": self.epoch,
                "scheduler": dict(zip(SCHEDULER_GAUGES, map(int, gauges)))}
