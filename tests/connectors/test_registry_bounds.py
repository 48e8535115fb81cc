"""Hostile registry-framed records and registry answers, against a stand-in registry client: an Avro record that
declares endless zero-byte items, Protobuf and JSON Schema values past the item limit are ConvertErrors naming the
field (`too-large`); a registry refusing kafold's credentials holds the partition (RetriableError); an unknown
schema id is asked for once per TTL and its records are dead-lettered as `unknown-schema`."""

from __future__ import annotations

import struct
import time
from typing import Any

import orjson
import pytest
from confluent_kafka.schema_registry import Schema
from confluent_kafka.schema_registry.error import SchemaRegistryError
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from structlog.testing import capture_logs

from kafold.config import RegistryConfig
from kafold.connectors.convert.plain import JsonConverter
from kafold.connectors.convert.registry import ConvertError, registry_format
from kafold.errors import RetriableError

EMPTY_ITEMS = orjson.dumps({"type": "record", "name": "Hostile", "fields": [
    {"name": "id", "type": "string"},
    {"name": "marks", "type": {"type": "array", "items": {"type": "record", "name": "Mark", "fields": []}}}]})


def _rows_class() -> Any:
    """A protobuf message `Rows { repeated int64 n = 1; }` built from a descriptor (no protoc needed)."""
    fd = descriptor_pb2.FileDescriptorProto(name="kafold_test_rows.proto", package="kafold.bounds", syntax="proto3")
    msg = fd.message_type.add(name="Rows")
    msg.field.add(name="n", number=1, type=descriptor_pb2.FieldDescriptorProto.TYPE_INT64,
                  label=descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fd)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("kafold.bounds.Rows"))


Rows = _rows_class()  # referenced by the protobuf format as "tests.connectors.test_registry_bounds:Rows"


def _varint(n: int) -> bytes:
    n = (n << 1) ^ (n >> 63)
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _framed(schema_id: int, body: bytes) -> bytes:
    return struct.pack(">bI", 0, schema_id) + body


def _format(kind: str = "avro", *, schema: bytes = EMPTY_ITEMS, fail: Exception | None = None,
            message_type: str = "", **cfg: Any) -> tuple[Any, list[int]]:
    """A registry format whose client answers `schema` (or raises `fail`) for any id; the ids it was asked for."""
    known = {k: v for k, v in cfg.items() if k in RegistryConfig.__dataclass_fields__}  # also runs on older trees
    fmt = registry_format(kind, RegistryConfig(url="http://127.0.0.1:9", retry_within_s=0, **known), message_type)
    asked: list[int] = []

    def get_schema(schema_id: int, *a: Any, **kw: Any) -> Schema:
        asked.append(schema_id)
        if fail is not None:
            raise fail
        return Schema(schema.decode(), "AVRO")

    fmt.client.get_schema = get_schema
    return fmt, asked


def _converter(fmt: Any) -> JsonConverter:
    class Options:
        id = type = key = version = time = aggregate_type = ""

    return JsonConverter(Options(), fmt)


def test_an_avro_record_declaring_endless_empty_items_is_dead_lettered_naming_the_field() -> None:
    fmt, _ = _format(max_decoded_items=1000)
    for count in (10**7, 2**60):  # a 5-byte body: "", then one block of `count` empty records
        hostile = _framed(7, b"\x00" + _varint(count))
        assert len(hostile) - 5 <= 10
        started = time.monotonic()
        with pytest.raises(ConvertError) as e:
            _converter(fmt).event(b"k", hostile, None, topic="orders", partition=3, offset=41, timestamp_ms=0,
                                  raw=None)
        assert time.monotonic() - started < 1.0
        assert e.value.reason == "too-large"
        assert "orders[3]@41" in str(e.value) and "'marks'" in str(e.value) and "1000" in str(e.value)


def test_an_avro_schema_with_references_is_walked_before_confluents_deserializer_runs() -> None:
    from confluent_kafka.schema_registry import RegisteredSchema, SchemaReference

    mark = '{"type": "record", "name": "Mark", "namespace": "kafold.test", "fields": []}'
    root = ('{"type": "record", "name": "Marks", "namespace": "kafold.test", "fields": [{"name": "marks", '
            '"type": {"type": "array", "items": "kafold.test.Mark"}}]}')
    fmt, _ = _format(max_decoded_items=1000)
    fmt.client.get_schema = lambda schema_id, *a, **kw: Schema(root, "AVRO", [SchemaReference(
        "kafold.test.Mark", "mark-value", 1)])
    fmt.client.get_version = lambda subject, version, *a, **kw: RegisteredSchema(subject, version, 3, None,
                                                                                 Schema(mark, "AVRO"))
    decoded: list[bytes] = []
    fmt._value = lambda data, ctx: decoded.append(data) or {"marks": []}
    with pytest.raises(ConvertError, match="'marks'") as e:
        fmt.load("orders", _framed(8, _varint(2**60)), is_key=False)
    assert e.value.reason == "too-large" and decoded == []
    assert fmt.load("orders", _framed(8, _varint(2) + b"\x00"), is_key=False) == {"marks": []}  # the deserializer's


