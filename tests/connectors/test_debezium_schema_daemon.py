"""Integration (Apache Kafka, PostgreSQL): Debezium change events as its JsonConverter writes them by default (the
Connect schema beside each payload) projected by `converter = "debezium"` into columns of every common type, row by
row; an update carrying the unavailable-value placeholder keeps the stored values; a truncate empties the table in
order with the changes around it, once; a rebuild of the projection (folding ahead) gives the same table."""

from __future__ import annotations

import datetime
import uuid
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from kafold import db
from kafold.config import (
    ConnectorConfig,
    ConvertConfig,
    ConverterKind,
    KafkaConfig,
    KafoldConfig,
    PostgresConfig,
    RegistryConfig,
)
from kafold.connectors.projection import rebuild as rb
from tests.connectors.test_debezium_avro import _running
from tests.connectors.test_debezium_schema import COLUMNS as FIELDS
from tests.connectors.test_debezium_schema import PLACEHOLDER, ROW, b64, opt, record
from tests.projection.projection_support import dead_letters, ends_of, table_name, wait_for_offsets
from tests.support import create_topic, produce

pytestmark = pytest.mark.integration

COLUMNS = {"id": "bigint", "name": "text", "price": "numeric(10,2)", "amount": "numeric", "born": "date",
           "closes": "time", "changed": "timestamp", "seen": "timestamptz", "doc": "jsonb", "ref": "uuid",
           "blob": "bytea", "active": "boolean", "note": "text"}
SETS = {c: f"payload.{c}" for c in COLUMNS if c != "id"}
NOTE = "a TOASTed text " * 500
SCHEMA = [*[f for f in FIELDS if f["field"] in COLUMNS], opt("note", "string")]  # the table's field schemas


def row(id_: int, **changes: Any) -> dict[str, Any]:
    return {**{c: ROW[c] for c in COLUMNS if c in ROW}, "id": id_, "note": NOTE, **changes}


@pytest.mark.timeout(120)
def test_default_debezium_records_land_column_by_column(
        kafka_config: KafkaConfig, pg_config: PostgresConfig, unique: str) -> None:
    topic, dst = f"{unique}.dbserver1.public.items", table_name()
    create_topic(kafka_config, topic, partitions=1)
    changes = [
        record("r", None, row(1), 100, SCHEMA),
        record("c", None, row(2, price=b64((-5).to_bytes(1, "big", signed=True)), blob=None), 110, SCHEMA),
        # the text, jsonb and bytea columns unchanged and TOASTed: Debezium sends its placeholder for each
        record("u", None, row(1, name="ada2", note=PLACEHOLDER, doc=PLACEHOLDER, blob=b64(PLACEHOLDER.encode())),
               120, SCHEMA),
        record("c", None, row(3), 130, SCHEMA),
        (None, record("t", None, None, 140, SCHEMA)[1]),  # TRUNCATE public.items
        record("c", None, row(4, name="after"), 150, SCHEMA),
        record("u", None, row(4, name="after2", note=PLACEHOLDER), 160, SCHEMA),
    ]
    before = [(0, k, v, None) for k, v in changes[:4]]
    after = [(0, k, v, None) for k, v in changes[4:]]
    cfg = ConnectorConfig(
        name=unique, connector_class="postgres-projection", topics=[topic], converter=ConverterKind.DEBEZIUM,
        convert=ConvertConfig(truncate="delete"),  # type: ignore[arg-type]
        config={"table": dst, "key_columns": ["id"], "columns": COLUMNS, "key": {"id": "payload.id"},
                "on": [{"type": ["create", "update", "read"], "set": SETS}, {"type": "delete", "action": "delete"}]})
    with _running(kafka_config, pg_config, cfg, RegistryConfig(), unique) as runner:
        coords = produce(kafka_config, topic, before)
        wait_for_offsets(pg_config, unique, topic, ends_of(coords), runner)
        rows = projected(pg_config, dst)
        coords += produce(kafka_config, topic, after)
        wait_for_offsets(pg_config, unique, topic, ends_of(coords), runner)
    assert dead_letters(pg_config, unique) == []

    assert sorted(rows) == [1, 2, 3]
    one = rows[1]
    assert one["name"] == "ada2" and one["note"] == NOTE  # kept: the placeholder never lands
    assert one["doc"] == {"a": {"b": [1, 2.5, None]}, "big": 123456789012345678901234567890}
    assert one["blob"] == b"\x01\x02\x03"
    assert (one["price"], one["amount"]) == (Decimal("123.45"), Decimal("0.482"))
    assert one["born"] == datetime.date(2024, 1, 1)
    assert one["closes"] == datetime.time(12, 34, 56, 789012)
    assert one["changed"] == datetime.datetime(2024, 1, 1, 12, 34, 56, 789012)
    assert one["seen"] == datetime.datetime(2024, 1, 1, 12, 34, 56, 789012, tzinfo=datetime.UTC)
    assert one["ref"] == uuid.UUID("9f1c3b0e-5b8a-4f0e-9a55-6b6166f1d000") and one["active"] is True
    assert (rows[2]["price"], rows[2]["blob"], rows[2]["note"]) == (Decimal("-0.05"), None, NOTE)

    final = projected(pg_config, dst)
    assert sorted(final) == [4]  # 1, 2 and 3 went with the truncate; 4 came after it
    assert (final[4]["name"], final[4]["note"]) == ("after2", NOTE)

    plan = rb.plan(KafoldConfig(kafka=kafka_config, postgres=pg_config, connectors=[cfg]), Path("."), unique)
    assert rb.Rebuild(plan, batch=3, max_tail=5, workers=1).run().phase == "swapped"
    assert projected(pg_config, dst) == final


def projected(pgc: PostgresConfig, table: str) -> dict[int, dict[str, Any]]:
    with db.connect(pgc) as conn:
        cur = conn.execute(f"SELECT {', '.join(COLUMNS)} FROM {table}")
        names = [d.name for d in cur.description or ()]
        return {r[0]: dict(zip(names, r, strict=True)) for r in cur.fetchall()}
