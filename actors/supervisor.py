"""The supervisor: owns every segment and process of one server, and restarts what dies or hangs.

It is not on the data path. Its loop sleeps on the process sentinels and a signal wake-up pipe,
and every `check_interval_s` looks at heartbeats. A dead or hung actor is restarted under a new
epoch: the supervisor bumps the epoch in the control block and rings every other actor's
doorbell, so peers drop frames of the old epoch and free their soft state. An actor whose
restart keeps the epoch (ActorSpec.keeps_epoch) only has its row's restart count moved on.

Where the actor has a warm spare that is set up, the spare is promoted into its place instead of a
cold start, and its successor starts `spare_delay_s` later, once the replay is done (the first
spares, `spare_settle_s` after start-up).

Start-up handles a death the same way, up to `startup_retries` times per actor; one more ends it.

Actors are forked by a forkserver (actors.forkserver) but are the supervisor's children, a child
subreaper: a forkserver's death takes none with it, and another forkserver starts at once.

A group that spans machines (Topology.meeting) has a supervisor on each; they agree on its starts
through node 0's store (actors.nodes).

A shadow server (Topology.shadow, actors.shadow) starts once every actor is ready and stops with them; it is
watched but never restarted.
"""

from __future__ import annotations

import argparse
import importlib
import multiprocessing as mp
import os
import signal
import time
from dataclasses import dataclass, field
from multiprocessing.connection import wait as wait_any
from typing import TYPE_CHECKING, cast

import structlog

from actors.base import ActorContext, Standby, actor_main
from actors.control import SPARE_STARTING, ActorState, ControlBlock, pid_alive
from actors.forkserver import Child, Forkserver
from actors.gauges import PROGRESS_GAUGE
from actors.nodes import GroupStore, NodeStoreError
from actors.topology import DEFAULT_PORT, Topology
from runtime.cli_args import CliConfig, flag
from runtime.obs.logs import configure_logging
from runtime.obs.metrics import metrics, prepare_dir
from transport.lifetime import become_subreaper
from transport.ring import Ring
from transport.segment import SHM_DIR, list_segments, remove_segments, unlink_segment
from transport.wakeup import Doorbell

if TYPE_CHECKING:
    from actors.shadow import ShadowProcess

log = structlog.get_logger()
SHADOW_STOP_MARGIN_S = 10.0  # beyond its stop timeout, seconds a shadow server may take to stop before it is killed


@dataclass(frozen=True)
class Spare:
    proc: Child
    standby: Standby

    def discard(self) -> None:
        """Kill a spare never promoted: nothing of its own to finish."""
        self.proc.kill()
        self.proc.join()
        self.proc.close()


@dataclass(frozen=True)
class SupervisorConfig(CliConfig):
    """How the supervisor watches and restarts; every field a flag of `ringllm serve` and of this module's entry."""

    hang_timeout_s: float = field(
        default=30.0,
        metadata=flag(
            "seconds without a heartbeat before an actor is restarted; the engine too, whatever its watchdog", ("--hang-timeout",)
        ),
    )
    ready_timeout_s: float = field(
        default=600.0, metadata=flag("seconds an actor may take to start (it may load weights)", ("--ready-timeout",))
    )
    stop_timeout_s: float = field(
        default=5.0, metadata=flag("seconds a stop waits for stragglers before it kills them", ("--stop-timeout",))
    )
    shutdown_timeout_s: float = field(
        default=30.0, metadata=flag("on SIGTERM, seconds in-flight requests may take", ("--shutdown-timeout",))
    )
    check_interval_s: float = field(
        default=0.25, metadata=flag("seconds between the supervisor's looks at the heartbeats", ("--check-interval",))
    )
    max_backoff_s: float = field(
        default=5.0,
        metadata=flag("the longest wait, in seconds, before restarting an actor that keeps dying before it is ready", ("--max-backoff",)),
    )
    startup_retries: int = field(
        default=3,
        metadata=flag(
            "times start-up starts again an actor that dies before the server is ready (with the restart backoff); "
            "one more death ends start-up",
            ("--startup-retries",),
        ),
    )
    # a warm spare's set-up competes for the cores: the first spares start once a new server has settled (its
    # first requests, a benchmark's warm-up), a replacement once the replay after a promotion is done
    spare_settle_s: float = field(default=5.0, metadata=flag("seconds from start-up to the first warm spares", ("--spare-settle",)))
    spare_delay_s: float = field(
        default=5.0, metadata=flag("seconds from a spare's promotion to its successor's start", ("--spare-delay",))
    )

    @property
    def heartbeat_s(self) -> float:
        return min(1.0, self.hang_timeout_s / 5)


