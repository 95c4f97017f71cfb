"""The LoRA adapters a running server serves, by name, in a file beside its shared memory: written by the api
worker that loads or unloads one, read by every api worker (which names a request may ask for, /v1/models) and by
an engine that starts again (what it loads beyond --lora-paths). The supervisor's sweep removes it with the
server's segments. No file: the adapters of --lora-paths."""

from __future__ import annotations

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


def write_registry(server: str, adapters: dict[str, str]) -> None:
    """All at once: a reader sees the old file or the new one, never half of one."""
    path = registry_path(server)
    partial = path.with_name(f"{path.name}.{os.getpid()}")
    partial.write_bytes(orjson.dumps(adapters))
    os.replace(partial, path)
