"""The serving topology: api workers → tokenizer → scheduler ⇄ engine → detokenizer → api workers,
and beside each engine its keeper, which holds the KV pool (actors.keeper).

Under tensor parallelism an engine is N rank processes (one group): the scheduler sends each plan
to every rank, and rank 0 answers. Under data parallelism there are M replicas, each a scheduler
and its engine (group), with its own KV pool and prefix cache; the tokenizer places each request on
one (runtime.scheduler.router) and every replica's tokens meet at the one detokenizer. Under --pd
the one scheduler plans two engines, each with its keeper: a prefill one and a decode one
(runtime.scheduler.disaggregated). Each KV pool, with its engine (group) and keeper, is a unit.
Where a group spans machines, each node runs its share of it (node_ranks)."""

from __future__ import annotations

import argparse
import dataclasses
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from actors.gauges import ApiGauge
from actors.topology import DEFAULT_PORT, ActorSpec, Edge, ShadowSpec, Topology
from api.chat_output import (
    DEFAULT_TOOL_CALL_PARSER,
    HARMONY,
    REASONING_PARSER_ALIASES,
    REASONING_PARSERS,
    TOOL_CALL_PARSER_ALIASES,
    TOOL_CALL_PARSERS,
)
from runtime.cli_args import CliConfig, flag, split_address
from runtime.config import EngineConfig
from runtime.scheduler.disaggregated import ROLES
from runtime.scheduler.router import POLICIES
from transport import env

# AutoTokenizer (and torch with it), and what a model's config class imports when AutoTokenizer reads it:
# transformers' image and video utilities and, through them, accelerate and sympy. A transformers without
# that module (before 5) leaves the forkserver to skip it.
TOKENIZER_MODULES = ("transformers.models.auto.tokenization_auto", "transformers.utils.type_validators")
# what a shadow's flags may not set: it listens on 127.0.0.1, on a port of its own, without keys, on one node
SHADOW_REFUSED = ("--port", "--host", "--api-key", "--shadow-engine", "--nnodes", "--node-rank", "--dist-init-addr", "--nccl-init-addr")


def _prefixes(text: str) -> tuple[str | list[int], ...]:
    """--warm-prefixes: a JSON list given inline, or the name of a file that holds one."""
    return tuple(orjson.loads(text if text.lstrip().startswith("[") else Path(text).read_bytes()))


