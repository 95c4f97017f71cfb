"""The tokenizer's view of the data-parallel replicas: which can serve now, how loaded each is, and
which takes a request (runtime.scheduler.router decides; this feeds it from the control block).

A replica is live while its scheduler and every engine rank of it are ready: the supervisor marks an
actor down the moment it exits, before the new epoch makes the api workers replay, so a dead
replica's requests are placed on a live one at once. A replica's load is its running and waiting
requests plus those sent to it that its scheduler has not taken in yet (SchedulerGauge.TAKEN)."""

from __future__ import annotations

from collections.abc import Sequence

from actors.control import ActorState, ControlBlock
from actors.gauges import SchedulerGauge
from actors.pipeline import ServeConfig, scheduler_engines, scheduler_names
from runtime.scheduler.router import Router


class Replicas:
    def __init__(self, control: ControlBlock, serve: ServeConfig) -> None:
        self.control = control
        self.schedulers = scheduler_names(serve)
        # each replica's slots in the control block, its scheduler's first
        self._member_slots = [
            [control.index(name), *(control.index(engine) for engine in scheduler_engines(serve, replica))]
            for replica, name in enumerate(self.schedulers)
        ]
        self._policy = serve.dp_policy
        self.restart()

    def restart(self) -> None:
        """A new epoch: every scheduler starts empty, with an empty prefix cache."""
        self._router = Router(len(self.schedulers), self._policy)
        self._sent = [0] * len(self.schedulers)
        self._taken_before = [self._gauge(r, SchedulerGauge.TAKEN) for r in range(len(self.schedulers))]

    def place(self, prompt: Sequence[int], salt: str | None = None) -> str:
        """The scheduler that takes a request with this prompt and cache salt."""
        if len(self.schedulers) == 1:
            return self.schedulers[0]
        replica = self._router.place(prompt, self.loads(), self.live(), salt)
        self._sent[replica] += 1
        return self.schedulers[replica]

    def any_live(self) -> str:
        """A scheduler to pass a refusal through."""
        live = self.live()
        return self.schedulers[live.index(True) if any(live) else 0]

    def live(self) -> list[bool]:
        states = self.control.slots["state"]
        return [all(states[i] == ActorState.READY for i in members) for members in self._member_slots]

    def loads(self) -> list[int]:
        loads = []
        for replica in range(len(self.schedulers)):
            taken = self._gauge(replica, SchedulerGauge.TAKEN) - self._taken_before[replica]
            queued = self._gauge(replica, SchedulerGauge.RUNNING) + self._gauge(replica, SchedulerGauge.WAITING)
            loads.append(queued + max(0, self._sent[replica] - taken))
        return loads

    def _gauge(self, replica: int, gauge: SchedulerGauge) -> int:
        return int(self.control.slots[self._member_slots[replica][0]]["gauges"][gauge])
