"""Log lines carry the current OpenTelemetry span's trace_id and span_id (kafold.logs.add_trace_context)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import TracerProvider

from kafold import logs


@pytest.fixture
def log_file(tmp_path: Path) -> Iterator[Path]:
    before = logs.current()
    path = tmp_path / "kafold.log"
    logs.configure("info", "json", str(path))
    yield path
    logs.configure(*before)


def _lines(path: Path) -> dict[str, dict[str, object]]:
    return {line["event"]: line for line in map(json.loads, path.read_text().splitlines())}


def test_a_line_logged_in_a_span_carries_its_trace_and_span_ids(log_file: Path) -> None:
    tracer = TracerProvider().get_tracer("test")  # a real SDK span, made current the usual way
    with tracer.start_as_current_span("outer"), tracer.start_as_current_span("inner") as span:
        logs.get("test").info("test.inside_span")
        logging.getLogger("thirdparty").warning("stdlib inside span")  # foreign lines go through the same chain
        ctx = span.get_span_context()
    logs.get("test").info("test.outside_span")
    lines = _lines(log_file)
    for event in ("test.inside_span", "stdlib inside span"):
        assert lines[event]["trace_id"] == format(ctx.trace_id, "032x"), lines[event]
        assert lines[event]["span_id"] == format(ctx.span_id, "016x"), lines[event]
    assert "trace_id" not in lines["test.outside_span"] and "span_id" not in lines["test.outside_span"]


def test_logging_does_not_import_opentelemetry() -> None:
    """With tracing off, configuring and logging costs no OpenTelemetry import (it is an optional extra)."""
    code = ("import sys; from kafold import logs; logs.configure('info', 'json'); logs.get('t').info('t.line'); "
            "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "[]", res.stdout
    assert json.loads(res.stderr.strip().splitlines()[-1])["event"] == "t.line"
