"""The serving topology: api workers → tokenizer → scheduler ⇄ engine → detokenizer → api workers,
and beside each engine its keeper, which holds the KV pool (actors.keeper).

Under tensor parallelism an engine is N rank processes (one group): the scheduler sends each plan
to every rank, and rank 0 answers. Under data parallelism there are M replicas, each a scheduler
and its engine (group), with its own KV pool and prefix cache; the tokenizer places each request on
one (runtime.scheduler.router) and every replica's tokens meet at the one detokenizer."""

from __future__ import annotations

from dataclasses import dataclass, field

from actors.gauges import ApiGauge
from actors.topology import ActorSpec, Edge, Topology
from api.chat_output import REASONING_PARSERS, TOOL_CALL_PARSERS
from runtime.config import EngineConfig
from runtime.scheduler.router import POLICIES

TOKENIZER_MODULES = ("transformers.models.auto.tokenization_auto",)  # AutoTokenizer, and torch with it


@dataclass(frozen=True)
class ServeConfig:
    model_dir: str
    served_model_name: str
    host: str = "127.0.0.1"
    port: int = 8000
    api_workers: int = 1
    max_queued_requests: int = 1024  # beyond running + queued, new requests get a 503 at once
    request_timeout: float | None = None  # seconds a request may take, queueing included
    body_timeout: float = 30.0  # seconds a client may take to send a request's body; then a 408, and the connection closes
    watchdog_timeout: float = 60.0  # an engine step with no progress for this long is a crash
    stats_interval: float = 10.0  # seconds between a scheduler's stats lines, and an MoE engine's expert-load reports
    data_parallel_size: int = 1  # replicas, each a scheduler and an engine (group) of its own
    dp_policy: str = "cache_aware"  # how the tokenizer places requests on replicas (runtime.scheduler.router)
    warm_spares: bool = True  # a ready tokenizer, scheduler, detokenizer (and engine on CPU) wait, idle, to replace one that dies
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # any of them opens the API; none: it is open to all
    tool_call_parser: str = "hermes"  # how the model writes tool calls (api.chat_output)
    reasoning_parser: str | None = None  # how it sets its reasoning apart: qwen3, deepseek_r1, or none
    warm_prefixes: tuple[str | list[int], ...] = ()  # pinned in the prefix cache at start-up (--warm-prefixes FILE)
    # the KV pool held by a keeper actor, outliving its engine (pool_outlives_engine); `ringllm serve` turns it off
    # on CPU where /dev/shm has no room for it
    shared_kv_pool: bool = True
    engine: EngineConfig = field(default_factory=EngineConfig)

    def __post_init__(self) -> None:
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be at least 1, not {self.data_parallel_size}")
        if not self.stats_interval > 0:
            raise ValueError(f"stats_interval must be more than 0 seconds, not {self.stats_interval}")
        if self.dp_policy not in POLICIES:
            raise ValueError(f"dp_policy must be one of {', '.join(POLICIES)}, not {self.dp_policy!r}")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, not {self.tool_call_parser!r}")
        if not all(p and (isinstance(p, str) or isinstance(p, list) and all(type(t) is int for t in p)) for p in self.warm_prefixes):
            raise ValueError("warm_prefixes must be a list of non-empty texts or token-id lists")
        if self.engine.standby_engine and not (self.warm_spares and pool_outlives_engine(self) and self.engine.device != "cpu"):
            raise ValueError("standby_engine needs a GPU, one rank, warm spares and a kept KV pool (a CPU engine has a spare anyway)")
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, not {self.reasoning_parser!r}")


def api_worker_names(config: ServeConfig) -> list[str]:
    return [f"api{i}" for i in range(config.api_workers)]


def _per_replica(config: ServeConfig, name: str) -> list[str]:
    """One per replica: NAME, or NAME0..NAMEM-1."""
    replicas = config.data_parallel_size
    return [name] if replicas == 1 else [f"{name}{r}" for r in range(replicas)]


def scheduler_names(config: ServeConfig) -> list[str]:
    return _per_replica(config, "scheduler")


def engine_names(config: ServeConfig, replica: int = 0) -> list[str]:
    """A replica's engine processes, rank 0 first: engine, engine{rank}, engine{replica} or engine{replica}.{rank}."""
    ranks, replicas = config.engine.tensor_parallel_size, config.data_parallel_size
    if replicas == 1:
        return ["engine"] if ranks == 1 else [f"engine{rank}" for rank in range(ranks)]
    return [f"engine{replica}"] if ranks == 1 else [f"engine{replica}.{rank}" for rank in range(ranks)]


