"""The gauges' layouts: which of an actor's 16 gauge slots (actors.control.SLOT) holds what, one
definition per actor kind. Other processes read them: the supervisor, api workers, the scheduler."""

from __future__ import annotations

from enum import IntEnum

# any actor with a watchdog (ActorSpec.watchdog_s) stamps its progress here: a CLOCK_MONOTONIC time
# while it has work, 0 when idle
PROGRESS_GAUGE = 1


class ApiGauge(IntEnum):
    LIVE = 0  # live requests: summed across workers for admission, awaited on drain


class TokenizerGauge(IntEnum):
    TOKEN_BYTES = 0  # the longest token in bytes: api workers refuse longer prompts unencoded


class EngineGauge(IntEnum):
    POOL = 0  # the KV pool in pages: the scheduler's page table is sized from it
    HOST_POOL = 2  # the host KV tier in pages (--enable-hierarchical-cache), sized with the pool
    PROGRESS = PROGRESS_GAUGE
    LAUNCHED = 3  # the last step it began to launch: a crash blames only a step its engine ran (Scheduler.after_crash)


class SchedulerGauge(IntEnum):
    """Shown by name (lower case) in /server_info."""

    USED_PAGES = 0
    TOTAL_PAGES = 1
    RUNNING = 2
    WAITING = 3
    CACHED_PAGES = 4
    TAKEN = 5  # requests taken in since the process started: the router counts those still on their way
    PINNED_PREFIXES = 6  # warmed prefixes held in the prefix cache (POST /warm_prefixes, --warm-prefixes)
    PINNED_PAGES = 7
    HOST_CACHED_PAGES = 8  # the host KV tier's pages the prefix cache holds (--enable-hierarchical-cache)
    HOST_TOTAL_PAGES = 9
    DEVICE_HIT_TOKENS = 10  # prompt tokens admitted requests found in each tier, since the scheduler's start
    HOST_HIT_TOKENS = 11
    DISK_HIT_TOKENS = 12
    DISK_PAGES = 13  # page files in the disk tier's folder, counted every --stats-interval
