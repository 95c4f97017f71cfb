"""Keeping Python's garbage collector off the serving path.

A full collection walks every tracked object, and an actor that has imported torch or transformers
holds 40k-420k of them (the tokenizer 417k on the H200 host; a full collection of 212k took 40 ms
on the 2-core machine). What start-up built lives as long as the process, so it is frozen out of
every later collection, as vLLM and SGLang do once they are up. Collections that still run long
are logged, so that a stall can be told from a slow kernel. (On the H200, servers that only logged
showed no pause of 10 ms over their benchmark levels: this guards long-running servers, whose
heaps grow until a full collection comes due.)
"""

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
    """Log a `gc_pause` warning for each collection that takes at least `threshold_s`."""
    started = 0.0

    def watch(phase: str, info: dict[str, Any]) -> None:
        nonlocal started
        if phase == "start":
            started = time.perf_counter()
        elif (took := time.perf_counter() - started) >= threshold_s:
            log.warning("gc_pause", generation=info["generation"], ms=round(took * 1e3, 1), collected=info["collected"])

    gc.callbacks.append(watch)