class StartupError(RuntimeError):
    pass


class Supervisor:
    def __init__(self, topology: Topology, config: SupervisorConfig = SupervisorConfig()) -> None:
        self.topology = topology
        self.config = config
        self._forkserver = Forkserver(sorted({module for actor in topology.actors for module in actor.preload}))
        self._procs: dict[int, Child] = {}
        self._started_at: dict[int, float] = {}
        self._restart_at: dict[int, float] = {}
        self._backoff: dict[int, float] = {}
        self._spares: dict[int, Spare] = {}  # actor index -> its warm spare
        self._spare_at: dict[int, float] = {}  # actor index -> when its next spare starts
        self._spare_backoff: dict[int, float] = {}  # for a spare that keeps dying before it is needed
        self._up = False  # start-up is over: every actor was ready once
        self._startup_deaths: dict[int, int] = {}  # actor index -> its deaths during start-up
        self._taken_down: set[int] = set()  # actors the supervisor killed for another's death (a group, ActorSpec.needs)
        # how often each group (ActorSpec.group) has been started: names its rendezvous
        self._group_starts = {actor.group: 1 for actor in topology.actors if actor.group is not None}
        self._nodes: GroupStore | None = None  # where a group spans machines: the nodes' agreement on its starts
        self._stopping = False
        self._drain_until: float | None = None  # set by SIGTERM: new requests are refused until then
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._control: ControlBlock | None = None
        self._shadow: ShadowProcess | None = None
        self._rings: dict[tuple[str, str], Ring] = {}
        self._doorbells: list[Doorbell] = []

    @property
    def control(self) -> ControlBlock:
        """The control block, which start makes; only the signal handler and stop may run before it exists."""
        assert self._control is not None
        return self._control

    # -- life cycle ---------------------------------------------------------------------------

    def run(self) -> int:
        """Start, supervise until SIGINT or SIGTERM, then stop and remove every segment."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        signal.set_wakeup_fd(self._wake_w)
        try:
            self.start()
            self.watch()
        except StartupError as exc:
            log.error("startup_failed", error=str(exc))
            return 1
        except NodeStoreError as exc:
            log.error("node_store_failed", error=str(exc))
            return 1
        finally:
            self.stop()
        return 0

    def _on_signal(self, signum: int, frame) -> None:
        if signum == signal.SIGTERM and self._control is not None and self._drain_until is None:
            self._drain_until = time.monotonic() + self.config.shutdown_timeout_s
            self._control.draining = True
        else:  # SIGINT, or a second SIGTERM: stop now
            self._stopping = True

    def _drained(self) -> bool:
        """On SIGTERM: are the requests in hand finished, or out of time?"""
        if self._drain_until is None:
            return False
        busy = [
            i
            for i, a in enumerate(self.topology.actors)
            if a.drain_gauge is not None and self.control.slots[i]["gauges"][a.drain_gauge] > 0
        ]
        if busy and time.monotonic() < self._drain_until:
            return False
        log.info("drained", unfinished=len(busy))
        return True

    @property
    def metrics_dir(self) -> str:
        """Where every process of this server writes its Prometheus samples (see runtime.obs.metrics)."""
        return f"{self.topology.prefix}metrics"

    def start(self) -> None:
        self._sweep_stale()
        become_subreaper()  # the actors the forkserver forks become this process's children
        prepare_dir(SHM_DIR / self.metrics_dir)  # before any child is spawned: they inherit its name
        for spec in self.topology.actors:  # each actor's count exported at 0 from the start, as Prometheus advises
            metrics().restarts.labels(spec.name)
        self._control = ControlBlock.create(self.topology)
        if self.topology.shadow is not None:
            from actors.shadow import ShadowProcess  # its HTTP client and the serving config only where it runs

            self._shadow = ShadowProcess(self.topology.shadow, self._control)
        if (meeting := self.topology.meeting) is not None:
            self._nodes = GroupStore(meeting, self.topology.node_rank, self._group_starts, self.config.ready_timeout_s)
            self._group_starts = {group: self._nodes.start(group) for group in self._group_starts}
        for edge in self.topology.edges:
            self._rings[edge.src, edge.dst] = Ring(self.topology.ring_name(edge), edge.capacity)
        self._doorbells = [Doorbell() for _ in self.topology.actors]
        self._forkserver.start()
        for index in range(len(self.topology.actors)):
            self._start_actor(index)
        self._await_ready()
        self._up = True
        for index, spec in enumerate(self.topology.actors):
            if spec.spare:
                self._schedule_spare(index, self.config.spare_settle_s)
        log.info("topology_ready", server=self.topology.server, actors=len(self._procs))
        if self._shadow is not None:  # only now: it would slow this server's start down
            self._shadow.start()

    def _sweep_stale(self) -> None:
        try:
            stale = ControlBlock.attach(self.topology.server)
        except FileNotFoundError:
            stale = None
        if stale is not None:
            owner = stale.supervisor_pid
            stale.close()
            if pid_alive(owner):
                raise StartupError(f"a ringllm server already runs on {self.topology.server} (supervisor pid {owner})")
        if removed := remove_segments(self.topology.prefix):
            log.warning("removed_stale_segments", segments=removed)

    def _await_ready(self) -> None:
        """Until every actor is ready: one that dies starts again as after start-up (ActorSpec.needs, groups and
        the backoff alike), up to startup_retries times (_on_exit); one not ready in ready_timeout_s ends it."""
        slots = self.control.slots
        while not all(slots["state"] == ActorState.READY):
            if self._stopping:
                raise StartupError("stopped during start-up")
            now = time.monotonic()
            for index in self._procs:
                if slots[index]["state"] != ActorState.READY and now - self._started_at[index] > self.config.ready_timeout_s:
                    raise StartupError(f"{self._name(index)} not ready after {self.config.ready_timeout_s} s")
            self._handle_exits(timeout=0.05)
            self._start_due()

    def watch(self) -> None:
        """Until a stop is requested: restart whatever dies or hangs."""
        while not self._stopping:
            self._handle_exits(timeout=self.config.check_interval_s)
            if self._stopping or self._drained():
                break
            self._kill_hung()
            self._sample_rings()
            self._start_due()

    def _handle_exits(self, timeout: float) -> None:
        """Wait up to `timeout` for an exit (an actor's, a spare's, the forkserver's) or a signal, and handle it."""
        sentinels = {proc.sentinel: (index, proc) for index, proc in self._procs.items()}
        spares = {spare.proc.sentinel: (index, spare) for index, spare in self._spares.items()}
        forkserver = self._forkserver.proc
        watched = [*sentinels, *spares, self._wake_r, *([forkserver.sentinel] if forkserver is not None else [])]
        # wait returns some of the objects it is given: here, file descriptors
        for fired in cast("list[int]", wait_any(watched, timeout=timeout)):
            # an exit handled already, with another's (ActorSpec.needs), is not handled again
            if fired in sentinels and self._procs.get(index := sentinels[fired][0]) is sentinels[fired][1]:
                self._on_exit(index)
            elif fired in spares and self._spares.get(index := spares[fired][0]) is spares[fired][1]:
                self._on_spare_exit(index)
            elif forkserver is not None and fired == forkserver.sentinel and self._forkserver.proc is forkserver:
                forkserver.join()
                log.warning("forkserver_exited", exitcode=forkserver.exitcode)
                self._forkserver.start()  # the next spawn waits less for its imports; no actor died with it
        self._drain_wakeups()
        if self._shadow is not None:  # reaped here if it exited, before the strays
            self._shadow.poll()
        self._reap_strays()

    def _start_due(self) -> None:
        self._follow_nodes()
        now = time.monotonic()
        for index, due in list(self._restart_at.items()):
            if due <= now:
                del self._restart_at[index]
                self._start_actor(index)
        for index, due in list(self._spare_at.items()):
            if due <= now:
                del self._spare_at[index]
                self._start_spare(index)

    def _reap_strays(self) -> None:
        """Reap children that are no actor, spare or forkserver of this supervisor: a subreaper inherits what
        an actor's death orphans (its own children; a spawn's processes when the forkserver dies mid-way)."""
        owned = {proc.pid for proc in self._procs.values()} | {spare.proc.pid for spare in self._spares.values()}
        if self._forkserver.proc is not None:
            owned.add(self._forkserver.proc.pid)
        if self._shadow is not None and self._shadow.pid is not None:
            owned.add(self._shadow.pid)
        while True:
            try:
                found = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                return
            if found is None or found.si_pid in owned:
                return  # an owned one is reaped by its handler; a stray behind it, next time
            os.waitpid(found.si_pid, 0)

    def stop(self) -> None:
        """Ask every actor to stop, kill stragglers, then unlink every segment."""
        self._stopping = True
        if self._control is None:  # nothing was created (another server owns the port)
            return
        if self._shadow is not None:  # it stops alongside this server's actors
            self._shadow.interrupt()
        self._restart_at.clear()
        self._spare_at.clear()
        for spare in self._spares.values():
            spare.discard()
        self._spares.clear()
        deadline = time.monotonic() + self.config.stop_timeout_s
        needed = {actor.needs for actor in self.topology.actors}
        for last in (False, True):  # what others map (a keeper's pool) stops after them
            stopping = {i: proc for i, proc in self._procs.items() if (self._name(i) in needed) == last}
            for index in stopping:
                self.control.slots[index]["stop"] = 1
                self._doorbells[index].ring()
            for index, proc in stopping.items():
                proc.join(max(0.0, deadline - time.monotonic()))
                if proc.is_alive():
                    log.warning("actor_killed_at_stop", child=self._name(index), pid=proc.pid)
                    proc.kill()
                    proc.join()
                proc.close()
        self._procs.clear()
        if self._shadow is not None:  # its own stop waits as long for its actors, and a moment more
            self._shadow.join(self.config.stop_timeout_s + SHADOW_STOP_MARGIN_S)
        self._forkserver.stop()
        self._reap_strays()
        for ring in self._rings.values():
            ring.close()
        for bell in self._doorbells:
            bell.close()
        self.control.close()
        unlink_segment(self.metrics_dir)
        for name in self.topology.kept:
            unlink_segment(self.topology.prefix + name)
        for group in self._group_starts:
            unlink_segment(self._rendezvous(group))
        if leftovers := list_segments(self.topology.prefix):
            remove_segments(self.topology.prefix)
            log.warning("removed_leftover_segments", segments=leftovers)
        log.info("stopped", server=self.topology.server)

    # -- actors -------------------------------------------------------------------------------

    def _name(self, index: int) -> str:
        return self.topology.actors[index].name

    def _spawn(self, index: int, standby: Standby | None = None) -> Child:
        spec = self.topology.actors[index]
        ctx = ActorContext(
            spec=spec,
            server=self.topology.server,
            index=index,
            inputs={src: ring.handle for (src, dst), ring in self._rings.items() if dst == spec.name},
            outputs={dst: ring.handle for (src, dst), ring in self._rings.items() if src == spec.name},
            doorbell=self._doorbells[index],
            heartbeat_s=self.config.heartbeat_s,
            rendezvous=None if spec.group is None else self._meeting_place(spec.group),
            standby=standby,
        )
        return self._forkserver.spawn(actor_main, ctx)

    def _reset_slot(self, index: int) -> None:
        """The actor's row afresh under the current epoch: before its process can write to it."""
        slot = self.control.slots[index]
        slot["state"], slot["stop"], slot["heartbeat"], slot["epoch"] = ActorState.STARTING, 0, 0.0, self.control.epoch

    def _own(self, index: int, proc: Child) -> None:
        self.control.slots[index]["pid"] = proc.pid
        self._procs[index] = proc
        self._started_at[index] = time.monotonic()

    def _start_actor(self, index: int) -> None:
        spec = self.topology.actors[index]
        self._reset_slot(index)
        self._own(index, proc := self._spawn(index))
        log.info("actor_started", child=spec.name, kind=spec.kind, pid=proc.pid, epoch=self.control.epoch)

    def _schedule_spare(self, index: int, delay: float) -> None:
        slot = self.control.slots[index]
        slot["spare_pid"], slot["spare_process"] = SPARE_STARTING, 0  # on its way, from now on
        self._spare_at[index] = time.monotonic() + delay

    def _start_spare(self, index: int) -> None:
        events = mp.get_context("spawn")  # not fork's: its semaphores cannot be sent to another process
        standby = Standby(events.Event(), events.Event())
        proc = self._spawn(index, standby)
        self._spares[index] = Spare(proc, standby)
        self.control.slots[index]["spare_process"] = proc.pid
        log.info("spare_started", child=self._name(index), pid=proc.pid)

    def _promote_spare(self, index: int) -> bool:
        """Put the actor's spare in its place, if one is set up; the next spare starts later."""
        spare = self._spares.get(index)
        if spare is None or not spare.standby.ready.is_set() or not spare.proc.is_alive():
            return False
        del self._spares[index]
        self._reset_slot(index)
        self._own(index, spare.proc)
        spare.standby.promoted.set()  # only now does the spare touch the row
        self._schedule_spare(index, self.config.spare_delay_s)
        log.info("spare_promoted", child=self._name(index), pid=spare.proc.pid, epoch=self.control.epoch)
        return True

    def _on_spare_exit(self, index: int) -> None:
        """A spare died before it was needed: another starts, later each time it happens again."""
        spare = self._spares.pop(index)
        spare.proc.join()
        delay = self._spare_backoff.get(index, self.config.spare_delay_s)
        self._spare_backoff[index] = min(self.config.max_backoff_s, 2 * delay)
        self._schedule_spare(index, delay)
        log.warning("spare_exited", child=self._name(index), exitcode=spare.proc.exitcode, restart_in_s=delay)
        spare.proc.close()

    def _on_exit(self, index: int) -> None:
        proc = self._procs.pop(index)
        proc.join()
        if index in self._taken_down:
            self._taken_down.discard(index)
        elif not self._up:  # a death of its own during start-up: restarted startup_retries times at most
            deaths = self._startup_deaths[index] = self._startup_deaths.get(index, 0) + 1
            if deaths > self.config.startup_retries:
                proc.close()
                raise StartupError(
                    f"{self._name(index)} exited with code {proc.exitcode} during start-up, its death number {deaths} "
                    f"(--startup-retries {self.config.startup_retries})"
                )
        self._restart_dependents(index)
        slots, group = self.control.slots, self.topology.actors[index].group
        slots[index]["exitcode"] = proc.exitcode if proc.exitcode is not None else 0
        members = [index] if group is None else self._members(group)
        was_ready = slots[index]["state"] in (ActorState.READY, ActorState.DOWN)  # DOWN: ready when its group went down
        for member in members:  # before the new epoch: nothing is placed on them
            if slots[member]["state"] == ActorState.READY:
                slots[member]["state"] = ActorState.DOWN
        if self.topology.actors[index].keeps_epoch:
            self._count_restart(index, reason="exited", exitcode=proc.exitcode)
        else:
            self._new_epoch(index, reason="exited", exitcode=proc.exitcode)
        proc.close()
        # a crash after a healthy start restarts at once; a crash loop at start-up backs off
        delay = 0.0 if was_ready else self._backoff.get(index, 0.25)
        self._backoff[index] = 0.25 if was_ready else min(self.config.max_backoff_s, delay * 2)
        if group is None:
            if not self._promote_spare(index):
                self._restart_at[index] = time.monotonic() + delay
            return
        if live := [m for m in members if m in self._procs]:
            self._take_down(live)  # each exit comes back here; the last one restarts the group
            return
        if self._nodes is not None and not self._nodes.leads:  # node 0 restarts it; _follow_nodes starts ours then
            self._nodes.report_failure(group, self._group_starts[group])
            return
        unlink_segment(self._rendezvous(group))
        self._group_starts[group] += 1
        if self._nodes is not None:
            self._nodes.announce(group, self._group_starts[group])
        for member in members:
            self._restart_at[member] = time.monotonic() + delay

    def _take_down(self, members: list[int]) -> None:
        for member in members:
            if member not in self._taken_down:
                self._procs[member].kill()
                self._taken_down.add(member)

    def _follow_nodes(self) -> None:
        """Where a group spans machines: node 0 takes its ranks down when another node reports a death in the
        current start (their exits restart the group); every other node starts its ranks at each new start
        node 0 announces, once those of the start before are gone."""
        if self._nodes is None:
            return
        for group, start in self._group_starts.items():
            members = self._members(group)
            live = [m for m in members if m in self._procs]
            if self._nodes.leads:
                standing = [m for m in live if m not in self._taken_down]
                if standing and self._nodes.failed(group) == start:
                    log.warning("group_failed_elsewhere", group=group, start=start)
                    self._take_down(standing)
            elif (latest := self._nodes.start(group)) != start:
                if live:
                    self._take_down(live)
                    continue
                self._group_starts[group] = latest
                for member in members:
                    self._restart_at[member] = time.monotonic()

    def _restart_dependents(self, index: int) -> None:
        """The actors that map what the dead one held (ActorSpec.needs) go with it, spares included, and
        start again: their restarts are counted before the dead one's new epoch, which replays their work."""
        name = self._name(index)
        for dependent, actor in enumerate(self.topology.actors):
            if actor.needs != name:
                continue
            if (spare := self._spares.pop(dependent, None)) is not None:
                spare.discard()
                self._schedule_spare(dependent, self.config.spare_delay_s)
            if (proc := self._procs.get(dependent)) is not None:
                proc.kill()
                self._taken_down.add(dependent)
                self._on_exit(dependent)

    def _members(self, group: str) -> list[int]:
        return [i for i, actor in enumerate(self.topology.actors) if actor.group == group]

    def _rendezvous(self, group: str) -> str:
        """The name in SHM_DIR where this start of the group meets (torch.distributed's FileStore)."""
        return f"{self.topology.prefix}{group}-{self._group_starts[group]}"

    def _meeting_place(self, group: str) -> str:
        """Where the ranks of this start of the group meet: node 0's store if it spans machines, else a file."""
        if self._nodes is not None:
            return self._nodes.rendezvous(group, self._group_starts[group])
        return str(SHM_DIR / self._rendezvous(group))

    def _kill_hung(self) -> None:
        """Kill an actor not ready after ready_timeout_s, a ready one whose heartbeat is older than
        hang_timeout_s, and one with a watchdog whose progress stamp is older than watchdog_s: the
        watchdog can only make a kill come sooner, never later."""
        now = time.monotonic()
        for index, proc in self._procs.items():
            slot, watchdog = self.control.slots[index], self.topology.actors[index].watchdog_s
            if slot["state"] != ActorState.READY:
                checks = [("ready_timeout", self._started_at[index], self.config.ready_timeout_s)]
            else:
                checks = [("hang_timeout", float(slot["heartbeat"]), self.config.hang_timeout_s)]
                if watchdog is not None and (progress := float(slot["gauges"][PROGRESS_GAUGE])):
                    checks.append(("watchdog", progress, watchdog))
            for limit, since, limit_s in checks:
                if (age := now - since) > limit_s:
                    log.warning("actor_hung", child=self._name(index), pid=proc.pid, limit=limit, silent_s=round(age, 3))
                    proc.kill()  # its sentinel fires on the next wait and restarts it
                    break

    def _sample_rings(self) -> None:
        gauge = metrics().ring_occupancy
        for (src, dst), ring in self._rings.items():
            gauge.labels(f"{src}->{dst}").set(ring.occupancy())

    def _new_epoch(self, index: int, **why) -> None:
        """Bump the epoch and tell every live peer, so in-flight frames of the old one are dropped."""
        self.control.epoch = self.control.epoch + 1
        self._count_restart(index, **why)

    def _count_restart(self, index: int, **why) -> None:
        """Count the restart in the actor's row and tell every live peer (a peer that watches the row acts on it)."""
        self.control.slots[index]["restarts"] += 1
        metrics().restarts.labels(self._name(index)).inc()
        for peer in self._procs:
            self._doorbells[peer].ring()
        log.warning("actor_restarting", child=self._name(index), epoch=self.control.epoch, **why)

    def _drain_wakeups(self) -> None:
        try:
            while os.read(self._wake_r, 512):
                pass
        except BlockingIOError:
            pass


def load_topology(path: str, server: str) -> Topology:
    """`module:function`, where function(server) returns the Topology to run."""
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)(server)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m actors.supervisor", description="Run a declared topology.")
    parser.add_argument("topology", help="module:function that returns a Topology for a port")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="names the server's segments")
    SupervisorConfig.add_cli_args(parser)
    args = parser.parse_args(argv)
    configure_logging("supervisor")
    topology = load_topology(args.topology, str(args.port))
    config = SupervisorConfig.from_cli_args(args)
    return Supervisor(topology, config).run()


if __name__ == "__main__":
    raise SystemExit(main())
