"""Integration (real PostgreSQL): the live writer deduplicating by version writes a batch of whole-row events in one
statement without reading a row (connectors/projection/whole_rows.py), and keeps every outcome exact: a record
produced twice, an old version inside a batch, a deleted row's tombstone, a zombie writer, changed held keys."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from decimal import Decimal
from pathlib import Path
from typing import Any

from kafold import db
from kafold.config import ConnectorConfig, PostgresConfig
from kafold.connectors.api import SinkRecord, TopicPartition
from kafold.connectors.projection.fold import BatchResult
from kafold.connectors.projection.mapping import Mapping
from kafold.connectors.projection.writer import ProjectionWriter
from kafold.connectors.registry import instantiate
from kafold.envelope import Event
from tests.projection.projection_support import COLUMNS, read_table, stored_offsets, table_name
from tests.projection.test_projection_writer import _records

WHOLE = [{"type": "AccountState", "set": {c: f"payload.{c}" for c in COLUMNS if c != "account_id"}},
         {"type": "AccountClosed", "action": "delete"}]


def state(account: str, version: int, balance: int) -> Event:
    return Event.new("AccountState", "account", account, version,
                     {"owner": f"o-{account}", "balance": balance, "last_amount": version, "status": "open"})


def closed(account: str, version: int) -> Event:
    return Event.new("AccountClosed", "account", account, version, {})


def expected(events: list[Event]) -> dict[str, dict[str, Any]]:
    """The table computed independently: per account the highest version's state (none once closed)."""
    rows: dict[str, dict[str, Any]] = {}
    last: dict[str, Event] = {}
    for e in events:
        if e.aggregate_id not in last or e.version > last[e.aggregate_id].version:
            last[e.aggregate_id] = e
    for acc, e in last.items():
        if e.type == "AccountState":
            rows[acc] = {**e.payload, "_kafold_version": e.version}
    return rows


@contextmanager
def writers(pgc: PostgresConfig, name: str, table: str, n: int = 1, columns: dict[str, str] | None = None,
            on: list[dict[str, Any]] | None = None) -> Iterator[list[ProjectionWriter]]:
    db.upgrade(pgc)
    cfg = ConnectorConfig(name=name, connector_class="postgres-projection", topics=[f"{name}.events"],
                          config={"table": table, "key_columns": ["account_id"], "columns": columns or COLUMNS,
                                  "on": on or WHOLE, "dedup": "version"})
    config = instantiate(cfg, Path(".")).config
    out = [ProjectionWriter(pgc, config, Mapping(config), name, track=False, fence=True) for _ in range(n)]
    try:
        for w in out:
            w.checkpoints()
        yield out
    finally:
        for w in out:
            w.close()


def outcomes(result: BatchResult) -> tuple[int, int, int]:
    """(applied, duplicates, stale) over the batch's partitions."""
    applied = sum(c[0] for c in result.by_partition.values())
    return applied, result.duplicates, result.stale


def dead(result: BatchResult) -> int:
    """Dead-lettered events over the batch's partitions."""
    return sum(c[3] for c in result.by_partition.values())


def test_offsets_alone_after_whole_rows_are_stored(pg_config: PostgresConfig, unique: str) -> None:
    """Records the runner skipped leave a write of offsets alone: the one statement with no row, its arrays empty."""
    topic, table = f"{unique}.events", table_name()
    tp = TopicPartition(topic, 0)
    with writers(pg_config, unique, table) as (w,):
        assert outcomes(w.write(_records(topic, 0, [state("acc-1", 1, 10)]))) == (1, 0, 0)
        assert w.write([], offsets={tp: 5}).checkpoints == {tp: 5}
        assert w.checkpoints() == {tp: 5}


def test_a_column_of_nulls_only_in_the_general_path(pg_config: PostgresConfig, unique: str) -> None:
    """A numeric column (not built directly: psycopg dumps it) holding only nulls in a batch: psycopg has no element
    type to dump in binary and gives text ('{NULL,NULL}'), which must not go out as a binary array (the real Debezium
    source's changes hung on it: "number of array dimensions (2068731212) exceeds the maximum allowed")."""
    topic, table = f"{unique}.events", table_name()
    columns = {**COLUMNS, "rate": "numeric"}
    on = [{"type": "AccountState", "set": {c: f"payload.{c}" for c in columns if c != "account_id"}}]
    with writers(pg_config, unique, table, columns=columns, on=on) as (w,):
        assert w.whole_rows.on
        batch = [Event.new("AccountState", "account", f"acc-{i}", 1, {"owner": "o", "balance": i, "last_amount": 1,
                                                                      "status": "open", "rate": None})
                 for i in range(3)]  # a rate of null in every payload: the column is all nulls
        assert outcomes(w.write(_records(topic, 0, batch))) == (3, 0, 0) and w.whole_rows.batches == 1
        rated = Event.new("AccountState", "account", "acc-0", 2, {"owner": "o", "balance": 5, "last_amount": 2,
                                                                  "status": "open", "rate": "1.25"})
        assert outcomes(w.write(_records(topic, 0, [rated], start=3))) == (1, 0, 0)
    rows = read_table(pg_config, table)
    assert {acc: r["rate"] for acc, r in rows.items()} == {"acc-0": Decimal("1.25"), "acc-1": None, "acc-2": None}


