"""Integration (real PostgreSQL): the writer's optimistic order (fold while a plain tracking insert runs) gives the
same table as the ON CONFLICT order, falls back to it on duplicates and returns to it after a clean batch."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from psycopg import sql
from psycopg.rows import dict_row

from kafold import db
from kafold.config import ConnectorConfig, PostgresConfig
from kafold.connectors.api import SinkRecord, sink_record
from kafold.connectors.projection.mapping import Mapping
from kafold.connectors.projection.table_rows import read_back
from kafold.connectors.projection.writer import ProjectionWriter
from kafold.connectors.registry import instantiate
from kafold.envelope import Event
from kafold.errors import ConfigError, RetriableError
from tests.projection.projection_support import (
    closed,
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


def _lose_session(pgc: PostgresConfig, writer: ProjectionWriter, recs: list[SinkRecord]) -> None:
    """The writer's session dies: its next write fails (RetriableError), and the rows it kept are dropped."""
    assert writer.conn is not None and writer.table_rows.cache
    with db.connect(pgc) as conn:
        conn.execute("SELECT pg_terminate_backend(%s)", (writer.conn.info.backend_pid,))
    with pytest.raises(RetriableError):
        writer.write(recs)
    assert not writer.table_rows.cache


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


def test_a_writer_keeping_rows_between_batches_writes_what_one_reading_them_writes(pg_config: PostgresConfig,
                                                                                   unique: str) -> None:
    """The rebuild's row cache (cache_rows): over batches that bisect around a rejected row, redo a fold without a
    refused event, meet duplicates, delete rows and lose their session, a writer keeping rows gives the table a
    writer reading them each batch gives — also for values PostgreSQL reads back as another Python value (an int
    into text, a timestamp written as text, jsonb floats), which are never kept."""
    from psycopg import sql
    from psycopg.rows import dict_row

    db.upgrade(pg_config)
    columns = {"account_id": "text", "owner": "text", "balance": "bigint", "status": "text", "tag": "text",
               "note": "varchar(8)", "meta": "jsonb", "seen": "timestamptz"}
    rules = [
        {"type": "AccountOpened", "set": {"owner": "payload.owner", "status": "'open'", "balance": 0,
                                          "tag": "payload.tag", "note": "payload.note", "meta": "payload.meta"}},
        {"type": "MoneyDeposited", "action": "update", "increment": {"balance": "payload.amount"}},
        {"type": "AccountSeen", "action": "update", "set": {"seen": "occurred_at", "meta": "payload.meta"}},
        {"type": "AccountClosed", "action": "delete"},
    ]

    def opened_(acc: str, tag: Any, note: str = "ok") -> Event:
        return Event.new("AccountOpened", "account", acc, 1, {"owner": acc, "tag": tag, "note": note,
                                                             "meta": {"n": [1, 2.5, 1e20]}})

    def seen(acc: str, version: int) -> Event:
        return Event.new("AccountSeen", "account", acc, version, {"meta": 1e20})

    def broken(acc: str, version: int) -> Event:  # no amount: the mapping refuses it
        return Event.new("MoneyDeposited", "account", acc, version, {})

    topic = f"{unique}.events"
    batches = [
        [opened_(f"a{i}", i if i % 2 else f"t{i}") for i in range(10)] + [deposited(f"a{i}", 2, i) for i in range(10)],
        [deposited(f"a{i}", 3, 10) for i in range(10)] + [opened_("b0", 1, note="far too long")]
        + [deposited("b0", 2, 5), deposited("a1", 4, 1)],
        [deposited("a2", 4, 7), broken("a3", 4), deposited("a3", 5, 2), seen("a4", 4), deposited("a4", 5, 1)],
        [closed("a5", 4), deposited("a5", 5, 3), opened_("c0", "x"), deposited("c0", 2, 4)],
        [deposited(f"a{i}", 6, 100) for i in range(10)],
    ]
    tables, writers = [], []
    for cache in (0, 1000):
        table = table_name()
        config = instantiate(settings(f"{unique}-{cache}", topic, table, columns=columns, on=rules),
                             Path(".")).config
        tables.append(table)
        writers.append(ProjectionWriter(pg_config, config, Mapping(config), f"{unique}-{cache}", cache_rows=cache))
    keeping = writers[1]

    def rows(table: str) -> list[dict[str, Any]]:
        with db.connect(pg_config, row_factory=dict_row) as conn:
            return conn.execute(sql.SQL("SELECT * FROM public.{} ORDER BY account_id").format(
                sql.Identifier(table))).fetchall()

    try:
        offset = 0
        for i, events in enumerate(batches):
            recs = _records(topic, 0, events, start=offset)
            offset += len(recs)
            if i == 3:  # the keeping writer's session dies: the write fails, what it kept is dropped
                _lose_session(pg_config, keeping, recs)
            done = [w.write(recs) for w in writers]
            if i == 2:  # a replay of the batch (another partition, same events): duplicates, or held behind a3's
                again = _records(topic, 1, events)
                done += [w.write(again) for w in writers]
                assert done[2].duplicates == 3 and done[2].held == 2
            assert done[1::2] == done[::2]
            assert rows(tables[1]) == rows(tables[0])
        assert keeping.table_rows.cache, "the keeping writer kept no row"
        final = {r["account_id"]: r for r in rows(tables[1])}
        assert "b0" not in final and "a5" not in final and final["c0"]["balance"] == 4
        assert final["a1"]["tag"] == "1" and final["a3"]["balance"] == 3 + 10  # later ones held behind v4
        assert final["a4"]["seen"] is not None and final["a4"]["meta"] == 1e20
    finally:
        for w in writers:
            w.close()