@dataclass(frozen=True)
class ServeConfig(CliConfig):
    """Everything `ringllm serve` runs: its own flags here, the engine's in `engine`. Every actor gets it."""

    model_dir: str = field(metadata=flag("a local Hugging Face folder or a hub id (default: SmolLM2-135M-Instruct)", ("--model",)))
    served_model_name: str = field(metadata=flag("the name clients pass as 'model' (default: --model)"))
    host: str = field(default="127.0.0.1", metadata=flag("the address the api workers listen on"))
    port: int = field(default=DEFAULT_PORT, metadata=flag("the HTTP port; it also names the server's segments (`ringllm status`)"))
    api_workers: int = field(default=1, metadata=flag("HTTP worker processes sharing the port"))
    max_queued_requests: int = field(default=1024, metadata=flag("beyond running + queued, new requests get a 503 at once"))
    request_timeout: float | None = field(default=None, metadata=flag("seconds a request may take, queueing included (default: none)"))
    body_timeout: float = field(
        default=30.0,
        metadata=flag(
            "seconds a client may take to send a request's body; a body still incomplete then gets a 408 and its connection is closed"
        ),
    )
    header_timeout: float = field(
        default=10.0,
        metadata=flag(
            "seconds a connection may take to send a request's headers, from its start or from its last response; it is "
            "closed then (an idle keep-alive connection too)"
        ),
    )
    write_timeout: float = field(
        default=30.0, metadata=flag("seconds a stream may wait for its client to read; a client that does not is aborted")
    )
    max_stream_backlog: int = field(
        default=4096,
        metadata=flag("tokens a stream may hold waiting for its client (all its choices); a client that falls further behind is aborted"),
    )
    max_connections: int = field(
        default=4096,
        metadata=flag("open connections each api worker keeps (below its file-descriptor limit); beyond, a 503 and the socket closed"),
    )
    max_client_connections: int = field(
        default=1024, metadata=flag("open connections each api worker keeps from one client address; beyond, a 503 and the socket closed")
    )
    max_request_sequences: int = field(default=256, metadata=flag("completions one request may ask for (prompts x n); more get a 400"))
    client_share: float = field(
        default=0.5,
        metadata=flag(
            "once half the running and queued places are taken, the share of them one client (its API key, else its address) "
            "may hold; beyond it, a 503 (each api worker counts its own share)"
        ),
    )
    allowed_hosts: tuple[str, ...] = field(
        default=(),
        metadata=flag(
            "a Host header value served without --api-key besides IP addresses and localhost, a guard against DNS rebinding "
            "(repeat for several; '*' serves any)",
            ("--allowed-host",),
            metavar="HOST",
        ),
    )
    cache_salt_by_key: bool = field(
        default=False, metadata=flag("keep each API key's prefix-cache entries apart from every other key's (tenants never share a prefix)")
    )
    watchdog_timeout: float = field(
        default=60.0,
        metadata=flag(
            "seconds an engine step may make no progress before the engine is restarted: the watchdog can only restart it sooner "
            "than --hang-timeout, never later"
        ),
    )
    stats_interval: float = field(
        default=10.0,
        metadata=flag(
            "seconds between each scheduler's stats line and count of the disk KV tier's pages, and, for a mixture-of-experts "
            "model, each engine's expert-load report (/server_info, ringllm:moe_expert_load_imbalance)"
        ),
    )
    data_parallel_size: int = field(
        default=1,
        metadata=flag(
            "replicas, each a scheduler and engine(s) with its own KV cache, on --dp x --tp devices "
            "(scheduler0.., engine0.. or engine0.0.. in `ringllm status`)",
            ("--dp", "--data-parallel-size"),
            metavar="N",
        ),
    )
    dp_policy: str = field(
        default="cache_aware",
        metadata=flag(
            "how the tokenizer places requests on replicas: cache_aware (the replica holding the longest prefix, unless it is "
            "busier than the least loaded by a margin), round_robin, least_load (default: %(default)s)",
            choices=POLICIES,
        ),
    )
    nnodes: int = field(
        default=1, metadata=flag("machines one tensor-parallel group spans: --tp counts the ranks of them all, --tp / --nnodes on each")
    )
    node_rank: int = field(
        default=0,
        metadata=flag(
            "this machine's place among --nnodes: node 0 runs the whole pipeline and the API, every other node its engine ranks only"
        ),
    )
    dist_init_addr: str | None = field(
        default=None,
        metadata=flag(
            "HOST:PORT on node 0 where the nodes meet (a TCP store node 0's supervisor serves); needed with --nnodes above 1",
            ("--dist-init-addr", "--nccl-init-addr"),
        ),
    )
    warm_spares: bool = field(
        default=True,
        metadata=flag("keep a set-up tokenizer, scheduler, detokenizer (and CPU engine) asleep to replace one that dies", negatable=True),
    )
    api_keys: tuple[str, ...] = field(
        default=(),
        repr=False,
        metadata=flag(
            "a key clients must send as 'Authorization: Bearer KEY' to every route but /health, /health/live, /metrics and "
            f"/version (repeat for several; {env.API_KEY} adds one; none: the API is open to all)",
            ("--api-key",),
            metavar="KEY",
        ),
    )
    tool_call_parser: str = field(
        default=DEFAULT_TOOL_CALL_PARSER,
        metadata=flag(
            "how the model writes tool calls: hermes and qwen3 <tool_call> tags (Qwen2.5, Qwen3, Hermes), llama3_json (Llama 3), "
            "gpt-oss (GPT-OSS's harmony, also spelled openai; it sets --reasoning-parser gpt-oss too)",
            choices=(*TOOL_CALL_PARSERS, *TOOL_CALL_PARSER_ALIASES),
        ),
    )
    reasoning_parser: str | None = field(
        default=None,
        metadata=flag(
            "set reasoning apart as reasoning_content: <think>...</think> (qwen3, deepseek_r1), or harmony's analysis channel "
            "(gpt-oss, also spelled openai_gptoss; it sets --tool-call-parser gpt-oss too)",
            choices=(*REASONING_PARSERS, *REASONING_PARSER_ALIASES),
        ),
    )
    warm_prefixes: tuple[str | list[int], ...] = field(
        default=(),
        metadata=flag(
            "a JSON list of prefixes (texts or token-id lists), or a file that holds one, prefilled at start-up and pinned in "
            "the prefix cache, as POST /warm_prefixes does",
            metavar="FILE",
            parse=_prefixes,
            show=lambda prefixes: orjson.dumps(prefixes).decode(),
        ),
    )
    shadow_engine: str | None = field(
        default=None,
        metadata=flag(
            "run a second server beside this one, with this one's flags and FLAGS on top (one string, split as a shell "
            "would; --shadow-engine=--flag when it is one word), and send it a sample of the answered requests again: "
            "each divergence from the live answer is logged, nothing it answers is served (docs/golden.md)",
            metavar="FLAGS",
        ),
    )
    shadow_fraction: float = field(
        default=0.1,
        metadata=flag("the share of its answered requests each api worker sends to the --shadow-engine server, from 0 to 1", metavar="F"),
    )
    # `ringllm serve` turns it off on CPU where /dev/shm has no room for the pool
    shared_kv_pool: bool = field(
        default=True,
        metadata=flag("hold each KV pool in a keeper process, so that an engine's restart keeps it (pool_outlives_engine)", negatable=True),
    )
    engine: EngineConfig = field(default_factory=EngineConfig)

    def __post_init__(self) -> None:
        self._name_parsers()
        if self.api_workers < 1:
            raise ValueError(f"api_workers must be at least 1, not {self.api_workers}")
        if not self.body_timeout > 0:
            raise ValueError(f"body_timeout must be more than 0 seconds, not {self.body_timeout}")
        for name in ("header_timeout", "write_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be more than 0 seconds, not {getattr(self, name)}")
        for name in ("max_stream_backlog", "max_connections", "max_client_connections", "max_request_sequences"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, not {getattr(self, name)}")
        if self.cache_salt_by_key and not self.api_keys:
            raise ValueError("cache_salt_by_key needs API keys (--api-key) to tell tenants apart")
        if not 0 < self.client_share <= 1:
            raise ValueError(f"client_share must be more than 0 and at most 1, not {self.client_share}")
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be at least 1, not {self.data_parallel_size}")
        if not self.stats_interval > 0:
            raise ValueError(f"stats_interval must be more than 0 seconds, not {self.stats_interval}")
        self._check_nodes()
        self._check_shadow()
        if self.dp_policy not in POLICIES:
            raise ValueError(f"dp_policy must be one of {', '.join(POLICIES)}, not {self.dp_policy!r}")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, not {self.tool_call_parser!r}")
        if not all(p and (isinstance(p, str) or isinstance(p, list) and all(type(t) is int for t in p)) for p in self.warm_prefixes):
            raise ValueError("warm_prefixes must be a list of non-empty texts or token-id lists")
        if self.engine.standby_engine and not (self.warm_spares and pool_outlives_engine(self) and self.engine.device != "cpu"):
            raise ValueError("standby_engine needs a GPU, one rank, warm spares and a kept KV pool (a CPU engine has a spare anyway)")
        if self.engine.pd and (self.data_parallel_size > 1 or not self.shared_kv_pool):
            raise ValueError(
                "prefill-decode disaggregation runs one replica, over kept KV pools (the decode engine maps the prefill one's)"
            )
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, not {self.reasoning_parser!r}")

    def _check_nodes(self) -> None:
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be from 0 to nnodes - 1 ({self.nnodes - 1}), not {self.node_rank}")
        if self.dist_init_addr is not None:
            split_address(self.dist_init_addr)
        if self.nnodes == 1:
            return
        if self.dist_init_addr is None:
            raise ValueError("nnodes above 1 needs dist_init_addr (--dist-init-addr HOST:PORT on node 0)")
        if self.engine.tensor_parallel_size % self.nnodes:
            raise ValueError(f"tensor_parallel_size {self.engine.tensor_parallel_size} does not split over {self.nnodes} nodes")
        if self.data_parallel_size > 1:
            raise ValueError("replicas do not span nodes: run one server per replica behind `ringllm router`")
        if self.engine.pd:
            raise ValueError("prefill-decode disaggregation runs on one node")

    def _check_shadow(self) -> None:
        if not 0 <= self.shadow_fraction <= 1:
            raise ValueError(f"shadow_fraction must be from 0 to 1, not {self.shadow_fraction}")
        if self.shadow_engine is None:
            return
        if self.nnodes > 1:
            raise ValueError("a shadow engine runs beside a server of one node")
        try:
            words = shlex.split(self.shadow_engine)
        except ValueError as exc:
            raise ValueError(f"shadow_engine is not a command line: {exc}") from None
        for word in words:  # a flag's abbreviation too, which argparse would take for it
            name = word.partition("=")[0]
            if name.startswith("--") and len(name) > 2 and any(refused.startswith(name) for refused in SHADOW_REFUSED):
                raise ValueError(
                    f"shadow_engine may not set {name}: the shadow listens on 127.0.0.1, on a port of its own, without keys, on one node"
                )

    def _name_parsers(self) -> None:
        """Each parser by its one name (vLLM's spellings are read as SGLang's). Harmony is one format whose reasoning
        and calls are read together, so gpt-oss for either parser names it for both; beside another parser it is
        refused (the tool-call parser's default, hermes, gives way to it)."""
        for name, aliases in (("reasoning_parser", REASONING_PARSER_ALIASES), ("tool_call_parser", TOOL_CALL_PARSER_ALIASES)):
            object.__setattr__(self, name, aliases.get(getattr(self, name), getattr(self, name)))
        if HARMONY not in (self.reasoning_parser, self.tool_call_parser):
            return
        if self.reasoning_parser not in (None, HARMONY) or self.tool_call_parser not in (DEFAULT_TOOL_CALL_PARSER, HARMONY):
            raise ValueError(
                f"the gpt-oss parsers read reasoning and tool calls together: reasoning_parser {self.reasoning_parser!r} and "
                f"tool_call_parser {self.tool_call_parser!r} cannot be mixed (give gpt-oss for either, or both)"
            )
        object.__setattr__(self, "reasoning_parser", HARMONY)
        object.__setattr__(self, "tool_call_parser", HARMONY)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, **given: Any) -> ServeConfig:
        """As every config's, and what a flag alone cannot say: --model resolved to a folder (a hub id fetched once,
        after the engine's flags are checked, so a refused size costs no download), the served name --model's
        unless given, and RINGLLM_API_KEY's key beside those of --api-key."""
        from runtime.models.source import NAME, resolve_model_dir

        engine = EngineConfig.from_cli_args(args)
        resolved = {
            "engine": engine,
            "model_dir": str(resolve_model_dir(args.model_dir)),
            "served_model_name": args.served_model_name or args.model_dir or NAME,
            "api_keys": tuple(args.api_keys or ()) + ((key,) if (key := env.api_key()) else ()),
        }
        return super().from_cli_args(args, **(resolved | given))

    def record(self) -> dict[str, Any]:
        """Every setting as the server runs it, the engine's nested, for /server_info and so for a benchmark's
        record; the API keys are shown as redacted."""
        return dataclasses.asdict(self) | {"api_keys": ["<redacted>"] * len(self.api_keys)}


