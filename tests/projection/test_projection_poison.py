"""Integration: poison records (undecodable, schema-invalid, unknown type, rejected by the database) are
dead-lettered with their coordinates in the table and on the DLQ topic while every other event is projected;
`kafold dlq` lists them and re-applies one after the cause is fixed."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest
from confluent_kafka import Consumer
from psycopg import sql

from kafold import db, kafka_clients
from kafold.config import KafkaConfig, PostgresConfig
from kafold.envelope import Event
from tests.projection.projection_support import (
    dead_letters,
    deposited,
    encoded,
    ends_of,
    fold,
    history,
    read_table,
    running,
    settings,
    wait_for_offsets,
)
from tests.support import create_topic, produce, wait_for


@dataclass
class Scenario:
    name: str
    topic: str
    table: str
    events: list[Event]
    poison: dict[str, tuple[int, int]]  # reason -> (partition, offset)
    dlq: list[Any]


@pytest.fixture(scope="module")
def scenario(kafka_config: KafkaConfig, pg_config: PostgresConfig) -> Scenario:
    name = f"kt.poison.{uuid.uuid4().hex[:8]}"
    topic, table = f"{name}.events", f"acc_{uuid.uuid4().hex[:10]}"
    cfg = settings(name, topic, table, on_unknown_type="dead-letter")
    create_topic(kafka_config, topic, partitions=2)
    create_topic(kafka_config, cfg.dlq_topic)
    with db.connect(pg_config) as conn:  # the user's table, with a rule of its own
        conn.execute(sql.SQL("CREATE TABLE public.{} (account_id text PRIMARY KEY, owner text, balance bigint "
                             "CHECK (balance >= 0), last_amount bigint, status text, "
                             "_kafold_version bigint NOT NULL DEFAULT 0)").format(sql.Identifier(table)))
    events = history(accounts=8, deposits=3)
    half = len(events) // 2
    schema_invalid = Event.new("AccountOpened", "account", "acc-20", 1, {"name": "no owner field"})
    rejected = deposited("acc-3", 5, -10_000)  # the last event of acc-3: balance would go negative
    unknown = Event.new("Mystery", "account", "acc-5", 5, {})
    items = [*encoded(events[:half], 2), (0, b"acc-0", b"\xff\xfe not json", []),
             *encoded([schema_invalid, rejected, unknown], 2), *encoded(events[half:], 2)]
    coords = produce(kafka_config, topic, items)
    poison = dict(zip(("bad-utf8", "schema-invalid", "db-rejected", "unknown-type"), coords[half:half + 4],
                      strict=True))
    with running(kafka_config, pg_config, cfg, name, batch=7) as runner:
        wait_for_offsets(pg_config, name, topic, ends_of(coords), runner)
    return Scenario(name, topic, table, events, poison, _consume_all(kafka_config, cfg.dlq_topic, 4))


def _consume_all(kafka: KafkaConfig, topic: str, count: int) -> list[Any]:
    consumer = Consumer(kafka_clients.librdkafka(kafka, **{"group.id": f"kt.read.{uuid.uuid4().hex[:6]}",
                                                          "auto.offset.reset": "earliest"}))
    consumer.subscribe([topic])
    got: list[Any] = []

    def enough() -> bool:
        got.extend(m for m in consumer.consume(10, 0.5) if m.error() is None)
        return len(got) >= count

    try:
        wait_for(enough, f"{count} records on {topic}")
    finally:
        consumer.close()
    return got


def test_every_other_event_is_projected(scenario: Scenario, pg_config: PostgresConfig) -> None:
    assert read_table(pg_config, scenario.table) == fold(scenario.events)


def test_poison_records_are_in_the_dead_letter_table_with_their_coordinates(
        scenario: Scenario, pg_config: PostgresConfig) -> None:
    rows = dead_letters(pg_config, scenario.name)
    found = {reason: (partition, offset) for topic, partition, offset, reason, _cls, _msg in rows
             if topic == scenario.topic}
    assert found == scenario.poison
    messages = {reason: msg for _t, _p, _o, reason, _cls, msg in rows}
    assert "payload.owner is missing" in messages["schema-invalid"]
    assert "rejected the row" in messages["db-rejected"] and "CheckViolation" in messages["db-rejected"]


def test_poison_records_are_on_the_dead_letter_topic_with_their_coordinates(scenario: Scenario) -> None:
    seen = set()
    for m in scenario.dlq:
        headers = {k: (v or b"").decode() for k, v in m.headers()}
        assert headers["kafold-dlq-topic"] == scenario.topic
        seen.add((headers["kafold-dlq-reason"], int(headers["kafold-dlq-partition"]),
                  int(headers["kafold-dlq-offset"])))
    assert seen == {(reason, p, o) for reason, (p, o) in scenario.poison.items()}


def test_dlq_replay_applies_a_rejected_event_once_its_cause_is_fixed(
        scenario: Scenario, pg_config: PostgresConfig, kafka_config: KafkaConfig, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    from kafold.tools import cli

    conf = tmp_path / "kafold.toml"
    conf.write_text(f"""