def test_whole_rows_are_written_without_reads_and_stale_events_counted_exactly(pg_config: PostgresConfig,
                                                                              unique: str) -> None:
    topic, table = f"{unique}.events", table_name()
    with writers(pg_config, unique, table) as (w,):
        assert w.whole_rows.on
        first = [state(f"acc-{i}", v, i * 10 + v) for v in (1, 2) for i in range(20)]
        done = w.write(_records(topic, 0, first))
        assert outcomes(done) == (40, 0, 0) and done.upserted == 20 and w.whole_rows.batches == 1
        # a record produced twice (same event id, later offset), then a key whose first event is stale and whose
        # last is new: the one statement refuses, the careful way counts exactly, and the path stays off until a
        # batch has nothing stale
        twice = first[25]
        mixed = [twice, state("acc-3", 1, 99), state("acc-3", 3, 33), state("acc-30", 1, 300)]
        done = w.write(_records(topic, 0, mixed, start=40))
        assert outcomes(done) == (2, 0, 2) and done.upserted == 2
        assert not w.whole_rows.on and w.whole_rows.batches == 1
        later = [state("acc-4", 3, 43), state("acc-4", 4, 44)]
        assert outcomes(w.write(_records(topic, 0, later, start=44))) == (2, 0, 0)  # the careful way, then back on
        assert w.whole_rows.on and w.whole_rows.batches == 1
        # a deleted row's tombstone keeps an old state from coming back, in the one statement's check too
        assert w.write(_records(topic, 0, [closed("acc-5", 3)], start=46)).deleted == 1
        again = w.write(_records(topic, 0, [state("acc-5", 2, 1), state("acc-6", 3, 63)], start=47))
        assert outcomes(again) == (1, 0, 1)
        assert outcomes(w.write(_records(topic, 0, [state("acc-5", 4, 54)], start=49))) == (1, 0, 0)
        assert w.whole_rows.on and w.whole_rows.batches == 1  # the tombstone's batch was redone; this one careful
        # versions not rising along a batch: the fold decides (the older one is stale)
        back = w.write(_records(topic, 0, [state("acc-7", 5, 75), state("acc-7", 4, 74)], start=50))
        assert outcomes(back) == (1, 0, 1)
        assert outcomes(w.write(_records(topic, 0, [state("acc-40", 1, 8)], start=52))) == (1, 0, 0)  # careful
        assert outcomes(w.write(_records(topic, 0, [state("acc-41", 1, 9)], start=53))) == (1, 0, 0)
        assert w.whole_rows.batches == 2
    events = first + mixed + later + [closed("acc-5", 3), state("acc-5", 2, 1), state("acc-6", 3, 63),
                                      state("acc-5", 4, 54), state("acc-7", 5, 75), state("acc-7", 4, 74),
                                      state("acc-40", 1, 8), state("acc-41", 1, 9)]
    assert read_table(pg_config, table) == expected(events)
    assert stored_offsets(pg_config, unique, topic) == {0: 54}


def test_a_zombie_writer_of_whole_rows_writes_nothing(pg_config: PostgresConfig, unique: str) -> None:
    """Two writers of one partition (a zombie after a rebalance and the new owner): the one whose stored checkpoint
    moved under it fails the one statement's fence, rolls back, and applies only what the checkpoint has not
    passed."""
    topic, table = f"{unique}.events", table_name()
    with writers(pg_config, unique, table, 2) as (owner, zombie):
        mine = _records(topic, 0, [state(f"acc-{i}", 1, i) for i in range(5)])
        theirs = _records(topic, 0, [dataclasses.replace(state(f"acc-{i}", 1, 1000 + i)) for i in range(5)])
        assert outcomes(owner.write(mine)) == (5, 0, 0) and owner.whole_rows.batches == 1
        late = zombie.write(theirs)
        assert (late.upserted, late.duplicates, late.checkpoints) == (0, 5, {})
        assert {r["balance"] for r in read_table(pg_config, table).values()} == set(range(5))
        more: list[SinkRecord] = _records(topic, 0, [state("acc-0", 2, 7)], start=5)
        assert zombie.write(more).upserted == 1
        assert owner.write(more).upserted == 0
        assert stored_offsets(pg_config, unique, topic) == {0: 6}
        assert read_table(pg_config, table)["acc-0"]["balance"] == 7


