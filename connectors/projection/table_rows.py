"""TableRows: one projection table's rows as its writer reads and writes them (writer.py has the protocol).

The table's shape, checked once per session (`check`); its rows read by key, with their tombstones when the writer
deduplicates by version; the rows kept between batches (`cache`) for a writer that is its table's only writer; and
the changed rows' values as PostgreSQL takes them. The writer owns one and hands it its open connection; this
class opens, commits and retries nothing.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence
from typing import Any

import orjson
import psycopg
from psycopg.adapt import PyFormat, Transformer
from psycopg.types.json import Jsonb

from kafold import db
from kafold.config import PostgresConfig
from kafold.connectors.projection import sql as q
from kafold.connectors.projection.config import VERSION_COLUMN, ProjectionConfig
from kafold.connectors.projection.held_keys import hold_text
from kafold.connectors.projection.mapping import Mapping, Row
from kafold.errors import ConfigError

Key = tuple[Any, ...]
TombstonesRead = tuple[psycopg.Cursor[Any], psycopg.Cursor[Any], dict[str, Key]]


class TableRows:
    """The rows of `table` (a projection's, or a rebuild's shadow) for one writer; `namespace` keys its tombstones."""

    def __init__(self, pgc: PostgresConfig, config: ProjectionConfig, mapping: Mapping, namespace: str, table: str,
                 cache_rows: int) -> None:
        self.config, self.mapping, self.namespace, self.table = config, mapping, namespace, table
        self.tombstones = db.table(pgc, "tombstones")
        self.shape: q.TableShape | None = None
        self.json: set[str] = set()
        # Rows kept between batches, for a writer that is its table's only writer (a rebuild's shadow): a key
        # written or read before is not read again. Only what a transaction committed goes in, only rows whose
        # values read back from PostgreSQL as the same Python values (see read_back), and the whole cache is
        # dropped when a write fails (its commit may or may not have happened). At most `cache_rows` keys: the
        # least recently written half goes when full.
        self.cache_rows = cache_rows
        self.cache: dict[Key, Row | int | None] = {}  # int: a tombstone (see remember)
        self.plain: dict[str, tuple[type, ...]] = {}  # column -> the Python types that read back as-is

    def check(self, conn: psycopg.Connection[Any]) -> q.TableShape:
        """Create the table if allowed and missing; check it has every configured column and a unique key."""
        c, schema, table = self.config, self.config.schema, self.table
        regclass = q.regclass_text(schema, table)
        guard_key = f"kafold.projection:{schema}.{table}"
        conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (guard_key,))
        found = dict(conn.execute(q.CATALOG_COLUMNS, (regclass,)).fetchall())
        if not found:
            if not c.create_table:
                raise ConfigError([f"projection table {schema}.{table} does not exist (create_table = false)"])
            try:
                conn.execute(q.create_table(schema, table, c.columns, c.key_columns, VERSION_COLUMN))
            except psycopg.errors.DatabaseError as e:
                raise ConfigError([f"projection table {schema}.{table}: cannot create it: {e}"]) from e
            found = dict(conn.execute(q.CATALOG_COLUMNS, (regclass,)).fetchall())
        missing = [col for col in (*c.columns, VERSION_COLUMN) if col not in found]
        if missing:
            fixes = "; ".join(
                f"ALTER TABLE {schema}.{table} ADD COLUMN {col} "
                f"{'bigint NOT NULL DEFAULT 0' if col == VERSION_COLUMN else c.columns[col]}" for col in missing)
            raise ConfigError([f"projection table {schema}.{table}: missing column(s) {', '.join(missing)} "
                               f"(add them: {fixes})"])
        unique = {tuple(cols) for (cols,) in conn.execute(q.CATALOG_UNIQUE, (regclass,)).fetchall()}
        if tuple(sorted(c.key_columns)) not in unique:
            raise ConfigError([f"projection table {schema}.{table}: no primary key or unique index on exactly "
                               f"({', '.join(c.key_columns)}), which upserts need"])
        types = {col: found[col] for col in (*c.columns, VERSION_COLUMN)}
        self.json = {col for col, tp in types.items() if tp in ("json", "jsonb")}
        self.plain = {col: read_back(tp, self.mapping.copies_rows) for col, tp in types.items()}
        self.shape = q.TableShape(schema, table, types, tuple(c.key_columns), VERSION_COLUMN)
        return self.shape

    # ---- reads (pipelined by the caller) -----------------------------------------------------------------
    def select(self, conn: psycopg.Connection[Any], keys: list[Key]) -> psycopg.Cursor[Any]:
        assert self.shape is not None
        return conn.execute(q.select_rows(self.shape), [list(col) for col in zip(*keys, strict=True)],
                            prepare=db.BY_KEYS)

    def select_uncached(self, conn: psycopg.Connection[Any], keys: list[Key]) -> psycopg.Cursor[Any] | None:
        """The rows of the keys the cache does not know (None: it knows them all)."""
        keys = self.uncached(keys)
        return self.select(conn, keys) if keys else None

    def read_keys(self, conn: psycopg.Connection[Any], keys: list[Key]) -> TombstonesRead:
        """Deduplicating by version, what PostgreSQL knows of `keys`: their rows, their tombstones, and the keys by
        their text as the tombstones store them."""
        texts = {hold_text(k): k for k in keys}
        return (self.select(conn, keys),
                conn.execute(q.select_tombstones(self.tombstones), (self.namespace, list(texts)), prepare=db.BY_KEYS),
                texts)

    @staticmethod
    def tombstones_read(read: TombstonesRead) -> dict[Key, int]:
        _, tombs, texts = read
        return {texts[text]: version for text, version in tombs.fetchall()}

    def rows(self, found: psycopg.Cursor[Any]) -> dict[Key, Row]:
        """The current rows read by `select`, by key."""
        assert self.shape is not None
        names, shape = self.shape.written, self.shape
        nkeys = [names.index(k) for k in shape.keys]
        key_at = operator.itemgetter(*nkeys) if len(nkeys) > 1 else None
        i0 = nkeys[0]
        return {key_at(row) if key_at else (row[i0],): dict(zip(names, row, strict=True))
                for row in found.fetchall()}

    # ---- the rows kept between batches -------------------------------------------------------------------
    def uncached(self, keys: list[Key]) -> list[Key]:
        if self.cache_rows:
            cache = self.cache
            return [k for k in keys if k not in cache]
        return keys

    def loaded(self, keys: list[Key], found: psycopg.Cursor[Any] | None) -> dict[Key, Row]:
        """The current rows of `keys`: those read by `select_uncached`, and the cached ones."""
        rows = self.rows(found) if found is not None else {}
        if self.cache_rows:
            cache = self.cache
            for k in keys:
                row = cache.get(k)
                if type(row) is dict:  # None: no row; an int: no row, a tombstone (see remember)
                    rows[k] = row
        return rows

    def cached_tombstones(self, keys: list[Key], gone: dict[Key, int]) -> None:
        """Add the cached tombstones of `keys` to `gone`."""
        if self.cache_rows:
            cache = self.cache
            for k in keys:
                v = cache.get(k)
                if type(v) is int:
                    gone[k] = v

    def remember(self, state: dict[Key, Row | None], buried: dict[Key, int]) -> None:
        """A committed transaction's rows into the cache (None: the key has no row; an int: nor a row, but that
        tombstone — kept only when deduplicating by version, whose reads of a key fetch both), most recent last."""
        cache, plain = self.cache, self.plain
        for key, row in state.items():
            cache.pop(key, None)
            if row is None:
                cache[key] = buried.get(key) if buried else None
            elif all(v is None or type(v) in plain.get(c, ()) for c, v in row.items()):
                cache[key] = row
        if len(cache) > self.cache_rows:
            keep = self.cache_rows // 2
            self.cache = dict(itertools.islice(cache.items(), len(cache) - keep, None))

    # ---- writes ------------------------------------------------------------------------------------------
    def staged(self, upserts: list[Row]) -> list[Sequence[Any]]:
        """The changed rows' values in the table's written column order, json and dict values adapted."""
        assert self.shape is not None
        written, special = self.shape.written, self.json
        values_of = operator.itemgetter(*written) if len(written) > 1 else (lambda row: (row[written[0]],))
        out: list[Sequence[Any]] = []
        for row in upserts:
            values = values_of(row)
            if special or dict in map(type, values):
                values = [self._value(c, v) for c, v in zip(written, values, strict=True)]
            out.append(values)
        return out

    def text_columns(self, conn: psycopg.Connection[Any], upserts: list[Row]) -> list[list[str | None]]:
        """The changed rows as one text array per written column, each value as COPY's text format has it (the same
        dumpers): what the upserts' one statement takes (sql.upsert_rows)."""
        assert self.shape is not None
        texts, encoding = Transformer(conn), conn.info.encoding
        formats = [PyFormat.TEXT] * len(self.shape.written)
        columns: list[list[str | None]] = [[] for _ in self.shape.written]
        for values in self.staged(upserts):
            for column, v in zip(columns, texts.dump_sequence(values, formats), strict=True):
                column.append(None if v is None else bytes(v).decode(encoding))
        return columns

    def _value(self, column: str, value: Any) -> Any:
        if value is None:
            return None
        if column in self.json:
            return Jsonb(value)
        if isinstance(value, dict):
            return orjson.dumps(value).decode()
        return value


_TEXT, _INT = (str,), (int,)
_READ_BACK: dict[str, tuple[type, ...]] = {
    "text": _TEXT, "character varying": _TEXT, "bigint": _INT, "integer": _INT, "smallint": _INT,
    "boolean": (bool,),
}


def read_back(pg_type: str, copies_rows: bool) -> tuple[type, ...]:
    """The Python types a value of a column of `pg_type` is written as and read back as, unchanged (none known:
    such a value is read from PostgreSQL each time). A json(b) float may come back an int (jsonb
    writes 1e20 out in full), so it is not kept; a json(b) container (equal when read back, with such floats
    inside) only when the mapping copies rows and only sets it (rules): a mapper's code sees what PostgreSQL
    gives back."""
    if pg_type in ("json", "jsonb"):
        return (str, int, bool, dict, list) if copies_rows else (str, int, bool)
    return _READ_BACK.get(pg_type.partition("(")[0], ())

