"""A sink runner's batch decoded: the records for `put`, and the dead letters and skips met on the way, counted per
partition for the offset accounting (daemon/accounting.py). runner.py puts, flushes and commits what this gives."""

from __future__ import annotations

from collections.abc import Callable, Sequence, Set
from dataclasses import dataclass, field
from typing import Any

from kafold.connectors.api import BatchReader, ErrantRecordReporter, SinkRecord, SinkTask, TopicPartition
from kafold.connectors.intake import Intake
from kafold.errors import KafoldError, RecordError, RetriableError
from kafold.kafka_message import Message

YIELD_EVERY_MASK = 255  # the decode loop offers the task a yield point every 256 records (SinkTask.yield_point)

# The runner's retrying of a step until it succeeds (its back-off serves the consumer with the partitions paused, so
# the membership stays): (step, warn(error, delay)); RetriableError once the runner gives up (stopping).
Retrying = Callable[[Callable[[], None], Callable[[RetriableError, float], None]], None]


class GaveUp(KafoldError):
    """A record's decode still failed on a transient error when the runner stopped retrying (it is stopping)."""


@dataclass
class Decoded:
    """One batch decoded. Per partition: the next offset after its records (`seen`), how many records it had
    (`counted`), were dead-lettered here (`dead_at`) or skipped (`skipped_at`)."""

    records: Sequence[SinkRecord] = field(default_factory=list)
    seen: dict[TopicPartition, int] = field(default_factory=dict)
    counted: dict[TopicPartition, int] = field(default_factory=dict)
    dead_at: dict[TopicPartition, int] = field(default_factory=dict)
    skipped_at: dict[TopicPartition, int] = field(default_factory=dict)
    dead: int = 0
    skipped: int = 0
    # A BatchReader's batch: the last event time per partition, from the reader (None: read from `records`).
    times: dict[TopicPartition, int] | None = None


def decode(msgs: list[Message], intake: Intake, task: SinkTask, reporter: ErrantRecordReporter,
           consumer_error: Callable[[Any], None], retrying: Retrying, assigned: Set[TopicPartition], log: Any
           ) -> Decoded:
    """Decode `msgs` in order: a record that is no valid envelope (RecordError) is reported to the dead-letter
    topic and never reaches `put`; one the task does not handle is skipped. `assigned` is the runner's live
    assignment: a record whose partition was revoked while its decode was retried is left to the new owner.
    GaveUp when a decode still fails as the runner stops retrying. A task's BatchReader (SinkTask.batch_reader)
    takes the batch first, when it offers one; where it cannot, the batch is decoded record by record from its
    start (so every record is decided here, as always)."""
    reader = task.batch_reader(intake, len(msgs)) if msgs else None
    if reader is not None:
        got = _loop(msgs, intake, task, reporter, consumer_error, retrying, assigned, log, reader)
        if got is not None:
            return got
    decoded = _loop(msgs, intake, task, reporter, consumer_error, retrying, assigned, log, None)
    assert decoded is not None
    return decoded


def _loop(msgs: list[Message], intake: Intake, task: SinkTask, reporter: ErrantRecordReporter,
          consumer_error: Callable[[Any], None], retrying: Retrying, assigned: Set[TopicPartition], log: Any,
          reader: BatchReader | None) -> Decoded | None:
    """`decode`'s one pass: each record decoded, or taken by `reader` (None the moment it cannot take one, or meets
    a record with an error: the pass without it decides those)."""
    records: list[SinkRecord] = []
    out = Decoded(records)
    seen, counted, dead_at, skipped_at = out.seen, out.counted, out.dead_at, out.skipped_at
    if reader is None:
        intake.prefetch(msgs)
    tp, last_topic, last_part, run, offset = None, None, -1, 0, -1
    yield_point = task.yield_point
    for i, m in enumerate(msgs):
        if not i & YIELD_EVERY_MASK:
            yield_point()
        err = m.error()
        if err is not None:
            if reader is not None:
                return None
            consumer_error(err)  # a fatal one ends the run before this batch is committed
            continue
        topic, part = m.topic(), m.partition()
        if part != last_part or topic != last_topic:  # records come in runs per partition: counted per run, and
            if tp is not None:  # `seen` is the run's last offset + 1 (a partition's offsets rise along a batch)
                counted[tp] = counted.get(tp, 0) + run
                seen[tp] = offset + 1
            tp, last_topic, last_part, run = TopicPartition(topic, part), topic, part, 0
        assert tp is not None
        offset = m.offset()
        run += 1
        if reader is not None:
            if not reader.take(m, topic, part, offset):
                return None
            continue
        try:
            try:
                record = intake.record(m, topic, part, offset)
            except RetriableError as e:  # a service the decode needs is down (a Schema Registry)
                record = _decode_later(intake, m, (topic, part, offset), e, retrying, log)
                if tp not in assigned:  # revoked during the back-off: the new owner reads it
                    continue
        except RecordError as e:
            reporter.report(m, e)
            task.on_dead_letter(m, e)
            out.dead += 1
            dead_at[tp] = dead_at.get(tp, 0) + 1
            continue
        if record is None:
            out.skipped += 1
            skipped_at[tp] = skipped_at.get(tp, 0) + 1
            continue
        records.append(record)
    if tp is not None:
        counted[tp] = counted.get(tp, 0) + run
        seen[tp] = offset + 1
    if reader is not None:
        out.records, out.times = reader.records(), reader.event_times()
    return out


def _decode_later(intake: Intake, m: Any, at: tuple[str, int, int], first: RetriableError, retrying: Retrying,
                  log: Any) -> SinkRecord | None:
    """A record whose decode failed on a transient error, decoded again until it succeeds or fails for good
    (RecordError: a dead letter), backing off as a failing put does. Nothing is skipped meanwhile, so the
    partition's order holds."""
    got: list[SinkRecord | None] = []

    def step() -> None:
        got[:] = [intake.record(m, *at)]

    def warn(e: RetriableError, delay: float) -> None:
        log.warning("runner.decode_retrying", topic=at[0], partition=at[1], offset=at[2], error=str(e),
                    retry_in_s=round(delay, 2))

    warn(first, 0.0)
    try:
        retrying(step, warn)
    except RetriableError as e:
        raise GaveUp(str(e)) from e
    return got[0]
