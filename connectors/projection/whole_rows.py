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

Planned ahead (`ahead`). Under load the task computes a batch's plan and its statement's parameters on the runner's
thread while the previous batch's transaction is in PostgreSQL (task.py, pipeline.py), so the server does not wait
for this Python between two batches. Such a plan assumes nothing is skipped (no record below a stored checkpoint,
none held, none dead-lettered) and the path on; the writer uses it only where its first transaction of the batch
finds exactly that, and plans again otherwise. Offsets and commits are untouched by this: the write it goes with is
still the one in flight, its checkpoint moved in its own transaction, Kafka's commit after it (pipeline.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

import psycopg
from psycopg import pq, sql
from psycopg.adapt import Dumper, PyFormat, Transformer

from kafold.connectors.api import SinkRecord
from kafold.connectors.projection import sql as q
from kafold.connectors.projection.arrays import INT8_ARRAY_OID, TEXT_ARRAY_OID, int8_array, text_array
from kafold.connectors.projection.fold import Candidates, Folded, Prepared, candidates
from kafold.connectors.projection.held_keys import hold_text
from kafold.connectors.projection.mapping import Mapping, MappingError
from kafold.connectors.projection.snapshot_sweep import ends_snapshot
from kafold.connectors.projection.table_rows import TableRows

Key = tuple[Any, ...]
# Column types whose values the arrays are built for directly (arrays.py), by the type without its modifier.
_TEXT_TYPES = frozenset({"text", "character varying"})
_INT_TYPES = frozenset({"bigint", "integer", "smallint"})


@dataclass
class WholePlan:
    """A batch collapsed: the last row of each key (its values in the order of `Mapping.written`), the version of its
    first event, and the batch as folded."""

    rows: dict[Key, tuple[Any, ...]]
    first: dict[Key, int]
    folded: Folded
    columns: list[Any] | None = None  # the upsert's arrays (its parameters but the namespace and the count),
    int8: frozenset[str] = frozenset()  # and the columns sent as bigint[], when planned ahead
    todo: Candidates | None = None  # the candidates it was made of, when planned ahead


class Dumped:
    """A statement's parameter dumped already (binary, with its type's oid): an array of a plan made ahead, whose
    dump (psycopg's list dumper runs in Python: most of what was left of the write's own Python) is then done on the
    runner's thread too."""

    __slots__ = ("data", "oid")

    def __init__(self, data: bytes, oid: int) -> None:
        self.data, self.oid = data, oid


class DumpedDumper(Dumper):
    """Sends a Dumped's bytes as they are, under its oid."""

    format = pq.Format.BINARY

    def get_key(self, obj: Any, format: PyFormat) -> Any:
        return (Dumped, obj.oid)

    def upgrade(self, obj: Any, format: PyFormat) -> Dumper:
        dumper = DumpedDumper(Dumped)
        dumper.oid = obj.oid
        return dumper

    def dump(self, obj: Any) -> bytes:
        return bytes(obj.data)


# Every connection made after this copies the global adapters: the writer's sessions know Dumped.
psycopg.adapters.register_dumper(Dumped, DumpedDumper)


