"""Integration: a postgres-projection reading Avro records through a real Apicurio Registry that stops in the middle.

The schema of an id is cached once fetched, so the stop only matters for an id not seen yet: the second half of the
records is written with a second schema version. While the registry is down the format retries for
`retry_within_s`, then the runner backs off and decodes the record again (partitions paused, membership kept);
nothing is dead-lettered. The registry keeps schemas in memory, so the restarted one
is given the same two schemas in the same order, which gives them the same ids again."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import structlog

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
from kafold.tools.dev.registry_server import Registry, free_port
from tests.projection.projection_support import dead_letters, read_table, table_name, wait_for_offsets
from tests.support import create_topic, produce, wait_for

pytestmark = pytest.mark.integration
DOWN_S = 30.0  # how long the registry stays stopped (the issue: "stopped for 30 s in the middle")

V1 = """{"type": "record", "name": "Deposit", "namespace": "kafold.test", "fields": [
  {"name": "id", "type": "string"}, {"name": "account", "type": "string"}, {"name": "amount", "type": "long"}]}"""
V2 = """{"type": "record", "name": "Deposit", "namespace": "kafold.test", "fields": [
  {"name": "id", "type": "string"}, {"name": "account", "type": "string"}, {"name": "amount", "type": "long"},
  {"name": "note", "type": ["null", "string"], "default": null}]}"""


def _register(url: str, topic: str) -> tuple[Any, Any, tuple[int, int]]:
    """Serializers of V1 and V2 (registered in that order) and their two schema ids."""
    from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
    from confluent_kafka.schema_registry.avro import AvroSerializer

    client = SchemaRegistryClient({"url": url})
    ids = (client.register_schema(f"{topic}-value", Schema(V1, "AVRO")),
           client.register_schema(f"{topic}-value", Schema(V2, "AVRO")))
    conf = {"auto.register.schemas": False, "use.latest.version": False}
    return AvroSerializer(client, V1, conf=conf), AvroSerializer(client, V2, conf=conf), ids


@contextmanager
def _running(kafka: KafkaConfig, pgc: PostgresConfig, cfg: ConnectorConfig, registry: RegistryConfig,
             group_prefix: str) -> Iterator[SinkRunner]:
    """The projection's SinkRunner in a thread, given [postgres] and [registry] as the daemon host would."""
    connector = instantiate(cfg, Path("."))
    task_config = connector.task_configs(1)[0].with_services(postgres=pgc)
    runner = SinkRunner(connector, task_config, kafka=kafka, registry=registry,
                        daemon=DaemonConfig(group_prefix=group_prefix, batch_max_records=50, shutdown_grace_s=5))
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    try:
        yield runner
    finally:
        runner.stop()
        thread.join(60)
    assert not thread.is_alive(), "the runner did not stop within 60 s"


def test_a_registry_stopped_mid_run_loses_nothing_and_dead_letters_nothing(
        kafka_config: KafkaConfig, pg_config: PostgresConfig, unique: str, tmp_path: Path) -> None:
    from confluent_kafka.serialization import MessageField, SerializationContext

    reg = Registry(tmp_path / "registry", free_port()).start()
    try:
        topic, table = f"{unique}.deposits", table_name()
        create_topic(kafka_config, topic, partitions=1)
        ser1, ser2, ids = _register(reg.url, topic)
        ctx = SerializationContext(topic, MessageField.VALUE)
        deposits = [{"id": f"d{i}", "account": f"a{i % 7}", "amount": i + 1} for i in range(400)]
        first = [(0, d["account"].encode(), ser1(d, ctx), None) for d in deposits[:200]]
        second = [(0, d["account"].encode(), ser2({**d, "note": None}, ctx), None) for d in deposits[200:]]
        cfg = ConnectorConfig(
            name=unique, connector_class="postgres-projection", topics=[topic], converter=ConverterKind.AVRO,
            convert=ConvertConfig(id="id", key="account", type="'deposit'"),
            config={"table": table, "key_columns": ["account_id"],
                    "columns": {"account_id": "text", "total": "bigint"},
                    "on": [{"type": "deposit", "increment": {"total": "payload.amount"}}]})
        # The format's own wait kept short, so the runner's retry (paused partitions, membership kept) is what runs.
        registry = RegistryConfig(url=reg.url, timeout_s=2.0, retry_within_s=1.0)
        produce(kafka_config, topic, first)
        with structlog.testing.capture_logs() as logs, \
                _running(kafka_config, pg_config, cfg, registry, unique) as runner:
            wait_for_offsets(pg_config, unique, topic, {0: 200}, runner)
            reg.stop()
            stopped = time.monotonic()
            produce(kafka_config, topic, second)  # schema id ids[1]: not in the format's cache yet
            wait_for(lambda: sum(e.get("event") == "runner.decode_retrying" for e in logs) >= 5,
                     "the runner retrying while the registry is down", 120)
            time.sleep(max(0.0, DOWN_S - (time.monotonic() - stopped)))  # the outage: 30 s at least
            reg.start()
            assert _register(reg.url, topic)[2] == ids  # the same ids again, so the records still resolve
            wait_for_offsets(pg_config, unique, topic, {0: 400}, runner, timeout=120)
        expected: dict[str, int] = {}
        for d in deposits:
            expected[d["account"]] = expected.get(d["account"], 0) + d["amount"]
        assert {k: v["total"] for k, v in read_table(pg_config, table).items()} == expected
        assert dead_letters(pg_config, unique) == []
    finally:
        reg.stop()