def api_worker_names(config: ServeConfig) -> list[str]:
    return [f"api{i}" for i in range(config.api_workers)]


def _numbered(name: str, count: int) -> list[str]:
    """NAME, or NAME0..NAME{count-1}."""
    return [name] if count == 1 else [f"{name}{i}" for i in range(count)]


def scheduler_names(config: ServeConfig) -> list[str]:
    """One per replica."""
    return _numbered("scheduler", config.data_parallel_size)


def engine_units(config: ServeConfig) -> int:
    """The KV pools, each with its engine (group) and keeper: one per replica, or under --pd a prefill one (unit 0)
    and a decode one (unit 1), both planned by the one scheduler."""
    return len(ROLES) if config.engine.pd else config.data_parallel_size


def unit_role(config: ServeConfig, unit: int) -> str | None:
    """Under --pd, what the unit's engine does (runtime.scheduler.disaggregated.ROLES); else None."""
    return ROLES[unit] if config.engine.pd else None


def unit_scheduler(config: ServeConfig, unit: int) -> str:
    """The scheduler that plans the unit's steps."""
    return scheduler_names(config)[0 if config.engine.pd else unit]


def node_ranks(config: ServeConfig) -> range:
    """The tensor-parallel ranks this node runs: all of them on one machine, --tp / --nnodes on each of many."""
    per_node = config.engine.tensor_parallel_size // config.nnodes
    return range(config.node_rank * per_node, (config.node_rank + 1) * per_node)


