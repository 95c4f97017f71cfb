"""structlog set-up for every process: JSON lines on stderr (or RINGLLM_LOG_FORMAT=console). Process fields
are process-wide, not contextvars; logging never raises (an unwritable stderr turns to /dev/null)."""

from __future__ import annotations

import logging
import os
import sys

import orjson
import structlog
from structlog.typing import EventDict, WrappedLogger

from transport import env

_PROCESS_FIELDS: dict[str, object] = {}


def bind_process(**fields: object) -> None:
    """Fields added to every log line this process writes from now on."""
    _PROCESS_FIELDS.update(fields)


def _add_process_fields(logger: WrappedLogger, method: str, event: EventDict) -> EventDict:
    return {**_PROCESS_FIELDS, **event}


class _Stderr:
    """stderr for structlog, turned to /dev/null at its first failed write."""

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
            os.dup2(sink, self._stream.fileno())
            os.close(sink)


LOG_FORMATS = ("json", "console")


def configure_logging(actor: str, level: str | None = None) -> None:
    level = level or env.log_level()
    console = env.log_format() == "console"
    structlog.configure(
        processors=[
            _add_process_fields,
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            *(
                # tracebacks as Python prints them: structlog's rich ones carry every frame's locals (kilobytes a line)
                [structlog.dev.ConsoleRenderer(colors=False, exception_formatter=structlog.dev.plain_traceback)]
                if console
                else [
                    structlog.processors.format_exc_info,
                    # OPT_NON_STR_KEYS: a field {1: 8} must not kill an actor
                    structlog.processors.JSONRenderer(serializer=orjson.dumps, option=orjson.OPT_NON_STR_KEYS),
                ]
            ),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        # structlog only writes to and flushes the file it is given, though its annotations ask for a whole TextIO or BinaryIO
        logger_factory=(
            structlog.WriteLoggerFactory(_Stderr(sys.stderr))  # pyright: ignore[reportArgumentType]
            if console
            else structlog.BytesLoggerFactory(_Stderr(sys.stderr.buffer))  # pyright: ignore[reportArgumentType]
        ),
        cache_logger_on_first_use=True,
    )
    bind_process(actor=actor, pid=os.getpid())