[kafka]
bootstrap_servers = "{kafka_config.bootstrap_servers}"
[postgres]
url = "{pg_config.url}"
[[connectors]]
name = "{scenario.name}"
class = "postgres-projection"
topics = ["{scenario.topic}"]
[connectors.config]
table = "{scenario.table}"
key_columns = ["account_id"]
columns = {{account_id = "text", owner = "text", balance = "bigint", last_amount = "bigint", status = "text"}}
[[connectors.config.on]]
type = "MoneyDeposited"
action = "update"
increment = {{balance = "payload.amount"}}
set = {{last_amount = "payload.amount"}}
""")

    def main(*argv: str) -> int:  # cli.main without its logging set-up (pytest owns stderr)
        args = cli.build_parser().parse_args(list(argv))
        return int(args.handler(args))

    assert main("dlq", "list", "-c", str(conf), "--connector", scenario.name) == 0
    assert "4 dead letter(s)" in capsys.readouterr().out
    assert main("dlq", "list", "-c", str(conf), "--connector", scenario.name, "--json") == 0
    listed = orjson.loads(capsys.readouterr().out)
    assert len(listed) == 4 and {d["connector"] for d in listed} == {scenario.name}
    assert "db-rejected" in {d["reason"] for d in listed} and all(d["status"] == "new" for d in listed)
    with db.connect(pg_config) as conn:
        (dead_id,) = conn.execute("SELECT id FROM kafold.dead_letters WHERE connector = %s AND reason = "
                                  "'db-rejected'", (scenario.name,)).fetchone() or (None,)
        conn.execute(sql.SQL("ALTER TABLE public.{} DROP CONSTRAINT {}").format(
            sql.Identifier(scenario.table), sql.Identifier(f"{scenario.table}_balance_check")))
    assert main("dlq", "show", "-c", str(conf), str(dead_id)) == 0
    assert "CheckViolation" in capsys.readouterr().out
    assert main("dlq", "replay", "-c", str(conf), "--to", "apply", str(dead_id)) == 0
    expected = fold(scenario.events)["acc-3"]
    row = read_table(pg_config, scenario.table)["acc-3"]
    assert row["balance"] == expected["balance"] - 10_000 and row["_kafold_version"] == 5
    with db.connect(pg_config) as conn:
        status = conn.execute("SELECT status FROM kafold.dead_letters WHERE id = %s", (dead_id,)).fetchone()
    assert status == ("replayed",)
    capsys.readouterr()
    # Again: nothing applied, and it says why (exit 1).
    assert main("dlq", "replay", "-c", str(conf), "--to", "apply", str(dead_id)) == 1
    assert "already applied before" in capsys.readouterr().out
    assert read_table(pg_config, scenario.table)["acc-3"] == row