def engine_names(config: ServeConfig, replica: int = 0) -> list[str]:
    """A unit's engine processes on this node, lowest rank first: engine, engine{rank}, engine{replica} or
    engine{replica}.{rank}; under --pd, prefill or decode."""
    ranks, replicas = config.engine.tensor_parallel_size, config.data_parallel_size
    if (role := unit_role(config, replica)) is not None:
        return [role]
    if replicas == 1:
        return ["engine"] if ranks == 1 else [f"engine{rank}" for rank in node_ranks(config)]
    return [f"engine{replica}"] if ranks == 1 else [f"engine{replica}.{rank}" for rank in node_ranks(config)]


def pool_outlives_engine(config: ServeConfig) -> bool:
    """Whether each replica's KV pool is held by a keeper actor (one rank; a tensor-parallel group's pool dies
    with it): a replacement engine maps it, the scheduler keeps its page table, and no request is recomputed."""
    return config.shared_kv_pool and config.engine.tensor_parallel_size == 1


def keeper_names(config: ServeConfig) -> list[str]:
    """One per unit where the pool outlives its engine."""
    return _numbered("keeper", engine_units(config)) if pool_outlives_engine(config) else []


def scheduler_engines(config: ServeConfig, replica: int) -> list[str]:
    """Every engine process the replica's scheduler plans for (under --pd, both units')."""
    units = range(engine_units(config)) if config.engine.pd else [replica]
    return [name for unit in units for name in engine_names(config, unit)]


