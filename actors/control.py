"""The supervisor's table in shared memory: the current epoch and one row per actor.

Actors write their own heartbeat and state (a warm spare, its pid once set up); the supervisor writes
everything else. Each field is an aligned 8- or 4-byte word, so a concurrent reader (`ringllm
status`) never sees it torn.
Heartbeats are CLOCK_MONOTONIC seconds, one clock for every process on the machine.
"""

from __future__ import annotations

import os
import signal
import time
from enum import IntEnum

import numpy as np
import orjson

from actors.topology import Topology, control_segment_name
from transport.segment import Segment

MAGIC = 0x52494E4743544C31  # "RINGCTL1"
_NAMES_BYTES = 16 << 10
_HEADER = np.dtype(
    [("magic", "<u8"), ("supervisor_pid", "<i8"), ("epoch", "<u8"), ("names_len", "<u8"), ("draining", "<u8"), ("shadow", "<u8")]
)
SLOT = np.dtype(
    [
        ("pid", "<i8"),
        ("epoch", "<u8"),
        ("restarts", "<u8"),
        ("heartbeat", "<f8"),
        ("state", "<u4"),
        ("stop", "<u4"),
        ("gauges", "<f8", (16,)),  # the actor's own numbers (the scheduler's page use, queue lengths)
        ("spare_pid", "<i8"),  # its warm spare: the pid once set up (written by the spare), SPARE_STARTING, or 0
        ("spare_process", "<i8"),  # its warm spare's pid from its start until it dies or is promoted, else 0
        ("exitcode", "<i8"),  # how its last process ended (multiprocessing's: -N for signal N), written before `restarts` moves
    ]
)
SPARE_STARTING = -1


def crashed(exitcode: int) -> bool:
    """Did an actor's process die of its own fault (an exception, a segfault, an abort), not of a kill from outside:
    SIGKILL (a kill, the OOM killer, or the supervisor's own for a hang) or SIGTERM?"""
    return exitcode not in (0, -signal.SIGKILL, -signal.SIGTERM)


STATUS_KEYS = ("name", "kind", "pid", "state", "epoch", "restarts", "heartbeat_age_s", "spare_pid", "spare_state")


class ActorState(IntEnum):
    STARTING = 0
    READY = 1
    STOPPING = 2
    DOWN = 3  # exited (or its group is going down), set by the supervisor until the restart


class ShadowState(IntEnum):
    """The shadow server's (actors.shadow), as the supervisor that runs it sees it."""

    NONE = 0  # the server runs none
    STARTING = 1
    READY = 2  # every actor of it is ready: api workers mirror requests to it
    FAILED = 3  # it exited while this server runs; it is not started again


class ControlBlock:
    def __init__(self, segment: Segment) -> None:
        self.segment = segment
        self._header = np.ndarray((), _HEADER, buffer=segment.buf)
        if int(self._header["magic"]) != MAGIC:
            raise ValueError(f"{segment.name} is not a ringllm control segment")
        names_len = int(self._header["names_len"])
        names_at = _HEADER.itemsize
        self.actors: list[tuple[str, str]] = [tuple(a) for a in orjson.loads(segment.buf[names_at : names_at + names_len])]
        self.slots = np.ndarray((len(self.actors),), SLOT, buffer=segment.buf, offset=names_at + _NAMES_BYTES)

    @classmethod
    def create(cls, topology: Topology) -> ControlBlock:
        names = orjson.dumps([(a.name, a.kind) for a in topology.actors])
        if len(names) > _NAMES_BYTES:
            raise ValueError("topology too large for the control segment")
        size = _HEADER.itemsize + _NAMES_BYTES + SLOT.itemsize * len(topology.actors)
        segment = Segment.create(topology.control_name(), size)
        header = np.ndarray((), _HEADER, buffer=segment.buf)
        header["supervisor_pid"], header["epoch"], header["names_len"] = os.getpid(), 1, len(names)
        segment.buf[_HEADER.itemsize : _HEADER.itemsize + len(names)] = names
        header["magic"] = MAGIC  # last: an attacher that sees the magic sees the rest
        del header
        return cls(segment)

    @classmethod
    def attach(cls, server: str) -> ControlBlock:
        return cls(Segment.attach(control_segment_name(server)))

    @property
    def epoch(self) -> int:
        return int(self._header["epoch"])

    @epoch.setter
    def epoch(self, value: int) -> None:
        self._header["epoch"] = value

    @property
    def draining(self) -> bool:
        """Set by the supervisor on SIGTERM: api workers refuse new requests."""
        return bool(self._header["draining"])

    @draining.setter
    def draining(self, value: bool) -> None:
        self._header["draining"] = int(value)

    @property
    def shadow(self) -> ShadowState:
        """Set by the supervisor: the shadow server's state."""
        return ShadowState(int(self._header["shadow"]))

    @shadow.setter
    def shadow(self, value: ShadowState) -> None:
        self._header["shadow"] = int(value)

    @property
    def supervisor_pid(self) -> int:
        return int(self._header["supervisor_pid"])

    def index(self, name: str) -> int:
        return [n for n, _ in self.actors].index(name)

    def status(self) -> list[dict]:
        """One row per actor, with exactly STATUS_KEYS. `spare_state`: None without a warm spare, "waiting" until
        its start is due, "starting" while it sets up, "ready" once it stands by."""
        now = time.monotonic()
        rows = []
        for (name, kind), slot in zip(self.actors, self.slots):
            beat = float(slot["heartbeat"])
            spare, process = int(slot["spare_pid"]), int(slot["spare_process"])
            if process > 0:
                spare_state = "ready" if spare == process else "starting"
            else:
                spare_state = "waiting" if spare == SPARE_STARTING else None
            rows.append(
                {
                    "name": name,
                    "kind": kind,
                    "pid": int(slot["pid"]),
                    "state": ActorState(int(slot["state"])).name.lower(),
                    "epoch": int(slot["epoch"]),
                    "restarts": int(slot["restarts"]),
                    "heartbeat_age_s": round(now - beat, 3) if beat else None,
                    "spare_pid": process or None,
                    "spare_state": spare_state,
                }
            )
        return rows

    def close(self) -> None:
        del self._header, self.slots
        self.segment.close()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
