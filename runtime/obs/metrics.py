"""Prometheus metrics (vLLM's names and buckets), summed across processes by prometheus_client's
multiprocess mode, which reads PROMETHEUS_MULTIPROC_DIR at import: the supervisor sets it first."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.024, 2.048, 4.096)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def prepare_dir(path: Path) -> None:
    """A fresh, empty folder for this server's samples, named in the environment for children."""
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(mode=0o700)
    os.environ[MULTIPROC_ENV] = str(path)


class Metrics:
    def __init__(self) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        model, replica = ("model_name",), ("model_name", "replica")  # replica: a data-parallel replica's scheduler and engine
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", model, buckets=TTFT_BUCKETS)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between tokens of a stream.", model, buckets=ITL_BUCKETS)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.", model, buckets=REQUEST_LATENCY_BUCKETS)
        self.success = Counter("vllm:request_success", "Finished requests.", (*model, "finished_reason"))
        self.queue_time = Histogram(
            "vllm:request_queue_time_seconds", "Time a request waited to be scheduled.", replica, buckets=REQUEST_LATENCY_BUCKETS
        )
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of admitted requests.", replica)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", replica)
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Tokens looked up in the prefix cache.", replica)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Tokens found in the prefix cache.", replica)
        self.tier_hits = Counter(
            "ringllm:hicache_hit_tokens", "Prompt tokens found in each KV tier (device, host, disk) at admission.", (*replica, "tier")
        )
        self.tier_bytes = Counter(
            "ringllm:hicache_moved_bytes",
            "KV bytes moved between tiers (device_to_host, host_to_device, host_to_disk, disk_to_host).",
            ("replica", "direction"),
        )
        self.tier_load = Histogram(
            "ringllm:hicache_load_seconds",
            "Time a step's KV moves between tiers took, ahead of its forward.",
            ("replica",),
            buckets=STEP_BUCKETS,
        )
        self.spec_accept_length = Histogram(
            "ringllm:spec_accept_length",
            "Tokens one speculative verify step gave a request: the draft tokens kept, and the one after them.",
            ("replica",),
            buckets=(1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16),
        )
        self.spec_verify = Histogram(
            "ringllm:spec_verify_seconds", "Device time of a step that verified drafts.", ("replica",), buckets=STEP_BUCKETS
        )
        self.spec_draft = Counter("ringllm:spec_draft_seconds", "Scheduler time spent drafting (NGRAM lookups).", replica)
        self.running = Gauge("vllm:num_requests_running", "Requests in the running batch.", replica, multiprocess_mode="mostrecent")
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", replica, multiprocess_mode="mostrecent")
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "Share of KV pages in use (1 = full).", replica, multiprocess_mode="mostrecent")
        self.batch_size = Histogram("ringllm:batch_size", "Sequences per engine step.", ("replica",), buckets=BATCH_BUCKETS)
        self.step_duration = Histogram(
            "ringllm:step_duration_seconds", "Device time of one engine step.", ("replica",), buckets=STEP_BUCKETS
        )
        self.moe_imbalance = Gauge(
            "ringllm:moe_expert_load_imbalance",
            "A sparse layer's busiest expert's tokens over the mean expert's, last interval.",
            ("replica", "layer"),
            multiprocess_mode="mostrecent",
        )
        self.pd_transfer_bytes = Counter(
            "ringllm:pd_transfer_bytes", "KV bytes the decode engine copied from the prefill engine's pool (--pd).", ()
        )
        self.pd_transfer = Histogram(
            "ringllm:pd_transfer_seconds",
            "Time one handed-over request's KV copy took on the decode engine (--pd).",
            (),
            buckets=STEP_BUCKETS,
        )
        self.pd_requests = Gauge(
            "ringllm:pd_requests", "Requests on each side of --pd, running or waiting.", ("side", "state"), multiprocess_mode="mostrecent"
        )
        self.restarts = Counter("ringllm:actor_restarts", "Actor restarts.", ("actor",))
        self.refused_connections = Counter(
            "ringllm:refused_connections", "Connections refused over --max-connections or --max-client-connections.", ()
        )
        self.slow_client_aborts = Counter(
            "ringllm:slow_client_aborts", "Streams aborted because their client fell behind reading them.", ()
        )
        self.shadow_requests = Counter(
            "ringllm:shadow_requests",
            "Answered requests sampled for the shadow server (--shadow-engine), by outcome: its answer matched, diverged, "
            "failed, or it was skipped (the shadow not ready, or too many under way).",
            ("outcome",),
        )
        self.ring_occupancy = Gauge(
            "ringllm:ring_occupancy", "Share of a ring's bytes written and not yet read.", ("edge",), multiprocess_mode="mostrecent"
        )


_metrics: Metrics | None = None


def metrics() -> Metrics:
    global _metrics
    if _metrics is None:
        _metrics = Metrics()
    return _metrics


def exposition() -> tuple[bytes, str]:
    """The /metrics body of every process of this server, and its content type."""
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest, multiprocess

    if MULTIPROC_ENV not in os.environ:
        from prometheus_client import REGISTRY

        return generate_latest(REGISTRY), CONTENT_TYPE_LATEST
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    return generate_latest(registry), CONTENT_TYPE_LATEST
