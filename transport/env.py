"""Every RINGLLM_* environment variable ringllm reads, each behind one accessor that says what it does.

The module sits in transport, the lowest layer, because the ring's waiting (transport.wakeup) reads one
of them and transport imports nothing above it; every other layer may import it. Each accessor reads
the environment when called, so a test or a parent process that sets a variable is seen by the next
call. Flags of `ringllm serve` are fields of its configs (runtime.cli_args), not variables here."""

from __future__ import annotations

import os
from pathlib import Path

API_KEY = "RINGLLM_API_KEY"
LOG_FORMAT = "RINGLLM_LOG_FORMAT"


def api_key() -> str | None:
    """RINGLLM_API_KEY: one more key `ringllm serve` accepts beside its --api-key flags, kept out of the process list."""
    return os.environ.get(API_KEY) or None


def log_format() -> str:
    """RINGLLM_LOG_FORMAT: json (one object per line, the default) or console; `ringllm serve --log-format` sets it
    for every actor it starts (set_log_format)."""
    return os.environ.get(LOG_FORMAT, "json")


def set_log_format(value: str) -> None:
    """Make `value` the log format of this process and of every process it starts from now on."""
    os.environ[LOG_FORMAT] = value


def log_level() -> str:
    """RINGLLM_LOG_LEVEL: the least level logged (default INFO; DEBUG adds each engine step)."""
    return os.environ.get("RINGLLM_LOG_LEVEL", "INFO")


def cache_root() -> Path:
    """RINGLLM_CACHE: where the default model and the built CPU kernels are kept (default ~/.cache/ringllm)."""
    return Path(os.environ.get("RINGLLM_CACHE", Path.home() / ".cache" / "ringllm"))


def cpu_kernels() -> bool:
    """RINGLLM_CPU_KERNELS: 0 runs the CPU path on torch's ops alone, without building ringllm's kernels."""
    return os.environ.get("RINGLLM_CPU_KERNELS", "1") != "0"


def fault_injection() -> bool:
    """RINGLLM_FAULT_INJECTION: 1 lets a request carry `crash_at`, which makes the engine raise once the request has
    drawn that many tokens: how the tests make a query of death. Off, the api refuses the field."""
    return os.environ.get("RINGLLM_FAULT_INJECTION", "0") == "1"


def pdl() -> bool:
    """RINGLLM_PDL: 0 turns off programmatic dependent launch of the Triton kernels on Hopper GPUs."""
    return os.environ.get("RINGLLM_PDL", "1") != "0"


def spin_us() -> float | None:
    """RINGLLM_SPIN_US: microseconds a waiting ring end spins before it sleeps, instead of the default by core count."""
    value = os.environ.get("RINGLLM_SPIN_US")
    return None if value is None else float(value)
