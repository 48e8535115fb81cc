"""The `debezium` converter: Debezium change events (before/after/op/source) as row events of a projection.

Types: op c/u/r/d as `create`/`update`/`read`/`delete`. Payload: `after` (c/u/r), or `before` merged with the key
fields (d: REPLICA IDENTITY DEFAULT gives only key columns). aggregate_id: the key's one value as text, several as
stable JSON; aggregate_type: `schema.table` (MySQL `db.table`). Version: the source's log position, so the
projection's version guard never lets an out-of-order redelivery roll a row back: PostgreSQL `source.lsn`; MySQL
`file` number, `pos` and `row` packed into one bigint; else the `version` path configured (`source.x`). The event id
is a uuid5 of table, key and position: Debezium's own redelivery of a change (another offset) dedups.

Values: with the `{"schema": …, "payload": …}` wrapper (JsonConverter's `schemas.enable`, Debezium's default) each
value is decoded by the record's own Connect schema (connect_schema.py: numerics exact, dates and times as ISO
text, jsonb as its document); with `schemas = false` a record must come without it, and the fields mapped to
`json`/`jsonb` or `bytea` columns are decoded by those declared types (schemaless.py); other values pass as they
are.
Debezium's unavailable-value placeholder (an unchanged TOASTed column) comes out as `api.UNAVAILABLE`:
the projection keeps the column's stored value.

A key change (a delete of the old key, then a create of the new one at the same position): the delete's payload
names the new key (rekey.py), for the projection to move the old row there and keep its TOASTed values.

The last record of a completed snapshot (`source.snapshot` `last`, or `last_in_data_collection` for its table)
carries SNAPSHOT_END when the connector sweeps (`snapshot_sweep`): the projection then deletes its rows older than
the snapshot, which it did not read (rows deleted while Debezium had lost its offsets and snapshotted again).

Truncate (op `t`, no key): by `[connectors.convert] truncate`, an event of type TRUNCATE (the projection empties
its table, in the transaction of the batch that holds it) or a dead letter naming the table.

Tombstones (value None after a delete) carry no position, so they are skipped: the `d` event before each one has
already deleted the row and left the writer's version tombstone (an older change redelivered later is stale). A
tombstone cannot be ordered against a later re-create of the key, so letting it delete could drop a newer row.
On a compacted topic keep `delete.retention.ms` above the projection's lag so a reader sees the `d` event.
"""

from __future__ import annotations

import re
from typing import Any

from kafold.config import TruncatePolicy
from kafold.connectors.convert.api import (
    SNAPSHOT_END,
    TRUNCATE,
    UNAVAILABLE,
    ConvertError,
    Headers,
    ValueFormat,
    where,
)
from kafold.connectors.convert.connect_schema import Compiler, SchemaError
from kafold.connectors.convert.plain import MISSING, NAMESPACE, JsonFormat, header, lookup, steps
from kafold.connectors.convert.rekey import NEW_KEY, aggregate_id_of, parse_key
from kafold.connectors.convert.schemaless import ColumnTypes
from kafold.envelope import Event, format_epoch_ms, utc_now, uuid5

# `source.snapshot` of a snapshot's last record: of the whole snapshot, or of one table's part of it (Debezium 2+)
SNAPSHOT_LAST = ("last", "last_in_data_collection")
OPS = {"c": "create", "u": "update", "r": "read", "d": "delete", "t": TRUNCATE}
BINLOG_NUMBER = re.compile(r"(\d+)$")
# MySQL position packing: file number (19 bits) | pos (32 bits) | row (12 bits) = 63 bits, a bigint.
POS_BITS, ROW_BITS = 32, 12
MAX_FILE = 1 << (63 - POS_BITS - ROW_BITS)


def wrapped(body: Any) -> bool:
    """`body` is a `{"schema": ..., "payload": ...}` wrapper (JsonConverter with schemas.enable)."""
    return type(body) is dict and len(body) == 2 and "payload" in body and "schema" in body


