"""The debezium converter on records as Debezium's PostgreSQL connector writes them with its defaults (JsonConverter
with schemas.enable, decimal.handling.mode=precise, time.precision.mode=adaptive): each logical type decoded by the
record's own Connect schema, the unavailable-value placeholder, truncates, and the options checked at load."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import orjson
import pytest
from structlog.testing import capture_logs

from kafold.config import ConnectorConfig, ConvertConfig, ConverterKind, load_file
from kafold.connectors.api import SinkRecord
from kafold.connectors.convert import ConvertError, converter_for
from kafold.connectors.convert.api import TRUNCATE, UNAVAILABLE
from kafold.connectors.convert.connect_schema import Compiler, decimal_text
from kafold.connectors.projection import fold as f
from kafold.connectors.projection.config import VERSION_COLUMN, ProjectionConfig
from kafold.connectors.projection.mapping import Mapping
from kafold.envelope import Event
from kafold.errors import ConfigError
from kafold.schema import Problems, is_missing, load

PLACEHOLDER = "__debezium_unavailable_value"


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def opt(field: str, tp: str, name: str | None = None, **params: str) -> dict[str, Any]:
    """One optional column's field schema, as Debezium writes it."""
    out: dict[str, Any] = {"type": tp, "optional": True, "field": field}
    if name is not None:
        out |= {"name": name, "version": 1}
    if params:
        out["parameters"] = params
    return out


# A PostgreSQL table `public.items` of every type below, its field schemas as Debezium 3 (JsonConverter) writes them.
COLUMNS = [
    {"type": "int32", "optional": False, "default": 0, "field": "id"},
    opt("name", "string"),
    opt("price", "bytes", "org.apache.kafka.connect.data.Decimal", scale="2", **{"connect.decimal.precision": "10"}),
    {"type": "struct", "fields": [{"type": "int32", "optional": False, "field": "scale"},
                                  {"type": "bytes", "optional": False, "field": "value"}],
     "optional": True, "name": "io.debezium.data.VariableScaleDecimal", "version": 1, "doc": "Variable scaled decimal",
     "field": "amount"},
    opt("born", "int32", "io.debezium.time.Date"),
    opt("opens", "int32", "io.debezium.time.Time"),
    opt("closes", "int64", "io.debezium.time.MicroTime"),
    opt("tick", "int64", "io.debezium.time.NanoTime"),
    opt("made", "int64", "io.debezium.time.Timestamp"),
    opt("changed", "int64", "io.debezium.time.MicroTimestamp"),
    opt("nano", "int64", "io.debezium.time.NanoTimestamp"),
    opt("seen", "string", "io.debezium.time.ZonedTimestamp"),
    opt("lunch", "string", "io.debezium.time.ZonedTime"),
    opt("doc", "string", "io.debezium.data.Json"),
    opt("ref", "string", "io.debezium.data.Uuid"),
    opt("color", "string", "io.debezium.data.Enum", allowed="red,green"),
    opt("flags", "bytes", "io.debezium.data.Bits", length="3"),
    opt("blob", "bytes"),
    opt("active", "boolean"),
    opt("ratio", "double"),
    {"type": "array", "items": {"type": "string", "optional": True}, "optional": True, "field": "tags"},
    opt("wait", "int64", "io.debezium.time.MicroDuration"),
    opt("cday", "int32", "org.apache.kafka.connect.data.Date"),
    opt("ctime", "int32", "org.apache.kafka.connect.data.Time"),
    opt("cstamp", "int64", "org.apache.kafka.connect.data.Timestamp"),
]
SOURCE_SCHEMA = {"type": "struct", "optional": False, "name": "io.debezium.connector.postgresql.Source",
                 "field": "source", "fields": [
                     {"type": "string", "optional": False, "field": "version"},
                     {"type": "string", "optional": False, "field": "connector"},
                     {"type": "string", "optional": False, "field": "name"},
                     {"type": "int64", "optional": False, "field": "ts_ms"},
                     opt("snapshot", "string", "io.debezium.data.Enum", allowed="true,first,last,false,incremental"),
                     {"type": "string", "optional": False, "field": "db"},
                     opt("sequence", "string"),
                     opt("ts_us", "int64"), opt("ts_ns", "int64"),
                     {"type": "string", "optional": False, "field": "schema"},
                     {"type": "string", "optional": False, "field": "table"},
                     opt("txId", "int64"), opt("lsn", "int64"), opt("xmin", "int64")]}


