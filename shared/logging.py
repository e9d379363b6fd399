"""structlog set-up shared by every process: JSON lines in production, readable
console output for `streamfleet serve`."""

from __future__ import annotations

import logging
import sys

import orjson
import structlog

__all__ = ["configure_logging", "get_logger"]


def configure_logging(level: str = "info", fmt: str = "json", process: str | None = None) -> None:
    """Configure structlog (and stdlib logging underneath) once per process.

    Args:
        level: minimum level name.
        fmt: ``"json"`` (orjson-encoded lines) or ``"console"``.
        process: bound into every line as ``process`` (gateway, worker, serve).
    """
    lvl = logging.getLevelName(level.upper())
    if not isinstance(lvl, int):
        lvl = logging.INFO
    processors: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.format_exc_info,
    ]
    if fmt == "console":
        processors.append(structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty()))
        factory: structlog.PrintLoggerFactory | structlog.BytesLoggerFactory = \
            structlog.PrintLoggerFactory(file=sys.stderr)
    else:
        processors.append(structlog.processors.JSONRenderer(serializer=orjson.dumps))
        factory = structlog.BytesLoggerFactory(file=sys.stderr.buffer)
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=factory,
        cache_logger_on_first_use=True,
    )
    logging.basicConfig(level=max(lvl, logging.WARNING), stream=sys.stderr, format="%(name)s %(levelname)s %(message)s")
    if process:
        structlog.contextvars.bind_contextvars(process=process)


def get_logger(name: str | None = None) -> structlog.stdlib.BoundLogger:
    logger: structlog.stdlib.BoundLogger = structlog.get_logger(name)
    return logger
