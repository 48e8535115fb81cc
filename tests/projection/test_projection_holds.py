"""Integration: a dead-lettered event holds its row key's later events back (the rest of the partition keeps
flowing); `kafold dlq replay` of the fixed event applies it and then the held ones in order, `dlq discard` releases
them without it; with the hold off, a replay older than its row says it was skipped as stale and exits 1."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from kafold import db
from kafold.config import KafkaConfig, PostgresConfig
from kafold.connectors.projection.holds import held_keys
from kafold.envelope import Event, encode
from tests.projection.projection_support import (
    deposited,
    encoded,
    ends_of,
    opened,
    read_table,
    running,
    settings,
    table_name,
)
from tests.projection.projection_support import wait_for_offsets as wait_offsets
from tests.projection.test_projection_kill9 import write_config
from tests.support import create_topic, produce


def _main(*argv: str) -> int:
    """cli.main without its logging set-up (pytest owns stderr)."""
    from kafold.tools import cli

    args = cli.build_parser().parse_args(list(argv))
    return int(args.handler(args))


def _dead(pgc: PostgresConfig, connector: str) -> list[dict[str, Any]]:
    from psycopg.rows import dict_row

    with db.connect(pgc, row_factory=dict_row) as conn:
        return list(conn.execute('SELECT id, "offset", status, reason, hold_key FROM kafold.dead_letters WHERE '
                                 'connector = %s ORDER BY "offset"', (connector,)).fetchall())


class Story:
    """The issue's sequence on acc-1 (Placed v1, Added 10 v2, Added with a misspelt field v3, Added 1 v4) with
    another account's events in between, all in one partition."""

    def __init__(self, kafka: KafkaConfig, pgc: PostgresConfig, unique: str, tmp_path: Path, **extra: Any) -> None:
        self.kafka, self.pgc, self.name = kafka, pgc, unique
        self.topic, self.table = f"{unique}.events", table_name()
        self.cfg = settings(unique, self.topic, self.table, **extra)
        create_topic(kafka, self.topic, partitions=1)
        create_topic(kafka, self.cfg.dlq_topic)
        self.bad = Event.new("MoneyDeposited", "account", "acc-1", 3, {"amuont": 100})
        events = [opened("acc-1"), opened("acc-2"), deposited("acc-1", 2, 10), self.bad, deposited("acc-2", 2, 5),
                  deposited("acc-1", 4, 1), deposited("acc-2", 3, 7)]
        self.coords = produce(kafka, self.topic, encoded(events, 1))
        self.conf = write_config(tmp_path / "kafold.toml", kafka, pgc.url or "", unique, self.topic, self.table)
        if extra.get("hold_on_dead_letter") is False:
            text = self.conf.read_text().replace('key_columns = ["account_id"]',
                                                 'key_columns = ["account_id"]\nhold_on_dead_letter = false')
            self.conf.write_text(text)
        fixed = dataclasses.replace(self.bad, payload={"amount": 100})
        self.fixed = tmp_path / "fixed.json"
        self.fixed.write_bytes(encode(fixed)[1])

    def row(self, account: str) -> tuple[int, int]:
        r = read_table(self.pgc, self.table)[account]
        return r["balance"], r["_kafold_version"]

    def produce(self, *events: Event) -> None:
        self.coords += produce(self.kafka, self.topic, encoded(list(events), 1))


