"""Held keys of a projection: repairing (`dlq replay`) or dropping (`dlq discard`) the dead letter that holds a row
key back, then applying the events held behind it, in order, with an answer per record.

Note on offsets and commits
---------------------------
Held events are below the connector's checkpoint (the transaction that held them recorded them as dead letters with
status `held` together with the checkpoint that passes them) and not in the tracking table, so applying them here
is their first application; the checkpoints are left alone (`advance=False`). A release applies one event per
transaction, together with its dead letter's new status, while this session holds the connector's holds lock
(exclusive, session-level): the projection's writer takes that lock shared at the start of every transaction,
before it reads the held keys, so it never holds an event of a key being released nor applies one of a key still
held. An event refused again during a release becomes the key's head (status `new`): the events behind it stay
held, in order.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import dict_row

from kafold import db
from kafold.config import PostgresConfig
from kafold.connectors.api import RawRecord, SinkRecord
from kafold.connectors.convert.api import Converter
from kafold.connectors.dlq import DeadLetterStatus, stored_headers
from kafold.connectors.intake import Intake
from kafold.connectors.projection import sql as q
from kafold.connectors.projection.config import VERSION_COLUMN, ProjectionConfig
from kafold.connectors.projection.held_keys import holds_lock
from kafold.connectors.projection.mapping import Mapping
from kafold.connectors.projection.writer import BatchResult, ProjectionWriter
from kafold.errors import KafoldError, RecordError, UnknownTypeError
from kafold.protect import Protector
from kafold.upcast import NONE, Upcaster

COLUMNS = 'id, connector, topic, partition, "offset", key, value, headers, status, hold_key'


class Disposition(StrEnum):
    """What became of a dead letter that was replayed or discarded."""

    APPLIED = "applied"
    HELD = "held"  # not applied: it waits behind its row key's head
    STALE = "stale"
    DUPLICATE = "duplicate"
    REFUSED = "refused"
    DISCARDED = "discarded"


@dataclass
class DeadLetterAction:
    """What a replay or a discard did to one dead letter."""

    id: int
    where: str  # topic[partition]@offset
    what: Disposition
    detail: str

    @property
    def applied(self) -> bool:
        return self.what == Disposition.APPLIED

    def line(self) -> str:
        return f"#{self.id} {self.where}: {self.detail}"


class _Refused(KafoldError):
    """The projection refused the event again (mapping or database); its transaction rolled back."""


def held_keys(pgc: PostgresConfig, connector: str | None = None) -> dict[str, int]:
    """Row keys held back behind a dead letter, per connector (from the dead-letter table)."""
    where = sql.SQL(" AND connector = %s" if connector else "")
    query = sql.SQL("SELECT connector, count(DISTINCT hold_key) FROM {} WHERE status IN {} "
                    "AND hold_key IS NOT NULL{} GROUP BY connector").format(db.table(pgc, "dead_letters"), q.OPEN,
                                                                            where)
    with db.connect(pgc) as conn:
        rows = conn.execute(query, (connector,) if connector else ()).fetchall()
    return {name: int(n) for name, n in rows}


class Release:
    """Replays or discards dead letters of one postgres-projection connector; a context manager holding the
    connector's holds lock."""

    def __init__(self, pgc: PostgresConfig, name: str, config: ProjectionConfig, mapping: Mapping,
                 repair: str, upcaster: Upcaster = NONE, converter: Converter | None = None,
                 protector: Protector | None = None) -> None:
        self.pgc, self.name, self.config, self.mapping = pgc, name, config, mapping
        # A replayed dead letter goes through the connector's one intake, as if read live (unknown types refused;
        # protected fields opened by the caller's `protector`, kafold.protect).
        self.intake = Intake(name, mapping.handles, "dead-letter", upcaster, converter=converter, protector=protector)
        self.repair = repair  # the command that rebuilds the projection (named in "skipped as stale")
        self.writer = ProjectionWriter(pgc, config, mapping, name)
        self._dead = db.table(pgc, "dead_letters")

    def __enter__(self) -> Release:
        conn = self.writer.connection()
        conn.execute("SELECT pg_advisory_lock(hashtext(%s))", (holds_lock(self.name),))
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            conn = self.writer.conn
            if conn is not None and not conn.closed and not conn.broken:
                conn.execute("SELECT pg_advisory_unlock(hashtext(%s))", (holds_lock(self.name),))
        finally:
            self.writer.close()  # ending the session releases the lock in any case

    # ---- reading ------------------------------------------------------------------------------------------
    def _one(self, where: str, params: tuple[Any, ...]) -> dict[str, Any] | None:
        """The first dead letter of this connector matching `where` (SQL with %s placeholders for `params`)."""
        conn = self.writer.connection()
        with conn.cursor(row_factory=dict_row) as cur:
            return cur.execute(sql.SQL("SELECT " + COLUMNS + " FROM {} WHERE connector = %s AND " + where +
                                       " ORDER BY id LIMIT 1").format(self._dead), (self.name, *params)).fetchone()

    @staticmethod
    def _where(r: dict[str, Any]) -> str:
        return f"{r['topic']}[{r['partition']}]@{r['offset']}"

    def _head(self, hold_key: str) -> dict[str, Any] | None:
        return self._one("hold_key = %s AND status = %s", (hold_key, DeadLetterStatus.NEW.value))

    def _set(self, conn: psycopg.Connection[Any], dead_id: int, status: DeadLetterStatus,
             error: str | None = None) -> None:
        conn.execute(sql.SQL("UPDATE {} SET status = %s, replayed_at = CASE WHEN %s THEN now() ELSE replayed_at END, "
                             "error_message = coalesce(%s, error_message) WHERE id = %s").format(self._dead),
                     (status.value, status is DeadLetterStatus.REPLAYED, error, dead_id))

    # ---- actions ------------------------------------------------------------------------------------------
    def replay(self, dead_id: int, value: bytes | None = None) -> list[DeadLetterAction]:
        """Apply dead letter `dead_id` (with `value` instead of its own, if given); if it held its row key back,
        then the events held behind it, in order."""
        r = self._one("id = %s", (dead_id,))
        if r is None:
            raise KafoldError(f"no dead letter with id {dead_id} for connector {self.name!r}")
        if r["status"] == DeadLetterStatus.HELD:
            head = self._head(r["hold_key"])
            behind = f"dead letter #{head['id']} ({self._where(head)})" if head else "an earlier dead letter"
            return [DeadLetterAction(dead_id, self._where(r), Disposition.HELD,
                                     f"held behind {behind} of row key {r['hold_key']}: replay or discard that one "
                                     "first (this one follows it)")]
        if value is not None:
            r["value"] = value
        heads = r["status"] == DeadLetterStatus.NEW and r["hold_key"] is not None
        first = self._apply(r, mark_always=False)
        out = [first]
        if heads and first.applied:
            out += self._release(r["hold_key"])
        return out

    def discard(self, dead_id: int) -> list[DeadLetterAction]:
        """Mark dead letter `dead_id` discarded (never applied); if it held its row key back, apply the events
        held behind it, in order."""
        r = self._one("id = %s", (dead_id,))
        if r is None:
            raise KafoldError(f"no dead letter with id {dead_id} for connector {self.name!r}")
        conn = self.writer.connection()
        with db.transaction(conn):
            self._set(conn, dead_id, DeadLetterStatus.DISCARDED)
        if r["status"] == DeadLetterStatus.HELD:
            return [DeadLetterAction(dead_id, self._where(r), Disposition.DISCARDED,
                                     f"discarded: it will not be applied when row key {r['hold_key']} is released")]
        out = [DeadLetterAction(dead_id, self._where(r), Disposition.DISCARDED, "discarded (not applied)")]
        if r["status"] == DeadLetterStatus.NEW and r["hold_key"] is not None:
            out += self._release(r["hold_key"])
        return out

    def _release(self, hold_key: str) -> list[DeadLetterAction]:
        """Apply the events held behind `hold_key`, oldest first, until none is left or one is refused."""
        out: list[DeadLetterAction] = []
        while True:
            r = self._one("hold_key = %s AND status = %s", (hold_key, DeadLetterStatus.HELD.value))
            if r is None:
                if out:
                    out[-1].detail += f"; row key {hold_key} released (no event held any more)"
                return out
            got = self._apply(r, mark_always=True)
            out.append(got)
            if got.what == Disposition.REFUSED:
                conn = self.writer.connection()
                with db.transaction(conn):
                    self._set(conn, r["id"], DeadLetterStatus.NEW, got.detail)
                left = self._count_held(hold_key)
                got.detail += f"; it now holds row key {hold_key} back ({left} event(s) held behind it)"
                return out

    def _count_held(self, hold_key: str) -> int:
        row = self.writer.connection().execute(sql.SQL(
            "SELECT count(*) FROM {} WHERE connector = %s AND hold_key = %s AND status = %s").format(
            self._dead), (self.name, hold_key, DeadLetterStatus.HELD.value)).fetchone()
        return int(row[0]) if row else 0

    def _apply(self, r: dict[str, Any], *, mark_always: bool) -> DeadLetterAction:
        """One dead letter through the projection, in one transaction with its new status (`replayed` when
        applied; with `mark_always` also when skipped as a duplicate or stale, which ends its hold)."""
        where = self._where(r)
        try:
            headers = stored_headers(r["headers"])
            event = self.intake.event(r["key"], r["value"], headers, topic=r["topic"],
                                      partition=r["partition"], offset=r["offset"])
        except UnknownTypeError as e:  # "unknown event type 'X'"
            return DeadLetterAction(r["id"], where, Disposition.REFUSED,
                                    f"still refused: the projection does not handle {str(e).removeprefix('unknown ')}")
        except RecordError as e:
            return DeadLetterAction(r["id"], where, Disposition.REFUSED, f"still refused: {e}")
        if event is None:  # "dead-letter": an unhandled type raises; a converter found no event (a tombstone)
            return DeadLetterAction(r["id"], where, Disposition.REFUSED, "still refused: the record carries no event")
        # its stored bytes as its source: refused again, what is kept of it is those bytes (sealed), never the event
        # opened here (SinkRecord.source)
        source = RawRecord(r["topic"], r["partition"], r["offset"], r["key"], r["value"], tuple(headers))
        record = SinkRecord(r["topic"], r["partition"], r["offset"], event.aggregate_id, event, source=source)

        def refuse(bad: Any) -> None:
            raise _Refused("; ".join(str(e) for _, e in bad))

        def mark(conn: psycopg.Connection[Any], result: BatchResult) -> None:
            if mark_always or not (result.duplicates or result.stale):
                self._set(conn, r["id"], DeadLetterStatus.REPLAYED)

        try:
            result = self.writer.write([record], advance=False, report=refuse, hold=False, then=mark)
        except _Refused as e:
            return DeadLetterAction(r["id"], where, Disposition.REFUSED, f"still refused: {e}")
        return self._outcome(r["id"], where, record, result)

    def _outcome(self, dead_id: int, where: str, record: SinkRecord, result: BatchResult) -> DeadLetterAction:
        event = record.event
        what = f"{event.type} v{event.version} of {event.aggregate_id}"
        if result.duplicates:
            return DeadLetterAction(dead_id, where, Disposition.DUPLICATE, f"{what}: not applied, already applied "
                                    "before (its event id is in the projection's tracking records)")
        key = self.mapping.key(event)
        row = self.writer.row_of(key)
        version = None if row is None else row.get(VERSION_COLUMN)
        if result.stale:
            return DeadLetterAction(dead_id, where, Disposition.STALE, f"{what}: skipped as stale: the row is at "
                                    f"version {version}, which already reflects later events; repair the row with "
                                    f"`{self.repair}`")
        now = "the row is deleted" if row is None else f"the row is at version {version}"
        unordered = "" if self.config.version_guard else " (version_guard = false: applied on top of the row as " \
                                                         "it is, not in version order)"
        return DeadLetterAction(dead_id, where, Disposition.APPLIED, f"{what}: applied; {now}{unordered}")
