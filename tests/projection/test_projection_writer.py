"""Integration (real PostgreSQL): the writer's optimistic order (fold while a plain tracking insert runs) gives the
same table as the ON CONFLICT order, falls back to it on duplicates and returns to it after a clean batch."""

from __future__ import annotations

from pathlib import Path

from kafold import db
from kafold.config import PostgresConfig
from kafold.connectors.api import SinkRecord, sink_record
from kafold.connectors.projection.mapping import Mapping
from kafold.connectors.projection.writer import ProjectionWriter
from kafold.connectors.registry import instantiate
from kafold.envelope import Event
from tests.projection.projection_support import (
    deposited,
    fold,
    history,
    read_table,
    settings,
    stored_offsets,
    table_name,
)


def _records(topic: str, partition: int, events: list[Event], start: int = 0) -> list[SinkRecord]:
    return [sink_record(topic, partition, start + i, e.aggregate_id, e, None) for i, e in enumerate(events)]


def test_duplicates_switch_the_writer_to_the_conflict_order_until_a_clean_batch(pg_config: PostgresConfig,
                                                                                unique: str) -> None:
    topic, table = f"{unique}.events", table_name()
    db.upgrade(pg_config)
    config = instantiate(settings(unique, topic, table), Path(".")).config
    writer = ProjectionWriter(pg_config, config, Mapping(config), unique)
    events = history(accounts=20, deposits=6)
    recs = _records(topic, 0, events)
    a, b, c = recs[:50], recs[50:100], recs[100:]
    try:
        first = writer.write(a)
        assert (first.duplicates, first.upserted, writer._optimistic) == (0, len({r.key for r in a}), True)
        # Events of `a` re-published on another partition, mixed into the next batch: the optimistic insert fails,
        # the batch is redone with ON CONFLICT, and the duplicates are dropped.
        again = _records(topic, 1, [r.event for r in a[::5]])
        mixed = writer.write([*again[:5], *b, *again[5:]])
        assert (mixed.duplicates, mixed.events, writer._optimistic) == (len(again), len(again) + len(b), False)
        # A batch whose stale event has a new id is tracked as new; the version guard skips it.
        late = _records(topic, 1, [deposited("acc-3", 2, 1_000_000)], start=len(again))
        clean = writer.write([*c, *late])
        assert (clean.duplicates, clean.stale, writer._optimistic) == (0, 1, True)
        assert writer.write(c).duplicates == len(c)  # a replay of a batch: all duplicates, nothing written
        assert writer.idle.is_set()  # between writes the runner's yield points never wait for this writer
    finally:
        writer.close()
    assert read_table(pg_config, table) == fold(events)
    assert stored_offsets(pg_config, unique, topic) == {0: len(recs), 1: len(again) + 1}
