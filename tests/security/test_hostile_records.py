"""Integration: hostile records through the real pipelines (projection in the daemon runner, aggregate commands)
are dead-lettered with the documented reason and their coordinates; the good events around them are all applied,
nothing crashes or hangs, and no log line carries a secret or a payload."""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import Any

import pytest
import structlog
from confluent_kafka import Producer

from kafold import kafka_clients
from kafold.client import CommandClient
from kafold.config import KafkaConfig, PostgresConfig
from kafold.connectors import dlq
from kafold.daemon.aggregates import dlq_topic
from kafold.schema import Secret
from tests.aggregates.agg_support import bank_config, create_topics, read_all, results, running, runtime
from tests.aggregates.agg_support import events as agg_events
from tests.projection.projection_support import (
    dead_letters,
    encoded,
    ends_of,
    fold,
    history,
    opened,
    read_table,
    settings,
    wait_for_offsets,
)
from tests.projection.projection_support import running as projection_running
from tests.security.hostile_corpus import BIG, BIG_TOPIC, CANARY, commands, produce_raw, stale_forgery
from tests.security.hostile_corpus import events as hostile_events
from tests.support import create_topic, wait_for

PG_SECRET = f"pg-secret-{uuid.uuid4().hex}"


@dataclass
class Scenario:
    """The module's run, done once: what went in and where each record ended."""

    name: str
    topic: str
    table: str
    good: list[Any]
    hostile: dict[str, Any]           # case name -> Hostile
    coords: dict[str, tuple[int, int]]  # case name -> (partition, offset)
    stale: tuple[int, int]
    log_lines: list[str]
    dlq: list[Any]


