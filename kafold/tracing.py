"""OpenTelemetry traces across Kafka: W3C `traceparent`/`tracestate` in record headers, spans where kafold works.

Off unless `[tracing].enabled` (`configure`): then `tracer()` is None and no caller imports or calls OpenTelemetry;
hot paths check `tracer()` once per batch and touch no header when it is None. On: a TracerProvider whose sampler
(OTEL_TRACES_SAMPLER, OTEL_TRACES_SAMPLER_ARG), batch schedule (OTEL_BSP_*) and OTLP/HTTP export
(OTEL_EXPORTER_OTLP_ENDPOINT, ...) come from the standard SDK environment variables.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from typing import Any

from kafold import logs
from kafold.config import TracingConfig
from kafold.kafka_message import Message

log = logs.get(__name__)

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
_NAMES = (TRACEPARENT, TRACESTATE)
MAX_TRACESTATE_CHARS = 512  # the W3C limit the SDK applies too
_W3C_TRACESTATE = re.compile(f"[\\x20-\\x7e]{{0,{MAX_TRACESTATE_CHARS}}}")
MAX_LINKS = 128  # the SDK's default link limit per span: a batch links at most this many distinct contexts

HeaderList = Sequence[tuple[str, bytes | None]]

_tracer: Any = None
_provider: Any = None


def tracer() -> Any:
    """The process's tracer when tracing is on, else None (the one check callers make)."""
    return _tracer


def configure(cfg: TracingConfig) -> None:
    """Turn tracing on for this process when `cfg.enabled` (once; later calls keep the first provider)."""
    global _tracer, _provider
    if not cfg.enabled or _tracer is not None:
        return
    # opentelemetry: kafold[tracing], imported only when [tracing] is on
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    name = os.environ.get("OTEL_SERVICE_NAME") or cfg.service_name
    _provider = TracerProvider(resource=Resource.create({"service.name": name}))  # sampler: OTEL_TRACES_SAMPLER
    exporter = os.environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower()
    if exporter == "console":
        # opentelemetry: kafold[tracing], imported only when [tracing] is on
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        _provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    elif exporter != "none":  # "none": spans are made and sampled, nothing is sent (e.g. to measure the cost)
        _provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    _tracer = _provider.get_tracer("kafold")
    log.info("tracing.enabled", service_name=name, exporter=exporter,
             endpoint=os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "http://localhost:4318"),
             sampler=os.environ.get("OTEL_TRACES_SAMPLER", "parentbased_always_on"))


def shutdown() -> None:
    """Export what is buffered and stop (at the process's end)."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _tracer = _provider = None


def provider() -> Any:
    return _provider


def inject(context: Any = None) -> list[tuple[str, bytes]]:
    """The W3C headers of `context` (default: the current one) as Kafka headers; [] when it has no valid span."""
    # opentelemetry: kafold[tracing], imported only when [tracing] is on
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, context=context)
    return [(k, v.encode()) for k, v in carrier.items()]


def extract(headers: HeaderList | None) -> Any:
    """The OpenTelemetry Context carried by Kafka headers (an empty one when they carry none)."""
    # opentelemetry: kafold[tracing], imported only when [tracing] is on
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier = {k: v.decode("latin-1") for k, v in headers or () if k in _NAMES and v is not None}
    state = carrier.get(TRACESTATE)
    if state is not None and not _W3C_TRACESTATE.fullmatch(state):
        # W3C allows printable ASCII only, up to MAX_TRACESTATE_CHARS; anything else is dropped here, before the
        # SDK's parser warns about it quoting the whole member (a producer's bytes, CR/LF included).
        del carrier[TRACESTATE]
    return TraceContextTextMapPropagator().extract(carrier)


def span_context(headers: HeaderList | None) -> Any:
    """The remote SpanContext in Kafka headers, or None."""
    # opentelemetry: kafold[tracing], imported only when [tracing] is on
    from opentelemetry import trace

    sc = trace.get_current_span(extract(headers)).get_span_context()
    return sc if sc.is_valid else None


def links(all_headers: Iterable[HeaderList | None]) -> list[Any]:
    """Links to the distinct contexts of records' headers (for a batch span), at most MAX_LINKS."""
    # opentelemetry: kafold[tracing], imported only when [tracing] is on
    from opentelemetry.trace import Link

    seen: dict[tuple[int, int], Any] = {}
    for headers in all_headers:
        if not headers or not any(k == TRACEPARENT for k, _ in headers):
            continue
        sc = span_context(headers)
        if sc is not None and (sc.trace_id, sc.span_id) not in seen:
            seen[(sc.trace_id, sc.span_id)] = Link(sc)
            if len(seen) >= MAX_LINKS:
                break
    return list(seen.values())


def without_trace(headers: HeaderList) -> list[tuple[str, bytes | None]]:
    """`headers` less any trace context (before a new one is added)."""
    return [(k, v) for k, v in headers if k not in _NAMES]


def application_tracer(tracer_provider: Any = None) -> Any:
    """For a client in an application's process: a tracer of `tracer_provider`, else of kafold's own provider
    (configure), else of the application's global SDK provider when it set one; None = no tracing."""
    if tracer_provider is not None:
        return tracer_provider.get_tracer("kafold.client")
    if _provider is not None:
        return _provider.get_tracer("kafold.client")
    try:
        # opentelemetry: kafold[tracing], imported only when [tracing] is on
        from opentelemetry import trace
    except ImportError:  # pragma: no cover - a dependency; kept harmless for slim installs
        return None
    global_provider = trace.get_tracer_provider()
    if type(global_provider).__name__ in ("ProxyTracerProvider", "NoOpTracerProvider"):
        return None
    return global_provider.get_tracer("kafold.client")


# Records handed from a traced batch to an effect executor (another thread): their trace headers by coordinates,
# filled only when tracing is on, bounded (oldest dropped first: a record that waited longer is traced without).
_RECORD_HEADERS: dict[tuple[str, int, int], list[tuple[str, bytes | None]]] = {}
MAX_REMEMBERED = 100_000


def batch_links(msgs: Iterable[Message], *, remember: bool) -> list[Any]:
    """`links` of a batch of consumed Kafka messages, reading each one's headers once; with `remember`, their
    trace headers noted for `recall` by the effect that runs them (a projection has no use for them)."""
    traced: list[HeaderList] = []
    for m in msgs:
        headers = m.headers()
        if headers and any(k == TRACEPARENT for k, _ in headers):
            traced.append(headers)
            if remember:
                _RECORD_HEADERS[(m.topic(), m.partition(), m.offset())] = [(k, v) for k, v in headers if k in _NAMES]
    if remember:
        while len(_RECORD_HEADERS) > MAX_REMEMBERED:
            del _RECORD_HEADERS[next(iter(_RECORD_HEADERS))]
    return links(traced) if traced else []


def recall(topic: str, partition: int, offset: int) -> list[tuple[str, bytes | None]] | None:
    return _RECORD_HEADERS.get((topic, partition, offset))


def forget(topic: str, partition: int, offset: int) -> None:
    _RECORD_HEADERS.pop((topic, partition, offset), None)
