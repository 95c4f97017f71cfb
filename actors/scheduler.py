"""The scheduler actor: runtime.Scheduler over rings.

It plans ahead of the results, EngineConfig.steps_in_flight steps (the engine feeds decodes their own
last sampled token), then turns each step's results into one TOKENS frame for the detokenizer. It logs each
request's queued, scheduled, prefill_done and finished events, keeps the batch's metrics, and
every ServeConfig.stats_interval logs one stats line (at debug level while idle).

A request held to a grammar stays in the queue, passed by the others (Request.compiling), until its engines
have compiled the grammar (frames.Compile): a compile never holds a step. One that takes longer than
--grammar-compile-timeout refuses the request with a 400. A new engine over the kept KV pool is asked again
for the compiles its predecessor had not answered.

Under --pd it plans for two engines, the prefill one and the decode one (runtime.scheduler.disaggregated), each
with its steps in flight, its resync and its answers; the prefill side takes new requests and holds the prefix
cache.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import structlog

from actors.base import Actor
from actors.control import crashed
from actors.frames import (
    Abort,
    Adopt,
    Announce,
    Compile,
    Detok,
    FlushCache,
    LoraAdapter,
    Ping,
    Refusal,
    Step,
    StepResults,
    TokenItem,
    Tokenized,
    Tokens,
    decode,
)
from actors.gauges import EngineGauge, SchedulerGauge
from actors.kinds import counter_of, first_counter, worker_of
from actors.pipeline import api_worker_names, engine_names, kv_host_segment, pool_outlives_engine
from runtime.config import ModelConfig
from runtime.obs.metrics import metrics
from runtime.scheduler.disaggregated import ROLES, Disaggregated
from runtime.scheduler.scheduler import Request, Scheduler
from runtime.scheduler.tiers import TIER_NAMES, HostIndex, count_pages
from runtime.step import HostEntry, StepPlan
from transport.ring import Frame
from transport.segment import Segment, server_prefix

log = structlog.get_logger()
ENDED_KEPT = 4096  # ended requests remembered, so that a copy resubmitted after a tokenizer restart is not run again
RESYNC_ENDED_S = 60.0  # ended requests a detokenizer restart announces again: their last frame may have died with it


@dataclass(frozen=True)
class Ended:
    """What a resync tells the detokenizer of a request that has ended."""

    detok: Detok
    output_ids: np.ndarray
    finish: str
    prompt_tokens: int
    cached_tokens: int
    at: float = field(default_factory=time.monotonic)


ADOPT_GRACE_S = 30.0  # how long adopted KV waits for its request's replay (the api workers replay at once)
ENGINE_LOOK_S = 0.05  # how often a scheduler waiting on its engine's steps looks whether the engine died
TOKENS_FRAME_BYTES = 1 << 20  # what a TOKENS frame may carry, by a generous estimate of its JSON, in a 4 MiB ring
BOTH = "both"  # the role of a colocated engine, which prefills and decodes


def _announce_bytes(announce: Announce) -> int:
    """An announcement's share of a frame: its tokens so far and its prompt, and the stop strings (up to 6
    bytes a character, escaped)."""
    return 4 * (len(announce.generated) + len(announce.prompt_ids)) + 6 * sum(map(len, announce.detok.stop))


def _first_item(request: Request, detok: Detok, generated: list[int], resync: bool = False) -> TokenItem:
    """A request's item that announces it to the detokenizer (with its prompt and the prompt's
    log-probabilities where the request asked for them); the caller adds its newest token."""
    prompt_ids = request.prompt_ids if detok.prompt else []
    announce = Announce(detok, generated, len(request.prompt_ids), request.cached_tokens, resync, prompt_ids)
    return TokenItem(request.rid, None, [], None, announce, request.prompt_logprobs)


def _item_bytes(item: TokenItem) -> int:
    """An item's share of a frame, generously: JSON of its logprobs, prompt logprobs and announcement."""
    size = 64 + sum(16 + 32 * len(top) for top in item.logprobs or ())
    if item.announce is not None:
        size += _announce_bytes(item.announce)
    return size + sum(48 + 32 * len(top) for _, _, top in item.prompt_logprobs or ())