def pool_outlives_engine(config: ServeConfig) -> bool:
    """Whether each replica's KV pool is held by a keeper actor (one rank; a tensor-parallel group's pool dies
    with it): a replacement engine maps it, the scheduler keeps its page table, and no request is recomputed."""
    return config.shared_kv_pool and config.engine.tensor_parallel_size == 1


def keeper_names(config: ServeConfig) -> list[str]:
    """One per replica where the pool outlives its engine."""
    return _per_replica(config, "keeper") if pool_outlives_engine(config) else []


def kv_pool_segment(config: ServeConfig, replica: int) -> str | None:
    """The shared-memory segment (after the server's prefix) where a keeper lays a replica's KV pool on CPU;
    None where the pool is not kept, or is device memory."""
    return f"kv{replica}" if pool_outlives_engine(config) and config.engine.device == "cpu" else None


def keeper_socket(replica: int) -> str:
    """The Unix socket (after the server's prefix, in SHM_DIR) where a replica's keeper answers its engines."""
    return f"keeper{replica}.sock"


def pipeline(config: ServeConfig) -> Topology:
    options = {"serve": config}
    workers, schedulers = api_worker_names(config), scheduler_names(config)
    ranks, outlives, keepers = config.engine.tensor_parallel_size, pool_outlives_engine(config), keeper_names(config)
    engines: list[ActorSpec] = []
    edges: list[Edge] = [Edge(name, "tokenizer") for name in workers]
    for replica, scheduler in enumerate(schedulers):
        names = engine_names(config, replica)
        engines += [
            ActorSpec(
                name,
                "engine",
                "actors.engine:EngineActor",
                {**options, "replica": replica, "rank": rank},
                torch_threads=True,
                preload=("torch",),
                watchdog_s=config.watchdog_timeout,
                group=f"engines{replica if len(schedulers) > 1 else ''}" if ranks > 1 else None,
                # on CPU a second copy of the weights is cheap; on a GPU it takes device memory: only on request
                # (ServeConfig allows a standby only over a kept pool: it could not hold a second one)
                spare=config.warm_spares and ranks == 1 and (config.engine.device == "cpu" or config.engine.standby_engine),
                keeps_epoch=outlives,
                needs=keepers[replica] if outlives else None,
            )
            for rank, name in enumerate(names)
        ]
        edges += [
            Edge("tokenizer", scheduler, 16 << 20),
            *(Edge(scheduler, name, 16 << 20) for name in names),  # a plan carries the histories of the slots it opens
            Edge(names[0], scheduler),
            Edge(scheduler, "detokenizer"),
        ]
    edges += [Edge("detokenizer", name) for name in workers]
    text_actor = {"preload": TOKENIZER_MODULES, "spare": config.warm_spares}  # slow to load a tokenizer, soft state
    actors = (
        # under data parallelism a resubmitted request could land on another replica than its first copy
        ActorSpec("tokenizer", "tokenizer", "actors.tokenizer:TokenizerActor", options, keeps_epoch=len(schedulers) == 1, **text_actor),
        *(
            ActorSpec(name, "scheduler", "actors.scheduler:SchedulerActor", {**options, "replica": r}, spare=config.warm_spares)
            for r, name in enumerate(schedulers)
        ),
        *(ActorSpec(name, "keeper", "actors.keeper:KeeperActor", {**options, "replica": r}) for r, name in enumerate(keepers)),
        *engines,
        ActorSpec("detokenizer", "detokenizer", "actors.detokenizer:DetokenizerActor", options, keeps_epoch=True, **text_actor),
        *(
            # its death ends its own connections; the schedulers drop its requests, nobody else replays
            ActorSpec(name, "api", "actors.api_worker:ApiWorker", {**options, "worker": i}, drain_gauge=ApiGauge.LIVE, keeps_epoch=True)
            for i, name in enumerate(workers)
        ),
    )
    kept = tuple(name for r in range(len(keepers)) for name in (kv_pool_segment(config, r), keeper_socket(r)) if name is not None)
    return Topology(server=str(config.port), actors=actors, edges=tuple(edges), kept=kept)
