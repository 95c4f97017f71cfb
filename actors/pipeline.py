"""The serving topology: api workers → tokenizer → scheduler ⇄ engine → detokenizer → api workers.
Under tensor parallelism the engine is N rank processes (engine0..engineN-1, one group): the
scheduler sends each plan to every rank, and rank 0 answers."""

from __future__ import annotations

from dataclasses import dataclass, field

from actors.gauges import ApiGauge
from actors.topology import ActorSpec, Edge, Topology
from runtime.config import EngineConfig

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
    engine: EngineConfig = field(default_factory=EngineConfig)


def api_worker_names(config: ServeConfig) -> list[str]:
    return [f"api{i}" for i in range(config.api_workers)]


def engine_names(config: ServeConfig) -> list[str]:
    """The engine's rank processes, rank 0 first."""
    ranks = config.engine.tensor_parallel_size
    return ["engine"] if ranks == 1 else [f"engine{rank}" for rank in range(ranks)]


def pipeline(config: ServeConfig) -> Topology:
    options = {"serve": config}
    workers, engines = api_worker_names(config), engine_names(config)
    actors = (
        ActorSpec("tokenizer", "tokenizer", "actors.tokenizer:TokenizerActor", options, preload=TOKENIZER_MODULES),
        ActorSpec("scheduler", "scheduler", "actors.scheduler:SchedulerActor", options),
        *(
            ActorSpec(
                name,
                "engine",
                "actors.engine:EngineActor",
                {**options, "rank": rank},
                torch_threads=True,
                preload=("torch",),
                watchdog_s=config.watchdog_timeout,
                group="engines" if len(engines) > 1 else None,
            )
            for rank, name in enumerate(engines)
        ),
        ActorSpec("detokenizer", "detokenizer", "actors.detokenizer:DetokenizerActor", options, preload=TOKENIZER_MODULES),
        *(
            ActorSpec(name, "api", "actors.api_worker:ApiWorker", {**options, "worker": i}, drain_gauge=ApiGauge.LIVE)
            for i, name in enumerate(workers)
        ),
    )
    edges = (
        *(Edge(name, "tokenizer") for name in workers),
        Edge("tokenizer", "scheduler", 16 << 20),
        *(Edge("scheduler", name, 16 << 20) for name in engines),  # a plan carries the histories of the slots it opens
        Edge(engines[0], "scheduler"),
        Edge("scheduler", "detokenizer"),
        *(Edge("detokenizer", name) for name in workers),
    )
    return Topology(server=str(config.port), actors=actors, edges=edges)
