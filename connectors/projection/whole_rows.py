"""WholeRows: a batch whose events each make their whole row, written without reading a row, in one round trip.

The live writer deduplicating by version (writer.py, `fence=True`) reads the rows of a batch's keys, folds the
batch onto them and writes the rows back. When every event of a batch is of a type whose rule sets every column
from the event (`Mapping.whole_types`: an upsert, no increment, no mapper) and none needs the stored row after all
(no UNAVAILABLE value, no snapshot's end, a row key for each), the stored row matters only through its version:
the fold would skip an event at or below it, or at or below its key's tombstone, and otherwise replace the row.
So such a batch is collapsed to the last event of each key (their versions must rise along the batch, else the
careful way) and written by ONE statement (sql.upsert_whole_rows), the version guard in its ON CONFLICT.

Exact outcomes, every guarantee kept. The writer counts every event of such a batch as applied, so the statement
fails (sql.redo) unless that is so: every row written (none held back by the guard or by a tombstone at or above the
first event of its key), and no stored row at or above the first event of a key with several. A failure rolls the
transaction back and the writer does the batch again the careful way (read, fold, write), which decides each event
exactly; batches stay careful until one has nothing stale (a replay after a crash pays this once). A row the table
refuses sends the batch the careful way too (its event may be stale there, and then nothing is written), which
isolates it if it is refused again. The checkpoint fence and the held keys' check are made in the server the same
way (the statements fail instead of returning what the writer would compare), so BEGIN, the holds lock and check,
the table's lock, the fence, the upsert, the dead letters and COMMIT go in one pipeline: one round trip a batch.
Their order: the table's lock before the checkpoints' rows (a rebuild's swap takes them in that order), the fence
before the upsert (its row locks make a second writer of the partition wait for the first's commit; the upsert's
snapshot is taken after that wait, so its checks see what the first committed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from kafold.connectors.projection import sql as q
from kafold.connectors.projection.config import VERSION_COLUMN
from kafold.connectors.projection.fold import Candidates, Folded
from kafold.connectors.projection.held_keys import hold_text
from kafold.connectors.projection.mapping import Mapping, MappingError, Row
from kafold.connectors.projection.snapshot_sweep import ends_snapshot
from kafold.connectors.projection.table_rows import TableRows

Key = tuple[Any, ...]


@dataclass
class WholePlan:
    """A batch collapsed: the last row of each key, the version of its first event, and the batch as folded."""

    rows: dict[Key, Row]
    first: dict[Key, int]
    folded: Folded


def redone(e: BaseException) -> bool:
    """Whether `e` is one of this path's checks failing (sql.redo): the batch is done again the careful way."""
    return isinstance(e, psycopg.errors.UndefinedObject) and q.REDO in str(e)


class WholeRows:
    """The one-statement path of one live writer's table (`usable`: its mapping has whole types); `on` is off from
    a redo until a careful batch commits with nothing stale."""

    def __init__(self, mapping: Mapping, table_rows: TableRows, namespace: str) -> None:
        self.mapping, self.table_rows, self.namespace = mapping, table_rows, namespace
        self.usable = mapping.guard and bool(mapping.whole_types) and not table_rows.cache_rows
        self.on = self.usable
        self.batches = 0  # batches committed by the one statement
        self.tried = False  # the transaction under way is the one statement's

    def plan(self, todo: Candidates) -> WholePlan | None:
        """The batch's candidates collapsed, or None when one of them needs the stored row (or this path is off)."""
        if not self.on or todo.key_errors:
            return None
        whole_types, whole_row, record_keys = self.mapping.whole_types, self.mapping.whole_row, todo.record_keys
        rows: dict[Key, Row] = {}
        first: dict[Key, int] = {}
        applied: dict[tuple[str, int], int] = {}
        for r in todo.first.values():
            event = r.event
            key = record_keys[id(r)]
            if event.type not in whole_types or not key or ends_snapshot(event):
                return None
            try:
                row = whole_row(event, key)
            except MappingError:  # the careful way dead-letters it
                return None
            if row is None:
                return None
            was = rows.get(key)
            if was is None:
                first[key] = event.version
            elif event.version <= was[VERSION_COLUMN]:  # not rising along the batch: the fold decides
                return None
            rows[key] = row
            tp = (r.topic, r.partition)
            applied[tp] = applied.get(tp, 0) + 1
        return WholePlan(rows, first, Folded({}, {}, 0, 0, [], applied=applied))

    def lock(self, conn: psycopg.Connection[Any]) -> None:
        """The table's lock the upsert takes, taken first (pipelined): before the checkpoints' rows (module note)."""
        shape = self.table_rows.shape
        assert shape is not None
        conn.execute(sql.SQL("LOCK TABLE {} IN ROW EXCLUSIVE MODE").format(shape.name))

    def upsert(self, conn: psycopg.Connection[Any], plan: WholePlan) -> None:
        """Queue the plan's one statement (pipelined); it fails unless every event of the batch applies."""
        shape = self.table_rows.shape
        assert shape is not None
        keys = list(plan.rows)
        columns: list[Any] = self.table_rows.text_columns(conn, list(plan.rows.values()))
        columns += [[hold_text(k) for k in keys], [plan.first[k] for k in keys]]
        conn.execute(q.upsert_whole_rows(shape, self.table_rows.tombstones),
                     (*columns, self.namespace, len(keys)))
