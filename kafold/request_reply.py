"""An aggregate's command side as both command clients speak it (kafold.client blocking, kafold.aio async):
commands and their records, where the results partitions end, which result answers which command, and what
`wait_visible` waits on.

Offset note: a client reads the results partitions from their end offsets as ListOffsets reported them before it
sent; a result is written (by a transaction committed after the command was read) at a later offset, so reading
each partition from there cannot miss it. A broker that under-reports that end only makes the client read a few
records more. Results are read with read_committed: only results of committed batches are seen.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Iterator
from typing import Any

from confluent_kafka import KafkaError, KafkaException, TopicPartition

from kafold import kafka_clients, logs, tracing
from kafold.config import AggregateConfig, KafkaConfig
from kafold.envelope import Headers
from kafold.errors import KafoldError, RetriableError
from kafold.messages import H_COMMAND_ID, Command, Result, decode_result, header

log = logs.get(__name__)

# librdkafka's murmur2_random is the partitioner of the Java client: the same key lands in the same partition
# whichever of the two produced it (the runtime writes events and results to the command's partition).
PARTITIONER = "murmur2_random"
# linger.ms 1, not librdkafka's 5: one command whose caller waits for its result leaves at once instead of 5 ms
# later. A client sending many at once still batches: what is queued while a request is in flight goes together.
PRODUCER_SETTINGS = {"enable.idempotence": True, "acks": "all", "linger.ms": 1, "partitioner": PARTITIONER}


class ResultTimeout(KafoldError):
    """No result arrived in time (the runtime may be down or still recovering); the command may still apply."""


class NoToken(KafoldError):
    """The result wrote events but carries no token (a duplicate whose first decision the runtime no longer
    remembers, or a daemon before tokens): there is nothing to wait on."""


def _producer_kind() -> Any:
    from opentelemetry.trace import SpanKind  # imported only when tracing is on (the `tracing` extra)
    return SpanKind.PRODUCER


def _in_span(span: Any) -> Any:
    from opentelemetry import trace  # as above
    return trace.set_span_in_context(span)


class Commands:
    """One aggregate type's commands: built, turned into records (with a tracing span each when tracing is on),
    and their results found among the results topic's records."""

    def __init__(self, agg: AggregateConfig, tracer_provider: Any = None) -> None:
        self.agg = agg
        # OpenTelemetry: a span per command (child of the current context) whose `traceparent` rides on the record;
        # None unless a provider is given, kafold.tracing is on here, or the application set a global SDK provider.
        self.tracer = tracing.application_tracer(tracer_provider)
        self.commands, self.results = agg.topic("commands"), agg.topic("results")

    def command(self, aggregate_id: str, type: str, data: dict[str, Any] | None = None, *,
                expected_version: int | None = None, command_id: str | None = None) -> Command:
        return Command.new(self.agg.name, aggregate_id, type, data, expected_version=expected_version,
                           command_id=command_id)

    def record(self, c: Command) -> tuple[bytes, bytes, Headers, Any]:
        """Key, value, headers of `c`'s record and its span (None without tracing; the caller ends it once the
        record is acknowledged or failed)."""
        key, value, headers = c.encode()
        if self.tracer is None:
            return key, value, headers, None
        span = self.tracer.start_span(f"send {self.agg.name} {c.type}", kind=_producer_kind(),
                                      attributes={"kafold.command_id": c.command_id,
                                                  "kafold.aggregate_id": c.aggregate_id,
                                                  "messaging.destination.name": self.commands})
        return key, value, [*headers, *tracing.inject(_in_span(span))], span

    def reader(self, kafka: KafkaConfig) -> Any:
        """An assign-only read_committed consumer of the results topic (it joins no group, commits nothing)."""
        return kafka_clients.consumer(kafka, f"kafold.client.{self.agg.name}", **{
            "isolation.level": "read_committed", "fetch.wait.max.ms": kafka_clients.RANGE_FETCH_WAIT_MS})

    def result_ends(self, reader: Any) -> dict[int, int]:
        """Every results partition's end offset (blocking: a metadata and a ListOffsets request)."""
        meta = reader.list_topics(self.results, timeout=10).topics[self.results]
        if meta.error is not None:
            raise RetriableError(f"results topic {self.results!r}: {meta.error.str()}")
        # Every partition's end in one ListOffsets request per leader (timestamp -1: the latest offset), not a
        # round trip per partition, which an idle `send` waited for in turn (docs/benchmarks.md, aggregates).
        try:
            found = reader.offsets_for_times([TopicPartition(self.results, p, -1) for p in meta.partitions],
                                             timeout=10)
        except KafkaException as e:
            raise RetriableError(f"{self.results}: cannot list offsets: {e}") from e
        ends = {}
        for tp in found:
            if tp.error is not None:
                raise RetriableError(f"{self.results}[{tp.partition}]: cannot list offsets: {tp.error}")
            ends[tp.partition] = max(0, tp.offset)
        return ends

    def assign(self, reader: Any, starts: dict[int, int]) -> None:
        reader.assign([TopicPartition(self.results, p, off) for p, off in starts.items()])


def results_in(messages: Iterable[Any], wanted: Container[str]) -> Iterator[tuple[str, Result]]:
    """(command id, Result) of each result record among consumed `messages` whose command id is `wanted` (the
    others' results are not decoded); consumer errors other than a partition's end are logged and skipped
    (librdkafka retries by itself)."""
    for m in messages:
        if m.error() is not None:
            if m.error().code() != KafkaError._PARTITION_EOF:
                log.warning("client.results_error", error=m.error().str())
            continue
        cid = header(m.headers(), H_COMMAND_ID)
        if cid is not None and cid in wanted and m.value() is not None:
            yield cid, decode_result(m.value())


def token_to_wait_on(result: Result) -> str | None:
    """The token `wait_visible(result, ...)` waits on; None when the command wrote nothing (rejected, or no
    events): nothing to wait for. NoToken when it wrote events but carries no token."""
    if not result.event_ids or not result.accepted:
        return None
    if result.token is None:
        why = "a duplicate whose first decision is no longer remembered" if result.duplicate else \
            "a daemon before tokens"
        raise NoToken(f"the result of command {result.command_id!r} carries no token ({why})")
    return result.token