def kv_pool_segment(config: ServeConfig, replica: int) -> str | None:
    """The shared-memory segment (after the server's prefix) where a keeper lays a replica's KV pool on CPU;
    None where the pool is not kept, or is device memory."""
    return f"kv{replica}" if pool_outlives_engine(config) and config.engine.device == "cpu" else None


def kv_host_segment(config: ServeConfig, replica: int) -> str | None:
    """The shared-memory segment (after the server's prefix) where a keeper lays a replica's host KV tier; None
    where there is none, or it is not kept (the engine then holds its own)."""
    return f"kvhost{replica}" if pool_outlives_engine(config) and config.engine.hierarchical_cache else None


def keeper_socket(replica: int) -> str:
    """The Unix socket (after the server's prefix, in SHM_DIR) where a replica's keeper answers its engines."""
    return f"keeper{replica}.sock"


def _engines(config: ServeConfig, replica: int) -> list[ActorSpec]:
    """A replica's engine ranks on this node."""
    ranks, outlives, keepers = config.engine.tensor_parallel_size, pool_outlives_engine(config), keeper_names(config)
    return [
        ActorSpec(
            name,
            "engine",
            "actors.engine:EngineActor",
            {"serve": config, "replica": replica, "rank": rank, "scheduler": unit_scheduler(config, replica)},
            torch_threads=True,
            # on CPU its own modules too (a cold restart skips importing them); on a GPU torch alone, since a
            # forked child cannot use CUDA that an import (flashinfer's, sgl-kernel's) set up in the forkserver
            preload=("torch", "actors.engine") if config.engine.device == "cpu" else ("torch",),
            watchdog_s=config.watchdog_timeout,
            group=f"engines{replica if engine_units(config) > 1 else ''}" if ranks > 1 else None,
            # on CPU a second copy of the weights is cheap; on a GPU it takes device memory: only on request
            # (ServeConfig allows a standby only over a kept pool: it could not hold a second one)
            spare=config.warm_spares and ranks == 1 and (config.engine.device == "cpu" or config.engine.standby_engine),
            keeps_epoch=outlives,
            needs=keepers[replica] if outlives else None,
        )
        for rank, name in zip(node_ranks(config), engine_names(config, replica))
    ]


