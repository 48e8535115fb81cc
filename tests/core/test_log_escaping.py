"""Header values from outside cannot forge log lines: a hostile `tracestate` (CR/LF, escape sequences, 10 kB) in a
record's headers, a header value in a kafold log field and a third-party message quoting one all come out as one
printable, bounded line each, in the console and the JSON format alike."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from kafold import logs, tracing

TRACEPARENT = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
HOSTILE = "k=v\r\nFORGED level=error event=daemon.compromised\x1b[2J" + "x" * 10_000


@pytest.fixture(params=["console", "json"])
def log_file(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "kafold.log"
    root = logging.getLogger()
    level, handlers = root.level, root.handlers[:]
    logs.configure("info", request.param, str(path))
    try:
        yield path
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
        structlog.reset_defaults()


def _lines(path: Path) -> list[str]:
    for h in logging.getLogger().handlers:
        h.flush()
    return path.read_text(encoding="utf-8").split("\n")[:-1]


def test_a_hostile_tracestate_in_record_headers_never_reaches_the_log_verbatim(log_file: Path) -> None:
    for state in (HOSTILE[:500], HOSTILE):
        sc = tracing.span_context([("traceparent", TRACEPARENT), ("tracestate", state.encode("latin-1"))])
        assert sc is not None and sc.trace_id == 0x0AF7651916CD43DD8448EB211C80319C  # the trace itself is kept
    logging.getLogger("opentelemetry.trace.span").warning("Member doesn't match %s", HOSTILE)
    logs.get("kafold.test").warning("test.header_seen", value=HOSTILE[:300])
    lines = _lines(log_file)
    assert not any(line.lstrip().startswith("FORGED") for line in lines), [line[:80] for line in lines]
    assert all("\r" not in line and "\x1b[2J" not in line for line in lines)  # the console's own colours aside
    assert all(len(line) < 3000 for line in lines), [len(line) for line in lines]
    # the third-party warning and kafold's own; the tracestates were dropped before the SDK could warn
    assert len(lines) == 2, [line[:80] for line in lines]


def test_printable_escapes_controls_and_bounds_the_length() -> None:
    assert logs.printable("a\r\nb\x00\u2028") == "a\\x0d\\x0ab\\x00\\u2028"
    assert logs.printable("y" * 300, 10) == "yyyyyyyyyy...(+290 chars)"
    assert logs.printable(b"\xff\n") == "\ufffd\\x0a"
