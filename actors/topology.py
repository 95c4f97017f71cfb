"""A declared pipeline: which actors run, and which directed rings connect them."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

from transport.segment import server_prefix

DEFAULT_PORT = 8000  # a server's HTTP port, which also names its segments, unless --port says otherwise


@dataclass(frozen=True)
class ActorSpec:
    name: str  # unique in the topology; names its rings and its row in `ringllm status`
    kind: str  # what it is (tokenizer, scheduler, ...), shown by `ringllm status`
    entry: str  # "module:Class" of an actors.base.Actor subclass, imported in the child
    options: dict[str, Any] = field(default_factory=dict)
    torch_threads: bool = False  # only the engine computes with torch; the rest get one thread
    preload: tuple[str, ...] = ()  # modules the forkserver imports once, not at every start (none may touch CUDA)
    # a watchdog: when set, a ready actor whose progress stamp (actors.gauges.PROGRESS_GAUGE, a CLOCK_MONOTONIC
    # time while it has work, 0 when idle) is older than this is killed and restarted; its heartbeat still
    # answers to the supervisor's hang timeout, so a watchdog can only make a restart come sooner
    watchdog_s: float | None = None
    drain_gauge: int | None = None  # gauge counting requests in hand: on SIGTERM, wait for it to reach 0
    # actors that live and die together (a tensor-parallel group: a collective cannot lose a member): one's
    # exit or hang restarts them all, and each start of the group meets at a fresh rendezvous file
    group: str | None = None
    # a warm spare: a second process of this actor that has run its setup and sleeps until the supervisor
    # promotes it in place of one that died or hung (actors whose start-up is slow and state soft)
    spare: bool = False
    # its restart keeps the epoch: the peers keep their requests, and those that watch its row make up for what
    # it held (api workers resubmit what the tokenizer may have held; a scheduler resyncs its detokenizer, or its
    # engine over the KV pool the engine left)
    keeps_epoch: bool = False
    # an actor whose state this one maps (an engine, its keeper's KV pool): that actor's death restarts this one
    # too, and drops its warm spare, before the new epoch starts
    needs: str | None = None

    def load_class(self) -> type:
        module, _, attr = self.entry.partition(":")
        return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    capacity: int = 4 << 20


@dataclass(frozen=True)
class ShadowSpec:
    """A second, complete server the supervisor runs beside this one (actors.shadow): started once every actor is
    ready, stopped with them, never restarted."""

    command: tuple[str, ...]  # its `ringllm serve` command line
    port: int  # on 127.0.0.1; it also names its segments
    log: str  # the file its output goes to

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass(frozen=True)
class Topology:
    server: str  # the port it serves on; every segment name carries it
    actors: tuple[ActorSpec, ...]
    edges: tuple[Edge, ...] = ()
    kept: tuple[str, ...] = ()  # segments (after the prefix) that actors share and that outlive them: unlinked at stop
    # HOST:PORT where the supervisors of the nodes a group spans agree on its starts (actors.nodes); None: one node
    meeting: str | None = None
    node_rank: int = 0  # this node's place among them: node 0 leads
    shadow: ShadowSpec | None = None

    def __post_init__(self) -> None:
        names = [a.name for a in self.actors]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate actor names in {names}")
        for actor in self.actors:
            if actor.needs is not None and actor.needs not in names:
                raise ValueError(f"{actor.name} needs the unknown actor {actor.needs}")
        for edge in self.edges:
            if edge.src not in names or edge.dst not in names:
                raise ValueError(f"edge {edge.src}->{edge.dst} names an unknown actor")

    @property
    def prefix(self) -> str:
        return server_prefix(self.server)

    def ring_name(self, edge: Edge) -> str:
        return f"{self.prefix}{edge.src}-{edge.dst}"

    def control_name(self) -> str:
        return control_segment_name(self.server)


def control_segment_name(server: str) -> str:
    return f"{server_prefix(server)}control"
