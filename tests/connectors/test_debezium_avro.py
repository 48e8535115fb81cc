"""Integration: Debezium change events in Avro (the PostgreSQL connector's envelope, the key a record) made from a
real PostgreSQL source table's changes, serialized with confluent-kafka's AvroSerializer against a real Apicurio
Registry, projected by `converter = "debezium"` with `[connectors.convert] format = "avro"`: the projected table
equals the source table (snapshot, insert, update, delete + tombstone, a re-created key, an older change
delivered again); a record whose key is not in Avro is a dead letter."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from kafold import db
from kafold.config import (
    ConnectorConfig,
    ConvertConfig,
    ConverterKind,
    DaemonConfig,
    KafkaConfig,
    PostgresConfig,
    RegistryConfig,
)
from kafold.connectors.registry import instantiate
from kafold.daemon.runner import SinkRunner
from tests.connectors.test_convert_daemon import Source, projected
from tests.projection.projection_support import dead_letters, ends_of, table_name, wait_for_offsets
from tests.support import create_topic, produce

pytestmark = pytest.mark.integration


def schemas(table: str) -> tuple[str, str]:
    """The key and value schemas Debezium's PostgreSQL connector registers for `public.<table>` (AvroConverter)."""
    ns = f"bench.public.{table}"
    value = {"type": "record", "name": "Value", "namespace": ns, "fields": [
        {"name": "id", "type": "long"},
        {"name": "name", "type": ["null", "string"], "default": None},
        {"name": "qty", "type": ["null", "long"], "default": None}]}
    source = {"type": "record", "name": "Source", "namespace": "io.debezium.connector.postgresql", "fields": [
        {"name": "version", "type": "string"}, {"name": "connector", "type": "string"},
        {"name": "name", "type": "string"}, {"name": "ts_ms", "type": "long"},
        {"name": "snapshot", "type": [{"type": "string", "connect.version": 1,
                                       "connect.parameters": {"allowed": "true,last,false,incremental"},
                                       "connect.default": "false",
                                       "connect.name": "io.debezium.data.Enum"}, "null"], "default": "false"},
        {"name": "db", "type": "string"},
        {"name": "sequence", "type": ["null", "string"], "default": None},
        {"name": "schema", "type": "string"}, {"name": "table", "type": "string"},
        {"name": "txId", "type": ["null", "long"], "default": None},
        {"name": "lsn", "type": ["null", "long"], "default": None},
        {"name": "xmin", "type": ["null", "long"], "default": None}],
        "connect.name": "io.debezium.connector.postgresql.Source"}
    envelope = {"type": "record", "name": "Envelope", "namespace": ns, "fields": [
        {"name": "before", "type": ["null", value], "default": None},
        {"name": "after", "type": ["null", "Value"], "default": None},
        {"name": "source", "type": source},
        {"name": "op", "type": "string"},
        {"name": "ts_ms", "type": ["null", "long"], "default": None}],
        "connect.name": f"{ns}.Envelope"}
    key = {"type": "record", "name": "Key", "namespace": ns, "fields": [{"name": "id", "type": "long"}],
           "connect.name": f"{ns}.Key"}
    return json.dumps(key), json.dumps(envelope)


class AvroSource(Source):
    """The source table's changes as Debezium's AvroConverter writes them: key and value framed for the registry."""

    def __init__(self, pgc: PostgresConfig, table: str, registry_url: str, topic: str) -> None:
        from confluent_kafka.schema_registry import SchemaRegistryClient
        from confluent_kafka.schema_registry.avro import AvroSerializer
        from confluent_kafka.serialization import MessageField, SerializationContext

        super().__init__(pgc, table)
        client = SchemaRegistryClient({"url": registry_url})
        key_schema, value_schema = schemas(table)
        self.key_ser = AvroSerializer(client, key_schema)  # registers `<topic>-key` / `<topic>-value` once
        self.value_ser = AvroSerializer(client, value_schema)
        self.key_ctx = SerializationContext(topic, MessageField.KEY)
        self.value_ctx = SerializationContext(topic, MessageField.VALUE)
        self.txid = 500

    def _record(self, op: str, key: int, before: Any, after: Any, lsn: int) -> tuple[int, bytes, bytes, Any]:
        self.txid += 1
        body = {"before": before, "after": after, "op": op, "ts_ms": 1764300000000 + self.txid,
                "source": {"version": "2.7.3.Final", "connector": "postgresql", "name": "bench",
                           "ts_ms": 1764300000000 + self.txid, "snapshot": "true" if op == "r" else "false",
                           "db": "app", "sequence": None, "schema": "public", "table": self.table,
                           "txId": self.txid, "lsn": lsn, "xmin": None}}
        return 0, self.key(key), self.value_ser(body, self.value_ctx), None

    def key(self, key: int) -> bytes:
        return self.key_ser({"id": key}, self.key_ctx)

    def change(self, sql: str, key: int, params: tuple[Any, ...] = ()) -> list[tuple[int, bytes, bytes | None, Any]]:
        # The tombstone after a delete carries the key in Avro too (its value None).
        return [(p, self.key(key) if v is None else k, v, h) for p, k, v, h in super().change(sql, key, params)]