def _in_frames(sized: list[tuple[TokenItem, int]]) -> list[list[TokenItem]]:
    """Items, with their estimated sizes, in frames that each stay well inside the ring."""
    frames: list[list[TokenItem]] = []
    in_frame = TOKENS_FRAME_BYTES
    for item, size in sized:
        if in_frame + size > TOKENS_FRAME_BYTES:
            frames.append([])
            in_frame = 0
        in_frame += size
        frames[-1].append(item)
    return frames


def _remember(kept: dict, key: int, value: object) -> None:
    """Keep `value` under `key`; past ENDED_KEPT entries, the oldest goes."""
    kept[key] = value
    if len(kept) > ENDED_KEPT:
        del kept[next(iter(kept))]


@dataclass
class Timeline:
    """A request's moments in this scheduler, for its log lines and the queue-time metric."""

    trace: str
    queued: float
    scheduled: float | None = None
    prefilled: float | None = None


@dataclass
class Window:
    """Counts since the last stats line."""

    started: float
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0


class SchedulerActor(Actor):
    async def setup(self) -> None:
        serve = self.options["serve"]
        model = ModelConfig.load(Path(serve.model_dir))
        self.engine_config, self.stats_interval = serve.engine, serve.stats_interval
        self.eos, self.max_position, self.long_rope_from = model.eos_token_ids, model.max_position, model.long_rope_from
        self.sliding_window = model.window
        self.replica, self.pd = self.options["replica"], serve.engine.pd
        # each engine (group) this scheduler plans for, by role: the first takes new requests and holds the prefix cache
        self.sides = (
            {role: engine_names(serve, unit) for unit, role in enumerate(ROLES)} if self.pd else {BOTH: engine_names(serve, self.replica)}
        )
        self.role_of = {name: role for role, names in self.sides.items() for name in names}
        self.engines, self.first = list(self.role_of), next(iter(self.sides))
        self.num_pages: dict[str, int] = {}
        for role, names in self.sides.items():
            engine = self.control.slots[self.control.index(names[0])]
            while not engine["gauges"][EngineGauge.POOL]:  # the engine sizes the KV pool once its weights are in place
                await asyncio.sleep(0.05)
            self.num_pages[role] = int(engine["gauges"][EngineGauge.POOL])
        first_engine = self.control.slots[self.control.index(self.sides[self.first][0])]
        self.host_pages = int(first_engine["gauges"][EngineGauge.HOST_POOL])  # set before POOL
        host_segment = kv_host_segment(serve, self.replica)
        self.host_segment = None if host_segment is None else server_prefix(self.ctx.server) + host_segment
        m, labels = metrics(), (serve.served_model_name, str(self.replica))
        self.m_queue_time, self.m_batch = m.queue_time.labels(*labels), m.batch_size.labels(labels[1])
        self.m_prompt_tokens, self.m_generation_tokens = m.prompt_tokens.labels(*labels), m.generation_tokens.labels(*labels)
        self.m_prefix_queries, self.m_prefix_hits = m.prefix_queries.labels(*labels), m.prefix_hits.labels(*labels)
        self.m_tier_hits = {tier: m.tier_hits.labels(*labels, tier) for tier in TIER_NAMES}
        self.m_spec_draft, self.m_pd_requests = m.spec_draft.labels(*labels), m.pd_requests
        self.m_running, self.m_waiting, self.m_kv_usage = (g.labels(*labels) for g in (m.running, m.waiting, m.kv_usage))
        self.window = Window(time.monotonic())
        self._detokenizer_slot = self.control.index("detokenizer")
        # an engine restart that keeps the epoch (its KV pool outlives it) is resynced over that pool
        self._engine_slots = (
            {role: self.control.index(names[0]) for role, names in self.sides.items()} if pool_outlives_engine(serve) else {}
        )
        # an api worker's restart keeps the epoch: its requests of an earlier start (ids below its floor) are dropped
        self._api_slots = {worker: self.control.index(name) for worker, name in enumerate(api_worker_names(serve))}
        self._api_restarts = {worker: self._restarts(index) for worker, index in self._api_slots.items()}
        self._api_floors = {worker: first_counter(restarts) for worker, restarts in self._api_restarts.items()}
        self._workers_lost = False
        self.on_epoch(self.epoch)

    def on_epoch(self, epoch: int) -> None:
        # the scheduler that takes new requests (under --pd, the prefill side's), and every side's
        self.core = Scheduler(
            self.engine_config,
            self.num_pages[self.first],
            self.eos,
            self.max_position,
            self.host_pages,
            long_rope_from=self.long_rope_from,
            window=self.sliding_window,
            prefill_only=self.pd,
        )
        self.cores = {self.first: self.core}
        self.pair: Disaggregated | None = None
        if self.pd:
            decoding = replace(self.engine_config, enable_prefix_cache=False)
            decode = Scheduler(decoding, self.num_pages["decode"], self.eos, self.max_position, long_rope_from=self.long_rope_from)
            self.pair, self.cores["decode"] = Disaggregated(self.core, decode), decode
        self.counted_hits = dict.fromkeys(self.core.tier_hits, 0)  # tier hits counted in /metrics, of this core's
        self.announce: dict[int, list[int]] = {}  # a replay's tokens so far, until the request's first tokens go out
        self.timelines: dict[int, Timeline] = {}  # the requests in hand, from their arrival to their end
        self.detoks: dict[int, Detok] = {}  # the same requests' detokenizer options: with the first tokens, and in a resync
        # the last ENDED_KEPT to end, in order: a resubmitted copy is dropped; those that ended in the last RESYNC_ENDED_S
        # with their tokens, whose last frame a dead detokenizer may have taken with it
        self.ended: dict[int, Ended | None] = {}
        self.refused: dict[int, tuple[Refusal, float]] = {}  # likewise, the requests refused here, and when
        # a restart of the detokenizer that keeps the epoch is resynced; one before this epoch is covered by its replay
        self._detokenizer_restarts, self._resync = self._restarts(self._detokenizer_slot), False
        self._engine_restarts = {role: self._restarts(index) for role, index in self._engine_slots.items()}
        self._engines_lost: set[str] = set()
        self._engines_crashed: set[str] = set()  # of those, the ones whose engine died of a crash, not of a kill
        self.in_flight = {role: dict[int, StepPlan]() for role in self.sides}  # by step, in order
        self.compiling: dict[int, Request] = {}  # waiting requests whose grammar the engines compile (Request.compiling)
        self.unloaded: set[str] = set()  # LoRA adapters unloaded since this scheduler started: a request for one is refused
        # nothing is planned until the engine has said what its pool kept of the epoch before (frames.Adopt)
        self.adopting = self._ask_adoption = True
        self._publish_gauges()  # a new epoch starts empty

    async def run(self) -> None:
        reporter = asyncio.create_task(self._report_stats(), name="stats")
        try:
            await self._serve()
        finally:
            reporter.cancel()

    def _orphaned(self, rid: int) -> bool:
        """A request of an api worker's start that has died (its connection with it)."""
        return counter_of(rid) < self._api_floors.get(worker_of(rid), 0)

    def _restarts(self, index: int | None) -> int:
        return 0 if index is None else int(self.control.slots[index]["restarts"])

    def on_tick(self) -> None:
        restarts = self._restarts(self._detokenizer_slot)
        if restarts != self._detokenizer_restarts:  # a restart within the epoch: the next turn of the loop resyncs it
            self._detokenizer_restarts, self._resync = restarts, True
        for role, index in self._engine_slots.items():
            if (restarts := self._restarts(index)) != self._engine_restarts[role]:
                self._engine_restarts[role] = restarts
                self._engines_lost.add(role)
                if crashed(int(self.control.slots[index]["exitcode"])):
                    self._engines_crashed.add(role)
        for worker, index in self._api_slots.items():
            if (restarts := self._restarts(index)) != self._api_restarts[worker]:
                self._api_restarts[worker], self._api_floors[worker] = restarts, first_counter(restarts)
                self._workers_lost = True

    async def _serve(self) -> None:
        while True:
            if self._resync:  # before any later tokens leave, so that none reaches it ahead of its request's resync
                self._resync = False
                await self._resync_detokenizer()
            for role in sorted(self._engines_lost):
                self._engines_lost.discard(role)
                await self._resync_engine(role)
            if self._ask_adoption:
                self._ask_adoption = False
                await self.send_all(self.sides[self.first], Adopt())
            if self._workers_lost:  # their clients are gone with them
                self._workers_lost = False
                dead = [r.rid for r in self._requests() if self._orphaned(r.rid)]
                log.info("orphans_aborted", requests=len(dead))
                await self._emit([request for rid in dead if (request := self._abort(rid)) is not None])
            while (got := self.poll_frame()) is not None:
                await self._handle(*got)
            planned = False
            for role, names in self.sides.items():
                epoch, core = self.epoch, self.cores[role]  # what the plan below belongs to, should the epoch move on meanwhile
                adopted = bool(core.adopted)
                ahead = 1 if core.quarantine else self.engine_config.steps_in_flight  # a suspect's step is the only one in flight
                plan = core.schedule() if not self.adopting and len(self.in_flight[role]) < ahead else None
                if adopted and not core.adopted:  # what no replay claimed has gone back to the pool
                    self._publish_gauges()
                if ended := core.take_ended():
                    await self._emit(ended, with_token=False, epoch=epoch)
                if plan:
                    if plan.resync:  # the engine that starts now skips a resync meant for an engine that died before it
                        plan.engine_start = self._engine_restarts.get(role, 0)
                    self._on_planned(plan, core)
                    await self.send_all(names, Step(plan), plan.step, epoch=epoch)  # every tensor-parallel rank runs it
                    if epoch == self.epoch:  # else it was dropped, and the new epoch starts with none in flight
                        self.in_flight[role][plan.step] = plan
                    self._publish_gauges()
                    planned = True
            if planned:
                continue
            # while steps are in flight, look up now and then: their engine may have died, and nothing would come
            waiting = any(self.in_flight.values()) and self._engine_slots
            if (got := await self.next_frame(ENGINE_LOOK_S if waiting else None)) is not None:
                await self._handle(*got)

    def _requests(self) -> list[Request]:
        """Every request in hand, running or waiting, on every side."""
        return [request for core in self.cores.values() for request in (*core.running, *core.waiting)]

    def _abort(self, rid: int) -> Request | None:
        return self.core.abort(rid) if self.pair is None else self.pair.abort(rid)

    async def _resync_engine(self, role: str) -> None:
        """Its engine died and another maps the same KV pool: take in what the dead one answered before it
        died, then reopen every running request over its pages; the steps it left unanswered are planned again."""
        while (got := self.poll_frame()) is not None:
            await self._handle(*got)
        core = self.cores[role]
        log.info("engine_resync", role=role, running=len(core.running), lost_steps=list(self.in_flight[role]))
        if role in self._engines_crashed:  # a query of death is run alone, then ended
            self._engines_crashed.discard(role)
            launched = int(self.control.slots[self._engine_slots[role]]["gauges"][EngineGauge.LAUNCHED])  # the dead one's
            await self._end_crashed(core.after_crash(list(self.in_flight[role].values()), launched))
        self.in_flight[role].clear()
        core.reopen()
        if self.pair is not None and role == "decode":  # copies it may not have run: the prefill side lets go of them
            self.pair.release_copied()
        for rid, request in self.compiling.items():  # the dead engine's compiles died with it
            await self._ask_compile(rid, request)
        self._ask_adoption = self.adopting  # the dead engine may have taken the question with it

    async def _end_crashed(self, requests: list[Request]) -> None:
        """Requests that crashed the engine twice end with a server error naming them; the others go on."""
        for request in requests:
            trace = timeline.trace if (timeline := self.timelines.get(request.rid)) is not None else str(request.rid)
            request.error = f"request {trace}: {request.error}"
            log.error("query_of_death", rid=trace, prompt_tokens=len(request.prompt_ids), generated=len(request.output_ids))
        await self._emit(requests)

    async def _handle(self, peer: str, frame: Frame) -> None:
        rid = frame.rid
        match decode(frame):
            case StepResults(step=step, results=results):
                role = self.role_of[peer]
                del self.in_flight[role][step]
                await self._emit(self.core.update(step, results) if self.pair is None else self.pair.update(role, step, results))
            case Adopt(held=held, disk=disk) if self.adopting and self.role_of[peer] == self.first:
                host = self._host_index()
                if disk is not None and self.core.cache is not None and self.core.cache.tiers is not None:
                    self.core.cache.tiers.disk = Path(disk)
                self.core.adopt(held, host)
                self.adopting = False
                log.info("adopted", requests=len(held), tokens=sum(len(tokens) for _, tokens, _, _ in held), host_pages=len(host))
                asyncio.get_running_loop().call_later(ADOPT_GRACE_S, self._release_adopted, self.core)

            case Tokenized() as req:
                if rid in self.timelines or rid in self.ended:  # a copy resubmitted after a tokenizer restart
                    log.info("resubmit_dropped", rid=req.trace)
                    return
                if self._orphaned(rid):  # sent by an api worker that has died since
                    log.info("orphan_dropped", rid=req.trace)
                    return
                self.slot["gauges"][SchedulerGauge.TAKEN] += 1  # requests taken in, for the router: a restart counts on
                try:
                    if req.params.lora in self.unloaded:  # an api worker that checked before the unload ended
                        raise ValueError(f"no LoRA adapter named '{req.params.lora}' is loaded")
                    request = self.core.add(rid, req.prompt_ids, req.params, req.generated, pin=req.pin)
                except ValueError as exc:
                    await self._refuse(rid, Refusal(str(exc)))
                    return
                self.announce[rid] = req.generated
                self.detoks[rid] = req.detok
                self.timelines[rid] = Timeline(req.trace, time.monotonic())
                if request.params.guide is not None:  # it waits out of the batch until its engines have compiled the grammar
                    request.compiling = True
                    self.compiling[rid] = request
                    await self._ask_compile(rid, request)
                log.info(
                    "queued",
                    rid=req.trace,
                    prompt_tokens=len(request.prompt_ids),
                    generated=len(req.generated),
                    waiting=len(self.core.waiting),
                )
                self._publish_gauges()  # a flush publishes its own; the other frames change them only through _emit
            case Ping() as ping:
                await self.send(self.engines[0] if peer == "tokenizer" else "detokenizer", ping, rid)  # under --pd, the prefill engine
            case FlushCache(unpin=unpin):
                pages = self.core.unpin_prefixes() if unpin else self.core.flush_cache()
                self._publish_gauges()  # before the answer, as in _emit
                await self.send("detokenizer", FlushCache(pages), rid)
            case LoraAdapter() as op if peer == "tokenizer":
                await self._lora_adapter(rid, op)
            case LoraAdapter() as answer:  # from rank 0 of the (first) engine
                unload = answer.path is None
                if answer.error is None and (unload or answer.replaced):
                    self.core.flush_cache()  # prefixes computed through the old weights, which a request must not read
                if (answer.error is None) != unload:  # loaded, or not unloaded after all
                    self.unloaded.discard(answer.name)
                await self.send("detokenizer", answer, rid)
            case Compile(error=error):
                await self._compiled(rid, error)
            case Abort():
                if self.compiling.pop(rid, None) is not None:  # its grammar need not be compiled any more
                    await self.send_all(self.engines, Compile(), rid)
                if (request := self._abort(rid)) is not None:
                    await self._emit([request])
                else:  # not here (yet): a copy resubmitted later is not run
                    self._ended(rid, None)
            case Refusal() as refusal:
                await self._refuse(rid, refusal)

    def _host_index(self) -> list[HostEntry]:
        """The kept host tier's index, read from the keeper's segment (its engine has just finished every store)."""
        if self.host_segment is None or not self.host_pages:
            return []
        segment = Segment.attach(self.host_segment)
        try:
            memory = np.frombuffer(segment.buf, np.uint8)
            entries = HostIndex(memory, self.host_pages, self.engine_config.page_size).entries()
            del memory
        finally:
            segment.close()
        return entries

    async def _ask_compile(self, rid: int, request: Request) -> None:
        await self.send_all(self.engines, Compile(request.params.guide), rid)  # every tensor-parallel rank compiles it

    async def _compiled(self, rid: int, error: str | None) -> None:
        """The engine's answer for a request waiting for its grammar: it may be admitted now, or is refused."""
        if (request := self.compiling.pop(rid, None)) is None:  # aborted meanwhile, or answered already
            return
        request.compiling = False
        if (timeline := self.timelines.get(rid)) is not None:
            log.info(
                "grammar_ready" if error is None else "grammar_refused",
                rid=timeline.trace,
                wait_s=round(time.monotonic() - timeline.queued, 6),
            )
        if error is not None and self._abort(rid) is not None:
            request.error = error
            await self._emit([request])

    def _release_adopted(self, core: Scheduler) -> None:
        """What no replay has claimed ADOPT_GRACE_S after the adoption goes back to the pool (unless a new
        epoch came first)."""
        if core is self.core and core.adopted:
            core.release_adopted()
            self._publish_gauges()

    async def _lora_adapter(self, rid: int, op: LoraAdapter) -> None:
        """Every engine loads or unloads the adapter; an unload waits for no request: one that any request runs with
        or waits for is refused."""
        if op.path is None and (users := sum(r.params.lora == op.name for r in (*self.core.running, *self.core.waiting))):
            await self.send("detokenizer", replace(op, error=f"the adapter '{op.name}' is in use by {users} requests"), rid)
            return
        if op.path is None:  # from now on: a request for it that reaches this scheduler after the unload is refused here
            self.unloaded.add(op.name)
        await self.send_all(self.engines, op, rid)

    async def _refuse(self, rid: int, refusal: Refusal) -> None:
        """Through the detokenizer to the request's api worker; kept a while, for a resync."""
        _remember(self.refused, rid, (refusal, time.monotonic()))
        await self.send("detokenizer", refusal, rid)

    async def _resync_detokenizer(self) -> None:
        """A new detokenizer knows no request, and the old one may have taken some tokens with it: every
        request it has heard of (running, or ended in the last RESYNC_ENDED_S) is announced again with all
        its tokens, and refusals of that time are sent again; the api workers keep what their clients
        have not had, and drop what is not theirs any more."""
        items = []
        for request in self._requests():  # a waiting one may be preempted after its first tokens
            if request.rid not in self.announce and (detok := self.detoks.get(request.rid)) is not None:
                items.append(_first_item(request, detok, list(request.output_ids), resync=True))
        recent = time.monotonic() - RESYNC_ENDED_S
        for rid, ended in self.ended.items():
            if ended is not None and ended.at > recent:
                announce = Announce(ended.detok, ended.output_ids.tolist(), ended.prompt_tokens, ended.cached_tokens, resync=True)
                items.append(TokenItem(rid, ended.finish, [], None, announce))
        refused = [(rid, refusal) for rid, (refusal, at) in self.refused.items() if at > recent]
        log.info("detokenizer_resync", requests=len(items), refusals=len(refused))
        for rid, refusal in refused:
            await self.send("detokenizer", refusal, rid)
        for frame in _in_frames([(item, _item_bytes(item)) for item in items]):
            await self.send("detokenizer", Tokens(frame))

    async def _emit(self, requests: list[Request], with_token: bool = True, epoch: int | None = None) -> None:
        """A frame per step: each request's newest token, and its finish reason if it finished
        (without a token: it was aborted, or outgrew the KV pool while being planned). A first token
        brings the request's stop strings, a replay's earlier tokens and, where asked, the prompt and its
        log-probabilities along, so a step's items are split across frames that each stay well inside the ring."""
        if not requests:
            return
        self._publish_gauges()  # before the tokens leave: a client that has them reads gauges that count them
        step_items: list[TokenItem] = []
        for request in requests:
            if request.error is not None:  # the engine could not go on: its client gets the error instead of a finish
                self.announce.pop(request.rid, None)
                self._on_finished(request)
                refusal = Refusal(request.error, 500, kind="internal_error") if request.crashed else Refusal(request.error)
                await self._refuse(request.rid, refusal)
                continue
            item = TokenItem(request.rid, None, [])
            if (generated := self.announce.pop(request.rid, None)) is not None:  # first tokens: what the detokenizer must know
                item = _first_item(request, self.detoks[request.rid], generated)
                self._on_prefilled(request)
            item.finish = request.finish_reason
            if request.finish_reason is not None:
                self._on_finished(request)
            if request.finish_reason != "abort" and with_token:
                fresh = max(request.fresh, 1)  # a speculative step gives several
                item.token_ids = request.output_ids[-fresh:]
                if request.params.logprobs is not None:
                    item.logprobs = [list(top.items()) for top in request.logprobs[-fresh:]]
            step_items.append(item)
        for items in _in_frames([(item, _item_bytes(item)) for item in step_items]):
            sent = sum(len(item.token_ids) for item in items)
            self.m_generation_tokens.inc(sent)
            self.window.generation_tokens += sent
            await self.send("detokenizer", Tokens(items), epoch=epoch)

    # -- observability --------------------------------------------------------------------------

    def _on_planned(self, plan: StepPlan, core: Scheduler) -> None:
        """A plan's batch; and where it comes from the scheduler that takes new requests, what its admissions found
        in the prefix cache (a request handed over to the decode side is not admitted anew)."""
        self.m_batch.observe(len(plan.chunks) + len(plan.decodes))
        if core is not self.core:
            return
        for tier, tokens in self.core.tier_hits.items():  # what this plan's admissions found in each tier
            if tokens > self.counted_hits[tier]:
                self.m_tier_hits[tier].inc(tokens - self.counted_hits[tier])
                self.counted_hits[tier] = tokens
        if self.core.draft_seconds:
            self.m_spec_draft.inc(self.core.draft_seconds)
            self.core.draft_seconds = 0.0
        now = time.monotonic()
        for request in self.core.admitted:
            if (timeline := self.timelines.get(request.rid)) is None:
                continue
            queue_s = now - timeline.queued
            if timeline.scheduled is None:  # a preempted request's later admissions are not queueing
                self.m_queue_time.observe(queue_s)
            timeline.scheduled = now
            looked_up, hits = len(request.tokens), request.matched
            self.m_prefix_queries.inc(looked_up)
            self.m_prefix_hits.inc(hits)
            self.window.prefix_queries += looked_up
            self.window.prefix_hits += hits
            log.info("scheduled", rid=timeline.trace, queue_s=round(queue_s, 6), cached_tokens=hits, running=len(self.core.running))

    def _on_prefilled(self, request: Request) -> None:
        self.m_prompt_tokens.inc(len(request.prompt_ids))
        self.window.prompt_tokens += len(request.prompt_ids)
        if (timeline := self.timelines.get(request.rid)) is not None and timeline.scheduled is not None:
            timeline.prefilled = time.monotonic()
            log.info("prefill_done", rid=timeline.trace, prefill_s=round(timeline.prefilled - timeline.scheduled, 6))

    def _ended(self, rid: int, request: Request | None) -> Timeline | None:
        detok = self.detoks.pop(rid, None)
        ended = None
        if request is not None and detok is not None and request.finish_reason != "abort":
            assert request.finish_reason is not None  # only finished requests end here
            output_ids = np.asarray(request.output_ids, np.int32)
            ended = Ended(detok, output_ids, request.finish_reason, len(request.prompt_ids), request.cached_tokens)
        _remember(self.ended, rid, ended)
        return self.timelines.pop(rid, None)

    def _on_finished(self, request: Request) -> None:
        if (timeline := self._ended(request.rid, request)) is None or request.finish_reason == "abort":
            return
        decode_s = time.monotonic() - (timeline.prefilled or timeline.queued)
        log.info(
            "finished",
            rid=timeline.trace,
            finish_reason=request.finish_reason,
            output_tokens=len(request.output_ids),
            decode_s=round(decode_s, 6),
        )

    async def _report_stats(self) -> None:
        """vLLM's periodic line: throughput, batch, KV use and prefix hits since the last one; and the disk tier's
        pages, counted (its folder may be shared with other servers)."""
        while True:
            await asyncio.sleep(self.stats_interval)
            if (cache := self.core.cache) is not None and cache.tiers is not None and (folder := cache.tiers.disk) is not None:
                self.slot["gauges"][SchedulerGauge.DISK_PAGES] = await asyncio.to_thread(count_pages, folder)
            now, w, (running, waiting, used, total) = time.monotonic(), self.window, self._load()
            self.window = Window(now)
            elapsed = now - w.started
            idle = not (w.prompt_tokens or w.generation_tokens or running or waiting)
            (log.debug if idle else log.info)(
                "stats",
                replica=self.replica,
                prompt_tok_s=round(w.prompt_tokens / elapsed, 1),
                gen_tok_s=round(w.generation_tokens / elapsed, 1),
                running=running,
                waiting=waiting,
                kv_usage=round(used / total, 4),
                prefix_hit_rate=round(w.prefix_hits / w.prefix_queries, 4) if w.prefix_queries else None,
            )

    def _load(self) -> tuple[int, int, int, int]:
        """Requests running and waiting, and KV pages used and in all, over every side."""
        cores = self.cores.values()
        return (
            sum(len(core.running) for core in cores),
            sum(len(core.waiting) for core in cores),
            sum(core.used_pages() for core in cores),
            sum(core.allocator.num_pages for core in cores),
        )

    def _publish_gauges(self) -> None:
        core, gauges = self.core, self.slot["gauges"]
        running, waiting, used, total = self._load()
        gauges[SchedulerGauge.USED_PAGES], gauges[SchedulerGauge.TOTAL_PAGES] = used, total
        gauges[SchedulerGauge.RUNNING], gauges[SchedulerGauge.WAITING] = running, waiting
        gauges[SchedulerGauge.CACHED_PAGES] = core.cache.cached_pages if core.cache else 0
        gauges[SchedulerGauge.PINNED_PREFIXES], gauges[SchedulerGauge.PINNED_PAGES] = len(core.pins), core.pinned_pages
        if core.cache is not None and (tiers := core.cache.tiers) is not None:
            gauges[SchedulerGauge.HOST_CACHED_PAGES], gauges[SchedulerGauge.HOST_TOTAL_PAGES] = (
                core.cache.host_cached_pages,
                tiers.host.num_pages,
            )
        hits = core.tier_hits
        gauges[SchedulerGauge.DEVICE_HIT_TOKENS], gauges[SchedulerGauge.HOST_HIT_TOKENS] = hits["device"], hits["host"]
        gauges[SchedulerGauge.DISK_HIT_TOKENS] = hits["disk"]
        self.m_running.set(running)
        self.m_waiting.set(waiting)
        if self.pd:  # the queue on each side
            for role, side in self.cores.items():
                self.m_pd_requests.labels(role, "running").set(len(side.running))
                self.m_pd_requests.labels(role, "waiting").set(len(side.waiting))
        self.m_kv_usage.set(used / total)
