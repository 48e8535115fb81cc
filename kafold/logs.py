"""structlog, configured once by the CLI: JSON when not a TTY, pretty on a TTY; payloads and secrets never logged."""

from __future__ import annotations

import logging
import sys

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
_current = ("info", "auto")  # what `configure` was last given (a task process configures itself the same way)


def configure(level: str = "info", fmt: str = "auto") -> None:
    """Configure structlog and stdlib logging (faust, aiokafka) to write one line per event on stderr."""
    global _current
    _current = (level, fmt)
    pretty = fmt == "console" or (fmt == "auto" and sys.stderr.isatty())
    shared: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: structlog.types.Processor = (
        structlog.dev.ConsoleRenderer() if pretty else structlog.processors.JSONRenderer()
    )
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(processors=[
        structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer], foreign_pre_chain=shared))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(max(_LEVELS[level], logging.WARNING))  # third-party chatter only from warnings up


def current() -> tuple[str, str]:
    """(level, format) as last configured."""
    return _current


def get(name: str) -> structlog.stdlib.BoundLogger:
    return structlog.get_logger(name)
