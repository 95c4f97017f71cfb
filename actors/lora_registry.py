"""The LoRA adapters a running server serves, by name, in a file beside its shared memory: written by the api
worker that loads or unloads one, read by every api worker (which names a request may ask for, /v1/models) and by
an engine that starts again (what it loads beyond --lora-paths). The supervisor's sweep removes it with the
server's segments. No file: the adapters of --lora-paths."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import orjson

from transport.segment import SHM_DIR, server_prefix


def registry_path(server: str) -> Path:
    return SHM_DIR / (server_prefix(server) + "lora-adapters.json")


def read_registry(server: str, started_with: tuple[tuple[str, str], ...]) -> dict[str, str]:
    """name -> path of each adapter served now."""
    try:
        return orjson.loads(registry_path(server).read_bytes())
    except FileNotFoundError:
        return dict(started_with)


def update_registry(server: str, started_with: tuple[tuple[str, str], ...], name: str, path: str | None) -> dict[str, str]:
    """Record a load of `name` from `path` (None: its unload), and return what is served after it. Under a lock, so
    that two api workers' changes at once both stay; written whole, so that a reader sees the old file or the new."""
    registry = registry_path(server)
    with open(registry.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        served = read_registry(server, started_with)
        if path is None:
            served.pop(name, None)
        else:
            served[name] = path
        partial = registry.with_name(f"{registry.name}.{os.getpid()}")
        partial.write_bytes(orjson.dumps(served))
        os.replace(partial, registry)
    return served
