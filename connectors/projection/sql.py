"""SQL for projections: identifier and type validation, and every statement composed with psycopg.sql.

Identifiers from the configuration are checked by `kafold.sqlnames` and always quoted with
`sql.Identifier`; SQL types are checked against TYPE_RE when the table is created, and the types used in casts
afterwards come from the catalog (`format_type`), never from the configuration text.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from psycopg import sql

from kafold.connectors.dlq import OPEN_STATUSES, DeadLetterStatus

TYPE_RE = re.compile(
    r"^[A-Za-z][A-Za-z0-9_]*( (precision|varying|with time zone|without time zone))?"
    r"(\(\s*\d{1,4}\s*(,\s*\d{1,4}\s*)?\))?"
    r"( (with|without) time zone)?(\[\])?$", re.IGNORECASE)


def check_type(tp: str) -> str | None:
    """None if `tp` looks like a plain SQL type (`text`, `numeric(12,2)`, `timestamp with time zone`, `int[]`)."""
    if not TYPE_RE.match(tp.strip()):
        return f"{tp!r} is not a plain SQL type name"
    return None


def qualified(schema: str, table: str) -> sql.Composed:
    return sql.SQL("{}.{}").format(sql.Identifier(schema), sql.Identifier(table))


def ids(names: Sequence[str]) -> sql.Composed:
    return sql.SQL(", ").join(sql.Identifier(n) for n in names)


@dataclass(frozen=True)
class TableShape:
    """A projection table as written: its columns (configured ones, then the version column) with the types the
    catalog reports (format_type), and its key columns."""

    schema: str
    table: str
    types: dict[str, str]
    keys: tuple[str, ...]
    version_column: str | None

    @property
    def name(self) -> sql.Composed:
        return qualified(self.schema, self.table)

    @property
    def written(self) -> tuple[str, ...]:
        return tuple(self.types)

    def cast(self, column: str) -> sql.SQL:
        return sql.SQL(self.types[column])  # from the catalog's format_type(), not from configuration text


def create_table(schema: str, table: str, columns: dict[str, str], keys: Sequence[str],
                 version_column: str | None) -> sql.Composed:
    cols = [sql.SQL("{} {}").format(sql.Identifier(c), sql.SQL(t.strip())) for c, t in columns.items()]
    if version_column:
        cols.append(sql.SQL("{} bigint NOT NULL DEFAULT 0").format(sql.Identifier(version_column)))
    cols.append(sql.SQL("PRIMARY KEY ({})").format(ids(keys)))
    # fillfactor 80: room on each page for HOT updates (a read model is updated far more than inserted into);
    # 42k -> 47k events/s at 1M events in `kafold bench projection`.
    return sql.SQL("CREATE TABLE IF NOT EXISTS {} ({}) WITH (fillfactor = 80)").format(
        qualified(schema, table), sql.SQL(", ").join(cols))


CATALOG_COLUMNS = sql.SQL(
    "SELECT a.attname, format_type(a.atttypid, a.atttypmod) FROM pg_attribute a "
    "WHERE a.attrelid = to_regclass(%s) AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum")

# Sets of columns with a unique index (the primary key or a unique constraint): ON CONFLICT needs one.
CATALOG_UNIQUE = sql.SQL(
    "SELECT array_agg(a.attname::text ORDER BY a.attname) FROM pg_index i "
    "JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey) "
    "WHERE i.indrelid = to_regclass(%s) AND i.indisunique AND i.indpred IS NULL GROUP BY i.indexrelid")


def regclass_text(schema: str, table: str) -> str:
    """The argument for to_regclass(): a quoted name, passed as a parameter (never spliced into SQL)."""
    return sql.SQL("{}.{}").format(sql.Identifier(schema), sql.Identifier(table)).as_string(None)


def key_join(shape: TableShape, alias: str = "t") -> sql.Composed:
    """`unnest(%s::t1[], ...) AS k(c1, ...)` joined on the key columns (one array parameter per key column)."""
    arrays = sql.SQL(", ").join(sql.SQL("%b::{}[]").format(shape.cast(k)) for k in shape.keys)
    on = sql.SQL(" AND ").join(sql.SQL("{}.{} = k.{}").format(sql.Identifier(alias), sql.Identifier(k),
                                                             sql.Identifier(k)) for k in shape.keys)
    return sql.SQL("unnest({}) AS k({}) ON {}").format(arrays, ids(shape.keys), on)


def select_rows(shape: TableShape) -> sql.Composed:
    """The current rows of a set of keys.

    Not locked: a concurrent writer of the same events waits on their tracking rows first, and this statement
    then sees its commit (READ COMMITTED); the merge's version guard covers any other overlap.
    """
    cols = sql.SQL(", ").join(sql.SQL("t.{}").format(sql.Identifier(c)) for c in shape.written)
    return sql.SQL("SELECT {} FROM {} t JOIN {}").format(cols, shape.name, key_join(shape))


def delete_rows(shape: TableShape) -> sql.Composed:
    arrays = sql.SQL(", ").join(sql.SQL("%b::{}[]").format(shape.cast(k)) for k in shape.keys)
    on = sql.SQL(" AND ").join(sql.SQL("t.{} = k.{}").format(sql.Identifier(k), sql.Identifier(k))
                               for k in shape.keys)
    return sql.SQL("DELETE FROM {} t USING unnest({}) AS k({}) WHERE {}").format(
        shape.name, arrays, ids(shape.keys), on)


def delete_all(shape: TableShape) -> sql.Composed:
    """Every row (a source table's truncate); DELETE, not TRUNCATE: it takes no exclusive lock, so readers of the
    projection wait for nothing, and it commits or rolls back with the batch and its checkpoint."""
    return sql.SQL("DELETE FROM {}").format(shape.name)


# A type's modifier (`character varying(3)`, `numeric(12,2)`, `timestamp(3) with time zone`): dropped from the cast
# in `upsert_rows`, so the column's own assignment applies it as an INSERT or COPY does (an explicit cast to
# `varchar(3)` would cut a longer value silently instead of refusing the row).
_TYPMOD = re.compile(r"\(\s*\d+\s*(,\s*\d+\s*)?\)")


def delete_older(shape: TableShape) -> sql.Composed:
    """Every row whose version is below the parameter (a completed snapshot's sweep, snapshot_sweep.py)."""
    assert shape.version_column
    return sql.SQL("DELETE FROM {} WHERE {} < %s").format(shape.name, sql.Identifier(shape.version_column))


def upsert_rows(shape: TableShape, guard: bool) -> sql.Composed:
    """Upsert rows given as one text array per written column (each value as COPY's text format has it, read by
    the column type's input function through the cast): one statement, no staging table, so it stays in the
    transaction's pipeline. With the version guard an older row never overwrites a newer one."""
    rest = [c for c in shape.written if c not in shape.keys]
    if rest:
        sets = sql.SQL(", ").join(sql.SQL("{} = EXCLUDED.{}").format(sql.Identifier(c), sql.Identifier(c))
                                  for c in rest)
        action: sql.Composable = sql.SQL("DO UPDATE SET {}").format(sets)
        if guard and shape.version_column:
            v = sql.Identifier(shape.version_column)
            action = sql.SQL("{} WHERE {}.{} < EXCLUDED.{}").format(action, shape.name, v, v)
    else:
        action = sql.SQL("DO NOTHING")
    arrays = sql.SQL(", ").join(sql.SQL("%b::text[]") for _ in shape.written)
    base = {c: sql.SQL(_TYPMOD.sub("", t)) for c, t in shape.types.items()}  # from the catalog, as `cast`
    values = sql.SQL(", ").join(sql.SQL("x.{}::{}").format(sql.Identifier(c), base[c]) for c in shape.written)
    return sql.SQL("INSERT INTO {} ({}) SELECT {} FROM unnest({}) AS x({}) ON CONFLICT ({}) {}").format(
        shape.name, ids(shape.written), values, arrays, ids(shape.written), ids(shape.keys), action)


def base_type(pg_type: str) -> str:
    """A column's type from the catalog without its modifier (`character varying(20)` -> `character varying`)."""
    return _TYPMOD.sub("", pg_type)


def upsert_whole_rows(shape: TableShape, tombstones: sql.Composed, int8: frozenset[str] = frozenset()
                      ) -> sql.Composed:
    """`upsert_rows` (guarded) for rows made whole by their batch's events (whole_rows.py), failing (`redo`) unless
    every event behind them is new: two arrays more (each row key as its tombstone stores it, and the version of the
    batch's first event of the key), then the tombstones' namespace (twice) and the number of rows. A row is written
    only when its stored version is below the new one and no tombstone of its key is at or above the first event's;
    and no stored row may be at or above a first event's version that is below its row's (a key with several
    events: their versions rise, checked in Python). The final SELECT reads the table as the statement began (a
    data-modifying WITH does not see its own changes): the versions before this upsert. The columns in `int8` come
    as bigint[] arrays (arrays.py), the others as text[]: each value is cast to its column's type. The namespace
    is given twice: a namespace without any tombstone (one probe, an InitPlan run once per statement) skips the
    probe per row (~0.7 µs a row in the server, docs/benchmarks.md); both read the statement's one snapshot, so
    the outcome is the per-row check's."""
    assert shape.version_column
    v = sql.Identifier(shape.version_column)
    written, extra = shape.written, ("kafold_row_key_text", "kafold_first_version")
    rk, first = (sql.Identifier(n) for n in extra)
    rest = [c for c in written if c not in shape.keys]
    sets = sql.SQL(", ").join(sql.SQL("{} = EXCLUDED.{}").format(sql.Identifier(c), sql.Identifier(c))
                              for c in rest) if rest else sql.SQL("{} = EXCLUDED.{}").format(v, v)
    base = {c: sql.SQL(_TYPMOD.sub("", t)) for c, t in shape.types.items()}  # from the catalog, as `cast`
    values = sql.SQL(", ").join(sql.SQL("x.{}::{}").format(sql.Identifier(c), base[c]) for c in written)
    arrays = sql.SQL(", ").join([*(sql.SQL("%b::bigint[]" if c in int8 else "%b::text[]") for c in written),
                                 sql.SQL("%b::text[]"),
                                 sql.SQL("%b::bigint[]")])
    on = sql.SQL(" AND ").join(sql.SQL("t.{} = x.{}::{}").format(sql.Identifier(k), sql.Identifier(k), base[k])
                               for k in shape.keys)
    return sql.SQL(
        "WITH x AS MATERIALIZED (SELECT * FROM unnest({arrays}) AS x({names})), "
        "w AS (INSERT INTO {table} AS t ({cols}) SELECT {values} FROM x WHERE NOT EXISTS (SELECT 1 FROM {tombs} g0 "
        "WHERE g0.namespace = %s) OR NOT EXISTS (SELECT 1 FROM {tombs} g "
        "WHERE g.namespace = %s AND g.row_key = x.{rk} AND g.version >= x.{first}) "
        "ON CONFLICT ({keys}) DO UPDATE SET {sets} WHERE t.{v} < EXCLUDED.{v} RETURNING 1) "
        "SELECT CASE WHEN (SELECT count(*) FROM w) = %s AND NOT EXISTS (SELECT 1 FROM x JOIN {table} t ON {on} "
        "WHERE x.{first} < x.{v}::bigint AND t.{v} >= x.{first}) THEN 0 ELSE {fail} END").format(
        arrays=arrays, names=ids((*written, *extra)), table=shape.name, cols=ids(written), values=values,
        tombs=tombstones, rk=rk, first=first, keys=ids(shape.keys), sets=sets, v=v, on=on, fail=redo("stale"))


def holds_unchanged(dead_letters: sql.Composed) -> sql.Composed:
    """Fails (`redo`) unless the connector's held keys are those given (a sorted text array): `held_keys`' check
    made in the server (as sets: twice the same array), for a transaction whose COMMIT is queued before its
    results are read."""
    return sql.SQL("SELECT CASE WHEN a @> %s::text[] AND a <@ %s::text[] THEN 0 ELSE {} END "
                   "FROM (SELECT coalesce(array_agg(k), '{{}}') FROM ({}) h(k)) s(a)").format(
        redo("holds_changed"), held_keys(dead_letters))


def track(tracking: sql.Composed) -> sql.Composed:
    """Record tracking keys as applied; one row: how many were new, and which — only when not all of them were
    (the common case, every event new, then transfers one row instead of a key per event)."""
    return sql.SQL("WITH ins AS (INSERT INTO {} (event_key, projection) SELECT unnest(%b::bytea[]), %s "
                   "ON CONFLICT DO NOTHING RETURNING event_key) "
                   "SELECT count(*), CASE WHEN count(*) < %s THEN array_agg(event_key) END FROM ins").format(tracking)


def track_new(tracking: sql.Composed) -> sql.Composed:
    """Record tracking keys expected to be new: a plain insert (a third cheaper than `track` in the server); one
    already there fails it with a unique violation, and the caller redoes the transaction with `track`."""
    return sql.SQL("INSERT INTO {} (event_key, projection) SELECT unnest(%b::bytea[]), %s").format(tracking)


def select_tombstones(tombstones: sql.Composed) -> sql.Composed:
    return sql.SQL("SELECT row_key, version FROM {} WHERE namespace = %s AND row_key = ANY(%s::text[])").format(
        tombstones)


def save_tombstones(tombstones: sql.Composed) -> sql.Composed:
    """Record deleted rows' versions (row key as JSON text); a tombstone only ever rises."""
    return sql.SQL(
        "INSERT INTO {} AS g (namespace, row_key, version) SELECT %s, k, v FROM unnest(%s::text[], %s::bigint[]) "
        "AS x(k, v) ON CONFLICT (namespace, row_key) DO UPDATE SET version = EXCLUDED.version "
        "WHERE g.version < EXCLUDED.version").format(tombstones)


def save_checkpoints(checkpoints: sql.Composed) -> sql.Composed:
    """Store next offsets; monotonic, so a zombie writer after a rebalance cannot move a checkpoint back."""
    return sql.SQL(
        "INSERT INTO {} AS c (connector, topic, partition, next_offset, updated_at) "
        "SELECT %s, t, p, o, now() FROM unnest(%b::text[], %b::int[], %b::bigint[]) AS x(t, p, o) "
        "ON CONFLICT (connector, topic, partition) DO UPDATE SET next_offset = EXCLUDED.next_offset, "
        "updated_at = now() WHERE c.next_offset < EXCLUDED.next_offset").format(checkpoints)


def redo(why: str) -> sql.Composed:
    """An expression that fails the statement evaluating it, naming `why`: reading a setting nobody defines raises
    UndefinedObject (never a DataError or IntegrityError, which would send the batch to be bisected) with the name
    in its message (REDO). The writer's one-round-trip path (whole_rows.py) uses it where the checks it cannot make
    in Python before its COMMIT is queued fail: the transaction rolls back and the batch is done the careful way."""
    return sql.SQL("current_setting({})::bigint").format(sql.Literal(REDO + why))


REDO = "kafold.redo_"


def fence_checkpoints(checkpoints: sql.Composed, strict: bool = False) -> sql.Composed:
    """Move each checkpoint from the offset the writer last stored (-1: none stored) to its next offset; the count
    of those moved. A checkpoint another writer moved is not moved (a row another transaction holds is waited for,
    then its committed offset compared: READ COMMITTED rechecks the WHERE), nor one inserted meanwhile; the caller
    fails the transaction when the count falls short (`strict`: the statement fails then, `redo`; one parameter
    more, the count expected)."""
    count = sql.SQL("(SELECT count(*) FROM moved) + (SELECT count(*) FROM added)")
    last = (sql.SQL("CASE WHEN {} = %s THEN 0 ELSE {} END").format(count, redo("checkpoint_moved")) if strict
            else count)
    return sql.SQL(
        "WITH x AS (SELECT * FROM unnest(%b::text[], %b::int[], %b::bigint[], %b::bigint[]) AS x(t, p, was, o)), "
        "moved AS (UPDATE {} AS c SET next_offset = x.o, updated_at = now() FROM x WHERE c.connector = %s "
        "AND c.topic = x.t AND c.partition = x.p AND c.next_offset = x.was RETURNING 1), "
        "added AS (INSERT INTO {} (connector, topic, partition, next_offset, updated_at) "
        "SELECT %s, t, p, o, now() FROM x WHERE x.was < 0 ON CONFLICT DO NOTHING RETURNING 1) "
        "SELECT {}").format(checkpoints, checkpoints, last)


def load_checkpoints(checkpoints: sql.Composed) -> sql.Composed:
    return sql.SQL("SELECT topic, partition, next_offset FROM {} WHERE connector = %s").format(checkpoints)


def insert_dead_letters(dead_letters: sql.Composed) -> sql.Composed:
    """A dead letter per record; seen again after a crash, the same coordinates are not recorded twice."""
    return sql.SQL(
        "INSERT INTO {} (connector, topic, partition, \"offset\", key, value, headers, error_class, "
        "error_message, reason, status, hold_key) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s) "
        "ON CONFLICT (connector, topic, partition, \"offset\") DO NOTHING").format(dead_letters)


def statuses(*wanted: DeadLetterStatus) -> sql.Composed:
    """`('new', 'held')`: dead-letter statuses as SQL literals, for `status IN {}` (literals, not parameters: the
    planner then matches the partial index on the open statuses)."""
    return sql.SQL("({})").format(sql.SQL(", ").join(sql.Literal(s.value) for s in wanted))


OPEN = statuses(*OPEN_STATUSES)  # dead letters that hold their row key back


def held_keys(dead_letters: sql.Composed) -> sql.Composed:
    """The row keys a connector holds back (heads and held events; a partial index covers exactly these rows)."""
    return sql.SQL("SELECT DISTINCT hold_key FROM {} WHERE connector = %s AND status IN {} "
                   "AND hold_key IS NOT NULL").format(dead_letters, OPEN)