def envelope_schema(columns: list[dict[str, Any]]) -> dict[str, Any]:
    value = {"type": "struct", "fields": columns, "optional": True, "name": "dbserver1.public.items.Value"}
    return {"type": "struct", "optional": False, "name": "dbserver1.public.items.Envelope", "version": 2, "fields": [
        {**value, "field": "before"}, {**value, "field": "after"}, SOURCE_SCHEMA,
        {"type": "string", "optional": False, "field": "op"}, opt("ts_ms", "int64"), opt("ts_us", "int64"),
        opt("ts_ns", "int64"),
        {"type": "struct", "optional": True, "name": "event.block", "version": 1, "field": "transaction", "fields": [
            {"type": "string", "optional": False, "field": "id"},
            {"type": "int64", "optional": False, "field": "total_order"},
            {"type": "int64", "optional": False, "field": "data_collection_order"}]}]}


KEY_SCHEMA = {"type": "struct", "optional": False, "name": "dbserver1.public.items.Key",
              "fields": [{"type": "int32", "optional": False, "field": "id"}]}


def source(lsn: int) -> dict[str, Any]:
    return {"version": "3.6.1.Final", "connector": "postgresql", "name": "dbserver1", "ts_ms": 1704112496000,
            "snapshot": "false", "db": "shop", "sequence": f'["{lsn - 8}","{lsn}"]', "ts_us": 1704112496000000,
            "ts_ns": 1704112496000000000, "schema": "public", "table": "items", "txId": 771, "lsn": lsn,
            "xmin": None}


def record(op: str, before: Any, after: Any, lsn: int, columns: list[dict[str, Any]] | None = None
           ) -> tuple[bytes | None, bytes]:
    """(key, value) as Debezium's JsonConverter writes them, the schema and the payload together."""
    body = {"before": before, "after": after, "source": source(lsn), "op": op, "ts_ms": 1704112496100,
            "ts_us": 1704112496100000, "ts_ns": 1704112496100000000, "transaction": None}
    row = after or before
    key = None if row is None else orjson.dumps({"schema": KEY_SCHEMA, "payload": {"id": row["id"]}})
    return key, orjson.dumps({"schema": envelope_schema(columns or COLUMNS), "payload": body})


def conv(**options: Any) -> Any:
    return converter_for(ConnectorConfig(name="c", connector_class="log", topics=["dbserver1.public.items"],
                                         converter=ConverterKind.DEBEZIUM, convert=ConvertConfig(**options)))


def run(c: Any, key: bytes | None, value: bytes, offset: int = 7) -> Any:
    return c.event(key, value, None, topic="dbserver1.public.items", partition=0, offset=offset,
                   timestamp_ms=1704112496200, raw=None)


ROW = {"id": 1, "name": "ada", "price": b64((12345).to_bytes(2, "big")), "amount": {"scale": 3, "value": "AeI="},
       "born": 19723, "opens": 45296789, "closes": 45296789012, "tick": 45296789012345, "made": 1704112496789,
       "changed": 1704112496789012, "nano": 1704112496789012345, "seen": "2024-01-01T12:34:56.789012Z",
       "lunch": "12:34:56.789Z", "doc": '{"a": {"b": [1, 2.5, null]}, "big": 123456789012345678901234567890}',
       "ref": "9f1c3b0e-5b8a-4f0e-9a55-6b6166f1d000", "color": "green", "flags": "BQ==", "blob": "AQID",
       "active": True, "ratio": 0.25, "tags": ["x", None], "wait": 90061000001, "cday": -1, "ctime": 0,
       "cstamp": -1}
