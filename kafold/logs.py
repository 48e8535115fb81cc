"""structlog, configured once by the CLI: JSON when not a TTY, pretty on a TTY; payloads and secrets never logged.

Output that nobody reads any more (`kafold run | tee run.log` after Ctrl-C killed tee, a closed terminal) must not
stop the process: stdout and stderr are wrapped so that a write to a closed pipe goes nowhere instead of raising
BrokenPipeError in whatever code logged, which could be a signal handler on the way to a graceful stop.
"""

from __future__ import annotations

import errno
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
# What `configure` was last given (a task process configures itself the same way): level, format, log file.
_current: tuple[str, str, str | None] = ("info", "auto", None)
_GONE = (errno.EPIPE, errno.EBADF, errno.ECONNRESET)


class Tolerant:
    """A text stream that, once its file is gone (closed pipe or descriptor), writes to os.devnull instead."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.gone = False

    def _drop(self) -> None:
        if not self.gone:
            self.gone = True
            self.stream = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process

    def write(self, text: str) -> int:
        self._tolerating(self.stream.write, text)
        return len(text)

    def flush(self) -> None:
        self._tolerating(self.stream.flush)

    def _tolerating(self, call: Callable[..., Any], *args: Any) -> None:
        """`call(*args)` on the stream; the stream dropped instead when its file is gone."""
        try:
            call(*args)
        except (BrokenPipeError, ValueError):  # ValueError: the file object was closed
            self._drop()
        except OSError as e:
            if e.errno not in _GONE:
                raise
            self._drop()

    def isatty(self) -> bool:
        return not self.gone and self.stream.isatty()

    def __getattr__(self, name: str) -> Any:  # fileno, encoding, ...: the real stream's
        return getattr(self.stream, name)


def tolerate_closed_output() -> None:
    """Wrap sys.stdout and sys.stderr in `Tolerant` (once)."""
    if not isinstance(sys.stdout, Tolerant):
        sys.stdout = Tolerant(sys.stdout)
    if not isinstance(sys.stderr, Tolerant):
        sys.stderr = Tolerant(sys.stderr)


def configure(level: str = "info", fmt: str = "auto", path: str | None = None) -> None:
    """Configure structlog and stdlib logging (faust, aiokafka) to write one line per event on stderr, or appended
    to the file `path` (JSON unless `fmt` says console)."""
    global _current
    _current = (level, fmt, path)
    tolerate_closed_output()
    out: Any = sys.stderr
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        out = Tolerant(open(path, "a", buffering=1, encoding="utf-8"))  # noqa: SIM115 - the process's log file
    pretty = fmt == "console" or (fmt == "auto" and path is None and sys.stderr.isatty())
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
        logger_factory=structlog.PrintLoggerFactory(file=out),
        cache_logger_on_first_use=False,
    )
    handler = logging.StreamHandler(out)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(processors=[
        structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name]))  # whose line: faust, kafold.librdkafka
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(max(_LEVELS[level], logging.WARNING))  # third-party chatter only from warnings up


def current() -> tuple[str, str, str | None]:
    """(level, format, log file or None) as last configured."""
    return _current


def get(name: str) -> structlog.stdlib.BoundLogger:
    return structlog.get_logger(name)
