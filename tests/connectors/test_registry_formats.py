"""The Schema Registry value formats against a real Apicurio Registry: records written by confluent-kafka's own
serializers decode to the values written; unknown ids, bad framing and bad bytes are ConvertErrors naming the id;
a registry that is down is a RetriableError (the runner's backoff retries it)."""

from __future__ import annotations

import struct
import uuid
from typing import Any

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from kafold.config import RegistryConfig
from kafold.connectors.convert.registry import ConvertError, registry_format
from kafold.errors import ConfigError, RetriableError
from kafold.tools.dev.registry_server import Registry, free_port

pytestmark = pytest.mark.integration

AVRO_SCHEMA = """{"type": "record", "name": "Deposit", "namespace": "kafold.test", "fields": [
  {"name": "id", "type": "string"}, {"name": "amount", "type": "long"},
  {"name": "note", "type": ["null", "string"], "default": null}]}"""
JSON_SCHEMA = """{"$schema": "http://json-schema.org/draft-07/schema#", "title": "Deposit", "type": "object",
  "properties": {"id": {"type": "string"}, "amount": {"type": "integer"}}, "required": ["id", "amount"]}"""


def _proto_class() -> Any:
    """A generated-style protobuf message class built from a descriptor (no protoc needed)."""
    fd = descriptor_pb2.FileDescriptorProto(name="kafold_test_deposit.proto", package="kafold.test", syntax="proto3")
    msg = fd.message_type.add(name="Deposit")
    msg.field.add(name="id", number=1, type=descriptor_pb2.FieldDescriptorProto.TYPE_STRING,
                  label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL)
    msg.field.add(name="amount", number=2, type=descriptor_pb2.FieldDescriptorProto.TYPE_INT64,
                  label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fd)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("kafold.test.Deposit"))


Deposit = _proto_class()  # referenced by the protobuf format as "tests.connectors.test_registry_formats:Deposit"


@pytest.fixture
def registry_cfg(registry_url: str) -> RegistryConfig:
    return RegistryConfig(url=registry_url)


def _client(url: str) -> Any:
    from confluent_kafka.schema_registry import SchemaRegistryClient

    return SchemaRegistryClient({"url": url})


def _ctx(topic: str) -> Any:
    from confluent_kafka.serialization import MessageField, SerializationContext

    return SerializationContext(topic, MessageField.VALUE)


def _topic() -> str:
    return f"reg-{uuid.uuid4().hex[:10]}"


def test_avro_records_decode_to_the_values_written_and_the_schema_is_fetched_once(
        registry_cfg: RegistryConfig) -> None:
    from confluent_kafka.schema_registry.avro import AvroSerializer

    topic = _topic()
    ser = AvroSerializer(_client(registry_cfg.url), AVRO_SCHEMA)
    values = [{"id": f"d{i}", "amount": i * 10, "note": None if i % 2 else "hi"} for i in range(5)]
    fmt = registry_format("avro", registry_cfg)
    fetched: list[int] = []
    real = fmt.client.get_schema

    def counting(schema_id: int, *a: Any, **kw: Any) -> Any:
        fetched.append(schema_id)
        return real(schema_id, *a, **kw)

    fmt.client.get_schema = counting  # type: ignore[method-assign]
    decoded = [fmt.load(topic, ser(v, _ctx(topic)), is_key=False) for v in values]
    assert decoded == values
    # The client's cache answers every record after the first: one schema, one lookup that reached the registry.
    assert len(set(fetched)) == 1
    assert len(fmt.client._cache.schema_id_index) == 1


def test_avro_logical_types_come_out_as_their_json_form(registry_cfg: RegistryConfig) -> None:
    import datetime
    import decimal

    from confluent_kafka.schema_registry.avro import AvroSerializer

    schema = """{"type": "record", "name": "Booked", "namespace": "kafold.test", "fields": [
      {"name": "at", "type": {"type": "long", "logicalType": "timestamp-millis"}},
      {"name": "amount", "type": {"type": "bytes", "logicalType": "decimal", "precision": 9, "scale": 2}},
      {"name": "raw", "type": "bytes"}]}"""
    topic = _topic()
    at = datetime.datetime(2026, 11, 28, 17, 0, 1, 250000, tzinfo=datetime.UTC)
    data = AvroSerializer(_client(registry_cfg.url), schema)(
        {"at": at, "amount": decimal.Decimal("12.34"), "raw": b"\x00\x01"}, _ctx(topic))
    assert registry_format("avro", registry_cfg).load(topic, data, is_key=False) == {
        "at": "2026-11-28T17:00:01.250000+00:00", "amount": "12.34", "raw": "AAE="}


def test_jsonschema_records_decode_to_the_values_written(registry_cfg: RegistryConfig) -> None:
    from confluent_kafka.schema_registry.json_schema import JSONSerializer

    topic = _topic()
    ser = JSONSerializer(JSON_SCHEMA, _client(registry_cfg.url))
    fmt = registry_format("jsonschema", registry_cfg)
    value = {"id": "j1", "amount": 42}
    assert fmt.load(topic, ser(value, _ctx(topic)), is_key=False) == value


def test_a_jsonschema_record_that_breaks_its_schema_is_a_convert_error(registry_cfg: RegistryConfig) -> None:
    from confluent_kafka.schema_registry.json_schema import JSONSerializer

    topic = _topic()
    good = JSONSerializer(JSON_SCHEMA, _client(registry_cfg.url))({"id": "j1", "amount": 1}, _ctx(topic))
    schema_id = struct.unpack(">bI", good[:5])[1]
    fmt = registry_format("jsonschema", registry_cfg)
    with pytest.raises(ConvertError, match=f"schema id {schema_id}"):
        fmt.load(topic, good[:5] + b'{"id": "j1", "amount": "lots"}', is_key=False)


