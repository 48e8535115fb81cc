"""Integration (real PostgreSQL): a whole-row batch read straight from its Kafka records (whole_batch.py: no Event nor
SinkRecord a record) is written with the outcomes of the same batch decoded record by record; a batch the reader
cannot take is decoded record by record as always (dead letters, skips); and every way the one statement can fail
(stale events, a zombie's fence, records below the stored checkpoint, held keys) reads the batch's records then,
deciding each exactly."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import confluent_kafka

from kafold import db
from kafold.config import PostgresConfig
from kafold.connectors.api import BatchReader, SinkRecord, SinkTask, TopicPartition
from kafold.connectors.intake import Intake
from kafold.connectors.projection.whole_batch import WholeBatch, WholeReader
from kafold.connectors.projection.writer import ProjectionWriter
from kafold.daemon import batch_decode
from kafold.envelope import Event, encode, epoch_ms
from kafold.errors import DecodeError, RecordError
from tests.projection.projection_support import read_table, stored_offsets, table_name
from tests.projection.test_projection_whole_rows import closed, dead, expected, outcomes, state, writers


class _Task(SinkTask):
    """The part of a task `batch_decode.decode` calls: a WholeReader of `writer`'s mapping (as ProjectionSinkTask
    offers one), the dead letters it is told of."""

    def __init__(self, writer: ProjectionWriter) -> None:
        self.writer = writer
        self.dead: list[Any] = []

    def start(self, task_config: Any, context: Any) -> None: ...

    def put(self, records: Sequence[SinkRecord]) -> None: ...

    def stop(self) -> None: ...

    def handles(self, event_type: str) -> bool:
        return self.writer.mapping.handles(event_type)

    def batch_reader(self, intake: Intake, size: int) -> BatchReader | None:
        return WholeReader(self.writer.mapping, intake)

    def on_dead_letter(self, record: Any, error: BaseException) -> None:
        self.dead.append(error)


class _Reporter:
    def __init__(self) -> None:
        self.reported: list[BaseException] = []

    def report(self, record: Any, error: BaseException) -> None:
        self.reported.append(error)

    def flush(self, timeout: float) -> None: ...


def messages(topic: str, events: list[Event | bytes], start: int = 0, partition: int = 0) -> list[Any]:
    """Kafka records as the consumer hands them over: kafold's encoding of each event (bytes: a value as it is)."""
    out = []
    for i, e in enumerate(events):
        key, value, headers = (b"acc", e, []) if isinstance(e, bytes) else encode(e)
        out.append(confluent_kafka.Message(topic=topic, partition=partition, offset=start + i, key=key, value=value,
                                           headers=headers, timestamp=(1, 1_700_000_000_000)))
    return out


def decoded(writer: ProjectionWriter, msgs: list[Any]) -> tuple[batch_decode.Decoded, _Reporter]:
    task, reporter = _Task(writer), _Reporter()
    intake = Intake("t", task.handles, "skip")
    got = batch_decode.decode(msgs, intake, task, reporter, lambda e: None, lambda step, warn: step(), set(), None)
    return got, reporter


def whole(writer: ProjectionWriter, topic: str, events: list[Event], start: int = 0) -> WholeBatch:
    """`events` as Kafka records, taken by the writer's task's reader."""
    got = decoded(writer, messages(topic, list(events), start))[0].records
    assert isinstance(got, WholeBatch)
    return got


def test_a_batch_read_straight_from_its_records_is_written_as_decoded_record_by_record(
        pg_config: PostgresConfig, unique: str) -> None:
    topic, table, other = f"{unique}.events", table_name(), table_name()
    events = [state(f"acc-{i}", v, i * 10 + v) for v in (1, 2, 3) for i in range(40)]
    msgs = messages(topic, list(events))
    with writers(pg_config, unique, table) as (w,), writers(pg_config, f"{unique}x", other) as (plain,):
        got, _ = decoded(w, msgs)
        batch = got.records
        assert isinstance(batch, WholeBatch) and len(batch) == 120
        tp = TopicPartition(topic, 0)
        assert (got.counted, got.seen, batch.next_offsets(), got.dead) == ({tp: 120}, {tp: 120}, {tp: 120}, 0)
        assert got.times == {tp: epoch_ms(events[-1].occurred_at)}
        ahead = w.whole_rows.arranged(w.conn, batch.plan)
        done = w.write(batch, ahead=ahead)
        assert not batch.opened  # nothing read its records one by one: no Event, no SinkRecord
        one_by_one = batch.decoded()
        assert [r.event for r in one_by_one] == events and [r.offset for r in one_by_one] == list(range(120))
        reference = plain.write(one_by_one)
        assert (outcomes(done), done.upserted, w.whole_rows.batches) == (outcomes(reference), 40, 1)
    assert read_table(pg_config, table) == read_table(pg_config, other) == expected(events)
    assert stored_offsets(pg_config, unique, topic) == {0: 120}


