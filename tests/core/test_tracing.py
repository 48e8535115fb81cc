"""kafold.tracing: W3C context through Kafka-style header lists; off touches nothing."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kafold import tracing
from kafold.config import TracingConfig


def _provider() -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def test_inject_extract_round_trip_through_kafka_headers() -> None:
    provider, _ = _provider()
    tracer = provider.get_tracer("t")
    with tracer.start_as_current_span("send") as span:
        injected = tracing.inject()
    sent = span.get_span_context()
    headers: list[tuple[str, bytes | None]] = [("kafold-command-id", b"c1"), *injected]
    assert dict(injected)["traceparent"].decode().split("-")[1] == format(sent.trace_id, "032x")
    got = tracing.span_context(headers)
    assert got is not None and got.is_remote
    assert (got.trace_id, got.span_id) == (sent.trace_id, sent.span_id)
    # a child of the extracted context continues the same trace
    with tracer.start_as_current_span("handle", context=tracing.extract(headers)) as child:
        assert child.get_span_context().trace_id == sent.trace_id
        parent = getattr(child, "parent", None)  # the SDK's Span (the API type has no parent)
        assert parent is not None and parent.span_id == sent.span_id
    assert tracing.without_trace(headers) == [("kafold-command-id", b"c1")]


def test_no_context_no_headers() -> None:
    assert tracing.inject(trace.set_span_in_context(trace.INVALID_SPAN)) == []
    assert tracing.span_context([("kafold-command-id", b"c1")]) is None
    assert tracing.span_context(None) is None
    assert tracing.span_context([("traceparent", b"garbage")]) is None


def test_links_are_distinct_contexts_of_a_batch() -> None:
    provider, _ = _provider()
    tracer = provider.get_tracer("t")
    batch: list[Sequence[tuple[str, bytes | None]]] = []
    for _ in range(3):
        with tracer.start_as_current_span("send"):
            batch.append(list(tracing.inject()))
    batch += [batch[0], [], [("other", b"x")]]
    links = tracing.links(batch)
    assert len(links) == 3
    assert {link.context.span_id for link in links} == {tracing.span_context(h).span_id for h in batch[:3]}


def test_application_tracer_prefers_the_given_provider() -> None:
    provider, exporter = _provider()
    tr = tracing.application_tracer(provider)
    assert tr is not None
    with tr.start_as_current_span("x"):
        pass
    assert [s.name for s in exporter.get_finished_spans()] == ["x"]


def test_disabled_sets_nothing_up() -> None:
    tracing.configure(TracingConfig(enabled=False))
    assert tracing.tracer() is None and tracing.provider() is None


def test_disabled_never_imports_opentelemetry() -> None:
    """Off, the daemon's modules that trace (runtime, runner, effects, client) load without OpenTelemetry."""
    code = ("import sys\n"
            "from kafold import tracing\n"
            "from kafold.config import TracingConfig\n"
            "import kafold.client, kafold.daemon.runner, kafold.daemon.aggregates.runtime\n"
            "import kafold.connectors.effects.executor, kafold.connectors.effects.drivers\n"
            "tracing.configure(TracingConfig())\n"
            "assert tracing.tracer() is None\n"
            "loaded = sorted(m for m in sys.modules if m.startswith('opentelemetry'))\n"
            "assert not loaded, loaded\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_batch_links_remember_and_recall_by_coordinates() -> None:
    class Msg:
        def __init__(self, offset: int, headers: list[tuple[str, bytes]] | None) -> None:
            self._offset, self._headers = offset, headers

        def topic(self) -> str:
            return "t"

        def partition(self) -> int:
            return 0

        def offset(self) -> int:
            return self._offset

        def headers(self) -> list[tuple[str, bytes]] | None:
            return self._headers

    tp = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    msgs = [Msg(1, [("traceparent", tp), ("x", b"y")]), Msg(2, None)]
    assert len(tracing.batch_links(msgs, remember=False)) == 1 and tracing.recall("t", 0, 1) is None
    assert len(tracing.batch_links(msgs, remember=True)) == 1  # one link: the one traced record
    assert tracing.recall("t", 0, 1) == [("traceparent", tp)]
    assert tracing.recall("t", 0, 2) is None
    tracing.forget("t", 0, 1)
    assert tracing.recall("t", 0, 1) is None
