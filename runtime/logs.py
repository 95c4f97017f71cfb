"""structlog set-up shared by every process: one JSON object per line on stderr, or aligned
console lines with RINGLLM_LOG_FORMAT=console (`ringllm serve --log-format console`). The
supervisor's environment reaches every actor, so one setting covers the whole server.

Fields that describe the process (actor, pid, epoch) are process-wide, not contextvars: asyncio
copies the context into each task, so an epoch bound in one task would not reach the others.
Request events pass their `rid` explicitly. Timestamps are wall-clock (CLOCK_REALTIME, one clock
for every process of the machine) with microseconds, so `ringllm trace` can order events across
actors.

A log line never raises: once stderr cannot be written (a pipe whose reader died, a closed
terminal), it points at /dev/null. A log call that raised had broken off its caller: a supervisor's
stop, before it killed a hung actor and removed the segments, or an actor, into a crash loop.
"""

from __future__ import annotations

import logging
import os
import sys

import orjson
import structlog

_PROCESS_FIELDS: dict[str, object] = {}


def bind_process(**fields: object) -> None:
    """Fields added to every log line this process writes from now on."""
    _PROCESS_FIELDS.update(fields)


def _add_process_fields(logger, method: str, event: dict) -> dict:
    return {**_PROCESS_FIELDS, **event}


class _Stderr:
    """stderr (its text or its byte stream) for structlog's loggers, turned to /dev/null at its first failed write."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def write(self, data) -> None:
        self._guarded(self._stream.write, data)

    def flush(self) -> None:
        self._guarded(self._stream.flush)

    def _guarded(self, call, *args) -> None:
        try:
            call(*args)
        except OSError:
            sink = os.open(os.devnull, os.O_WRONLY)
            os.dup2(sink, self._stream.fileno())  # what stays buffered, and every later write, go there
            os.close(sink)


LOG_FORMATS = ("json", "console")


def configure_logging(actor: str, level: str | None = None) -> None:
    level = level or os.environ.get("RINGLLM_LOG_LEVEL", "INFO")
    console = os.environ.get("RINGLLM_LOG_FORMAT", "json") == "console"
    structlog.configure(
        processors=[
            _add_process_fields,
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            *([structlog.dev.ConsoleRenderer(colors=False)] if console else [
                structlog.processors.dict_tracebacks,  # log.exception's traceback as a field, not just exc_info=true
                # OPT_NON_STR_KEYS: a field {1: 8} must not kill an actor
                structlog.processors.JSONRenderer(serializer=orjson.dumps, option=orjson.OPT_NON_STR_KEYS)]),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=(structlog.WriteLoggerFactory(_Stderr(sys.stderr)) if console
                        else structlog.BytesLoggerFactory(_Stderr(sys.stderr.buffer))),
        cache_logger_on_first_use=True,
    )
    bind_process(actor=actor, pid=os.getpid())
