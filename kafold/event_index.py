"""The history index in PostgreSQL: (events topic, aggregate id, version) -> (partition, offset, event id).

Kept up to date from the events topic itself (`catch_up`): on first use (or `kafold events index`) a partition is
read from its first offset, then each read indexes only what was written since. The aggregate runtime does not
write it: an index written beside a Kafka transaction could name records that transaction later aborts, and a read
that must check every row anyway (see kafold.history) gains nothing from it.

Offset note: a partition's mark (`event_index_marks.indexed_to`) is the offset below which every committed event
is in `event_index`. It is the reader's position at partition EOF under read_committed, i.e. the last stable offset:
records of a transaction still open lie at or past it and are indexed by a later catch-up, once decided; records
of aborted transactions are never returned, so never indexed. A catch-up writes its rows and the new mark in one
PostgreSQL transaction, holding the mark's row lock, so concurrent catch-ups of one partition (several daemons)
index it once. A first occurrence of a version wins (ON CONFLICT DO NOTHING), as in the fold, which skips an event
whose version is not above its aggregate's. The index is a cache: it may lag, be dropped (`rebuild`) or be
rebuilt; a mark beyond the partition's end (the topic recreated) drops the partition's rows and starts over.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from confluent_kafka import KafkaException, TopicPartition
from psycopg import sql

from kafold import db, logs
from kafold.config import PostgresConfig
from kafold.errors import KafoldError, RetriableError
from kafold.fold import fields
from kafold.snapshot import kafka_io

log = logs.get(__name__)
MISSING_TABLE = ("the history index tables are missing: run `kafold db upgrade` (or `kafold events index`, which "
                 "migrates first)")


class IndexUnavailable(KafoldError):
    """The index cannot be used: its tables are missing (no migration), or no PostgreSQL is configured."""


@dataclass(frozen=True)
class IndexRow:
    """One indexed event: its version, where it lies, and the event id the record there must carry."""

    version: int
    partition: int
    offset: int
    event_id: str


@dataclass(frozen=True)
class CaughtUp:
    """What one catch-up did: the mark before and after, events indexed, records not readable as events."""

    partition: int
    start: int
    indexed_to: int
    indexed: int
    unreadable: int
    duration_s: float


class EventIndex:
    """The index tables of one PostgreSQL database (kafold's schema), on one connection (not shared by threads)."""

    def __init__(self, pgc: PostgresConfig) -> None:
        self.pgc = pgc
        self.rows_table, self.marks_table = db.table(pgc, "event_index"), db.table(pgc, "event_index_marks")
        self.conn: psycopg.Connection[Any] | None = None

    def _conn(self) -> psycopg.Connection[Any]:
        if self.conn is None or self.conn.closed or self.conn.broken:
            self.conn = db.connect(self.pgc)
        return self.conn

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()

    def _run(self, step: Any, *, atomic: bool = True) -> Any:
        """`step(conn)` in one transaction (`atomic=False`: one statement on the autocommit connection, one round
        trip instead of three: what a read of one query needs); a missing table or a lost connection named."""
        try:
            if not atomic:
                return step(self._conn())
            with db.transaction(self._conn()) as conn:
                return step(conn)
        except psycopg.errors.UndefinedTable as e:
            raise IndexUnavailable(MISSING_TABLE) from e
        except psycopg.OperationalError as e:
            raise RetriableError(f"PostgreSQL: {e}") from e

    # ---- reading -----------------------------------------------------------------------------------------
    def rows(self, topic: str, aggregate_id: str, from_version: int = 1, upto: int | None = None,
             limit: int | None = None) -> list[IndexRow]:
        """The indexed events of one aggregate from `from_version` (up to `upto`), in version order."""
        q = sql.SQL('SELECT version, partition, "offset", event_id FROM {} WHERE topic = %s AND aggregate_id = %s '
                    "AND version >= %s AND version <= %s ORDER BY version LIMIT %s").format(self.rows_table)
        params = (topic, aggregate_id, from_version, upto if upto is not None else 2**62,
                  limit if limit is not None else 2**62)
        return [IndexRow(*r) for r in self._run(lambda c: c.execute(q, params).fetchall(), atomic=False)]

    def mark(self, topic: str, partition: int) -> int | None:
        q = sql.SQL("SELECT indexed_to FROM {} WHERE topic = %s AND partition = %s").format(self.marks_table)
        got = self._run(lambda c: c.execute(q, (topic, partition)).fetchone(), atomic=False)
        return None if got is None else int(got[0])

    def drop_row(self, topic: str, aggregate_id: str, version: int) -> None:
        """Forget one row found not to match its record (kafold.history checks each before serving it)."""
        q = sql.SQL("DELETE FROM {} WHERE topic = %s AND aggregate_id = %s AND version = %s").format(self.rows_table)
        self._run(lambda c: c.execute(q, (topic, aggregate_id, version)))

    def drop(self, topic: str, partitions: Sequence[int] | None = None) -> int:
        """Drop the index of `topic` (or of some of its partitions): its rows and marks; rows dropped. The next
        read (or `kafold events index`) rebuilds it from the topic."""
        where = sql.SQL("topic = %s") if partitions is None else sql.SQL("topic = %s AND partition = ANY(%s)")
        params: tuple[Any, ...] = (topic,) if partitions is None else (topic, list(partitions))

        def step(c: Any) -> int:
            c.execute(sql.SQL("DELETE FROM {} WHERE ").format(self.marks_table) + where, params)
            return int(c.execute(sql.SQL("DELETE FROM {} WHERE ").format(self.rows_table) + where, params).rowcount)

        dropped: int = self._run(step)
        log.info("history.index_dropped", topic=topic, partitions=list(partitions) if partitions else "all",
                 rows=dropped)
        return dropped

    # ---- writing -----------------------------------------------------------------------------------------
    def catch_up(self, consumer: Any, topic: str, partition: int) -> CaughtUp:
        """Index partition `partition` of `topic` from its mark up to its end (see the module's offset note);
        `consumer` is a read_committed range reader (kafka_io.reader) this call assigns."""
        began = time.monotonic()
        low, end = _listed(consumer, topic, partition)
        known = self.mark(topic, partition)
        if known is not None and low <= known == end:
            return CaughtUp(partition, known, known, 0, 0, 0.0)  # nothing new: no lock, no read
        return self._run(lambda conn: self._index(conn, consumer, topic, partition, low, end, began))

    def _index(self, conn: Any, consumer: Any, topic: str, partition: int, low: int, end: int,
               began: float) -> CaughtUp:
        conn.execute(sql.SQL("INSERT INTO {} (topic, partition, indexed_to) VALUES (%s, %s, %s) "
                             "ON CONFLICT DO NOTHING").format(self.marks_table), (topic, partition, low))
        mark = int(conn.execute(sql.SQL("SELECT indexed_to FROM {} WHERE topic = %s AND partition = %s FOR UPDATE")
                                .format(self.marks_table), (topic, partition)).fetchone()[0])
        if mark > end:  # the topic was recreated under the same name: its old rows name other records
            conn.execute(sql.SQL("DELETE FROM {} WHERE topic = %s AND partition = %s").format(self.rows_table),
                         (topic, partition))
            log.warning("history.index_reset", topic=topic, partition=partition, indexed_to=mark, end=end,
                        reason="the partition ends before the index's mark (topic recreated?)")
            mark = low
        start = max(mark, low)  # below `low`: deleted by retention; their rows stay until checked (kafold.history)
        positions: dict[kafka_io.TP, int] = {}
        indexed = unreadable = 0
        last = start
        conn.execute(sql.SQL("CREATE TEMP TABLE IF NOT EXISTS event_index_in (aggregate_id text, version bigint, "
                             '"offset" bigint, event_id text) ON COMMIT DELETE ROWS'))
        with conn.cursor().copy('COPY event_index_in (aggregate_id, version, "offset", event_id) FROM STDIN') as cp:
            for _, offsets, keys, values in kafka_io.read_many(consumer, {(topic, partition): (start, None)},
                                                               positions):
                for offset, key, value in zip(offsets, keys, values, strict=True):
                    try:
                        body = fields(value)
                        aid, version, event_id = body.aggregate_id, body.version, body.event_id
                        ok = type(version) is int and key is not None and key.decode() == aid
                    except Exception:  # not an event a fold can read: it is not history (the fold names it)
                        ok = False
                    if not ok:
                        unreadable += 1
                        continue
                    cp.write_row((aid, version, offset, str(event_id)))
                    indexed += 1
                last = offsets[-1] + 1
        indexed_to = max(last, positions.get((topic, partition), last))
        conn.execute(sql.SQL('INSERT INTO {} (topic, aggregate_id, version, partition, "offset", event_id) '
                             'SELECT DISTINCT ON (aggregate_id, version) %s, aggregate_id, version, %s, "offset", '
                             'event_id FROM event_index_in ORDER BY aggregate_id, version, "offset" '
                             "ON CONFLICT DO NOTHING").format(self.rows_table), (topic, partition))
        conn.execute(sql.SQL("UPDATE {} SET indexed_to = %s, updated_at = now() WHERE topic = %s AND partition = %s")
                     .format(self.marks_table), (indexed_to, topic, partition))
        done = CaughtUp(partition, start, indexed_to, indexed, unreadable, time.monotonic() - began)
        if indexed or unreadable:
            log.info("history.indexed", topic=topic, partition=partition, start=start, indexed_to=indexed_to,
                     events=indexed, unreadable=unreadable or None, duration_ms=round(done.duration_s * 1000, 1))
        return done


def _listed(consumer: Any, topic: str, partition: int) -> tuple[int, int]:
    """(first offset, end) as ListOffsets gives them to this read_committed consumer (the end: the last stable
    offset), fresh from the broker."""
    try:
        low, high = consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=10, cached=False)
    except KafkaException as e:
        raise RetriableError(f"{topic}[{partition}]: cannot list offsets: {e}") from e
    return max(0, low), max(0, high, low)
