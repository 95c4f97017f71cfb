"""Keeping the garbage collector off the serving path: what start-up built (hundreds of thousands of
objects once torch is in) is frozen out of later collections, and long collections are logged."""

from __future__ import annotations

import gc
import time
from typing import Any

import structlog

log = structlog.get_logger()

LONG_PAUSE_S = 0.01


def freeze_startup_heap() -> int:
    """Collect once, then move every surviving object out of the collector's reach; returns how many."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def log_long_pauses(threshold_s: float = LONG_PAUSE_S) -> None:
    started = 0.0

    def watch(phase: str, info: dict[str, Any]) -> None:
        nonlocal started
        if phase == "start":
            started = time.perf_counter()
        elif (took := time.perf_counter() - started) >= threshold_s:
            log.warning("gc_pause", generation=info["generation"], ms=round(took * 1e3, 1), collected=info["collected"])

    gc.callbacks.append(watch)
