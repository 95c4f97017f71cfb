"""`ringllm router`: one OpenAI-compatible front over many `ringllm serve` workers, by URL.

It is SGLang's router (the sglang-router package: a Rust load balancer with cache-aware routing, health checks,
retries of requests that have not started streaming, circuit breakers, runtime /workers and Prometheus metrics
per worker), started with ringllm's defaults: workers are checked every two seconds, not every minute, and three failed
requests in a row open a worker's circuit, so a dead one leaves the rotation at once and a request sent to it is
tried again elsewhere; a returning one rejoins within seconds. The workers answer what it polls (/health,
/model_info, /server_info, /get_load: api.app). Each worker keeps its own failover."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from runtime.cli_args import CliConfig, flag

POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")


@dataclass(frozen=True)
class RouterConfig(CliConfig):
    """The router's flags, SGLang's spellings; the rest of SGLang's router keeps its own defaults."""

    worker_urls: tuple[str, ...] = field(default=(), metadata=flag("the workers' base URLs (http://HOST:PORT); more join at POST /workers"))
    policy: str = field(
        default="cache_aware",
        metadata=flag(
            "cache_aware: to the worker whose recent prompts share the most of this one's prefix, unless the load is "
            "out of balance; round_robin; power_of_two: the less loaded of two at random; random",
            choices=POLICIES,
        ),
    )
    host: str = field(default="127.0.0.1", metadata=flag("the address the router listens on"))
    port: int = field(default=30000, metadata=flag("the router's HTTP port"))
    cache_threshold: float = field(
        default=0.3, metadata=flag("cache_aware: the least share of a prompt matched at a worker that sends it there")
    )
    balance_abs_threshold: int = field(
        default=64, metadata=flag("cache_aware: the load is out of balance when the busiest worker has this many more requests ...")
    )
    balance_rel_threshold: float = field(default=1.5, metadata=flag("... and this many times the least busy's"))
    health_check_interval_secs: int = field(default=2, metadata=flag("seconds between health checks of each worker"))
    health_failure_threshold: int = field(default=2, metadata=flag("failed checks in a row that take a worker out of rotation"))
    health_success_threshold: int = field(default=1, metadata=flag("passed checks in a row that bring it back"))
    retry_max_retries: int = field(default=5, metadata=flag("times a request that failed before streaming is tried again"))
    retry_initial_backoff_ms: int = field(default=100, metadata=flag("the wait before the first try again; each next waits twice as long"))
    cb_failure_threshold: int = field(
        default=3, metadata=flag("failures in a row that open a worker's circuit: no request goes to it until it half-opens")
    )
    cb_timeout_duration_secs: int = field(default=5, metadata=flag("seconds an open circuit waits before it lets a request try"))
    request_timeout_secs: int = field(default=1800, metadata=flag("seconds a request may take"))
    worker_startup_timeout_secs: int = field(default=600, metadata=flag("seconds to wait for the first workers to be healthy"))
    service_discovery: bool = field(
        default=False, metadata=flag("in Kubernetes: take as workers the pods that --selector picks, as they come and go")
    )
    selector: tuple[str, ...] = field(default=(), metadata=flag("the pods' labels, KEY=VALUE", metavar="KEY=VALUE"))
    service_discovery_port: int = field(default=80, metadata=flag("the port the picked pods serve on"))
    service_discovery_namespace: str | None = field(default=None, metadata=flag("their namespace (default: every one the router may list)"))
    prometheus_port: int | None = field(default=None, metadata=flag("serve the per-worker metrics on this port (default: none)"))
    api_key: str | None = field(default=None, metadata=flag("the key the router sends to workers started with --api-key"))
    log_level: str = field(default="warn", metadata=flag("the router's log level", choices=("debug", "info", "warn", "error")))

    def router_args(self) -> Any:
        """SGLang's RouterArgs for these settings."""
        from sglang_router.router_args import RouterArgs

        settings = {name: getattr(self, name) for name in self.__dataclass_fields__}
        selector = dict(label.split("=", 1) for label in self.selector)
        fixed = {
            "worker_urls": list(self.worker_urls),
            "selector": selector,
            "retry_backoff_multiplier": 2.0,
            "shutdown_grace_period_secs": 5,
        }
        return RouterArgs(**(settings | fixed))


def run(args: argparse.Namespace) -> int:
    """Serves until the router is stopped (SIGINT or SIGTERM)."""
    try:
        from sglang_router.router import Router
    except ImportError as exc:  # a wheel for the machine's platform is on PyPI: pip install sglang-router
        raise SystemExit(f"ringllm router needs SGLang's router: pip install sglang-router ({exc})") from exc
    router_args = RouterConfig.from_cli_args(args).router_args()
    router_args._validate_router_args()
    Router.from_args(router_args).start()
    return 0
