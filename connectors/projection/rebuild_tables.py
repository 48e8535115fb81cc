"""RebuildTables: a rebuild's tables and bookkeeping in PostgreSQL, as rebuild.py's Rebuild runs them.

The shadow table made, or the run in progress found to resume (`begin`); the run's progress saved in rebuild_state
(`save`); its bookkeeping — the shadow's checkpoints, tracking records, tombstones and dead letters, under the
rebuild's key — forgotten (`forget`); and under the live table's lock, in the swap transaction Rebuild holds, the
shadow swapped in with the live connector's bookkeeping made to match it (`swap`). Handed the plan's values, never
the plan: this module reads and writes PostgreSQL and nothing of Kafka.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import psycopg
from psycopg import sql

from kafold import db
from kafold.config import PostgresConfig
from kafold.connectors.dlq import DeadLetterStatus, stored_headers
from kafold.connectors.projection import sql as q
from kafold.connectors.projection.config import VERSION_COLUMN, ProjectionConfig
from kafold.connectors.projection.rebuild_state import ACTIVE
from kafold.connectors.projection.writer import tracking_key, tracking_prefix
from kafold.envelope import DecodeError, decode


class RebuildTables:
    """The tables of the rebuild of projection `name` (its live connector's key) into `shadow`, whose bookkeeping
    is kept under `key`; `keep_old`: the swap keeps the old table, renamed."""

    def __init__(self, pgc: PostgresConfig, config: ProjectionConfig, name: str, key: str, shadow: str,
                 keep_old: bool) -> None:
        self.pgc, self.config, self.name, self.key, self.shadow = pgc, config, name, key, shadow
        self.keep_old = keep_old
        self.meta: psycopg.Connection[Any] | None = None  # see session

    def begin(self) -> str | None:
        """The phase of the rebuild in progress, to resume; None: started afresh (the shadow made again, the
        bookkeeping forgotten, rebuild_state at 'copying')."""
        c = self.config
        states, shadow = db.table(self.pgc, "rebuild_state"), q.qualified(c.schema, self.shadow)
        with db.connect(self.pgc) as conn, conn.transaction():
            row = conn.execute(sql.SQL("SELECT phase, shadow_table, to_regclass(%s) IS NOT NULL FROM {} "
                                       "WHERE projection = %s FOR UPDATE").format(states),
                               (q.regclass_text(c.schema, self.shadow), self.name)).fetchone()
            if row is not None and row[0] in ACTIVE and row[1] == self.shadow and row[2]:
                return str(row[0])
            conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(shadow))
            self.forget(conn)
            conn.execute(q.create_table(c.schema, self.shadow, c.columns, c.key_columns, VERSION_COLUMN))
            conn.execute(sql.SQL(
                "INSERT INTO {} (projection, shadow_table, namespace, phase, events, started_at, updated_at) "
                "VALUES (%s, %s, %s, 'copying', 0, now(), now()) ON CONFLICT (projection) DO UPDATE SET "
                "shadow_table = EXCLUDED.shadow_table, namespace = EXCLUDED.namespace, phase = 'copying', "
                "events = 0, started_at = now(), updated_at = now()").format(states),
                (self.name, self.shadow, self.key))
        return None

    def forget(self, conn: psycopg.Connection[Any]) -> None:
        """Remove the rebuild's checkpoints, tracking records, tombstones and dead letters (the live ones stay)."""
        pgc, key = self.pgc, self.key
        conn.execute(sql.SQL("DELETE FROM {} WHERE connector = %s").format(db.table(pgc, "checkpoints")), (key,))
        conn.execute(sql.SQL("DELETE FROM {} WHERE projection = %s").format(db.table(pgc, "tracking")), (key,))
        conn.execute(sql.SQL("DELETE FROM {} WHERE namespace = %s").format(db.table(pgc, "tombstones")), (key,))
        conn.execute(sql.SQL("DELETE FROM {} WHERE connector = %s").format(db.table(pgc, "dead_letters")), (key,))

    def save(self, phase: str, events: int, conn: psycopg.Connection[Any] | None = None) -> None:
        """The run's phase and the events its shadow covers, into rebuild_state (on `conn`, else `session`)."""
        query = sql.SQL("UPDATE {} SET phase = %s, events = %s, updated_at = now() WHERE projection = %s").format(
            db.table(self.pgc, "rebuild_state"))
        (conn or self.session()).execute(query, (phase, events, self.name))

    def session(self) -> psycopg.Connection[Any]:
        """One session (autocommit) for reading the live checkpoints and saving progress, batch after batch."""
        if self.meta is None or self.meta.closed or self.meta.broken:
            self.meta = db.connect(self.pgc)
        return self.meta

    def close(self) -> None:
        if self.meta is not None:
            self.meta.close()

    def swap(self, conn: psycopg.Connection[Any], live_exists: bool) -> None:
        """Under the lock, with the shadow equal to the live connector's checkpoints: swap the shadow in."""
        c, name, key = self.config, self.name, self.key
        live, shadow = q.qualified(c.schema, c.table), q.qualified(c.schema, self.shadow)
        dead = db.table(self.pgc, "dead_letters")
        self._rename(conn, live_exists, live, shadow)
        conn.execute(sql.SQL("DELETE FROM {} WHERE connector = %s").format(db.table(self.pgc, "checkpoints")), (key,))
        # The events the rebuild dead-lettered or held are not in the new table: the live writer's tracking must not
        # claim them (a `dlq replay` in the old table tracked them there), or their replay would be a duplicate.
        self._untrack(conn, dead)
        # The new table's deleted rows keep their versions for the live writer deduplicating by version
        # (`dedup = "version"`, writer.py): without them a record of such a key produced twice would open the row
        # again. Both tables folded the same events, so a tombstone of either holds for the new one: the higher wins.
        tombstones = db.table(self.pgc, "tombstones")
        conn.execute(sql.SQL(
            "INSERT INTO {} AS g (namespace, row_key, version) SELECT %s, row_key, version FROM {} "
            "WHERE namespace = %s ON CONFLICT (namespace, row_key) DO UPDATE SET version = EXCLUDED.version "
            "WHERE g.version < EXCLUDED.version").format(tombstones, tombstones), (name, key))
        # Held keys follow the new table: a key the live connector held that the rebuild applied is released (its
        # dead letters count as replayed), and one the rebuild holds is held again, even if it had been repaired
        # in the old table (the repair was not in the topic the rebuild read).
        conn.execute(sql.SQL(
            "UPDATE {} l SET status = %s, replayed_at = now() WHERE l.connector = %s AND l.status IN {} "
            "AND l.hold_key IS NOT NULL AND NOT EXISTS (SELECT 1 FROM {} d WHERE d.connector = %s "
            "AND d.topic = l.topic AND d.partition = l.partition AND d.\"offset\" = l.\"offset\")").format(
            dead, q.OPEN, dead), (DeadLetterStatus.REPLAYED.value, name, key))
        conn.execute(sql.SQL(
            "UPDATE {} l SET status = d.status, hold_key = d.hold_key, reason = d.reason, error_class = "
            "d.error_class, error_message = d.error_message, replayed_at = NULL FROM {} d WHERE d.connector = %s "
            "AND l.connector = %s AND d.topic = l.topic AND d.partition = l.partition AND d.\"offset\" = "
            "l.\"offset\" AND d.hold_key IS NOT NULL AND d.status IN {}").format(dead, dead, q.OPEN),
            (key, name))
        # Records the new mapping refused become the live connector's dead letters (not lost); those the live
        # connector already recorded are dropped with the rest of the rebuild's bookkeeping.
        conn.execute(sql.SQL(
            "UPDATE {} d SET connector = %s WHERE d.connector = %s AND NOT EXISTS (SELECT 1 FROM {} l "
            "WHERE l.connector = %s AND l.topic = d.topic AND l.partition = d.partition "
            "AND l.\"offset\" = d.\"offset\")").format(dead, dead), (name, key, name))

    def _untrack(self, conn: psycopg.Connection[Any], dead: sql.Composed) -> None:
        """Delete the live namespace's tracking records of the events the rebuild dead-lettered or held."""
        prefix, keys = tracking_prefix(self.name), []
        rows = conn.execute(sql.SQL("SELECT key, value, headers FROM {} WHERE connector = %s").format(dead),
                            (self.key,)).fetchall()
        for key, value, headers in rows:
            try:
                keys.append(tracking_key(prefix, decode(key, value, stored_headers(headers)).event_id))
            except DecodeError:
                continue  # never decoded, so never applied nor tracked
        if keys:
            conn.execute(sql.SQL("DELETE FROM {} WHERE event_key = ANY(%s)").format(db.table(self.pgc, "tracking")),
                         (keys,))

    def _rename(self, conn: psycopg.Connection[Any], exists: bool, live: sql.Composed, shadow: sql.Composed) -> None:
        """live -> old (dropped unless kept), shadow -> live; the primary key keeps the live table's name."""
        c = self.config
        pk = sql.SQL("SELECT conname FROM pg_constraint WHERE conrelid = to_regclass(%s) AND contype = 'p'")
        live_pk = conn.execute(pk, (q.regclass_text(c.schema, c.table),)).fetchone() if exists else None
        shadow_pk = conn.execute(pk, (q.regclass_text(c.schema, self.shadow),)).fetchone()
        if exists:
            old = f"{c.table[:40]}_old_{datetime.now(UTC):%Y%m%d%H%M%S}"
            conn.execute(sql.SQL("ALTER TABLE {} RENAME TO {}").format(live, sql.Identifier(old)))
            if not self.keep_old:
                conn.execute(sql.SQL("DROP TABLE {}").format(q.qualified(c.schema, old)))
            elif live_pk is not None:
                conn.execute(sql.SQL("ALTER TABLE {} RENAME CONSTRAINT {} TO {}").format(
                    q.qualified(c.schema, old), sql.Identifier(live_pk[0]), sql.Identifier(f"{old}_pkey")))
        conn.execute(sql.SQL("ALTER TABLE {} RENAME TO {}").format(shadow, sql.Identifier(c.table)))
        if live_pk is not None and shadow_pk is not None:
            conn.execute(sql.SQL("ALTER TABLE {} RENAME CONSTRAINT {} TO {}").format(
                live, sql.Identifier(shadow_pk[0]), sql.Identifier(live_pk[0])))