def test_only_values_postgresql_reads_back_as_the_same_python_value_are_kept() -> None:
    """What the row cache may keep, per column type: ints into text come back as str, a timestamp written as text
    comes back a datetime, a jsonb float may come back an int; a mapper's code is never handed a kept container."""
    assert read_back("text", True) == (str,) and read_back("character varying(8)", True) == (str,)
    assert read_back("bigint", False) == (int,) and read_back("boolean", True) == (bool,)
    assert read_back("timestamp with time zone", True) == () and read_back("numeric(10,2)", True) == ()
    assert read_back("character(5)", True) == ()  # blank-padded on the way back
    assert float not in read_back("jsonb", True) and dict in read_back("jsonb", True)
    assert dict not in read_back("jsonb", False) and list not in read_back("json", False)


def test_a_writer_deduplicating_by_version_writes_what_a_tracking_one_writes(pg_config: PostgresConfig,
                                                                              unique: str) -> None:
    """A rebuild's writer (track=False): no tracking records; the version guard skips duplicates, and a deleted
    row's tombstone skips late duplicates of its events — also after its session died (its cache dropped) and in
    a new writer (a resumed rebuild), which reads the tombstones from PostgreSQL. A re-opening at a later version
    is applied. Same table as a tracking writer's after every batch."""
    from psycopg import sql

    db.upgrade(pg_config)
    topic = f"{unique}.events"
    tables, writers = [], []
    for track in (True, False):
        table, name = table_name(), f"{unique}-{track}"
        config = instantiate(settings(name, topic, table), Path(".")).config
        tables.append(table)
        writers.append(ProjectionWriter(pg_config, config, Mapping(config), name, f"{name}:ns", cache_rows=1000,
                                        track=track))
    versioned = writers[1]
    first = history(accounts=6, deposits=3, close_every=2)  # acc-0, acc-2, acc-4 closed at version 5
    reopened = Event.new("AccountOpened", "account", "acc-2", 6, {"owner": "again"})
    batches = [
        first[:12],
        first[12:] + first[:3],  # acc-0 closed, then its opening and first deposit again
        [first[5], reopened, first[9], deposited("acc-2", 7, 40)],  # duplicates of a live row's, of a closed one's
        first[::4],
    ]

    def tracking_rows(ns: str) -> int:
        with db.connect(pg_config) as conn:
            row = conn.execute(sql.SQL("SELECT count(*) FROM {} WHERE projection = %s").format(
                db.table(pg_config, "tracking")), (ns,)).fetchone()
        assert row is not None
        return int(row[0])

    try:
        offset = 0
        for i, events in enumerate(batches):
            recs = _records(topic, 0, events, start=offset)
            offset += len(recs)
            if i == 2:  # the versioned writer's session dies: what it kept is dropped, tombstones read again
                _lose_session(pg_config, versioned, recs)
            done = [w.write(recs) for w in writers]
            assert done[0].upserted == done[1].upserted and done[0].deleted == done[1].deleted
            assert done[1].duplicates == 0 and done[1].stale == done[0].stale + done[0].duplicates
            assert read_table(pg_config, tables[1]) == read_table(pg_config, tables[0])
        # A new writer, as a resumed rebuild: nothing cached; the tombstones of acc-0 and acc-4 are in PostgreSQL.
        fresh = ProjectionWriter(pg_config, versioned.config, versioned.mapping, versioned.connector,
                                 versioned.namespace, cache_rows=1000, track=False)
        try:
            late = fresh.write(_records(topic, 0, [first[0], first[1], first[18]], start=offset))
        finally:
            fresh.close()
        assert (late.stale, late.upserted) == (3, 0)
    finally:
        for w in writers:
            w.close()
    final = read_table(pg_config, tables[1])
    assert final == fold([*first, reopened, deposited("acc-2", 7, 40)])
    assert "acc-0" not in final and final["acc-2"]["owner"] == "again" and final["acc-2"]["balance"] == 40
    assert tracking_rows(f"{unique}-False:ns") == 0 and tracking_rows(f"{unique}-True:ns") > 0
    with db.connect(pg_config) as conn:
        tombs = conn.execute(sql.SQL("SELECT row_key, version FROM {} WHERE namespace = %s ORDER BY 1").format(
            db.table(pg_config, "tombstones")), (f"{unique}-False:ns",)).fetchall()
    assert tombs == [('["acc-0"]', 5), ('["acc-2"]', 5), ('["acc-4"]', 5)]