DECODED = {"id": 1, "name": "ada", "price": "123.45", "amount": "0.482", "born": "2024-01-01",
           "opens": "12:34:56.789", "closes": "12:34:56.789012", "tick": "12:34:56.789012345",
           "made": "2024-01-01T12:34:56.789", "changed": "2024-01-01T12:34:56.789012",
           "nano": "2024-01-01T12:34:56.789012345", "seen": "2024-01-01T12:34:56.789012Z",
           "lunch": "12:34:56.789Z", "doc": {"a": {"b": [1, 2.5, None]}, "big": 123456789012345678901234567890},
           "ref": "9f1c3b0e-5b8a-4f0e-9a55-6b6166f1d000", "color": "green", "flags": "101", "blob": "\\x010203",
           "active": True, "ratio": 0.25, "tags": ["x", None], "wait": "90061000001 microseconds",
           "cday": "1969-12-31", "ctime": "00:00:00", "cstamp": "1969-12-31T23:59:59.999"}


def test_each_logical_type_is_decoded_by_the_records_own_schema():
    e = run(conv(), *record("c", None, ROW, 5000))
    assert (e.type, e.aggregate_id, e.aggregate_type, e.version) == ("create", "1", "public.items", 5000)
    assert e.payload == DECODED
    # a document's integer beyond 64 bits stays exact (msgspec; orjson would round it to a float)
    assert type(e.payload["doc"]["big"]) is int


def test_nulls_and_optional_fields_stay_null():
    row = dict.fromkeys(ROW) | {"id": 2}
    assert run(conv(), *record("c", None, row, 5000)).payload == row