@pytest.mark.timeout(240)
def test_a_dead_letter_holds_its_key_and_replay_of_the_fix_applies_it_then_the_held_events(
        kafka_config: KafkaConfig, pg_config: PostgresConfig, unique: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    s = Story(kafka_config, pg_config, unique, tmp_path)
    with running(kafka_config, pg_config, s.cfg, unique, batch=3) as live:
        wait_offsets(pg_config, unique, s.topic, ends_of(s.coords), live)
        assert s.row("acc-1") == (10, 2)  # v4 did not skip over the dead-lettered v3
        assert s.row("acc-2") == (12, 3)  # the other key, behind it in the same partition, never waited
        dead = _dead(pg_config, unique)
        assert [(d["offset"], d["status"], d["reason"], d["hold_key"]) for d in dead] == [
            (3, "new", "schema-invalid", '["acc-1"]'), (5, "held", "held", '["acc-1"]')]
        assert held_keys(pg_config, unique) == {unique: 1}
        assert _main("status", "-c", str(s.conf), "--offline") == 0
        assert f"held keys of {unique}: 1" in capsys.readouterr().out

        head = dead[0]["id"]
        assert _main("dlq", "replay", "-c", str(s.conf), str(dead[1]["id"])) == 1  # the held one: not before v3
        out = capsys.readouterr().out
        assert f"held behind dead letter #{head}" in out and "nothing was applied" in out
        assert s.row("acc-1") == (10, 2)

        assert _main("dlq", "replay", "-c", str(s.conf), str(head), "--value-file", str(s.fixed)) == 0
        out = capsys.readouterr().out
        assert "MoneyDeposited v3 of acc-1: applied; the row is at version 3" in out
        assert "MoneyDeposited v4 of acc-1: applied; the row is at version 4" in out
        assert "row key [\"acc-1\"] released" in out
        assert s.row("acc-1") == (111, 4)
        assert [d["status"] for d in _dead(pg_config, unique)] == ["replayed", "replayed"]
        assert held_keys(pg_config, unique) == {}

        s.produce(deposited("acc-1", 5, 5))  # the live writer sees the key released
        wait_offsets(pg_config, unique, s.topic, ends_of(s.coords), live)
        assert s.row("acc-1") == (116, 5)


@pytest.mark.timeout(240)
def test_discarding_the_head_applies_the_held_events_without_it_and_says_so(
        kafka_config: KafkaConfig, pg_config: PostgresConfig, unique: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    s = Story(kafka_config, pg_config, unique, tmp_path)
    with running(kafka_config, pg_config, s.cfg, unique, batch=50) as live:  # the whole story in one batch
        wait_offsets(pg_config, unique, s.topic, ends_of(s.coords), live)
        assert s.row("acc-1") == (10, 2) and s.row("acc-2") == (12, 3)
        dead = _dead(pg_config, unique)
        assert [d["status"] for d in dead] == ["new", "held"]

        assert _main("dlq", "discard", "-c", str(s.conf), str(dead[0]["id"])) == 0
        out = capsys.readouterr().out
        assert f"#{dead[0]['id']}" in out and "discarded (not applied)" in out
        assert "MoneyDeposited v4 of acc-1: applied; the row is at version 4" in out
        assert s.row("acc-1") == (11, 4)
        assert [d["status"] for d in _dead(pg_config, unique)] == ["discarded", "replayed"]
        s.produce(deposited("acc-1", 5, 1000))  # released: the live writer applies the key's next event
        wait_offsets(pg_config, unique, s.topic, ends_of(s.coords), live)
        assert s.row("acc-1") == (1011, 5) and held_keys(pg_config, unique) == {}


@pytest.mark.timeout(240)
def test_without_the_hold_a_replay_older_than_its_row_is_skipped_as_stale_and_exits_nonzero(
        kafka_config: KafkaConfig, pg_config: PostgresConfig, unique: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    s = Story(kafka_config, pg_config, unique, tmp_path, hold_on_dead_letter=False)
    with running(kafka_config, pg_config, s.cfg, unique, batch=3) as live:
        wait_offsets(pg_config, unique, s.topic, ends_of(s.coords), live)
    assert s.row("acc-1") == (11, 4)  # v4 applied over the gap: what the hold prevents
    dead = _dead(pg_config, unique)
    assert [(d["status"], d["hold_key"]) for d in dead] == [("new", None)]
    assert _main("dlq", "replay", "-c", str(s.conf), str(dead[0]["id"]), "--value-file", str(s.fixed)) == 1
    out = capsys.readouterr().out
    assert "skipped as stale: the row is at version 4" in out
    assert f"kafold projection rebuild {unique} -c {s.conf}" in out and "nothing was applied" in out
    assert s.row("acc-1") == (11, 4)
    assert [d["status"] for d in _dead(pg_config, unique)] == ["new"]  # still to be repaired


@pytest.mark.timeout(240)
def test_a_rebuild_carries_the_holds_over_to_the_new_table(
        kafka_config: KafkaConfig, pg_config: PostgresConfig, unique: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The repair by replay is not in the topic: the rebuilt table holds acc-1 again, and says so, until replayed
    again; the live connector, running through the swap, holds and releases by the new table's dead letters."""
    from kafold.config import KafoldConfig
    from kafold.connectors.projection import rebuild as rb

    s = Story(kafka_config, pg_config, unique, tmp_path)
    plan = rb.plan(KafoldConfig(kafka=kafka_config, postgres=pg_config, connectors=[s.cfg]), Path("."), unique)
    with running(kafka_config, pg_config, s.cfg, unique, batch=3) as live:
        wait_offsets(pg_config, unique, s.topic, ends_of(s.coords), live)
        head = _dead(pg_config, unique)[0]["id"]
        assert _main("dlq", "replay", "-c", str(s.conf), str(head), "--value-file", str(s.fixed)) == 0
        assert s.row("acc-1") == (111, 4) and held_keys(pg_config, unique) == {}
        assert rb.Rebuild(plan, batch=2).run().phase == "swapped"
        assert s.row("acc-1") == (10, 2) and s.row("acc-2") == (12, 3)  # the topic still has the misspelt v3
        dead = _dead(pg_config, unique)
        assert [(d["offset"], d["status"]) for d in dead] == [(3, "new"), (5, "held")] and dead[0]["id"] == head
        s.produce(deposited("acc-1", 5, 5))  # held by the live connector behind the head again
        wait_offsets(pg_config, unique, s.topic, ends_of(s.coords), live)
        assert s.row("acc-1") == (10, 2) and held_keys(pg_config, unique) == {unique: 1}
        capsys.readouterr()
        assert _main("dlq", "replay", "-c", str(s.conf), str(head), "--value-file", str(s.fixed)) == 0
        assert "v5 of acc-1: applied; the row is at version 5" in capsys.readouterr().out
        assert s.row("acc-1") == (116, 5)