def test_avro_records_within_the_limit_still_decode() -> None:
    fmt, _ = _format(max_decoded_items=1000)
    good = _framed(7, b"\x04ab" + _varint(3) + b"\x00")
    assert fmt.load("orders", good, is_key=False) == {"id": "ab", "marks": [{}, {}, {}]}


def test_the_walk_counts_blocks_of_maps_and_arrays_in_nested_records() -> None:
    from kafold.connectors.convert.bounds import AvroWalk  # here: the other tests run on a tree without it

    schema = {"type": "record", "name": "R", "namespace": "n", "fields": [
        {"name": "m", "type": {"type": "map", "values": {"type": "array", "items": "null"}}},
        {"name": "next", "type": ["null", "R"]}]}
    walk = AvroWalk(schema)
    assert walk.needed
    # m = {"a": [null x 3]}, next = R(m = {}, next = null)
    body = _varint(1) + b"\x02a" + _varint(3) + b"\x00" + b"\x00" + _varint(1) + b"\x00" + _varint(0)
    walk.check(body, 4)
    with pytest.raises(Exception, match="'m'"):
        walk.check(body, 3)
    assert not AvroWalk({"type": "array", "items": "long"}).needed


def test_decoded_values_past_the_limit_name_the_path() -> None:
    from kafold.connectors.convert.bounds import excess

    assert excess({"a": [1, 2], "b": {"c": list(range(10))}}, 100) is None
    assert excess({"a": [1, 2], "b": {"c": list(range(10))}}, 10) == "b.c"


def test_a_long_jsonschema_value_past_the_item_limit_is_dead_lettered() -> None:
    fmt, _ = _format("jsonschema", max_decoded_items=50)
    fmt._value = lambda data, ctx: {"rows": list(range(200))}  # the deserializer's result for a long record
    with pytest.raises(ConvertError, match="'rows'") as e:
        fmt.load("orders", _framed(1, b" " * 300), is_key=False)
    assert e.value.reason == "too-large"


def test_a_long_protobuf_value_past_the_item_limit_is_dead_lettered() -> None:
    fmt, _ = _format("protobuf", message_type="tests.connectors.test_registry_bounds:Rows", max_decoded_items=50)
    fmt._value = lambda data, ctx: Rows(n=list(range(200)))  # the deserializer's result for a long record
    with pytest.raises(ConvertError, match="'n'") as e:
        fmt.load("orders", _framed(1, b" " * 300), is_key=False)
    assert e.value.reason == "too-large"


@pytest.mark.parametrize("status", [401, 403])
def test_a_registry_refusing_the_credentials_holds_the_partition(status: int) -> None:
    fmt, _ = _format(fail=SchemaRegistryError(status, status * 100 + 1, "Unauthorized"))
    with capture_logs() as logs, pytest.raises(RetriableError, match="authentication failed"):
        fmt.load("orders", _framed(3, b"\x00\x00"), is_key=False)
    assert any(e["event"] == "registry.authentication_failed" and e["status"] == status for e in logs)


def test_a_flood_of_one_unknown_schema_id_asks_the_registry_once_per_ttl() -> None:
    fmt, asked = _format(fail=SchemaRegistryError(404, 40403, "Schema not found"), unknown_id_ttl_s=0.3)
    conv = _converter(fmt)
    reasons = set()
    for offset in range(500):
        with pytest.raises(ConvertError, match="schema id 99 is unknown") as e:
            conv.event(b"k", _framed(99, b"\x00"), None, topic="orders", partition=0, offset=offset,
                       timestamp_ms=0, raw=None)
        reasons.add(e.value.reason)
    assert asked == [99]
    assert reasons == {"unknown-schema"}
    time.sleep(0.35)
    with pytest.raises(ConvertError):
        fmt.load("orders", _framed(99, b"\x00"), is_key=False)
    assert asked == [99, 99]


def test_the_unknown_ids_remembered_are_bounded() -> None:
    fmt, _ = _format(fail=SchemaRegistryError(404, 40403, "Schema not found"), unknown_id_max=10)
    for schema_id in range(100):
        with pytest.raises(ConvertError):
            fmt.load("orders", _framed(schema_id, b"\x00"), is_key=False)
    assert len(fmt._unknown) == 10 and sorted(fmt._unknown) == list(range(90, 100))