@pytest.mark.parametrize(("unscaled", "scale", "text"), [
    (12345, 2, "123.45"), (-12345, 2, "-123.45"), (5, 4, "0.0005"), (-5, 4, "-0.0005"), (0, 2, "0.00"),
    (7, -3, "7000"), (10**37 + 1, 10, "1000000000000000000000000000.0000000001"), (0, 0, "0"),
])
def test_decimals_keep_every_digit(unscaled, scale, text):
    raw = unscaled.to_bytes((unscaled.bit_length() + 8) // 8, "big", signed=True)
    columns = [COLUMNS[0], opt("price", "bytes", "org.apache.kafka.connect.data.Decimal", scale=str(scale))]
    assert run(conv(), *record("c", None, {"id": 1, "price": b64(raw)}, 10, columns)).payload["price"] == text
    assert decimal_text(unscaled, scale) == text


def test_a_delete_decodes_before_and_merges_the_key():
    e = run(conv(), *record("d", dict.fromkeys(ROW) | {"id": 3, "price": "MDk="}, None, 6000))
    assert (e.type, e.payload["id"], e.payload["price"]) == ("delete", 3, "123.45")


def test_a_bad_value_is_a_convert_error_naming_the_field_and_the_record():
    with pytest.raises(ConvertError, match=r"dbserver1.public.items\[0\]@7: path 'after.doc'") as got:
        run(conv(), *record("c", None, {"id": 1, "doc": "{not json"}, 10))
    assert got.value.reason == "convert-failed"
    with pytest.raises(ConvertError, match=r"path 'after\.price'"):
        run(conv(), *record("c", None, {"id": 1, "price": "%%%"}, 10))
    bad_scale = [COLUMNS[0], opt("price", "bytes", "org.apache.kafka.connect.data.Decimal", scale="two")]
    # a schema that does not compile (first seen at `before`, the same Value schema as `after`)
    with pytest.raises(ConvertError, match=r"path 'before\.price': Decimal scale 'two'"):
        run(conv(), *record("c", None, {"id": 1, "price": "MDk="}, 10, bad_scale))


def test_a_bare_value_is_refused_where_schemas_are_declared():
    bare = orjson.dumps({"before": None, "after": {"id": 1}, "source": source(9), "op": "c"})
    with pytest.raises(ConvertError, match=r"no \{\"schema\", \"payload\"\} wrapper.*schemas = false"):
        run(conv(), b'{"id": 1}', bare)
    assert run(conv(schemas=False, decimal_handling_mode="string", time_precision_mode="isostring"),
               b'{"id": 1}', bare).payload == {"id": 1}


def test_a_schema_is_compiled_once_and_the_cache_is_bounded():
    compiler = Compiler(capacity=4)
    schema = envelope_schema(COLUMNS)
    assert compiler.decoder(schema) is compiler.decoder(orjson.loads(orjson.dumps(schema)))
    for n in range(10):
        compiler.decoder(envelope_schema([*COLUMNS, opt(f"extra{n}", "string")]))
    assert len(compiler._cache) <= 4
    assert compiler.decoder({"type": "struct", "fields": [opt("name", "string")]}) is None  # plain: nothing to do


@pytest.mark.parametrize(("field", "value"), [
    ("name", PLACEHOLDER), ("doc", PLACEHOLDER), ("blob", b64(PLACEHOLDER.encode())), ("tags", [PLACEHOLDER]),
])
def test_the_unavailable_placeholder_in_each_form_is_marked(field, value):
    e = run(conv(), *record("u", None, {"id": 1, "name": "ada", field: value}, 7000))
    assert e.payload[field] == UNAVAILABLE
    assert e.payload["name" if field != "name" else "id"] in ("ada", 1)


def test_a_configured_placeholder_is_recognised_and_marked_as_the_default():
    c = conv(unavailable_value_placeholder="<toast>")
    e = run(c, *record("u", None, {"id": 1, "name": "<toast>", "blob": b64(b"<toast>")}, 7000))
    assert (e.payload["name"], e.payload["blob"]) == (UNAVAILABLE, UNAVAILABLE)


def test_a_schemaless_row_marks_the_placeholder_too():
    c = conv(schemas=False, decimal_handling_mode="string", time_precision_mode="isostring")
    body = {"before": None, "after": {"id": 1, "note": PLACEHOLDER, "raw": b64(PLACEHOLDER.encode())},
            "source": source(9), "op": "u"}
    assert run(c, b'{"id": 1}', orjson.dumps(body)).payload == {"id": 1, "note": UNAVAILABLE, "raw": UNAVAILABLE}


def truncate_record() -> tuple[None, bytes]:
    return None, record("t", None, None, 8000)[1]


def test_a_truncate_is_dead_lettered_by_default_naming_the_table():
    with pytest.raises(ConvertError, match=r"table public.items was truncated.*truncate = \"dead-letter\"") as got:
        run(conv(), *truncate_record())
    assert got.value.reason == "truncate"


def test_a_truncate_to_apply_is_an_event_of_its_own_type():
    e = run(conv(truncate="delete"), *truncate_record())
    assert (e.type, e.aggregate_type, e.version, e.payload) == (TRUNCATE, "public.items", 8000, {})
    assert run(conv(truncate="delete"), *truncate_record(), offset=99).event_id == e.event_id  # redelivery dedups


# ---- what the projection does with them ----------------------------------------------------------------------

def projection() -> ProjectionConfig:
    problems = Problems("kafold.toml")
    cfg = load(ProjectionConfig, {
        "table": "items", "key_columns": ["id"], "columns": {"id": "bigint", "name": "text", "note": "text"},
        "key": {"id": "payload.id"},
        "on": [{"type": ["create", "update", "read"], "set": {"name": "payload.name", "note": "payload.note"}},
               {"type": "delete", "action": "delete"}]}, "c", problems, Path("."))
    assert problems.items == [] and not is_missing(cfg)
    return cfg


PC = projection()


def changed(key: int, version: int, **payload: Any) -> Event:
    return Event.new("update", "public.items", str(key), version, {"id": key, **payload})


def test_an_unavailable_value_keeps_the_stored_column():
    m = Mapping(PC)
    row = {"id": 1, "name": "ada", "note": "a long text", VERSION_COLUMN: 10}
    new = m.apply(row, changed(1, 11, name="ada2", note=UNAVAILABLE), (1,))
    assert new == {"id": 1, "name": "ada2", "note": "a long text", VERSION_COLUMN: 11}


def test_an_unavailable_value_on_a_new_row_leaves_the_column_null_and_says_so():
    with capture_logs() as logs:
        new = Mapping(PC).apply(None, changed(1, 11, name="ada", note=UNAVAILABLE), (1,))
    assert new == {"id": 1, "name": "ada", "note": None, VERSION_COLUMN: 11}
    assert [(x["event"], x["column"]) for x in logs] == [("projection.value_unavailable", "note")]


def sink(event: Event, offset: int) -> SinkRecord:
    return SinkRecord("t", 0, offset, event.aggregate_id, event)


def test_a_truncate_empties_the_rows_and_later_events_start_anew():
    m = Mapping(PC)
    truncate = Event.new(TRUNCATE, "public.items", "public.items", 20, {})
    records = [sink(changed(1, 15, name="before", note=None), 0), sink(truncate, 1),
               sink(changed(2, 21, name="after", note=None), 2)]
    assert m.handles(TRUNCATE) and m.key(truncate) == ()
    prep = f.prepare(m, records, b"p")
    todo = f.candidates(records, prep, set())
    assert todo.keys == [(1,), (2,)]
    loaded = {(1,): {"id": 1, "name": "x", "note": None, VERSION_COLUMN: 3},
              (2,): {"id": 2, "name": "y", "note": None, VERSION_COLUMN: 4}}
    folded = f.fold(m, list(todo.first.values()), loaded, todo.record_keys, todo.key_errors)
    assert folded.truncated and not folded.bad
    assert folded.changes() == ([{"id": 2, "name": "after", "note": None, VERSION_COLUMN: 21}], [])
    assert sum(folded.applied.values()) == 3


# ---- options checked at load ---------------------------------------------------------------------------------

def test_options_that_cannot_be_decoded_are_refused_at_load_by_key(tmp_path: Path):
    conf = tmp_path / "kafold.toml"
    conf.write_text('''
[[connectors]]
name = "items"
class = "postgres-projection"
topics = ["dbserver1.public.items", "dbserver1.public.orders"]
converter = "debezium"

[connectors.convert]
schemas = false
truncate = "delete"
unavailable_value_placeholder = ""

[connectors.config]
table = "items"
key_columns = ["id"]
columns = {id = "bigint"}
key = {id = "payload.id"}

[[connectors.config.on]]
type = "delete"
action = "delete"
''')
    with pytest.raises(ConfigError) as got:
        load_file(conf)
    text = str(got.value)
    for key in ("convert.decimal_handling_mode: \"precise\"", "convert.time_precision_mode: \"adaptive\"",
                "convert.truncate: \"delete\" empties", "convert.unavailable_value_placeholder"):
        assert f"connectors[0].{key}" in text, text
    conf.write_text(conf.read_text().replace('schemas = false', 'schemas = false\ndecimal_handling_mode = "string"\n'
                                             'time_precision_mode = "isostring"')
                    .replace('truncate = "delete"\nunavailable_value_placeholder = ""\n', ''))
    assert load_file(conf).config.connectors[0].convert.schemas is False


# ---- schema-less values typed by the projection's declared columns ---------------------------------------------

def schemaless_conv(binary: str, **extra: Any) -> Any:
    settings = ConnectorConfig(
        name="c", connector_class="postgres-projection", topics=["dbserver1.public.items"],
        converter=ConverterKind.DEBEZIUM,
        convert=ConvertConfig(schemas=False, decimal_handling_mode="string", time_precision_mode="isostring",
                              binary_handling_mode=binary),
        config={"table": "items", "key_columns": ["id"], "key": {"id": "payload.id"},
                "columns": {"id": "bigint", "doc": "jsonb", "blob": "bytea", "note": "text", "raw": "json",
                            **extra},
                "on": [{"type": ["create", "update", "read"], "set": {"doc": "payload.doc", "blob": "payload.blob",
                                                                     "note": "payload.note", "raw": "payload.raw"}}]})
    return converter_for(settings)


def bare(op: str, after: dict[str, Any]) -> tuple[bytes, bytes]:
    return (orjson.dumps({"id": after["id"]}),
            orjson.dumps({"before": None, "after": after, "source": source(100), "op": op, "ts_ms": 1}))


@pytest.mark.parametrize(("binary", "text"), [("hex", "00ff10"), ("base64", "AP8Q"), ("base64-url-safe", "AP8Q"),
                                              ("bytes", "AP8Q")])
def test_a_schemaless_value_is_decoded_by_its_declared_column_type(binary: str, text: str):
    got = run(schemaless_conv(binary), *bare("c", {"id": 1, "doc": '{"a": [1, 2.5], "n": 123456789012345678901}',
                                                   "blob": text, "note": '{"not": "json"}', "raw": "[]"}))
    assert got.payload == {"id": 1, "doc": {"a": [1, 2.5], "n": 123456789012345678901}, "blob": "\\x00ff10",
                           "note": '{"not": "json"}', "raw": []}


def test_a_schemaless_placeholder_and_null_stay_as_they_are():
    hexed = UNAVAILABLE.encode().hex()
    got = run(schemaless_conv("hex"), *bare("u", {"id": 1, "doc": UNAVAILABLE, "blob": hexed, "note": None,
                                                  "raw": None}))
    assert got.payload == {"id": 1, "doc": UNAVAILABLE, "blob": UNAVAILABLE, "note": None, "raw": None}


@pytest.mark.parametrize(("field", "value"), [("doc", "{not json"), ("blob", "zz"), ("doc", 5)])
def test_a_schemaless_value_that_does_not_decode_names_its_field(field: str, value: Any):
    row = {"id": 1, "doc": "{}", "blob": "00", "note": "x", "raw": "1", field: value}
    with pytest.raises(ConvertError, match=rf"@7: path 'after\.{field}'.*declared column type"):
        run(schemaless_conv("hex"), *bare("c", row))


def test_a_field_mapped_to_a_json_and_a_bytea_column_is_refused():
    with pytest.raises(ValueError, match="'doc' is mapped to a JSON and to a bytea column"):
        converter_for(ConnectorConfig(
            name="c", connector_class="postgres-projection", topics=["t"], converter=ConverterKind.DEBEZIUM,
            convert=ConvertConfig(schemas=False, decimal_handling_mode="string", time_precision_mode="isostring"),
            config={"columns": {"a": "jsonb", "b": "bytea"},
                    "on": [{"type": "create", "set": {"a": "payload.doc", "b": "payload.doc"}}]}))


# ---- a key change: the delete names the new key, the projection moves the row ----------------------------------

@pytest.mark.parametrize("header", [b'{"id":50}',
                                    orjson.dumps({"schema": KEY_SCHEMA, "payload": {"id": 50}})])
def test_a_key_changes_delete_names_the_new_key_in_each_header_form(header: bytes):
    key, value = record("d", {"id": 1, "name": None}, None, 300)
    got = conv().event(key, value, [("__debezium.newkey", header)], topic="t", partition=0, offset=1,
                       timestamp_ms=None, raw=None)
    assert got.payload == {"id": 1, "name": None, "__debezium.newkey": {"id": 50}}
    plain = run(conv(), key, value)
    assert "__debezium.newkey" not in plain.payload
    other = conv().event(key, value, [("__debezium.newkey", b"Struct{id=50}")], topic="t", partition=0, offset=1,
                         timestamp_ms=None, raw=None)
    assert "__debezium.newkey" not in other.payload  # not a key this form can read: a plain delete


def rekey_delete(old: int, new: int, version: int) -> Event:
    return Event.new("delete", "public.items", str(old), version, {"id": old, "__debezium.newkey": {"id": new}})


def created(key: int, version: int, **payload: Any) -> Event:
    return Event.new("create", "public.items", str(key), version, {"id": key, **payload})


def fold_batch(m: Mapping, events: list[Event], loaded: dict[Any, Any], gone: dict[Any, int] | None = None
               ) -> f.Folded:
    records = [sink(e, i) for i, e in enumerate(events)]
    todo = f.candidates(records, f.prepare(m, records, b"p"), set())
    return f.fold(m, list(todo.first.values()), {k: v for k, v in loaded.items() if k in todo.keys},
                  todo.record_keys, todo.key_errors, gone)


OLD_ROW = {"id": 1, "name": "ada", "note": "a long TOASTed text", VERSION_COLUMN: 10}
RE_KEYED = {"id": 50, "name": "ada", "note": "a long TOASTed text", VERSION_COLUMN: 300}


def test_a_key_change_in_one_batch_keeps_the_toasted_value():
    m = Mapping(PC)
    folded = fold_batch(m, [rekey_delete(1, 50, 300), created(50, 300, name="ada", note=UNAVAILABLE)],
                        {(1,): OLD_ROW})
    assert folded.changes() == ([RE_KEYED], [(1,)])


@pytest.mark.parametrize("dedup_by_version", [False, True])
def test_a_key_change_across_two_batches_keeps_the_toasted_value_once(dedup_by_version: bool):
    m = Mapping(PC)
    gone: dict[Any, int] | None = {} if dedup_by_version else None
    first = fold_batch(m, [rekey_delete(1, 50, 300)], {(1,): OLD_ROW}, gone)
    upserts, deletes = first.changes()
    assert upserts == [{**OLD_ROW, "id": 50}] and deletes == [(1,)]  # moved with its old version
    table = {(50,): upserts[0]}  # what the first transaction committed
    second = fold_batch(m, [created(50, 300, name="ada", note=UNAVAILABLE)], table, gone)
    assert second.changes() == ([RE_KEYED], [])
    # the delete delivered again finds no old row: nothing moves a second time
    again = fold_batch(m, [rekey_delete(1, 50, 300)], {(50,): RE_KEYED}, gone)
    assert again.changes() == ([], [])


def test_a_key_change_never_replaces_a_row_the_new_key_has():
    """A row of the new key in the batch (or its tombstone) stays; one only in the table is kept by the upsert's
    version guard (the moved row has the old row's lower version)."""
    m = Mapping(PC)
    folded = fold_batch(m, [created(50, 400, name="other", note="kept"), rekey_delete(1, 50, 300)],
                        {(1,): OLD_ROW})
    assert folded.changes() == ([{"id": 50, "name": "other", "note": "kept", VERSION_COLUMN: 400}], [(1,)])
    buried = fold_batch(m, [rekey_delete(1, 50, 300)], {(1,): OLD_ROW}, {(50,): 350})
    assert buried.changes() == ([], [(1,)])


# ---- a completed snapshot sweeps the rows it did not read ------------------------------------------------------

def snapshot_record(row: dict[str, Any], lsn: int, mark: str) -> tuple[bytes | None, bytes]:
    key, value = record("r", None, row, lsn)
    body = orjson.loads(value)
    body["payload"]["source"]["snapshot"] = mark
    return key, orjson.dumps(body)


@pytest.mark.parametrize(("mark", "topics", "sweep", "marked"), [
    ("last", 1, "auto", True), ("last_in_data_collection", 1, "auto", True), ("true", 1, "auto", False),
    ("first", 1, "sweep", False), ("incremental", 1, "sweep", False), ("last", 2, "auto", False),
    ("last", 2, "sweep", True), ("last", 1, "keep", False)])
def test_a_snapshots_last_record_is_marked_for_the_sweep(mark: str, topics: int, sweep: str, marked: bool):
    c = converter_for(ConnectorConfig(name="c", connector_class="log", topics=[f"t{i}" for i in range(topics)],
                                      converter=ConverterKind.DEBEZIUM, convert=ConvertConfig(snapshot_sweep=sweep)))
    got = run(c, *snapshot_record({"id": 1, "name": "ada"}, 500, mark))
    assert got.type == "read" and ("__debezium.snapshot_end" in got.payload) is marked


def read(key: int, version: int, last: bool = False, **payload: Any) -> Event:
    extra = {"__debezium.snapshot_end": True} if last else {}
    return Event.new("read", "public.items", str(key), version, {"id": key, **payload, **extra})


@pytest.mark.parametrize("dedup_by_version", [False, True])
def test_the_end_of_a_snapshot_sweeps_the_rows_it_did_not_read(dedup_by_version: bool):
    m = Mapping(PC)
    gone: dict[Any, int] | None = {} if dedup_by_version else None
    stored = {(k,): {"id": k, "name": f"n{k}", "note": None, VERSION_COLUMN: v} for k, v in ((1, 10), (2, 20),
                                                                                             (3, 900))}
    # a re-snapshot at 500 reads 1 (not 2: deleted meanwhile; 3 changed after it started); then a change at 600
    folded = fold_batch(m, [read(1, 500, name="n1", note=None), read(3, 500, last=True, name="old", note=None),
                            changed(4, 600, name="after", note=None)], {**stored, (2,): stored[(2,)]}, gone)
    assert folded.swept == 500
    upserts, deletes = folded.changes()
    assert upserts == [{"id": 1, "name": "n1", "note": None, VERSION_COLUMN: 500},
                       {"id": 4, "name": "after", "note": None, VERSION_COLUMN: 600}]
    assert deletes == []  # key 2 is not in the batch: the writer's DELETE below 500 removes it from the table
    if gone is not None:
        assert gone == {}  # no loaded row was older
    # a row of the batch older than the snapshot goes here, with a tombstone at the snapshot's position
    again = fold_batch(m, [changed(2, 30, name="old change", note=None), read(1, 500, last=True, name="n1",
                                                                                note=None)], stored, gone)
    assert again.changes() == ([{"id": 1, "name": "n1", "note": None, VERSION_COLUMN: 500}], [(2,)])
    if gone is not None:
        assert gone == {(2,): 499}  # just below the snapshot: its own reads still apply


def test_snapshot_sweep_with_several_topics_is_refused_at_load(tmp_path: Path):
    conf = tmp_path / "kafold.toml"
    conf.write_text('''
[[connectors]]
name = "items"
class = "postgres-projection"
topics = ["dbserver1.public.items", "dbserver1.public.orders"]
converter = "debezium"

[connectors.convert]
snapshot_sweep = "sweep"

[connectors.config]
table = "items"
key_columns = ["id"]
columns = {id = "bigint"}
key = {id = "payload.id"}

[[connectors.config.on]]
type = "delete"
action = "delete"
''')
    with pytest.raises(ConfigError, match=r"connectors\[0\]\.convert\.snapshot_sweep: \"sweep\" deletes"):
        load_file(conf)
    conf.write_text(conf.read_text().replace('"sweep"', '"keep"'))
    assert load_file(conf).config.connectors[0].convert.snapshot_sweep == "keep"