def test_protobuf_records_decode_through_the_configured_message_class(registry_cfg: RegistryConfig) -> None:
    from confluent_kafka.schema_registry.protobuf import ProtobufSerializer

    topic = _topic()
    ser = ProtobufSerializer(Deposit, _client(registry_cfg.url), {"use.deprecated.format": False})
    fmt = registry_format("protobuf", registry_cfg, message_type="tests.connectors.test_registry_formats:Deposit")
    data = ser(Deposit(id="p1", amount=7), _ctx(topic))
    assert fmt.load(topic, data, is_key=False) == {"id": "p1", "amount": "7"}  # int64 as a JSON string


def test_protobuf_without_a_message_type_is_refused_up_front(registry_cfg: RegistryConfig) -> None:
    with pytest.raises(ConfigError, match="message_type"):
        registry_format("protobuf", registry_cfg)


def test_an_unknown_schema_id_is_a_convert_error_naming_the_id(registry_cfg: RegistryConfig) -> None:
    topic = _topic()
    fmt = registry_format("avro", registry_cfg)
    with pytest.raises(ConvertError, match="schema id 987654") as caught:
        fmt.load(topic, struct.pack(">bI", 0, 987654) + b"\x02", is_key=False)
    assert caught.value.reason == "unknown-schema"  # remembered for unknown_id_ttl_s: a flood costs one request
    assert topic in str(caught.value)


def test_a_flood_of_records_with_one_unknown_id_asks_the_registry_once(registry_cfg: RegistryConfig) -> None:
    fmt = registry_format("avro", registry_cfg)
    asked: list[int] = []
    real = fmt.client.get_schema

    def counting(schema_id: int, *a: Any, **kw: Any) -> Any:
        asked.append(schema_id)
        return real(schema_id, *a, **kw)

    fmt.client.get_schema = counting  # type: ignore[method-assign]
    for _ in range(200):
        with pytest.raises(ConvertError, match="schema id 987655 is unknown"):
            fmt.load(_topic(), struct.pack(">bI", 0, 987655) + b"\x02", is_key=False)
    assert asked == [987655]


def test_a_five_byte_avro_record_declaring_endless_empty_items_is_refused_at_once(
        registry_cfg: RegistryConfig) -> None:
    from confluent_kafka.schema_registry import Schema

    schema = """{"type": "record", "name": "Marks", "namespace": "kafold.test", "fields": [
      {"name": "marks", "type": {"type": "array", "items": {"type": "record", "name": "Mark", "fields": []}}}]}"""
    topic = _topic()
    schema_id = _client(registry_cfg.url).register_schema(f"{topic}-value", Schema(schema, "AVRO"))
    fmt = registry_format("avro", registry_cfg)
    assert fmt.load(topic, struct.pack(">bI", 0, schema_id) + b"\x06\x00", is_key=False) == {"marks": [{}, {}, {}]}
    hostile = struct.pack(">bI", 0, schema_id) + b"\x80\x80\x80\x80\x80\x80\x80\x80\x20"  # one block of 2^60
    with pytest.raises(ConvertError, match="field 'marks'") as caught:
        fmt.load(topic, hostile, is_key=False)
    assert caught.value.reason == "too-large"


def test_bad_framing_and_bytes_that_do_not_match_the_schema_are_convert_errors(registry_cfg: RegistryConfig) -> None:
    from confluent_kafka.schema_registry.avro import AvroSerializer

    topic = _topic()
    fmt = registry_format("avro", registry_cfg)
    with pytest.raises(ConvertError, match="magic byte"):
        fmt.load(topic, b'{"id": "x"}', is_key=False)
    good = AvroSerializer(_client(registry_cfg.url), AVRO_SCHEMA)({"id": "a", "amount": 1, "note": None}, _ctx(topic))
    schema_id = struct.unpack(">bI", good[:5])[1]
    with pytest.raises(ConvertError, match=f"schema id {schema_id}"):
        fmt.load(topic, good[:5] + b"\xff\xff\xff", is_key=False)  # a string length past the end


def test_a_registry_that_is_down_is_a_retriable_error() -> None:
    fmt = registry_format("avro", RegistryConfig(url=f"http://127.0.0.1:{free_port()}/apis/ccompat/v7",
                                                  timeout_s=2.0, retry_within_s=0))  # no waiting: raised at once
    with pytest.raises(RetriableError, match="schema id 5"):
        fmt.load("t", struct.pack(">bI", 0, 5) + b"\x02", is_key=False)


def test_a_stopped_registry_is_retriable_and_a_restarted_one_serves_again(tmp_path: Any) -> None:
    """Stopped: RetriableError (never a dead letter). Restarted on the same port with the schema registered again
    (in-memory storage forgets it; the first schema of a fresh registry gets the same id): the record decodes."""
    from confluent_kafka.schema_registry.avro import AvroSerializer

    reg = Registry(tmp_path / "reg", free_port()).start()
    try:
        topic = _topic()
        data = AvroSerializer(_client(reg.url), AVRO_SCHEMA)({"id": "r", "amount": 3, "note": None}, _ctx(topic))
        fmt = registry_format("avro", RegistryConfig(url=reg.url, timeout_s=2.0, retry_within_s=0))
        reg.stop()
        with pytest.raises(RetriableError):
            fmt.load(topic, data, is_key=False)
        reg.start()
        again = AvroSerializer(_client(reg.url), AVRO_SCHEMA)({"id": "r", "amount": 3, "note": None}, _ctx(topic))
        assert again[:5] == data[:5]  # same id after re-registering in the same order
        assert fmt.load(topic, data, is_key=False) == {"id": "r", "amount": 3, "note": None}
    finally:
        reg.stop()