class Collapse:
    """A batch's whole-row events collapsed one at a time to the last row of each key: the one rule of this path, for
    a batch's candidates (`WholeRows.plan`) and for records read straight from Kafka (whole_batch.py). `add` takes an
    Event or an envelope body (envelope.record_body: the same fields, the same values)."""

    __slots__ = ("applied", "first", "rows", "whole_row", "whole_types")

    def __init__(self, mapping: Mapping) -> None:
        self.whole_types, self.whole_row = mapping.whole_types, mapping.whole_row
        self.rows: dict[Key, tuple[Any, ...]] = {}
        self.first: dict[Key, int] = {}
        self.applied: dict[tuple[str, int], int] = {}

    def add(self, event: Any, key: Key, topic: str, partition: int) -> bool:
        """Take `event` of row `key`; False when the batch must go the careful way: a type whose rule does not make
        the whole row, a truncate, a snapshot's end, a value UNAVAILABLE, a record the mapping refuses (the careful
        way dead-letters it), or versions of a key not rising along the batch (the fold decides)."""
        if event.type not in self.whole_types or not key or ends_snapshot(event):
            return False
        try:
            row = self.whole_row(event, key)
        except MappingError:
            return False
        if row is None:
            return False
        rows = self.rows
        was = rows.get(key)
        if was is None:
            self.first[key] = event.version
        elif event.version <= was[-1]:  # the version, last
            return False
        rows[key] = row
        tp, applied = (topic, partition), self.applied
        applied[tp] = applied.get(tp, 0) + 1
        return True

    def plan(self) -> WholePlan:
        return WholePlan(self.rows, self.first, Folded({}, {}, 0, 0, [], applied=self.applied))


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

    def plan(self, todo: Candidates | None, ahead: WholePlan | None = None) -> WholePlan | None:
        """The batch's candidates collapsed, or None when one of them needs the stored row (or this path is off);
        `ahead`, when given, is the plan of the same candidates made before (`ahead`, or a WholeBatch's own:
        `todo` None)."""
        if not self.on or (todo is not None and todo.key_errors):
            return None
        if ahead is not None:
            return ahead
        assert todo is not None
        collapse, record_keys = Collapse(self.mapping), todo.record_keys
        add = collapse.add
        for r in todo.first.values():
            if not add(r.event, record_keys[id(r)], r.topic, r.partition):
                return None
        return collapse.plan()

    def lock(self, conn: psycopg.Connection[Any]) -> None:
        """The table's lock the upsert takes, taken first (pipelined): before the checkpoints' rows (module note)."""
        shape = self.table_rows.shape
        assert shape is not None
        conn.execute(sql.SQL("LOCK TABLE {} IN ROW EXCLUSIVE MODE").format(shape.name))

    def ahead(self, conn: psycopg.Connection[Any] | None, records: Sequence[SinkRecord], prepared: Prepared
              ) -> WholePlan | None:
        """`plan` of `records` with none skipped, its statement's parameters included, or None: made on the runner's
        thread before the batch's transaction (module note), while the writer's session runs the one before. It
        reads the session's adapters and encoding, runs no statement; a path switched off meanwhile is seen later."""
        if not self.on or conn is None or conn.closed or not records:
            return None
        todo = candidates(list(records), prepared, set())
        plan = self.plan(todo)
        if plan is None:
            return None
        plan.todo = todo
        return self.arranged(conn, plan)

    def arranged(self, conn: psycopg.Connection[Any] | None, plan: WholePlan) -> WholePlan | None:
        """`plan` with its statement's parameters made (`columns`), or None when they cannot be made ahead: on the
        runner's thread (module note), as `ahead` does, for a plan made already (a WholeBatch's)."""
        if not self.on or conn is None or conn.closed:
            return None
        try:
            plan.columns, plan.int8 = self.arrays(conn, plan)
        except psycopg.Error:  # the session closed under it (the writer reconnects): the write plans itself
            return None
        return plan

    def arrays(self, conn: psycopg.Connection[Any], plan: WholePlan) -> tuple[list[Any], frozenset[str]]:
        """The upsert's parameters but the namespace and the count, each array dumped: one per column, the keys, the
        versions; and the columns sent as bigint[]. Built directly (arrays.py) where every column is text or an
        integer type holding only such values, in a UTF-8 session; otherwise each value as COPY's text format has
        it (TableRows.text_columns, psycopg's dumpers), in text arrays."""
        keys, written = list(plan.rows), self.mapping.written
        direct = self._direct(conn, list(plan.rows.values()))
        if direct is not None:
            arrays, int8 = direct
            key_texts, firsts = text_array([hold_text(k) for k in keys]), int8_array([plan.first[k] for k in keys])
            if key_texts is not None and firsts is not None:
                return [*arrays, Dumped(key_texts, TEXT_ARRAY_OID), Dumped(firsts, INT8_ARRAY_OID)], int8
        rows = [dict(zip(written, values, strict=True)) for values in plan.rows.values()]
        texts: list[Any] = self.table_rows.text_columns(conn, rows)
        columns = [*texts, [hold_text(k) for k in keys], [plan.first[k] for k in keys]]
        # One rule, two cases: psycopg sends an empty list as text of no type, and dumps a column of nulls only as
        # text ('{NULL}', no element type to dump in binary), which a Dumped would send as binary. Such a batch's
        # arrays are adapted when the statement runs instead.
        if keys:
            dumper = Transformer(conn)
            data = dumper.dump_sequence(columns, [PyFormat.BINARY] * len(columns))
            if all(f == pq.Format.BINARY for f in dumper.formats or ()):
                dumped = [Dumped(bytes(d or b""), oid) for d, oid in zip(data, dumper.types or (), strict=True)]
                return dumped, frozenset()
        return columns, frozenset()

    def _direct(self, conn: psycopg.Connection[Any], rows: list[tuple[Any, ...]]
                ) -> tuple[list[Dumped], frozenset[str]] | None:
        shape = self.table_rows.shape
        assert shape is not None and shape.written == self.mapping.written  # the table's columns, as checked
        if conn.info.encoding != "utf-8":
            return None
        arrays: list[Dumped] = []
        int8: list[str] = []
        for i, column in enumerate(shape.written):
            kind = q.base_type(shape.types[column])
            values = list(map(itemgetter(i), rows))
            if kind in _INT_TYPES:
                data, oid = int8_array(values), INT8_ARRAY_OID
                int8.append(column)
            elif kind in _TEXT_TYPES:
                data, oid = text_array(values), TEXT_ARRAY_OID
            else:
                return None
            if data is None:
                return None
            arrays.append(Dumped(data, oid))
        return arrays, frozenset(int8)

    def upsert(self, conn: psycopg.Connection[Any], plan: WholePlan) -> None:
        """Queue the plan's one statement (pipelined); it fails unless every event of the batch applies."""
        shape = self.table_rows.shape
        assert shape is not None
        columns, int8 = (plan.columns, plan.int8) if plan.columns is not None else self.arrays(conn, plan)
        conn.execute(q.upsert_whole_rows(shape, self.table_rows.tombstones, int8),
                     (*columns, self.namespace, self.namespace, len(plan.rows)))
