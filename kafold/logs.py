"""structlog, configured once by the CLI: JSON when not a TTY, pretty on a TTY; payloads and secrets never logged.

Output that nobody reads any more (`kafold run | tee run.log` after Ctrl-C killed tee, a closed terminal) must not
stop the process: stdout and stderr are wrapped so that a write to a closed pipe goes nowhere instead of raising
BrokenPipeError in whatever code logged, which could be a signal handler on the way to a graceful stop.

What a client sends never reaches the log: aiohttp's server logs a request it cannot parse with an exception whose
message quotes the offending header line (an `Authorization: Bearer <token>` included), so the exceptions it logs
keep their type and stack but not their message (`WithholdMessages`); and a traceback never shows the frames' local
variables (the console renderer's default would, request bytes and secrets included).

A value that came from outside (a header, a message a library formats with one in it, an OpenTelemetry warning
quoting a `tracestate`) cannot forge a log line: every string field has its control characters escaped
(`escape_controls`, CR and LF included, in JSON and console alike), and a third-party message is cut at
MAX_FOREIGN_CHARS; a header value logged on purpose goes through `printable`, which also bounds its length.

A line logged while an OpenTelemetry span is current carries its `trace_id` and `span_id` (`add_trace_context`),
so a log search finds the trace and a trace the lines.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import sys
from collections.abc import Callable, MutableMapping
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
# What `configure` was last given (a task process configures itself the same way): level, format, log file.
_current: tuple[str, str, str | None] = ("info", "auto", None)
_GONE = (errno.EPIPE, errno.EBADF, errno.ECONNRESET)
# Loggers whose exceptions may quote raw request bytes (header lines, a bearer token among them).
REQUEST_LOGGERS = ("aiohttp.server", "aiohttp.web", "aiohttp.access")
MAX_HEADER_CHARS = 256  # a header value logged on purpose: enough to recognise it, not to flood a line
MAX_FOREIGN_CHARS = 2000  # a third-party message: its own text plus whatever it quotes
# C0 and C1 controls, DEL, and the Unicode line and paragraph separators: what a terminal or a log shipper may take
# for the end of a line or an escape sequence.
_CONTROLS = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
# Fields that are several lines by nature and made by kafold's own formatting, not by a client.
_MULTILINE = frozenset({"exception", "stack"})


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(value: object, limit: int = MAX_HEADER_CHARS) -> str:
    """`value` as one printable line for a log: control characters escaped (a line feed as `\\x0a`), cut at `limit`
    characters with the number cut said."""
    text = value.decode("utf-8", "replace") if isinstance(value, (bytes, bytearray)) else str(value)
    cut = len(text) - limit
    if cut > 0:
        text = text[:limit]
    text = _CONTROLS.sub(_escape, text)
    return f"{text}...(+{cut} chars)" if cut > 0 else text


def escape_controls(logger: Any, method: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """structlog processor: control characters escaped in every string field (not the traceback's)."""
    for key, value in event.items():
        if type(value) is str and key not in _MULTILINE and _CONTROLS.search(value):
            event[key] = _CONTROLS.sub(_escape, value)
    return event


def _bound_foreign(logger: Any, method: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """A third-party record's message cut at MAX_FOREIGN_CHARS: it may quote what a client sent."""
    text = event.get("event")
    if type(text) is str and len(text) > MAX_FOREIGN_CHARS:
        event["event"] = f"{text[:MAX_FOREIGN_CHARS]}...(+{len(text) - MAX_FOREIGN_CHARS} chars)"
    return event


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


class Withheld(Exception):
    """Stands in, in a log record, for an exception whose message may quote what a client sent."""


def _withheld(exc: BaseException | None, seen: set[int]) -> BaseException | None:
    """`exc` (and its cause and context) as `Withheld` exceptions naming their type, with the same stacks."""
    if exc is None or id(exc) in seen:
        return None
    seen.add(id(exc))
    stand_in = Withheld(f"{type(exc).__module__}.{type(exc).__qualname__} (message withheld: it may quote the "
                        "request)").with_traceback(exc.__traceback__)
    stand_in.__cause__ = _withheld(exc.__cause__, seen)
    stand_in.__context__ = _withheld(exc.__context__, seen)
    stand_in.__suppress_context__ = exc.__suppress_context__
    return stand_in


class WithholdMessages(logging.Filter):
    """Replaces a record's exception by `Withheld` stand-ins: type and stack stay, the message goes."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None:
            stand_in = _withheld(record.exc_info[1], set())
            assert stand_in is not None
            tb: TracebackType | None = stand_in.__traceback__
            record.exc_info = (Withheld, stand_in, tb)
            record.exc_text = None
        return True


def withhold_request_bytes() -> None:
    """Install `WithholdMessages` on REQUEST_LOGGERS (once)."""
    for name in REQUEST_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, WithholdMessages) for f in logger.filters):
            logger.addFilter(WithholdMessages())


def add_trace_context(logger: Any, method: str, event_dict: Any) -> Any:
    """structlog processor: the current span's `trace_id` and `span_id` (W3C hex), when a valid one is current.

    OpenTelemetry is the optional extra `tracing`; it is looked up in sys.modules, never imported here: if nothing
    imported it, no span can be current, and a process that does not trace pays one dict lookup per line."""
    trace = sys.modules.get("opentelemetry.trace")
    current = getattr(trace, "get_current_span", None)  # None also while another thread is importing the module
    if current is None:
        return event_dict
    ctx = current().get_span_context()
    if ctx.is_valid:
        event_dict.setdefault("trace_id", format(ctx.trace_id, "032x"))
        event_dict.setdefault("span_id", format(ctx.span_id, "016x"))
    return event_dict


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
    withhold_request_bytes()
    out: Any = sys.stderr
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        out = Tolerant(open(path, "a", buffering=1, encoding="utf-8"))  # noqa: SIM115 - the process's log file
    pretty = fmt == "console" or (fmt == "auto" and path is None and sys.stderr.isatty())
    shared: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        add_trace_context,
        escape_controls,
    ]
    renderer: structlog.types.Processor = (  # a plain traceback: the default shows each frame's local variables
        structlog.dev.ConsoleRenderer(exception_formatter=structlog.dev.plain_traceback) if pretty
        else structlog.processors.JSONRenderer()
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
        foreign_pre_chain=[_bound_foreign, *shared,
                           structlog.stdlib.add_logger_name]))  # whose line: faust, kafold.librdkafka
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(max(_LEVELS[level], logging.WARNING))  # third-party chatter only from warnings up


def current() -> tuple[str, str, str | None]:
    """(level, format, log file or None) as last configured."""
    return _current


def get(name: str) -> structlog.stdlib.BoundLogger:
    return structlog.get_logger(name)