class LogLines:
    """Every structlog event and stdlib log record emitted while active, rendered as text."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self._handler = logging.Handler()
        self._handler.emit = lambda record: self.lines.append(f"{record.name} {record.getMessage()}")  # type: ignore
        self._structlog: Any = None

    def __enter__(self) -> LogLines:
        self._structlog = structlog.testing.capture_logs()
        self._captured = self._structlog.__enter__()
        logging.getLogger().addHandler(self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger().removeHandler(self._handler)
        self._structlog.__exit__(*exc)
        self.lines += [repr(e) for e in self._captured]


@pytest.fixture(scope="module")
def outcome(kafka_config: KafkaConfig, pg_config: PostgresConfig) -> Scenario:
    name = f"kt.hostile.{uuid.uuid4().hex[:8]}"
    topic, table = f"{name}.events", f"acc_{uuid.uuid4().hex[:10]}"
    cfg = settings(name, topic, table, on_unknown_type="dead-letter")
    create_topic(kafka_config, topic, partitions=2, configs=BIG_TOPIC)
    create_topic(kafka_config, cfg.dlq_topic)
    good = history(accounts=6, deposits=3)
    half = len(good) // 2
    corpus = hostile_events()
    stale = stale_forgery("acc-1", 2)  # acc-1 lives in partition 1; its version 2 is in the first half
    last = opened("acc-7", "last")
    items = [*encoded(good[:half], 2), *[(i % 2, h.key, h.value, h.headers) for i, h in enumerate(corpus)],
             *encoded(good[half:], 2), *encoded([stale, last], 2)]
    coords = produce_raw(kafka_config, topic, items)
    hostile_coords = dict(zip((h.name for h in corpus), coords[half:half + len(corpus)], strict=True))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KAFOLD_TEST_PG_SECRET", PG_SECRET)
        pgc = PostgresConfig(url=pg_config.url, password=Secret("env:KAFOLD_TEST_PG_SECRET"))
        with LogLines() as logs, projection_running(kafka_config, pgc, cfg, name, batch=50) as runner:
            # Offsets: the stored next offset reaches the end of every partition only once every record before
            # it, hostile or not, was applied, skipped or dead-lettered in a committed transaction.
            wait_for_offsets(pgc, name, topic, ends_of(coords), runner, timeout=180)
            assert not runner.failed, runner.error
    return Scenario(name, topic, table, [*good, last], {h.name: h for h in corpus}, hostile_coords,
                   coords[-2], logs.lines, read_all(kafka_config, cfg.dlq_topic))


def test_every_good_event_is_projected_and_nothing_hostile_is(outcome: Scenario, pg_config: PostgresConfig) -> None:
    """The table equals the independent fold of the good events: no hostile row, no stale forgery, no loss."""
    assert read_table(pg_config, outcome.table) == fold(outcome.good)


def test_each_hostile_record_is_dead_lettered_with_its_reason_and_coordinates(
        outcome: Scenario, pg_config: PostgresConfig) -> None:
    rows = {(p, o): (topic, reason, msg) for topic, p, o, reason, _cls, msg in dead_letters(pg_config, outcome.name)}
    problems = []
    for name, at in outcome.coords.items():
        case = outcome.hostile[name]
        got = rows.get(at)
        if got is None or got[0] != outcome.topic or got[1] != case.reason or case.message not in got[2]:
            problems.append(f"{name}: expected ({case.reason}, {case.message!r}) at {at}, got {got}")
    assert not problems, "\n".join(problems)
    assert outcome.stale not in rows  # a stale version is skipped by the version guard, not an error
    assert len(rows) == len(outcome.coords)


def test_each_hostile_record_is_on_the_dlq_topic_with_its_coordinates(outcome: Scenario) -> None:
    seen = {}
    for m in outcome.dlq:
        h = {k: (v or b"").decode("utf-8", "replace") for k, v in m.headers()}
        assert h[dlq.H_TOPIC] == outcome.topic and h[dlq.H_CONNECTOR] == outcome.name
        seen[(int(h[dlq.H_PARTITION]), int(h[dlq.H_OFFSET]))] = h[dlq.H_REASON]
        if h[dlq.H_REASON] == "too-large":  # too big for the DLQ topic: coordinates and error, not the value
            assert m.value() is None and int(h[dlq.H_VALUE_DROPPED]) > dlq.MAX_VALUE_BYTES
    assert seen == {at: outcome.hostile[name].reason for name, at in outcome.coords.items()}


def test_no_log_line_carries_a_secret_or_a_payload(outcome: Scenario) -> None:
    dead = [line for line in outcome.log_lines if "dlq.record_dead_lettered" in line]
    assert len(dead) >= len(outcome.coords)  # the capture saw the runner's log lines
    leaks = [line for line in outcome.log_lines if PG_SECRET in line or CANARY in line]
    assert not leaks, leaks[:3]


# ---- the aggregate command path ------------------------------------------------------------------------------
def test_hostile_commands_are_rejected_and_dead_lettered_and_the_rest_flows(kafka_config: KafkaConfig,
                                                                          unique: str) -> None:
    agg = bank_config(unique)
    create_topics(kafka_config, agg, BIG_TOPIC)
    hostile = commands()
    producer = Producer(kafka_clients.librdkafka(kafka_config, **BIG))
    with LogLines() as logs, running(runtime(kafka_config, agg)) as r, CommandClient(kafka_config, agg) as client:
        wait_for(lambda: r.runtime.ready, what="runtime live")
        assert client.send(client.command("acc", "OpenAccount", {"owner": CANARY})) is not None
        for _cid, key, value, headers, _reason in hostile:
            producer.produce(agg.topic("commands"), key=key, value=value, headers=headers, partition=0)
        assert producer.flush(30) == 0
        after = client.send(client.command("acc", "Deposit", {"amount": 3}), timeout=90)
        assert after is not None and after.status == "accepted" and after.version == 2
        assert r.runtime.error is None and r.thread.is_alive()
    dead = read_all(kafka_config, dlq_topic(agg))
    reasons = sorted(dict(m.headers())[dlq.H_REASON].decode() for m in dead)
    assert reasons == sorted(reason for *_, reason in hostile)
    for m in dead:
        h = dict(m.headers())
        assert h[dlq.H_TOPIC].decode() == agg.topic("commands") and int(h[dlq.H_OFFSET]) >= 1
    statuses = [res["status"] for res in results(kafka_config, agg)]
    assert statuses.count("rejected") == len(hostile) and statuses.count("accepted") == 2
    assert [e["version"] for e in agg_events(kafka_config, agg)] == [1, 2]
    assert not [line for line in logs.lines if CANARY in line]
