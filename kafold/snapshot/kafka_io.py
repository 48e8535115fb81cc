"""Kafka access for snapshots: partition bounds, reading offset ranges, writing snapshots (idempotent producer).

Offset note: the end of a partition is taken from the fetch path (read until partition EOF, which Kafka signals
at the high watermark — the last stable offset under read_committed), starting one record before the end that
ListOffsets reports, so a broker whose ListOffsets under-reports still yields the true end. On Apache Kafka both
report the same offset (ListOffsets(latest) under read_committed is the last stable offset, where a fetch reports
EOF), so the read from one record before it costs one small fetch; it also gives the position past a trailing
transaction marker. Ranges are read with read_committed: events of aborted transactions are never folded.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any, cast

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, TopicPartition

from kafold import kafka_clients, logs
from kafold.config import KafkaConfig
from kafold.errors import RetriableError
from kafold.kafka_message import Message
from kafold.snapshot.record import Encoded, Marker, Snapshot

log = logs.get(__name__)
STALL_S = 30.0
Batch = tuple[list[int], list[bytes | None], list[bytes | None]]
TP = tuple[str, int]  # (topic, partition)


# The readers' group id. They assign partitions themselves and never join the group; a finished snapshot run
# commits, under this group, each events partition's end it snapshotted up to (`record_progress`), so Kafka's
# tooling shows per partition how many events came after the last run (its "lag"), and the next run starts
# fetching the new events while it reads the snapshots (`progress`). A hint only: what a run folds is decided by
# the snapshots and markers it reads, never by these offsets.
PROGRESS_GROUP = "kafold.snapshot.reader"


def reader(kafka: KafkaConfig) -> Consumer:
    """A reader that assigns partitions itself (never joins its group) and reports partition EOF."""
    return kafka_clients.range_reader(kafka, PROGRESS_GROUP)


def progress(consumer: Consumer, topic: str, partitions: list[int]) -> dict[int, int]:
    """Where the last finished snapshot run ended, per events partition (committed by `record_progress`); empty
    when unknown or unreadable (a hint: the run then reads as it would without it)."""
    try:
        found = consumer.committed([TopicPartition(topic, p) for p in partitions], timeout=5)
    except KafkaException as e:
        log.info("snapshot.progress_unavailable", topic=topic, error=str(e))
        return {}
    return {tp.partition: tp.offset for tp in found if tp.error is None and tp.offset >= 0}


def record_progress(consumer: Consumer, topic: str, ends: dict[int, int]) -> None:
    """Commit each events partition's snapshotted end under PROGRESS_GROUP (call once the markers are written);
    a failure is logged and otherwise ignored (see PROGRESS_GROUP)."""
    if not ends:
        return
    try:
        consumer.commit(offsets=[TopicPartition(topic, p, end) for p, end in sorted(ends.items())],
                        asynchronous=False)
    except KafkaException as e:
        log.warning("snapshot.progress_not_recorded", topic=topic, error=str(e), effect="none on snapshots")


def _poll(consumer: Consumer, size: int, timeout: float) -> list[Message]:
    try:
        # typed by confluent-kafka's stubs with Optional coordinates, which a consumed record always has
        return cast("list[Message]", consumer.consume(size, timeout))
    except KafkaException as e:
        raise RetriableError(f"reading from Kafka failed: {e}") from e


def bounds(consumer: Consumer, topic: str, partition: int) -> tuple[int, int]:
    """(first offset, end offset) of a partition, the end as the fetch path reports it."""
    return bounds_many(consumer, topic, [partition])[partition]


def bounds_many(consumer: Consumer, topic: str, partitions: list[int]) -> dict[int, tuple[int, int]]:
    """`bounds` of several partitions, probed together (one wait for the ends instead of one per partition)."""
    probe = Probe(topic, partitions)
    for tp, offsets, _, _ in read_many(consumer, probe.ranges(consumer), probe.positions):
        probe.saw(tp[1], offsets)
    return probe.bounds()


class Probe:
    """Finding partitions' ends on the fetch path: `ranges` (ListOffsets, then a read from one record before the
    listed end up to partition EOF) can be read together with other ranges (`read_many`); feed this topic's
    batches to `saw` and, once the read is over, `bounds` gives (first offset, end offset) per partition."""

    def __init__(self, topic: str, partitions: list[int]) -> None:
        self.topic = topic
        self.listed: dict[int, tuple[int, int]] = {}
        self.partitions = partitions
        self.positions: dict[TP, int] = {}  # where each read stopped: past a trailing transaction marker too

    def ranges(self, consumer: Consumer) -> dict[TP, tuple[int, int | None]]:
        """The reads that find the ends (ListOffsets first: `listed`). A caller may start one earlier (the probe
        then also fetches the records from there: `select_partitions`' prefetch)."""
        for p in self.partitions:
            try:
                self.listed[p] = consumer.get_watermark_offsets(TopicPartition(self.topic, p), timeout=10,
                                                                cached=False)
            except KafkaException as e:
                raise RetriableError(f"{self.topic}[{p}]: cannot list offsets: {e}") from e
        return {(self.topic, p): (max(low, listed - 1), None) for p, (low, listed) in self.listed.items()
                if listed > low}

    def saw(self, partition: int, offsets: list[int]) -> None:
        low, end = self.listed[partition]
        self.listed[partition] = (low, max(end, offsets[-1] + 1))

    def bounds(self) -> dict[int, tuple[int, int]]:
        return {p: (low, max(low, end, self.positions.get((self.topic, p), -1)))
                for p, (low, end) in self.listed.items()}


def read_many(consumer: Consumer, ranges: dict[TP, tuple[int, int | None]], positions: dict[TP, int] | None = None
              ) -> Iterator[tuple[TP, list[int], list[bytes | None], list[bytes | None]]]:
    """Records of several (topic, partition) ranges read together, as ((topic, partition), offsets, keys, values)
    batches, per partition in offset order (partitions interleave). A range (start, end) stops before `end`, or
    with `end` None at its partition EOF; records past a range's end (new data) are left for the next read, as
    `read_range` does. `positions` gets the consumer's position of each partition that reached its EOF.

    One assignment for all the ranges: their fetches share rounds (and the wait for their EOFs), where reading
    them one after the other pays a fetch round (and a broker-side wait at each EOF) per range."""
    remaining = {tp: end for tp, (start, end) in ranges.items() if end is None or start < end}
    if not remaining:
        return
    consumer.assign([TopicPartition(t, p, ranges[(t, p)][0]) for t, p in remaining])
    last_progress = time.monotonic()
    try:
        while remaining:
            batches: dict[TP, Batch] = {}
            for m in _poll(consumer, 20000, 0.01):
                tp, err = (m.topic(), m.partition()), m.error()
                if tp not in remaining:
                    continue
                end = remaining[tp]
                if err is not None:
                    if err.code() != KafkaError._PARTITION_EOF:
                        raise RetriableError(f"{tp[0]}[{tp[1]}]: {err.str()}")
                    if end is None or m.offset() >= end:  # an EOF below a known end: the range is not there yet
                        del remaining[tp]
                        if positions is not None and m.offset() >= 0:
                            positions[tp] = m.offset()  # an EOF event carries the offset the fetch stopped at
                        last_progress = time.monotonic()
                    continue
                offset = m.offset()
                if end is not None and offset >= end:
                    del remaining[tp]
                    continue
                batch = batches.setdefault(tp, ([], [], []))
                batch[0].append(offset)
                batch[1].append(m.key())
                batch[2].append(m.value())
                if end is not None and offset + 1 >= end:
                    del remaining[tp]
            for tp, (offsets, keys, values) in batches.items():
                last_progress = time.monotonic()
                yield tp, offsets, keys, values
            if remaining and time.monotonic() - last_progress > STALL_S:
                topic, p = min(remaining)
                end = remaining[(topic, p)]
                where = "partition EOF" if end is None else f"offset {end}"
                raise RetriableError(f"{topic}[{p}]: no progress for {STALL_S:.0f} s before {where} "
                                     f"({_where(consumer, topic, p, -1)})")
    finally:
        consumer.unassign()


def exists(consumer: Consumer, topic: str) -> bool:
    """Whether the broker knows `topic` (a metadata request; consumers never auto-create topics here)."""
    try:
        meta = consumer.list_topics(topic, timeout=10)
    except KafkaException as e:
        raise RetriableError(f"{topic}: cannot read metadata: {e}") from e
    found = meta.topics.get(topic)
    return found is not None and found.error is None and bool(found.partitions)


def read_range(consumer: Consumer, topic: str, partition: int, start: int, end: int | None,
               batch: int = 20000) -> Iterator[Batch]:
    """Records at offsets [start, end) as (offsets, keys, values) batches; `end` None = up to partition EOF."""
    if end is not None and start >= end:
        return
    # `end` None: read until partition EOF (the high watermark, or the last stable offset under read_committed).
    consumer.assign([TopicPartition(topic, partition, start)])
    last_progress = time.monotonic()
    position = start
    try:
        while True:
            # consume() returns when it has `size` records or times out: ask for no more than the range holds,
            # so the last batch of a range does not wait out the timeout.
            size = batch if end is None else max(1, min(batch, end - position))
            msgs = _poll(consumer, size, 0.01 if end is None else 0.2)
            last = msgs[-1] if msgs else None
            if last is not None and last.error() is None and (end is None or last.offset() < end) \
                    and not any(m.error() for m in msgs):
                # the common case, a batch of plain records inside the range: no per-record branching
                offsets = [m.offset() for m in msgs]
                keys = [m.key() for m in msgs]
                values = [m.value() for m in msgs]
                done = False
            else:
                offsets, keys, values, done = _sift(msgs, end, topic, partition)
            if offsets:
                last_progress = time.monotonic()
                position = offsets[-1] + 1
                yield offsets, keys, values
            if done or (end is not None and position >= end):
                return
            if time.monotonic() - last_progress > STALL_S:
                raise RetriableError(f"{topic}[{partition}]: no progress for {STALL_S:.0f} s before offset {end} "
                                     f"({_where(consumer, topic, partition, position)})")
    finally:
        consumer.unassign()


def _where(consumer: Consumer, topic: str, partition: int, position: int) -> str:
    """Where a stalled read stands, for its error: our position, the consumer's, and the fetch watermarks."""
    tp = TopicPartition(topic, partition)
    try:
        low, high = consumer.get_watermark_offsets(tp, cached=True)
        at = consumer.position([tp])[0].offset
    except KafkaException as e:
        return f"next offset {position}; watermarks unavailable: {e}"
    return f"next offset {position}, consumer position {at}, fetch watermarks {low}..{high}"


def _sift(msgs: list[Message], end: int | None, topic: str, partition: int) -> tuple[
        list[int], list[bytes | None], list[bytes | None], bool]:
    """Records of a batch up to `end`, and whether the range is done (EOF at or past the end, or past it)."""
    offsets: list[int] = []
    keys: list[bytes | None] = []
    values: list[bytes | None] = []
    for m in msgs:
        err = m.error()
        if err is not None:
            if err.code() == KafkaError._PARTITION_EOF:
                if end is None or m.offset() >= end:
                    return offsets, keys, values, True
                continue
            raise RetriableError(f"{topic}[{partition}]: {err.str()}")
        off = m.offset()
        if end is not None and off >= end:
            return offsets, keys, values, True
        offsets.append(off)
        keys.append(m.key())
        values.append(m.value())
    return offsets, keys, values, False


def records(consumer: Consumer, topic: str, partition: int) -> Iterator[tuple[bytes | None, bytes | None, int]]:
    """Every record of a (snapshot) partition as (key, value, offset), in log order, up to partition EOF."""
    for offsets, keys, values in read_range(consumer, topic, partition, OFFSET_BEGINNING, None):
        yield from zip(keys, values, offsets, strict=True)


def records_many(consumer: Consumer, topic: str, partitions: list[int]) -> Iterator[
        tuple[int, bytes | None, bytes | None, int]]:
    """Every record of several (snapshot) partitions as (partition, key, value, offset), read together, per
    partition in log order, each up to its partition EOF."""
    for (_, p), offsets, keys, values in read_many(consumer, {(topic, p): (OFFSET_BEGINNING, None)
                                                              for p in partitions}):
        for key, value, offset in zip(keys, values, offsets, strict=True):
            yield p, key, value, offset


_WRITERS: dict[str, Any] = {}


def writer(kafka: KafkaConfig) -> Any:
    """An idempotent producer (retries never duplicate or reorder a snapshot within its partition), one per
    process and broker config: its start-up handshake (a producer id) costs a round of waits, so it is reused."""
    key = repr(kafka)
    if key not in _WRITERS:
        _WRITERS[key] = kafka_clients.producer(kafka, **{"enable.idempotence": True, "acks": "all",
                                                         "linger.ms": 20, "batch.num.messages": 10000})
    return _WRITERS[key]


class Writes:
    """Records produced to one partition of `topic`; `flush` waits until all are acknowledged or raises.

    The partition is the events partition the snapshots were folded from, so a snapshot sits in the same
    partition number as its aggregate's events whatever partitioner the event producers use.
    """

    def __init__(self, producer: Any, topic: str, partition: int) -> None:
        self.producer, self.topic, self.partition = producer, topic, partition
        self.failures: list[str] = []
        self.count = 0

    def _delivered(self, err: Any, _msg: Any) -> None:
        if err is not None:
            self.failures.append(str(err))

    def add(self, records: Iterable[Encoded]) -> int:
        """Produce (key, value, headers) records in order; how many."""
        producer, topic, partition, on_delivery = self.producer, self.topic, self.partition, self._delivered
        n = 0
        for key, value, headers in records:
            while True:
                try:
                    producer.produce(topic, value=value, key=key, headers=headers, partition=partition,
                                     on_delivery=on_delivery)
                    break
                except BufferError:
                    producer.poll(0.1)
            n += 1
            if n % 1000 == 0:
                producer.poll(0)
        self.count += n
        return n

    def flush(self) -> int:
        """Wait for every record added so far; RetriableError if any failed (nothing after them may be written)."""
        left = self.producer.flush(60)
        if self.failures or left:
            raise RetriableError(f"{self.topic}[{self.partition}]: {len(self.failures) + left} snapshot writes "
                                 f"failed ({self.failures[0] if self.failures else 'flush timed out'})")
        return self.count


def write(producer: Any, topic: str, partition: int, items: Iterable[Snapshot | Marker]) -> int:
    """Produce snapshots (then, if given, a marker last) to `partition` and wait until all are acknowledged."""
    writes = Writes(producer, topic, partition)
    writes.add(item.encode() for item in items)
    return writes.flush()
