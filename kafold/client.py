"""Request/reply for aggregates: send commands to the commands topic and wait for their results.

Offset note: before sending, the client takes each results partition's end offset as ListOffsets reports it;
a result is written (by a transaction committed after the command was read) at a later offset, so reading
each partition from there cannot miss it. A broker that under-reports that end only makes the client read a
few records more. Results are read with read_committed: only results of committed batches are seen.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from confluent_kafka import KafkaError, KafkaException, TopicPartition

from kafold import kafka_clients, logs
from kafold.config import AggregateConfig, KafkaConfig
from kafold.errors import KafoldError, RetriableError
from kafold.messages import H_COMMAND_ID, Command, Result, decode_result, header

log = logs.get(__name__)

# librdkafka's murmur2_random is the partitioner of the Java client: the same key lands in the same partition
# whichever of the two produced it (the runtime writes events and results to the command's partition).
PARTITIONER = "murmur2_random"


class ResultTimeout(KafoldError):
    """No result arrived in time (the runtime may be down or still recovering); the command may still apply."""


class CommandClient:
    """Sends commands of one aggregate type; `send` waits for the result when asked to."""

    def __init__(self, kafka: KafkaConfig, agg: AggregateConfig) -> None:
        self.agg = agg
        self.commands, self.results = agg.topic("commands"), agg.topic("results")
        self.producer = kafka_clients.producer(kafka, **{"enable.idempotence": True, "acks": "all",
                                                         "linger.ms": 5, "partitioner": PARTITIONER})
        self.kafka = kafka
        self._reader: Any = None

    def command(self, aggregate_id: str, type: str, data: dict[str, Any] | None = None, *,
                expected_version: int | None = None, command_id: str | None = None) -> Command:
        return Command.new(self.agg.name, aggregate_id, type, data, expected_version=expected_version,
                           command_id=command_id)

    def send(self, command: Command, *, wait: bool = True, timeout: float = 30.0) -> Result | None:
        """Send one command; with `wait`, its Result (ResultTimeout if none arrives within `timeout`)."""
        results = self.send_many([command], wait=wait, timeout=timeout)
        return results.get(command.command_id) if wait else None

    def send_many(self, commands: Iterable[Command], *, wait: bool = True,
                  timeout: float = 30.0) -> dict[str, Result]:
        """Send commands (in order per aggregate) and, with `wait`, collect one result per command id."""
        cmds = list(commands)
        starts = self._result_ends() if wait else {}
        partitions = self._produce(cmds)
        if not wait:
            return {}
        return self._collect({c.command_id for c in cmds}, {p: starts[p] for p in set(partitions.values())},
                             timeout)

    def _produce(self, cmds: list[Command]) -> dict[str, int]:
        placed: dict[str, int] = {}
        failed: list[str] = []

        def delivered(cid: str) -> Any:
            def report(err: Any, msg: Any) -> None:
                if err is not None:
                    failed.append(str(err))
                else:
                    placed[cid] = msg.partition()
            return report

        for c in cmds:
            key, value, headers = c.encode()
            kafka_clients.produce(self.producer, self.commands, value, key, headers,
                                  on_delivery=delivered(c.command_id))
        if self.producer.flush(30) or failed:
            raise RetriableError(f"{self.commands}: commands not acknowledged: {failed[:1] or 'timeout'}")
        return placed

    def _result_ends(self) -> dict[int, int]:
        reader = self._results_reader()
        meta = reader.list_topics(self.results, timeout=10).topics[self.results]
        if meta.error is not None:
            raise RetriableError(f"results topic {self.results!r}: {meta.error.str()}")
        ends = {}
        for p in meta.partitions:
            try:
                _, high = reader.get_watermark_offsets(TopicPartition(self.results, p), timeout=10, cached=False)
            except KafkaException as e:
                raise RetriableError(f"{self.results}[{p}]: cannot list offsets: {e}") from e
            ends[p] = max(0, high)
        return ends

    def _results_reader(self) -> Any:
        if self._reader is None:
            self._reader = kafka_clients.consumer(self.kafka, f"kafold.client.{self.agg.name}", **{
                "isolation.level": "read_committed", "fetch.wait.max.ms": kafka_clients.RANGE_FETCH_WAIT_MS})
        return self._reader

    def _collect(self, wanted: set[str], starts: dict[int, int], timeout: float) -> dict[str, Result]:
        reader = self._results_reader()
        reader.assign([TopicPartition(self.results, p, off) for p, off in starts.items()])
        found: dict[str, Result] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(found) < len(wanted):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ResultTimeout(f"{len(wanted) - len(found)} of {len(wanted)} results not received within "
                                        f"{timeout:.1f}s from {self.results!r}")
                for m in reader.consume(1000, min(left, 0.2)):
                    if m.error() is not None:
                        if m.error().code() != KafkaError._PARTITION_EOF:
                            log.warning("client.results_error", error=m.error().str())
                        continue
                    cid = header(m.headers(), H_COMMAND_ID)
                    if cid in wanted and cid not in found and m.value() is not None:
                        found[cid] = decode_result(m.value())
        finally:
            reader.unassign()
        return found

    def close(self) -> None:
        kafka_clients.close_producer(self.producer, 10)
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    def __enter__(self) -> CommandClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