def pipeline(config: ServeConfig, shadow: ShadowSpec | None = None) -> Topology:
    """The actors of this node: on node 0 (or the only one) the whole pipeline; on every other node of a group
    spanning machines its engine ranks alone, which rank 0 feeds (actors.relay). `shadow`: the server the
    supervisor runs beside it (actors.shadow), to which the api workers send their sample."""
    meeting = config.dist_init_addr if config.nnodes > 1 else None
    if config.node_rank > 0:
        return Topology(str(config.port), tuple(_engines(config, 0)), meeting=meeting, node_rank=config.node_rank)
    options = {"serve": config}
    workers, schedulers, keepers = api_worker_names(config), scheduler_names(config), keeper_names(config)
    engines: list[ActorSpec] = []
    edges: list[Edge] = [Edge(name, "tokenizer") for name in workers]
    for scheduler in schedulers:
        edges += [Edge("tokenizer", scheduler, 16 << 20), Edge(scheduler, "detokenizer")]
    for unit in range(engine_units(config)):
        engines += (local := _engines(config, unit))
        scheduler = unit_scheduler(config, unit)
        edges += [
            *(Edge(scheduler, spec.name, 16 << 20) for spec in local),  # a plan carries the histories of the slots it opens
            Edge(local[0].name, scheduler),
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
        *(ActorSpec(name, "keeper", "actors.keeper:KeeperActor", {**options, "replica": unit}) for unit, name in enumerate(keepers)),
        *engines,
        ActorSpec("detokenizer", "detokenizer", "actors.detokenizer:DetokenizerActor", options, keeps_epoch=True, **text_actor),
        *(
            # its death ends its own connections; the schedulers drop its requests, nobody else replays
            ActorSpec(
                name,
                "api",
                "actors.api_worker:ApiWorker",
                {**options, "worker": i, "shadow": shadow},
                drain_gauge=ApiGauge.LIVE,
                keeps_epoch=True,
            )
            for i, name in enumerate(workers)
        ),
    )
    kept = tuple(
        name
        for r in range(len(keepers))
        for name in (kv_pool_segment(config, r), kv_host_segment(config, r), keeper_socket(r))
        if name is not None
    )
    return Topology(server=str(config.port), actors=actors, edges=tuple(edges), kept=kept, meeting=meeting, shadow=shadow)