def test_held_keys_changed_under_the_one_statement_are_read_again(pg_config: PostgresConfig, unique: str) -> None:
    """A key held by another task's dead letter since this writer last read the held keys: the one statement's
    check fails, the careful way reads them, and that key's event is held, the rest applied."""
    topic, table = f"{unique}.events", table_name()
    with writers(pg_config, unique, table) as (w,):
        assert outcomes(w.write(_records(topic, 0, [state("acc-1", 1, 1)]))) == (1, 0, 0) and w.whole_rows.batches
        with db.connect(pg_config) as conn:  # a head another task recorded
            conn.execute("INSERT INTO kafold.dead_letters (connector, topic, partition, \"offset\", error_class, "
                         "error_message, reason, status, hold_key) VALUES (%s, %s, 1, 0, 'x', 'x', 'db-rejected', "
                         "'new', %s)", (unique, topic, '["acc-2"]'))
        done = w.write(_records(topic, 0, [state("acc-2", 1, 2), state("acc-3", 1, 3)], start=1))
        assert (done.held, outcomes(done), w.whole_rows.batches) == (1, (1, 0, 0), 1)
    assert set(read_table(pg_config, table)) == {"acc-1", "acc-3"}


def test_a_stale_event_the_table_would_refuse_is_stale_not_dead_lettered(pg_config: PostgresConfig,
                                                                        unique: str) -> None:
    """The one statement tries every row, stale ones too, and the table refuses a bad value before the version
    guard is seen: the careful way decides, where a stale event is not written at all (as without this path); a
    bad new event is still isolated and dead-lettered."""
    topic, table = f"{unique}.events", table_name()
    with writers(pg_config, unique, table) as (w,):
        assert outcomes(w.write(_records(topic, 0, [state("acc-1", 2, 20)]))) == (1, 0, 0)
        with db.connect(pg_config) as conn:
            conn.execute(f"ALTER TABLE public.{table} ADD CHECK (balance >= 0)")
        stale = w.write(_records(topic, 0, [state("acc-1", 1, -1), state("acc-2", 1, 2)], start=1))
        assert (outcomes(stale), dead(stale)) == ((1, 0, 1), 0)
        bad = w.write(_records(topic, 0, [state("acc-3", 1, -3), state("acc-4", 1, 4)], start=3))
        assert (outcomes(bad), dead(bad)) == ((1, 0, 0), 1)
    assert {k: r["balance"] for k, r in read_table(pg_config, table).items()} == {"acc-1": 20, "acc-2": 2, "acc-4": 4}


def test_a_plan_made_ahead_is_used_only_where_its_assumptions_hold(pg_config: PostgresConfig, unique: str) -> None:
    """A whole-row plan made before its batch's transaction (`WholeRows.ahead`, as the task makes it while the previous
    batch is in PostgreSQL) assumes no record skipped: used then; a batch redelivered from below the stored
    checkpoint is planned again without the records passed; a zombie's plan is fenced like any other."""
    topic, table = f"{unique}.events", table_name()
    with writers(pg_config, unique, table, 2) as (owner, zombie):
        mine = _records(topic, 0, [state(f"acc-{i}", 1, i) for i in range(5)])
        ahead = owner.whole_rows.ahead(owner.conn, mine, owner.prepare(mine))
        assert ahead is not None and ahead.columns is not None
        assert outcomes(owner.write(mine, ahead=ahead)) == (5, 0, 0) and owner.whole_rows.batches == 1
        # offsets 3..5 again: had the plan made ahead been used, acc-3 and acc-4 would fail its check (the batch
        # then goes the careful way, not counted in `batches`); planned again, it skips them and goes in one
        again = _records(topic, 0, [state("acc-3", 1, 3), state("acc-4", 1, 4), state("acc-9", 1, 9)], start=3)
        done = owner.write(again, ahead=owner.whole_rows.ahead(owner.conn, again, owner.prepare(again)))
        assert outcomes(done) == (1, 2, 0) and owner.whole_rows.batches == 2
        theirs = _records(topic, 0, [state(f"acc-{i}", 1, 1000 + i) for i in range(5)])
        late = zombie.write(theirs, ahead=zombie.whole_rows.ahead(zombie.conn, theirs, zombie.prepare(theirs)))
        assert (late.upserted, late.duplicates, late.checkpoints) == (0, 5, {})
    assert {acc: row["balance"] for acc, row in read_table(pg_config, table).items()} == {
        **{f"acc-{i}": i for i in range(5)}, "acc-9": 9}
    assert stored_offsets(pg_config, unique, topic) == {0: 6}
