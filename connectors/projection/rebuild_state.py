"""A rebuild's bookkeeping in PostgreSQL: its state row, the checkpoints it compares and its progress, read by
`kafold projection status` and the daemon's /metrics without loading the rebuild machinery."""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import dict_row

from kafold import db
from kafold.config import PostgresConfig
from kafold.connectors.api import TopicPartition
from kafold.connectors.projection import sql as q

ACTIVE = ("copying", "catching-up")

__all__ = ["ACTIVE", "offsets", "progress", "state"]


def state(pgc: PostgresConfig, name: str) -> dict[str, Any] | None:
    """The rebuild_state row of projection `name` (None if it was never rebuilt)."""
    with db.connect(pgc, row_factory=dict_row) as conn:
        return conn.execute(sql.SQL("SELECT * FROM {} WHERE projection = %s").format(
            db.table(pgc, "rebuild_state")), (name,)).fetchone()


def offsets(pgc: PostgresConfig, key: str, conn: psycopg.Connection[Any] | None = None,
            lock: bool = False) -> dict[TopicPartition, int]:
    """The checkpoints stored under `key` (FOR UPDATE with `lock`: blocks the writer's next checkpoint)."""
    query = sql.SQL("{} FOR UPDATE" if lock else "{}").format(q.load_checkpoints(db.table(pgc, "checkpoints")))
    if conn is None:
        with db.connect(pgc) as own:
            rows = own.execute(query, (key,)).fetchall()
    else:
        rows = conn.execute(query, (key,)).fetchall()
    return {TopicPartition(t, p): o for t, p, o in rows}


def progress(pgc: PostgresConfig, name: str) -> tuple[str, int, int] | None:
    """(phase, offsets the shadow covers, offsets it is behind the live connector) of the rebuild of projection
    `name`, from PostgreSQL alone (what the daemon's /metrics reports); None if it was never rebuilt."""
    row = state(pgc, name)
    if row is None:
        return None
    behind = 0
    if row["phase"] in ACTIVE:
        live, shadow = offsets(pgc, name), offsets(pgc, f"{name}:rebuild")
        behind = sum(max(0, off - shadow.get(tp, 0)) for tp, off in live.items())
    return str(row["phase"]), int(row["events"]), behind