def position(source: dict[str, Any]) -> int | None:
    """The change's log position as one increasing int: PostgreSQL lsn, MySQL file/pos/row; None if neither."""
    lsn = source.get("lsn")
    if type(lsn) is int and lsn > 0:
        return lsn
    file, pos = source.get("file"), source.get("pos")
    if isinstance(file, str) and type(pos) is int and (m := BINLOG_NUMBER.search(file)):
        number, row = int(m.group(1)), source.get("row") or 0
        if number < MAX_FILE and 0 <= pos < 1 << POS_BITS and 0 <= row < 1 << ROW_BITS:
            return (number << (POS_BITS + ROW_BITS) | pos << ROW_BITS | row) + 1
    return None


def table_of(source: dict[str, Any], at: str, raw: Any) -> str:
    """The change's source table, `schema.table` (MySQL `db.table`)."""
    table, schema = source.get("table"), source.get("schema") or source.get("db")
    if not table:
        raise ConvertError(f"{at}: path 'source.table' is missing", raw=raw)
    return f"{schema}.{table}" if schema else str(table)


class DebeziumConverter:
    """One Debezium change record as an Event (see the module docstring)."""

    def __init__(self, options: Any, fmt: ValueFormat | None = None, columns: ColumnTypes | None = None,
                 sweep: bool = False) -> None:
        self.fmt: ValueFormat = fmt if fmt is not None else JsonFormat()
        self.key_fmt: ValueFormat = self.fmt
        self.version_path = steps(options.version) if options.version else None
        self.version_src = options.version
        # The wrapper is required where it is declared (the JSON format; registry formats carry their own schema).
        self.needs_schema = options.schemas and options.format == "json"
        self.truncate = TruncatePolicy(options.truncate)
        self.schemas = Compiler(options.unavailable_value_placeholder)
        # schema-less records: the projection's declared column types say which text fields are JSON or bytes
        self.columns = columns if columns is not None else ColumnTypes({})
        self.sweep = sweep  # mark a completed snapshot's last record (SNAPSHOT_END)

    def decoded(self, body: Any, is_key: bool, at: str, raw: Any) -> Any:
        """`body` decoded by the schema it carries; a bare body as it is (refused for a value where schemas are
        declared: its numbers and dates could not be told apart)."""
        if wrapped(body):
            payload = body["payload"]
            try:
                decode = self.schemas.decoder(body["schema"])
                return decode(payload) if decode is not None and payload is not None else payload
            except SchemaError as e:
                raise ConvertError(f"{at}: {'key ' if is_key else ''}{e}", raw=raw) from None
        if self.needs_schema and not is_key and body is not None:
            raise ConvertError(f"{at}: the value has no {{\"schema\", \"payload\"}} wrapper, which "
                               "[connectors.convert] schemas = true expects (JsonConverter's schemas.enable, "
                               "Debezium's default); for schema-less records set schemas = false and declare the "
                               "Debezium settings (docs/connectors.md#debezium-change-events)", raw=raw)
        return body

    def placeheld(self, row: dict[str, Any]) -> dict[str, Any]:
        """A schema-less row with each form of the placeholder as UNAVAILABLE."""
        unavailable = self.schemas.unavailable
        if any(unavailable(v) for v in row.values()):
            return {k: UNAVAILABLE if unavailable(v) else v for k, v in row.items()}
        return row

    def event(self, key: bytes | None, value: bytes | None, headers: Headers, *, topic: str, partition: int,
              offset: int, timestamp_ms: int | None, raw: Any) -> Event | None:
        if value is None:
            return None  # a tombstone: see the module docstring
        at = where(topic, partition, offset)
        try:
            loaded = self.fmt.load(topic, value, is_key=False)
            key_loaded = self.key_fmt.load(topic, key, is_key=True) if key is not None else None
        except ConvertError as e:
            raise ConvertError(f"{at}: {e}", raw=raw, reason=e.reason) from None
        schemaless = not wrapped(loaded)
        body = self.decoded(loaded, False, at, raw)
        if type(body) is not dict:
            raise ConvertError(f"{at}: expected a Debezium change event (an object), got {type(body).__name__}",
                               raw=raw)
        op = body.get("op")
        if op not in OPS:
            raise ConvertError(f"{at}: path 'op' is {op!r}, expected one of c, u, r, d, t", raw=raw)
        source = body.get("source")
        if type(source) is not dict:
            raise ConvertError(f"{at}: path 'source' is missing or not an object", raw=raw)
        if op == "t":
            return self.truncated(body, source, at, raw, timestamp_ms)
        key_body = self.decoded(key_loaded, True, at, raw)
        row = body.get("before" if op == "d" else "after")
        if type(row) is not dict:
            raise ConvertError(f"{at}: path {'before' if op == 'd' else 'after'!r} is missing or not an object "
                               f"(op {op!r})", raw=raw)
        if type(key_body) is not dict or not key_body:
            raise ConvertError(f"{at}: the record key is not a Debezium key (an object of the key columns)", raw=raw)
        aggregate_type = table_of(source, at, raw)
        aggregate_id = aggregate_id_of(key_body)
        version = self.version(body, source, at, raw)
        if schemaless:
            row = self.placeheld(row)
            if self.columns:
                try:
                    row = self.columns.row(row, "before" if op == "d" else "after")
                except SchemaError as e:
                    raise ConvertError(f"{at}: {e}", raw=raw) from None
        payload = {**row, **key_body} if op == "d" else row
        if op == "d" and (new_key := self.new_key(headers, at, raw)) is not None:
            payload[NEW_KEY] = new_key
        elif op == "r" and self.sweep and source.get("snapshot") in SNAPSHOT_LAST:
            payload = {**payload, SNAPSHOT_END: True}
        ts = source.get("ts_ms") or body.get("ts_ms") or timestamp_ms
        event_id = uuid5(NAMESPACE, f"debezium/{aggregate_type}/{aggregate_id}/{version}/{op}")
        try:
            return Event(event_id=event_id, type=OPS[op], aggregate_type=aggregate_type, aggregate_id=aggregate_id,
                         version=version, occurred_at=format_epoch_ms(ts) if type(ts) is int else utc_now(),
                         correlation_id=event_id, payload=payload)
        except ValueError as e:
            raise ConvertError(f"{at}: {e}", raw=raw) from None

    def new_key(self, headers: Headers, at: str, raw: Any) -> dict[str, Any] | None:
        """The new key a key change's delete names (rekey.py); None for a plain delete or a header of another
        form (the new row then lacks the TOASTed values the create leaves out, as without the header)."""
        got = header(headers, NEW_KEY)
        if got is None:
            return None
        key = parse_key(got)
        key = self.decoded(key, True, at, raw) if key is not None else None
        return key if type(key) is dict and key else None

    def truncated(self, body: dict[str, Any], source: dict[str, Any], at: str, raw: Any,
                  timestamp_ms: int | None) -> Event:
        """A truncate as the `truncate` option says: an event of type TRUNCATE, or a dead letter naming the table."""
        name = table_of(source, at, raw)
        if self.truncate is TruncatePolicy.DEAD_LETTER:
            raise ConvertError(f"{at}: table {name} was truncated at the source (op 't'); its rows stay in the "
                               "projection ([connectors.convert] truncate = \"dead-letter\"; \"delete\" empties "
                               "the projection in order with the other changes)", raw=raw, reason="truncate")
        version = self.version(body, source, at, raw)
        ts = source.get("ts_ms") or body.get("ts_ms") or timestamp_ms
        event_id = uuid5(NAMESPACE, f"debezium/{name}/{version}/t")
        return Event(event_id=event_id, type=TRUNCATE, aggregate_type=name, aggregate_id=name, version=version,
                     occurred_at=format_epoch_ms(ts) if type(ts) is int else utc_now(), correlation_id=event_id,
                     payload={})

    def version(self, body: dict[str, Any], source: dict[str, Any], at: str, raw: Any) -> int:
        if self.version_path is not None:
            got = lookup(body, self.version_path)
            if got is MISSING or type(got) is not int or got < 1:
                raise ConvertError(f"{at}: version path {self.version_src!r} is "
                                   f"{'missing' if got is MISSING else repr(got)}, expected an integer >= 1",
                                   raw=raw)
            return int(got)
        pos = position(source)
        if pos is None:
            raise ConvertError(f"{at}: no log position in 'source' (PostgreSQL lsn, MySQL file/pos): set "
                               "[connectors.convert] version = \"source.<field>\"", raw=raw)
        return pos
