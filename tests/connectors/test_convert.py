"""The json and debezium converters (kafold.connectors.convert) and the intake that uses them."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from kafold.config import ConnectorConfig, ConvertConfig, ConverterKind
from kafold.connectors.convert import ConvertError, converter_for
from kafold.connectors.convert.debezium import position
from kafold.connectors.intake import Intake
from kafold.connectors.projection.config import OnEvent, ProjectionConfig


def conv(kind: str, **options: Any) -> Any:
    cc = ConnectorConfig(name="c", connector_class="log", topics=["t"], converter=ConverterKind(kind),
                         convert=ConvertConfig(**options))
    return converter_for(cc)


def run(c: Any, key: bytes | None, value: Any, *, offset: int = 4, headers: Any = None, ts: int | None = 1000,
        wrap: bool = False) -> Any:
    data = value if isinstance(value, bytes) or value is None else orjson.dumps(value)
    return c.event(key, data, headers, topic="t", partition=0, offset=offset, timestamp_ms=ts, raw=None)


def test_kafold_converter_is_none():
    assert converter_for(ConnectorConfig(name="c", connector_class="log", topics=["t"])) is None


def test_json_defaults():
    c = conv("json")
    e = run(c, b"acc-1", {"amount": 5})
    assert (e.aggregate_id, e.version, e.type, e.aggregate_type, e.payload) == ("acc-1", 5, "t", "t", {"amount": 5})
    assert e.occurred_at.startswith("1970-01-01T00:00:01")
    # the derived id is stable for the same coordinates (a redelivery dedups), different at another offset
    assert run(c, b"acc-1", {"amount": 5}).event_id == e.event_id
    assert run(c, b"acc-1", {"amount": 5}, offset=5).event_id != e.event_id


def test_json_paths_headers_and_constants():
    c = conv("json", id="$.meta.id", type="'Deposited'", key="header:account", version="meta.seq",
             time="@timestamp")
    e = run(c, b"k", {"meta": {"id": "e-1", "seq": 3}, "n": [1]}, headers=[("account", b"a-9")])
    assert (e.event_id, e.type, e.aggregate_id, e.version) == ("e-1", "Deposited", "a-9", 3)
    assert conv("json", type="items.1").event(b"k", b'{"items": ["a", "B"]}', None, topic="t", partition=0,
                                              offset=0, timestamp_ms=None, raw=None).type == "B"


def test_json_non_object_value():
    assert run(conv("json"), b"k", [1, 2]).payload == {"value": [1, 2]}


@pytest.mark.parametrize(("options", "value", "needle"), [
    ({"id": "meta.id"}, {"meta": {}}, "id path 'meta.id' is missing"),
    ({"version": "seq"}, {"seq": "x"}, "version source 'seq'"),
    ({}, b"{not json", "not valid JSON"),
    ({"key": "header:nope"}, {}, "key source 'header:nope' is empty"),
])
def test_json_bad_input_names_the_path(options, value, needle):
    with pytest.raises(ConvertError) as got:
        run(conv("json", **options), b"k", value)
    assert needle in str(got.value) and "t[0]@4" in str(got.value)
    assert got.value.reason == "convert-failed"


def test_convert_config_rejects_bad_source():
    with pytest.raises(ValueError, match=r"id: 'a\.\.b'"):
        ConvertConfig(id="a..b")
    with pytest.raises(ValueError, match="@nope"):
        ConvertConfig(key="@nope")


SOURCE = {"version": "2.7", "connector": "postgresql", "db": "shop", "schema": "public", "table": "items",
          "ts_ms": 1700000000000}


def change(op: str, before: Any, after: Any, lsn: int) -> dict[str, Any]:
    return {"before": before, "after": after, "op": op, "source": {**SOURCE, "lsn": lsn}, "ts_ms": 1700000000001}


# Debezium with value.converter.schemas.enable=false and the settings that make it readable
SCHEMALESS = {"schemas": False, "decimal_handling_mode": "string", "time_precision_mode": "isostring"}


def wrapped(body: Any) -> dict[str, Any]:
    return {"schema": {"type": "struct"}, "payload": body}


@pytest.mark.parametrize("wrap", [False, True])
def test_debezium_each_op(wrap):
    c = conv("debezium", **({} if wrap else SCHEMALESS))
    key = orjson.dumps(wrapped({"id": 7}) if wrap else {"id": 7})

    def ev(body: dict[str, Any]) -> Any:
        return run(c, key, wrapped(body) if wrap else body)

    created = ev(change("c", None, {"id": 7, "name": "a"}, 100))
    assert (created.type, created.aggregate_id, created.aggregate_type, created.version, created.payload) == (
        "create", "7", "public.items", 100, {"id": 7, "name": "a"})
    assert ev(change("r", None, {"id": 7, "name": "a"}, 50)).type == "read"
    assert ev(change("u", {"id": 7}, {"id": 7, "name": "b"}, 120)).payload == {"id": 7, "name": "b"}
    deleted = ev(change("d", {"id": 7, "name": None}, None, 130))
    assert (deleted.type, deleted.version, deleted.payload) == ("delete", 130, {"id": 7, "name": None})
    # Debezium's redelivery of the same change at another offset keeps its id; another change has another one
    assert run(c, key, wrapped(change("c", None, {"id": 7, "name": "a"}, 100)) if wrap
               else change("c", None, {"id": 7, "name": "a"}, 100), offset=99).event_id == created.event_id
    assert ev(change("u", {"id": 7}, {"id": 7, "name": "b"}, 120)).event_id != created.event_id


def test_debezium_delete_merges_key_fields_and_composite_key():
    c = conv("debezium", **SCHEMALESS)
    e = run(c, b'{"a": 1, "b": "x"}', change("d", {"a": None, "b": None, "v": 1}, None, 9))
    assert e.payload == {"a": 1, "b": "x", "v": 1}
    assert e.aggregate_id == '{"a":1,"b":"x"}'


def test_debezium_tombstone_is_skipped():
    assert run(conv("debezium"), b'{"id": 7}', None) is None


def test_debezium_mysql_position_orders_and_fits_bigint():
    a = position({"file": "mysql-bin.000003", "pos": 4000, "row": 0})
    b = position({"file": "mysql-bin.000003", "pos": 4000, "row": 1})
    c = position({"file": "mysql-bin.000004", "pos": 4, "row": 0})
    assert a is not None and b is not None and c is not None and a < b < c < 2**63


def test_debezium_configured_version_and_missing_position():
    body = change("c", None, {"id": 1}, 0)
    body["source"].pop("lsn")
    with pytest.raises(ConvertError, match="no log position"):
        run(conv("debezium", **SCHEMALESS), b'{"id": 1}', body)
    body["source"]["seq"] = 42
    assert run(conv("debezium", **SCHEMALESS, version="source.seq"), b'{"id": 1}', body).version == 42


@pytest.mark.parametrize(("body", "needle"), [
    ({"before": None, "after": {"id": 1}, "op": "x", "source": SOURCE}, "path 'op'"),
    ({"before": None, "after": None, "op": "c", "source": {**SOURCE, "lsn": 5}}, "path 'after'"),
    ({"before": None, "after": {"id": 1}, "op": "c"}, "path 'source'"),
    ([1], "expected a Debezium change event"),
])
def test_debezium_bad_input_names_the_path(body, needle):
    with pytest.raises(ConvertError, match=needle):
        run(conv("debezium", **SCHEMALESS), b'{"id": 1}', body)


def test_intake_uses_the_converter_and_skips_tombstones():
    intake = Intake("c", {"create", "update", "read", "delete"}.__contains__, "dead-letter",
                    converter=conv("debezium", **SCHEMALESS))
    e = intake.event(b'{"id": 1}', orjson.dumps(change("c", None, {"id": 1}, 5)), None, topic="t", partition=0,
                     offset=0)
    assert e is not None and e.type == "create"
    assert intake.event(b'{"id": 1}', None, None, topic="t", partition=0, offset=1) is None


def test_projection_rule_type_list_expands():
    pc = ProjectionConfig(table="items", key_columns=["id"], columns={"id": "bigint", "name": "text"},
                          key={"id": "payload.id"},
                          on=[OnEvent(type=["create", "update", "read"], set={"name": "payload.name"}),
                              OnEvent(type="delete", action="delete")])
    assert [r.type for r in pc.on] == ["create", "update", "read", "delete"]
    with pytest.raises(ValueError, match=r"on\[0\]\.type"):
        ProjectionConfig(table="items", key_columns=["id"], columns={"id": "bigint"}, on=[OnEvent(type=[])])