def test_a_batch_the_reader_cannot_take_is_decoded_record_by_record(pg_config: PostgresConfig, unique: str) -> None:
    """A record that is no envelope (dead-lettered, naming the defect), a type whose rule does not make the whole
    row (a delete), a key's versions going back, a record produced twice in the batch: each sends the whole batch
    the record-by-record way, which decides every record as without the reader."""
    topic, table = f"{unique}.events", table_name()
    good = [state(f"acc-{i}", 1, i) for i in range(5)]
    with writers(pg_config, unique, table) as (w,):
        for odd in (b"\xff\xfe not json", closed("acc-1", 2), state("acc-2", 1, 7), good[3]):
            got, reporter = decoded(w, messages(topic, [*good, odd]))
            assert not isinstance(got.records, WholeBatch) and got.times is None
            if isinstance(odd, bytes):
                assert got.dead == 1 and len(got.records) == 5
                assert isinstance(reporter.reported[0], DecodeError)
                assert "invalid kafold envelope: value: not valid JSON" in str(reporter.reported[0])
            else:
                assert got.dead == 0 and [r.event for r in got.records] == [*good, odd]
        done = w.write(decoded(w, messages(topic, [*good, closed("acc-1", 2)]))[0].records)
        assert outcomes(done) == (6, 0, 0) and done.upserted == 4  # acc-1 made and closed in the batch
    assert set(read_table(pg_config, table)) == {"acc-0", "acc-2", "acc-3", "acc-4"}


def test_a_whole_batch_the_one_statement_refuses_is_decided_record_by_record(pg_config: PostgresConfig,
                                                                           unique: str) -> None:
    """Stale events (a replay: their rows are newer), a zombie's batch (its checkpoint moved under it), a batch
    redelivered from below the stored checkpoint, a key held by another task's dead letter: the batch's records are
    read then, and each is decided exactly as without the reader."""
    topic, table = f"{unique}.events", table_name()
    first = [state(f"acc-{i}", 2, 20 + i) for i in range(5)]
    with writers(pg_config, unique, table, 2) as (owner, zombie):
        batch = whole(owner, topic, first)
        assert outcomes(owner.write(batch)) == (5, 0, 0) and not batch.opened
        # the zombie read the same offsets: its fence fails, it writes nothing and counts them as applied before
        theirs = whole(zombie, topic, [state(f"acc-{i}", 2, 99) for i in range(5)])
        late = zombie.write(theirs)
        assert (late.upserted, late.duplicates, late.checkpoints) == (0, 5, {}) and theirs.opened
        # older states at new offsets (the same events produced again, say): stale, none written
        stale = whole(owner, topic, [state(f"acc-{i}", 1, 1) for i in range(5)], start=5)
        assert outcomes(owner.write(stale)) == (0, 0, 5) and stale.opened
        # offsets 8..11 again with a new key: the records below the checkpoint are passed, the new one applied
        redelivered = whole(owner, topic, [state(f"acc-{i}", 1, 1) for i in (3, 4)] + [state("acc-9", 1, 9)], start=8)
        done = owner.write(redelivered)
        assert (outcomes(done), done.upserted) == ((1, 2, 0), 1)
        with db.connect(pg_config) as conn:  # a head another task recorded
            conn.execute("INSERT INTO kafold.dead_letters (connector, topic, partition, \"offset\", error_class, "
                         "error_message, reason, status, hold_key) VALUES (%s, %s, 1, 0, 'x', 'x', 'db-rejected', "
                         "'new', %s)", (unique, topic, '["acc-7"]'))
        held = whole(owner, topic, [state("acc-7", 1, 7), state("acc-8", 1, 8)], start=11)
        result = owner.write(held)
        assert (result.held, outcomes(result), dead(result)) == (1, (1, 0, 0), 1)
    rows = read_table(pg_config, table)
    assert {acc: row["balance"] for acc, row in rows.items()} == {
        **{f"acc-{i}": 20 + i for i in range(5)}, "acc-8": 8, "acc-9": 9}
    assert stored_offsets(pg_config, unique, topic) == {0: 13}


def test_the_records_of_a_whole_batch_are_those_decoded_one_by_one() -> None:
    """A WholeBatch's records, when read, are the runner's record-by-record decode of the same records."""
    events = [state(f"acc-{i}", 1, i) for i in range(3)]
    msgs = messages("t", list(events), start=10, partition=2)
    intake = Intake("t", lambda t: True, "skip")
    assert [intake.record(m, "t", 2, 10 + i) for i, m in enumerate(msgs)] == [
        r for r in WholeBatch(msgs, intake, None, {("t", 2): [10, 13, None]})]  # type: ignore[arg-type]
    try:
        intake.record(messages("t", [b"{}"])[0], "t", 0, 0)
    except RecordError as e:
        assert "missing" in str(e)
    else:
        raise AssertionError("an envelope without fields decoded")
