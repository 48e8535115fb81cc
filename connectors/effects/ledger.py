"""The delivery ledger in PostgreSQL: outcome rows per (connector, event id), failed attempts, parked events.

Note on commits
---------------
Rows are queued and written by one writer thread in set-based batches (COPY into a staging table, one merge),
never one round trip per event. A *succeeded* row needs no durability before the Kafka commit (a crash merely
re-delivers with the same idempotency key); a *parked* event does: its dead letter is acknowledged by the
dead-letter topic and its parked row committed to PostgreSQL before `on_durable` fires, and only then does the
tracker count it complete. A failing write is retried with backoff; completions simply wait (offsets hold back).

A producer chooses an event's id, type, key and payload: whatever they hold, the rows must be writable, or one event
stalls the ledger for good. Ids, keys and error texts are stored as `pg_text` (NUL and lone surrogates escaped; the
task hands over keys already so, see task.py), and a parked event PostgreSQL's jsonb cannot hold exactly (a NUL in
a string) is stored as {"base64": its JSON}, read back to the same event.
"""

from __future__ import annotations

import base64
import queue
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

import orjson
import psycopg
from psycopg import sql

from kafold import db, logs
from kafold.config import PostgresConfig
from kafold.connectors.api import ErrantRecordReporter, SinkRecord
from kafold.connectors.dlq import pg_text
from kafold.envelope import Event, body_json
from kafold.errors import FatalError, KafoldError, RetriableError
from kafold.pg import conninfo
from kafold.protect import Protector
from kafold.retry import retrying

log = logs.get("kafold.connectors.effects.ledger")

LEDGER_COLS = ("connector", "event_id", "event_type", "key", "topic", "partition", "offset", "status", "attempts",
               "first_attempt_at", "last_attempt_at", "completed_at", "latency_ms", "last_error")
MAX_ROWS = 5000
STOP_GRACE_S = 5.0  # after close, how long a failing write is still retried before its rows are dropped


def now() -> datetime:
    return datetime.now(UTC)


def table(schema: str, name: str) -> sql.Composed:
    return sql.SQL("{}.{}").format(sql.Identifier(schema), sql.Identifier(name))


class DeliveryStatus(StrEnum):
    """An event's delivery state in the ledger (the values are stored in effect_ledger.status)."""

    RETRYING = "retrying"
    SUCCEEDED = "succeeded"
    PARKED = "parked"
    SKIPPED = "skipped"


@dataclass(slots=True)
class LedgerUpdate:
    """One ledger update for an event: `attempts` is how many attempts this update adds."""

    record: SinkRecord
    status: DeliveryStatus
    attempts: int
    first_attempt_at: datetime | None
    last_attempt_at: datetime | None
    latency_ms: float | None = None
    error: str | None = None
    completed_at: datetime | None = None


@dataclass(slots=True)
class Parking:
    """A parked event: `head` = its own retries ran out; otherwise it waits behind its key's head."""

    record: SinkRecord
    head: bool
    error: str
    on_durable: Callable[[], None]
    exc: BaseException | None = None
    parked_at: datetime = field(default_factory=now)
    reported: bool = False  # its dead letter was acknowledged (a failed DB write does not send it again)


def _text(value: str | None) -> str | None:
    return None if value is None else pg_text(value)


def parked_json(event: Event, protector: Protector | None) -> str:
    """A parked event as its jsonb column holds it exactly: its JSON, or {"base64": its JSON} when that holds a NUL
    (jsonb refuses \\u0000). Its protected fields, which the intake opened, are sealed again by `protector` (the
    task's, kafold.protect): the row outlives a forget of the subject and must not keep a clear value
    (`parked_event` opens them)."""
    body = body_json(event if protector is None else protector.resealed(event))
    if b"\\u0000" in body:
        return orjson.dumps({"base64": base64.b64encode(body).decode()}).decode()
    return body.decode()


def parked_event(body: bytes, protector: Protector | None) -> Event:
    """The event `parked_json` stored (its JSON), its protected fields opened by `protector` as the intake opens
    them: the placeholder once the subject is forgotten; RecordError `decrypt-failed` when one does not open."""
    event = Event(**orjson.loads(body))
    return event if protector is None else protector.event(event)