def test_deduplicating_by_version_needs_the_version_guard(pg_config: PostgresConfig, unique: str) -> None:
    config = instantiate(settings(unique, f"{unique}.events", table_name(), version_guard=False), Path(".")).config
    with pytest.raises(ConfigError, match="version guard"):
        ProjectionWriter(pg_config, config, Mapping(config), unique, track=False)


def _typed_row(row: dict[str, Any] | None, event: Event) -> dict[str, Any]:
    """A mapper with Python values PostgreSQL reads differently from their own types' text (a bool into text, a
    datetime into text and timestamptz, a Decimal, a float, a dict, a list, a null)."""
    i = event.payload["i"]
    at = datetime(2026, 11, 29, 12, 30, i % 60, 123456, tzinfo=UTC)
    return {"flag_text": i % 2 == 0, "at_text": at, "at": at, "amount": Decimal(f"{i}.10"), "ratio": i / 3,
            "doc": {"i": i, "nested": [1, "two", None]}, "tags": [f"t{i}", "x,y", 'q"uote'], "note": None}


def test_rows_of_a_small_and_a_large_batch_are_stored_alike(pg_config: PostgresConfig, unique: str) -> None:
    """A small batch and a large one go by the same one upsert of text arrays: PostgreSQL must read
    each value the same way both times (as COPY's text format has it)."""
    topic, table = f"{unique}.events", table_name()
    db.upgrade(pg_config)
    columns = {"k": "text", "flag_text": "text", "at_text": "text", "at": "timestamptz", "amount": "numeric",
               "ratio": "double precision", "doc": "jsonb", "tags": "text[]", "note": "text"}
    config = instantiate(ConnectorConfig(name=unique, connector_class="postgres-projection", topics=[topic],
                                         config={"table": table, "key_columns": ["k"], "columns": columns,
                                                 "key": {"k": "aggregate_id"},
                                                 "mapper": f"{__name__}:_typed_row"}), Path(".")).config
    writer = ProjectionWriter(pg_config, config, Mapping(config, _typed_row), unique)
    n = 70  # more rows than the small batch: the same one statement either way

    def batch(prefix: str, count: int, start: int) -> list[SinkRecord]:
        return _records(topic, 0, [Event.new("Typed", "typed", f"{prefix}{i}", 1, {"i": i}) for i in range(count)],
                        start)

    try:
        small, large = writer.write(batch("inline-", 6, 0)), writer.write(batch("copied-", n, 6))
        assert (small.upserted, large.upserted) == (6, n)
    finally:
        writer.close()
    with db.connect(pg_config, row_factory=dict_row) as conn:
        rows = {r.pop("k"): r for r in conn.execute(
            sql.SQL("SELECT * FROM public.{}").format(sql.Identifier(table))).fetchall()}
    for i in range(6):
        inline, copied = rows[f"inline-{i}"], rows[f"copied-{i}"]
        assert inline == copied
        assert inline["flag_text"] == ("t" if i % 2 == 0 else "f")  # the text of a bool, as COPY stores it
        assert inline["at"] == datetime(2026, 11, 29, 12, 30, i, 123456, tzinfo=UTC)
        assert inline["tags"] == [f"t{i}", "x,y", 'q"uote'] and inline["doc"] == {"i": i, "nested": [1, "two", None]}
        assert inline["amount"] == Decimal(f"{i}.10") and inline["note"] is None
