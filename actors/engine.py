"""The engine actor: executes step plans in order and answers with the sampled tokens.

It keeps the device busy: a plan that arrives while earlier steps still run is queued
behind them at once, and a step's results are sent as soon as the device has them. While
steps are in flight it stamps when it last made progress (EngineGauge.PROGRESS); the supervisor treats
a stamp older than --watchdog-timeout as a crash.

A data-parallel replica's engine takes the devices after those of the replicas before it.
Under tensor parallelism each rank is an engine actor: it joins its group at the rendezvous the
supervisor names, runs every plan the scheduler sends it, and only rank 0 answers. The ranks move
to a new epoch where their frames do, so they launch the same steps in the same order. Where the
group spans machines, the ranks past node 0 have no ring: rank 0 relays its frames to them
(actors.relay), and they take their epochs from those frames alone.

A step's duration (ringllm:step_duration_seconds) runs from when the device could start it (its
launch, or the end of the step before it, whichever is later) to when its results are read. At
debug level each step is also logged with its size and how long its launch held the host.

A request held to a grammar waits out of the batch while the grammar compiles: the scheduler sends every
rank a COMPILE frame for it, each rank compiles on a thread of its own (runtime.structured.masks), and rank 0
answers once the grammar is ready, or once its compile has run past --grammar-compile-timeout (the request is
then refused). Only rank 0's answer admits the request, so every rank sees the same requests in each step; a
rank whose own compile trails waits for it when the slot opens.

On CPU, where launch runs the whole step and holds the loop, the engine beats and stamps its progress between
two layers (a long prefill under load is not a hang), and a new epoch (the scheduler's restart) cuts the step short
there: nobody waits for its tokens, and the replay's first step should not wait for it.

Where the KV pool outlives the engine (actors.pipeline.pool_outlives_engine: one rank), the engine's
keeper holds it (actors.keeper), and a replacement engine maps it as it is: the restart keeps the
epoch, and the new engine skips the plans its predecessor left in the ring, up to the scheduler's
resync plan, which opens the running requests' slots over their pages again
(runtime.scheduler.Scheduler.reopen).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import time
from collections import deque
from pathlib import Path
from typing import NamedTuple

import structlog
import torch

from actors.base import Actor
from actors.frames import Adopt, Compile, LoraAdapter, Ping, Step, StepResults, decode
from actors.gauges import EngineGauge
from actors.keeper import keeper_address, kept_pages, map_kept_pool, wait_for_keeper
from actors.lora_registry import read_registry
from actors.pipeline import engine_names, engine_units, node_ranks, pool_outlives_engine, unit_role
from actors.relay import FrameRelay
from runtime.batch import StepAbandoned
from runtime.distributed import TensorParallel, rank_device
from runtime.engine.engine import Engine, PendingStep
from runtime.models.lora import AdapterError
from runtime.obs import expert_load
from runtime.obs.metrics import metrics
from runtime.step import HeldKV
from transport.ring import Frame
from transport.segment import Segment

log = structlog.get_logger()
COMPILE_LOOK_S = 0.02  # how often an idle engine looks whether a grammar a request waits for is ready


class InFlight(NamedTuple):
    step: int
    pending: PendingStep
    launched: float
    launch_s: float  # host time the launch took
    prefill_tokens: int
    decodes: int
    host_waits: dict[str, float]  # Engine.host_waits of its launch


class EngineActor(Actor):
    async def setup(self) -> None:
        serve = self.options["serve"]
        config, self.rank, replica = serve.engine, self.options["rank"], self.options["replica"]
        self.scheduler = self.options["scheduler"]
        address = keeper_address(self.ctx.server, replica) if pool_outlives_engine(serve) else None
        if address is not None:  # the keeper holds the pool; on CUDA its context is made before this sizes one
            wait_for_keeper(address)
        # a restart keeps the pool the scheduler knows, or the one an engine that died in its start-up left with the keeper
        if pages := int(self.slot["gauges"][EngineGauge.POOL]) or (address is not None and kept_pages(address)):
            config = dataclasses.replace(config, num_pages=pages)
        started = time.monotonic()
        local_rank = self.rank - node_ranks(serve).start
        device = rank_device(config.device, replica * config.tensor_parallel_size + local_rank)
        tp = TensorParallel.join(self.rank, config, self.ctx.rendezvous, device)
        self.relay = FrameRelay(tp, serve.nnodes) if serve.nnodes > 1 else None
        if self.relay is not None and self.relay.follows:
            self.epoch = 0  # node 0's epochs, from the first frame relayed: this node's control block counts its own
        if device.type == "cpu" and (units := engine_units(serve)) > 1:  # the replicas' (or --pd's two) engines share the cores
            torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // (units * tp.size)))
        self.threads = torch.get_num_threads()
        if device.type == "cpu" and self.ctx.standby is not None:  # a spare sets up beside the live engine: on one core
            torch.set_num_threads(1)
        self.epochs_from_frames = tp.size > 1
        self.kv_segment: Segment | None = None  # on CPU, the kept pool's mapping, held as long as the engine uses it
        self.host_segment: Segment | None = None  # the kept host KV tier's mapping, likewise
        kv_memory = host_memory = None
        if address is not None:
            kv_memory = functools.partial(self._kept_kv, address)
            host_memory = functools.partial(self._kept_host, address) if config.hierarchical_cache else None
        self.engine = Engine(Path(serve.model_dir), config, tp, device, kv_memory, host_memory)
        self.peer_segment: Segment | None = None  # under --pd, the prefill pool's mapping on CPU, held by the decode engine
        if unit_role(serve, replica) == "decode":
            self._map_prefill_pool()
        self.synced = False  # plans before the scheduler's next resync were meant for an engine before this one
        self.held: list[HeldKV] = []  # the pool's KV of the epoch before (Engine.reset), until a scheduler adopts it
        if device.type == "cpu":  # launch runs the whole step: beat through it, and cut it short in a new epoch
            self.engine.between_layers = self._beat_and_check_epoch
        log.info("engine_loaded", load_s=round(time.monotonic() - started, 3))
        self.in_flight: deque[InFlight] = deque()
        self.last_done = 0.0
        self.m_step_duration = metrics().step_duration.labels(str(replica))
        self.m_spec_verify = metrics().spec_verify.labels(str(replica))
        self.m_spec_accept = metrics().spec_accept_length.labels(str(replica))
        self.m_tier_bytes, self.m_tier_load = metrics().tier_bytes, metrics().tier_load.labels(str(replica))
        self.m_transfer_bytes, self.m_transfer = metrics().pd_transfer_bytes, metrics().pd_transfer
        self.replica, self.stats_interval, self.load_since = replica, serve.stats_interval, time.monotonic()

    def _start(self) -> int:
        """Which start of this engine's row this one is, where its restart keeps the epoch (its row's restart count,
        read once promoted): two deaths in a row leave two resync plans in the ring, and only the second is for it.
        An engine group's restart starts a new epoch, whose frames alone it reads."""
        return int(self.slot["restarts"]) if self.ctx.spec.keeps_epoch else 0

    async def _next_frame(self, timeout: float | None) -> tuple[str, Frame] | None:
        """The next admitted frame within `timeout` (0: one already there): from the scheduler's ring, or on
        a node past the first from rank 0's relay. Rank 0 relays each one it reads but pings, which are its own."""
        if self.relay is not None and self.relay.follows:
            while (frame := await self.relay.next(timeout)) is not None:
                if self.admit(frame):
                    return "relay", frame
            return None
        got = self.poll_frame() if timeout == 0 else await self.next_frame(timeout)
        if got is not None and self.relay is not None and self.relay.leads and got[1].kind != Ping.KIND:
            self.relay.forward(got[1])
        return got

    def _map_prefill_pool(self) -> None:
        """The prefill engine's KV pool, which this decode engine copies handed-over requests' KV from (its keeper
        holds it, so it outlives either engine); sized by the prefill engine's pages, once it has said them."""
        prefill = self.control.slots[self.control.index(engine_names(self.options["serve"], 0)[0])]
        while not (pages := int(prefill["gauges"][EngineGauge.POOL])):
            time.sleep(0.05)
        address = keeper_address(self.ctx.server, 0)
        wait_for_keeper(address)

        def memory(size: int) -> torch.Tensor:
            self.peer_segment, kept = map_kept_pool(address, size)
            return kept

        self.engine.map_peer(pages, memory)

    def _lora_adapter(self, op: LoraAdapter) -> LoraAdapter:
        """Load or unload the adapter between steps (a step in flight keeps the weights it was launched with: a slot is
        rewritten on the stream, after it); the answer says why not, where it fails."""
        adapters = self.engine.adapters
        if adapters is None:
            return dataclasses.replace(op, error="LoRA is off: start the server with --enable-lora (or --lora-paths) to load adapters")
        replaced = op.name in adapters.loaded
        try:
            if op.path is None:
                if replaced:  # an unload asked again (one replica refused it before) is done already
                    adapters.unload(op.name)
            else:
                adapters.load(op.name, op.path)
        except AdapterError as exc:
            return dataclasses.replace(op, error=str(exc))
        log.info("lora_adapter_loaded" if op.path else "lora_adapter_unloaded", name=op.name, path=op.path)
        return dataclasses.replace(op, replaced=replaced)

    def _reload_adapters(self) -> None:
        """A restarted engine, or a promoted spare, serves what the server served before it: the adapters loaded or
        unloaded at run time too (actors.lora_registry), not only --lora-paths."""
        adapters = self.engine.adapters
        if adapters is None:
            return
        served = read_registry(self.ctx.server, self.options["serve"].engine.lora_adapters)
        for name in [name for name in adapters.loaded if name not in served]:
            adapters.unload(name)
        for name, path in served.items():
            if name not in adapters.loaded or adapters.loaded[name].path != path:
                try:
                    adapters.load(name, path)
                except AdapterError as exc:  # its folder went away meanwhile: requests for it fail, the engine serves on
                    log.warning("lora_adapter_not_reloaded", name=name, error=str(exc))

    def _kept_kv(self, address: str, size: int, pages: int) -> torch.Tensor:
        self.kv_segment, memory = map_kept_pool(address, size, pages=pages)
        return memory

    def _kept_host(self, address: str, size: int) -> torch.Tensor:
        self.host_segment, memory = map_kept_pool(address, size, "host")
        return memory

    def _beat_and_check_epoch(self) -> bool:
        """Between two layers of a CPU step: a layer done is progress too, for the watchdog as for the heartbeat, so
        that a long prefill on a busy machine is not taken for a hang (and killed, and run again, and killed)."""
        self.beat()
        self.slot["gauges"][EngineGauge.PROGRESS] = time.monotonic()
        return self.epoch_moved_on()

    def on_epoch(self, epoch: int) -> None:
        # what the pool holds for the old epoch's requests, until this epoch's scheduler asks; an epoch in which no
        # step ran leaves the pool as it was, and what it held before
        self.held = self.engine.reset() or self.held
        self.in_flight.clear()
        self.slot["gauges"][EngineGauge.PROGRESS] = 0.0

    async def run(self) -> None:
        torch.set_num_threads(self.threads)  # a promoted spare's cores
        self._reload_adapters()  # here, not in setup: a warm spare may have set up before the last load or unload
        # only now, not in setup: a warm spare sets up while the engine it may replace still runs on this row
        self.slot["gauges"][EngineGauge.PROGRESS] = 0.0  # a stamp left by a predecessor that died mid-step
        self.slot["gauges"][EngineGauge.HOST_POOL] = self.engine.tiers.num_pages if self.engine.tiers else 0
        self.slot["gauges"][EngineGauge.POOL] = self.engine.num_pages  # the scheduler sizes its page table from this
        assert self.engine.config.steps_in_flight is not None  # EngineConfig fills in the device's default
        grammars = self.engine.grammars
        while True:
            await self.yield_if_due()
            for rid, error in grammars.take_prepared():  # every rank compiles; rank 0 tells the scheduler
                if self.rank == 0:
                    await self.send(self.scheduler, Compile(error=error), rid)
            got = await self._next_frame(0 if self.in_flight else COMPILE_LOOK_S if grammars.waiting else None)
            if got is not None:
                payload = decode(got[1])
                if isinstance(payload, Ping):  # only rank 0 is pinged
                    await self.send(self.scheduler, payload, got[1].rid)
                    continue
                if isinstance(payload, Adopt):
                    if self.rank == 0:
                        tiers = self.engine.tiers
                        await self.send(self.scheduler, Adopt(self.held, str(tiers.disk) if tiers and tiers.disk else None))
                    continue
                if isinstance(payload, LoraAdapter):
                    answer = self._lora_adapter(payload)
                    if self.engine.tp.size > 1:  # every rank's outcome: one that could not load (its node lacks the path) too
                        errors = [error for error in self.engine.tp.gather(answer.error) if error is not None]
                        answer = dataclasses.replace(answer, error=errors[0] if errors else None)
                    if self.rank == 0:
                        await self.send(self.scheduler, answer, got[1].rid)
                    continue
                if isinstance(payload, Compile):  # a request waits out of the batch until its grammar is compiled
                    if payload.guide is None:  # it was aborted meanwhile
                        grammars.forget(got[1].rid)
                    else:
                        grammars.prepare(got[1].rid, payload.guide)
                    continue
                assert isinstance(payload, Step)
                plan = payload.plan
                if not (self.synced or (plan.resync and plan.engine_start >= self._start())):
                    log.info("step_skipped", step=plan.step)  # a predecessor's: the scheduler plans it again
                    continue
                self.synced, self.held = True, []  # a step changes the pool: what it held is the slots' now
                if not self.in_flight:
                    self.slot["gauges"][EngineGauge.PROGRESS] = time.monotonic()
                self.slot["gauges"][EngineGauge.LAUNCHED] = plan.step
                launched = time.monotonic()  # before: on CPU, launch does the whole step
                try:
                    pending = self.engine.launch(plan)
                except StepAbandoned:
                    log.info("step_abandoned", step=plan.step)
                    self.catch_up_epoch()
                    continue
                self.in_flight.append(
                    InFlight(
                        plan.step,
                        pending,
                        launched,
                        time.monotonic() - launched,
                        sum(len(c.token_ids) for c in plan.chunks),
                        len(plan.decodes),
                        self.engine.host_waits,
                    )
                )
                if len(self.in_flight) < self.engine.config.steps_in_flight and not self.in_flight[0].pending.ready():
                    continue  # room for one more while the device works; on CPU, launch has done the work
            elif not self.in_flight:
                continue  # the wait for a frame ran out: a grammar may be ready
            elif not self.in_flight[0].pending.ready():
                await asyncio.sleep(0)  # the device is busy and no plan is waiting: look again
                continue
            done = self.in_flight.popleft()
            results = done.pending.result()
            now = time.monotonic()
            duration = now - max(done.launched, self.last_done)
            self.m_step_duration.observe(duration)
            if done.pending.drafts:
                self.m_spec_verify.observe(duration)
                for gave in self.engine.speculation.gave:
                    self.m_spec_accept.observe(gave)
                self.engine.speculation.gave.clear()
            log.debug(
                "step",
                step=done.step,
                prefill_tokens=done.prefill_tokens,
                decodes=done.decodes,
                launch_ms=round(done.launch_s * 1e3, 3),
                duration_ms=round(duration * 1e3, 3),
                **done.host_waits,
            )
            self.last_done = now
            self.slot["gauges"][EngineGauge.PROGRESS] = now if self.in_flight else 0.0
            if self.engine.tiers is not None:
                self._publish_tier_stats()
            if self.engine.peer is not None:
                self._publish_transfers()
            if self.rank == 0:
                await self.send(self.scheduler, StepResults(done.step, results), done.step)
                if now - self.load_since >= self.stats_interval:
                    self._publish_expert_load(now)

    def _publish_tier_stats(self) -> None:
        assert self.engine.tiers is not None
        moved, seconds = self.engine.tiers.take_stats()
        for direction, count in moved.items():
            if count:
                self.m_tier_bytes.labels(str(self.replica), direction).inc(count)
        for elapsed in seconds:
            self.m_tier_load.observe(elapsed)

    def _publish_transfers(self) -> None:
        """A decode engine's copies from the prefill engine's pool (--pd): bytes, and each request's time."""
        for size, seconds in self.engine.take_imports():
            self.m_transfer_bytes.inc(size)
            self.m_transfer.observe(seconds)

    def _publish_expert_load(self, now: float) -> None:
        """The routing counts since the last call, for /server_info and /metrics (MoE models only)."""
        load = self.engine.model.take_expert_load()
        if load is not None:
            layers, tokens = load
            expert_load.publish(self.replica, layers, tokens.cpu().numpy(), now - self.load_since)
        self.load_since = now