def parked_body(stored: str) -> bytes:
    """The event JSON `parked_json` stored."""
    if stored.startswith('{"base64"'):
        return base64.b64decode(orjson.loads(stored)["base64"])
    return stored.encode()


class Ledger:
    """Batched writer (own thread) plus the few reads the executor needs: the intake's check on a connection of the
    executor's loop, the rest serialized on a second connection."""

    def __init__(self, pg: PostgresConfig, connector: str, reporter: ErrantRecordReporter | None,
                 flush_s: float = 0.0, protector: Protector | None = None) -> None:
        """`flush_s` (the `ledger_flush_ms` setting) is no longer a wait: rows are written as soon as the writer
        is free (`_take`); it is accepted so that callers and configurations setting it keep working. `protector`:
        the task's (TaskConfig.protector), sealing and opening the protected fields of parked events."""
        self.connector = connector
        self.schema = pg.schema
        self.reporter = reporter
        self.protector = protector
        self.flush_s = flush_s
        self._dsn = conninfo(pg)
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._stop_at: float | None = None  # when close was called: the writer's last retries count from there
        self._conn: psycopg.Connection[Any] | None = None  # the writer thread's
        self._read_lock = threading.Lock()
        self._reader: psycopg.Connection[Any] = psycopg.connect(self._dsn, autocommit=True)
        self._aread: psycopg.AsyncConnection[Any] | None = None  # the executor loop's (finished_ids)
        self._thread = threading.Thread(target=self._run, name=f"kafold-ledger-{connector}", daemon=True)
        self._thread.start()

    # ---- writes (any thread) ------------------------------------------------------------------------------
    def outcome(self, row: LedgerUpdate) -> None:
        self._queue.put(row)

    def park(self, item: Parking) -> None:
        self._queue.put(item)

    def barrier(self) -> Future[None]:
        """A future done once everything queued before it is written."""
        fut: Future[None] = Future()
        self._queue.put(fut)
        return fut

    def close(self, timeout: float = 10.0) -> None:
        self._stop_at = time.monotonic()
        self._stop.set()
        self._queue.put(None)
        self._thread.join(timeout)
        self._reader.close()

    # ---- the writer thread ----------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            batch = self._take()
            if batch is None:
                break
            self._write_retrying(batch)
            for item in batch:
                if isinstance(item, Parking):
                    item.on_durable()
                elif isinstance(item, Future):
                    item.set_result(None)
            if self._stopping_now():
                break
        self._disconnect()

    def _write_retrying(self, batch: list[Any]) -> None:
        """`_write` on the writer's connection, reconnecting and retrying with backoff while PostgreSQL is away;
        once closing, for up to STOP_GRACE_S after `close`, then the rows are dropped (their offsets hold back)."""
        def write() -> None:
            if self._conn is None or self._conn.closed:
                self._conn = psycopg.connect(self._dsn)
            self._write(self._conn, batch)

        def warn(e: Exception, delay: float) -> None:
            log.warning("ledger.write_retrying", connector=self.connector, error=str(e), retry_in_s=delay)
            self._disconnect()

        grace = STOP_GRACE_S if self._stop_at is None else max(0.0, self._stop_at + STOP_GRACE_S - time.monotonic())
        try:
            retrying(write, within_s=float("inf"), on_retry=warn, first_delay=0.1, stop=self._stop, grace_s=grace,
                     errors=(psycopg.Error, RetriableError))
        except (psycopg.Error, RetriableError) as e:
            self._disconnect()
            log.error("ledger.rows_dropped", hint="their offsets were not committed",
                      connector=self.connector, rows=len(batch), error=str(e))

    def _disconnect(self) -> None:
        if self._conn is not None:
            self._conn.close()
        self._conn = None

    def _stopping_now(self) -> bool:
        return self._stop.is_set() and self._queue.empty()

    def _take(self) -> list[Any] | None:
        """Natural batching: block for the first item only, then take what is queued already (up to MAX_ROWS) and
        write it at once. Under load the batches grow by themselves: what queued while the last write ran."""
        first = self._queue.get()
        if first is None:
            return None
        batch = [first]
        while len(batch) < MAX_ROWS:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is None:
                self._stop.set()
                break
            batch.append(item)
        return batch

    def _write(self, conn: psycopg.Connection[Any], batch: list[Any]) -> None:
        outcomes: dict[str, list[Any]] = {}
        failures: list[tuple[Any, ...]] = []
        parkings = [i for i in batch if isinstance(i, Parking)]
        for item in batch:
            if isinstance(item, LedgerUpdate):
                self._merge(outcomes, item, failures)
        heads = [p for p in parkings if p.head and not p.reported]
        if heads and self.reporter is not None:
            for p in heads:
                self.reporter.report(p.record, p.exc or RetriableError(p.error))
            self.reporter.flush(timeout=10.0)  # dead letters acknowledged before the parked rows commit
            for p in heads:
                p.reported = True
        with conn.transaction(), conn.cursor() as cur:
            if outcomes:
                self._copy_outcomes(cur, list(outcomes.values()))
            if failures:
                cur.executemany(sql.SQL(
                    "INSERT INTO {} (connector, event_id, attempted_at, latency_ms, outcome, error) "
                    "VALUES (%s, %s, %s, %s, %s, %s)").format(table(self.schema, "effect_attempts")), failures)
            if parkings:
                self._insert_parked(cur, parkings)

    def _merge(self, out: dict[str, list[Any]], o: LedgerUpdate, failures: list[tuple[Any, ...]]) -> None:
        r = o.record
        if o.status == DeliveryStatus.RETRYING or (o.status == DeliveryStatus.PARKED and o.attempts):
            failures.append((self.connector, pg_text(r.event.event_id), o.last_attempt_at, o.latency_ms, "failed",
                             _text(o.error)))
        row = out.get(r.event.event_id)
        if row is None:
            out[r.event.event_id] = [self.connector, pg_text(r.event.event_id), pg_text(r.event.type), r.key,
                                     r.topic, r.partition, r.offset, o.status, o.attempts, o.first_attempt_at,
                                     o.last_attempt_at, o.completed_at, o.latency_ms, _text(o.error)]
            return
        row[7] = o.status
        row[8] += o.attempts
        row[9] = row[9] or o.first_attempt_at
        row[10] = o.last_attempt_at or row[10]
        row[11] = o.completed_at or row[11]
        row[12] = o.latency_ms if o.latency_ms is not None else row[12]
        row[13] = _text(o.error) or row[13]

    def _copy_outcomes(self, cur: psycopg.Cursor[Any], rows: list[list[Any]]) -> None:
        ledger = table(self.schema, "effect_ledger")
        cols = sql.SQL(", ").join(map(sql.Identifier, LEDGER_COLS))
        cur.execute(sql.SQL("CREATE TEMP TABLE IF NOT EXISTS effect_ledger_stage "
                            "(LIKE {} INCLUDING DEFAULTS) ON COMMIT DELETE ROWS").format(ledger))
        with cur.copy(sql.SQL("COPY effect_ledger_stage ({}) FROM STDIN").format(cols)) as copy:
            for row in rows:
                copy.write_row(row)
        cur.execute(sql.SQL(
            "INSERT INTO {t} AS l ({cols}) SELECT {cols} FROM effect_ledger_stage "
            "ON CONFLICT (connector, event_id) DO UPDATE SET status = EXCLUDED.status, "
            "attempts = l.attempts + EXCLUDED.attempts, "
            "first_attempt_at = COALESCE(l.first_attempt_at, EXCLUDED.first_attempt_at), "
            "last_attempt_at = COALESCE(EXCLUDED.last_attempt_at, l.last_attempt_at), "
            "completed_at = COALESCE(EXCLUDED.completed_at, l.completed_at), "
            "latency_ms = COALESCE(EXCLUDED.latency_ms, l.latency_ms), "
            "last_error = COALESCE(EXCLUDED.last_error, l.last_error), "
            "topic = EXCLUDED.topic, partition = EXCLUDED.partition, \"offset\" = EXCLUDED.\"offset\"").format(
            t=ledger, cols=cols))

    def _insert_parked(self, cur: psycopg.Cursor[Any], parkings: list[Parking]) -> None:
        cur.executemany(sql.SQL(
            "INSERT INTO {} (connector, key, event_id, topic, partition, \"offset\", head, error, event, parked_at) "
            "VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s::jsonb, %s) "
            "ON CONFLICT (connector, event_id) DO NOTHING").format(
            table(self.schema, "effect_parked")),
            [(self.connector, p.record.key, pg_text(p.record.event.event_id), p.record.topic, p.record.partition,
              p.record.offset, p.head, pg_text(p.error), parked_json(p.record.event, self.protector), p.parked_at)
             for p in parkings])
        heads = {p.record.key: p for p in parkings if p.head}
        if heads:
            cur.executemany(sql.SQL(
                "INSERT INTO {} (connector, key, topic, partition, head_event_id, error, parked_at) "
                "VALUES (%s, %s, %s, %s, %s, %s, %s) ON CONFLICT (connector, key) DO UPDATE SET "
                "head_event_id = EXCLUDED.head_event_id, error = EXCLUDED.error, requested_action = NULL, "
                "requested_at = NULL").format(table(self.schema, "effect_parked_keys")),
                [(self.connector, k, p.record.topic, p.record.partition, pg_text(p.record.event.event_id),
                  pg_text(p.error), p.parked_at) for k, p in heads.items()])

    # ---- reads and release steps (executor thread pool; one at a time) ----------------------------------------
    @contextmanager
    def _reading(self, transaction: bool = False) -> Iterator[psycopg.Cursor[Any]]:
        """A cursor on the reader connection, reopened if PostgreSQL restarted since (a broken connection is
        closed here and the error raised as RetriableError: the caller's next try gets a fresh one)."""
        with self._read_lock:
            try:
                if self._reader.closed or self._reader.broken:
                    self._reader = psycopg.connect(self._dsn, autocommit=True)
                if transaction:
                    with self._reader.transaction(), self._reader.cursor() as cur:
                        yield cur
                else:
                    with self._reader.cursor() as cur:
                        yield cur
            except psycopg.OperationalError as e:
                self._reader.close()
                raise self._read_failed(e) from e
            except psycopg.errors.UndefinedTable as e:
                raise self._read_failed(e) from e

    def _read_failed(self, e: psycopg.Error) -> KafoldError:
        """What a failed read raises: RetriableError when PostgreSQL is away (the caller's next try reconnects),
        FatalError when kafold's tables are missing."""
        if isinstance(e, psycopg.errors.UndefinedTable):
            return FatalError(f"effect connector {self.connector!r}: kafold's tables are missing in schema "
                              f"{self.schema!r} ({str(e).splitlines()[0]}); run `kafold db upgrade` or set "
                              "postgres.migrate_on_start = true")
        return RetriableError(f"PostgreSQL: {e}")

    def _read(self, query: sql.Composed, params: Iterable[Any], prepare: bool | None = None) -> list[tuple[Any, ...]]:
        with self._reading() as cur:
            cur.execute(query, tuple(params), prepare=prepare)
            return cur.fetchall() if cur.description else []

    async def finished_ids(self, event_ids: Collection[str]) -> set[str]:
        """Ids among `event_ids` this connector already finished (succeeded, parked or skipped). Read on the effect
        executor's asyncio loop, on a connection only that loop uses: it waits for PostgreSQL without blocking the
        loop and without a hop to a worker thread and back (two turns at the interpreter lock per intake, beside
        the connectors' other threads). PostgreSQL away: RetriableError (the next call reconnects)."""
        if not event_ids:
            return set()
        stored = {pg_text(i): i for i in event_ids}
        query = sql.SQL("SELECT event_id FROM {} WHERE connector = %s AND event_id = ANY(%s) AND status <> %s").format(
            table(self.schema, "effect_ledger"))
        params = (self.connector, list(stored), DeliveryStatus.RETRYING)
        try:
            if self._aread is None or self._aread.closed or self._aread.broken:
                self._aread = await psycopg.AsyncConnection.connect(self._dsn, autocommit=True)
            async with self._aread.cursor() as cur:
                await cur.execute(query, params, prepare=db.BY_KEYS)
                rows = await cur.fetchall()
        except psycopg.OperationalError as e:
            await self.close_async()
            raise self._read_failed(e) from e
        except psycopg.errors.UndefinedTable as e:
            raise self._read_failed(e) from e
        return {stored[r[0]] for r in rows}

    async def close_async(self) -> None:
        """Close the executor loop's connection (on that loop)."""
        if self._aread is not None:
            await self._aread.close()
            self._aread = None

    def parked_keys(self) -> list[tuple[str, str, int]]:
        """(key, topic, partition) of this connector's parked keys."""
        rows = self._read(sql.SQL("SELECT key, topic, partition FROM {} WHERE connector = %s").format(
            table(self.schema, "effect_parked_keys")), (self.connector,))
        return [(r[0], r[1], r[2]) for r in rows]

    def requests(self) -> list[tuple[str, str]]:
        """(key, action) for every pending `retry` / `skip` request of this connector."""
        rows = self._read(sql.SQL("SELECT key, requested_action FROM {} WHERE connector = %s "
                                  "AND requested_action IS NOT NULL ORDER BY requested_at").format(
            table(self.schema, "effect_parked_keys")), (self.connector,))
        return [(r[0], r[1]) for r in rows]

    def parked_events(self, key: str) -> list[tuple[str, str, int, int, bytes]]:
        """(event_id, topic, partition, offset, event json) of a key's parked events, oldest first."""
        rows = self._read(sql.SQL("SELECT event_id, topic, partition, \"offset\", event::text FROM {} "
                                  "WHERE connector = %s AND key = %s ORDER BY seq").format(
            table(self.schema, "effect_parked")), (self.connector, key))
        return [(r[0], r[1], r[2], r[3], parked_body(r[4])) for r in rows]

    def settle(self, key: str, event_id: str, status: DeliveryStatus, outcome: LedgerUpdate | None) -> None:
        """A parked event left the queue (`succeeded` or `skipped`): ledger updated, parked row deleted."""
        with self._reading(transaction=True) as cur:
            cur.execute(sql.SQL("DELETE FROM {} WHERE connector = %s AND event_id = %s").format(
                table(self.schema, "effect_parked")), (self.connector, event_id))
            o = outcome
            cur.execute(sql.SQL(
                "UPDATE {} SET status = %s, attempts = attempts + %s, last_attempt_at = COALESCE(%s, "
                "last_attempt_at), completed_at = %s, latency_ms = COALESCE(%s, latency_ms) "
                "WHERE connector = %s AND event_id = %s").format(table(self.schema, "effect_ledger")),
                (status, o.attempts if o else 0, o.last_attempt_at if o else None, now(),
                 o.latency_ms if o else None, self.connector, event_id))

    def repark(self, key: str, event_id: str, error: str, outcome: LedgerUpdate) -> None:
        """A released event failed again: it becomes the key's head again; the request is answered."""
        with self._reading(transaction=True) as cur:
            cur.execute(sql.SQL("UPDATE {} SET head = true, error = %s WHERE connector = %s AND event_id = %s").format(
                table(self.schema, "effect_parked")), (pg_text(error), self.connector, event_id))
            cur.execute(sql.SQL("UPDATE {} SET head_event_id = %s, error = %s, requested_action = NULL, "
                                "requested_at = NULL WHERE connector = %s AND key = %s").format(
                table(self.schema, "effect_parked_keys")), (event_id, pg_text(error), self.connector, key))
            cur.execute(sql.SQL("UPDATE {} SET status = %s, attempts = attempts + %s, last_attempt_at = %s, "
                                "last_error = %s WHERE connector = %s AND event_id = %s").format(
                table(self.schema, "effect_ledger")),
                (DeliveryStatus.PARKED, outcome.attempts, outcome.last_attempt_at, pg_text(error), self.connector,
                 event_id))

    def unpark(self, key: str) -> None:
        self._read(sql.SQL("DELETE FROM {} WHERE connector = %s AND key = %s").format(
            table(self.schema, "effect_parked_keys")), (self.connector, key))