@contextmanager
def _running(kafka: KafkaConfig, pgc: PostgresConfig, cfg: ConnectorConfig, registry: RegistryConfig,
             group_prefix: str) -> Iterator[SinkRunner]:
    """The projection's SinkRunner in a thread, given [postgres] and [registry] as the daemon host would."""
    connector = instantiate(cfg, Path("."))
    task_config = connector.task_configs(1)[0].with_services(postgres=pgc)
    runner = SinkRunner(connector, task_config, kafka=kafka, registry=registry,
                        daemon=DaemonConfig(group_prefix=group_prefix, batch_max_records=3, shutdown_grace_s=5))
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    try:
        yield runner
    finally:
        runner.stop()
        thread.join(60)
    assert not thread.is_alive(), "the runner did not stop within 60 s"


@pytest.mark.apache_kafka
@pytest.mark.timeout(300)
def test_debezium_avro_change_events_project_the_source_table(
        kafka_config: KafkaConfig, pg_config: PostgresConfig, registry_url: str, unique: str) -> None:
    topic, src, dst = f"{unique}.cdc", table_name(), table_name()
    create_topic(kafka_config, topic, partitions=1)
    source = AvroSource(pg_config, src, registry_url, topic)
    with db.connect(pg_config) as conn:  # rows that exist before the connector: they arrive as a snapshot (op r)
        conn.execute(f"INSERT INTO {src} VALUES (1, 'ada', 1), (2, 'bob', 2), (3, 'cy', NULL)")
    records = source.snapshot()
    records += source.change(f"UPDATE {src} SET qty = 10 WHERE id = 1", 1)
    records += source.change(f"INSERT INTO {src} VALUES (4, 'dee', 4)", 4)
    records += source.change(f"DELETE FROM {src} WHERE id = 3", 3)
    records += source.change(f"DELETE FROM {src} WHERE id = 2", 2)
    records += source.change(f"INSERT INTO {src} VALUES (2, 'bob again', 22)", 2)  # re-created after its delete
    records += source.change(f"UPDATE {src} SET name = NULL WHERE id = 4", 4)
    assert sum(v is None for _, _, v, _ in records) == 2  # the two tombstones are in the topic
    assert all(k[0] == 0 for _, k, _, _ in records)  # every key framed for the registry (magic byte 0)
    # an older change delivered again (the snapshot row of 1: its lsn is older, the version guard keeps it out) and
    # a change whose key is JSON, not framed for the registry: a dead letter naming the key, later records flow
    bad_key = (0, b'{"id": 4}', records[-1][2], None)
    records += [records[0], bad_key, *source.change(f"UPDATE {src} SET qty = 40 WHERE id = 4", 4)]
    coords = produce(kafka_config, topic, records)

    cfg = ConnectorConfig(
        name=unique, connector_class="postgres-projection", topics=[topic], converter=ConverterKind.DEBEZIUM,
        convert=ConvertConfig(format="avro"),
        config={"table": dst, "key_columns": ["id"], "columns": {"id": "bigint", "name": "text", "qty": "bigint"},
                "key": {"id": "payload.id"},
                "on": [{"type": ["create", "update", "read"], "set": {"name": "payload.name", "qty": "payload.qty"}},
                       {"type": "delete", "action": "delete"}]})
    with _running(kafka_config, pg_config, cfg, RegistryConfig(url=registry_url), unique) as runner:
        wait_for_offsets(pg_config, unique, topic, ends_of(coords), runner)
    dead = dead_letters(pg_config, unique)
    assert [(d[2], d[3]) for d in dead] == [(coords[-2][1], "convert-failed")], dead
    assert "key: not framed for a schema registry" in dead[0][5]
    assert projected(pg_config, dst, "id, name, qty") == source.table_now()
    assert set(source.table_now()) == {1, 2, 4}
