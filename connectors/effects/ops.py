"""Operator actions on effect connectors (the CLI calls these): ledger lookups, parked keys, offset resets."""

from __future__ import annotations

import time
from enum import StrEnum
from typing import Any

import psycopg
from confluent_kafka import Consumer
from confluent_kafka import TopicPartition as KafkaTP
from psycopg import sql
from psycopg.rows import dict_row

from kafold import kafka_clients
from kafold.config import KafkaConfig, PostgresConfig
from kafold.connectors.effects.ledger import table
from kafold.errors import KafoldError
from kafold.pg import conninfo


def _query(pg: PostgresConfig, query: sql.Composed, params: tuple[Any, ...]) -> list[dict[str, Any]]:
    with psycopg.connect(conninfo(pg), autocommit=True, row_factory=dict_row) as conn:
        cur = conn.execute(query, params)
        return list(cur.fetchall()) if cur.description else []


def show(pg: PostgresConfig, event_id: str) -> list[dict[str, Any]]:
    """Per effect connector: the event's outcome, attempts, times, latency, and every failed attempt."""
    rows = _query(pg, sql.SQL("SELECT * FROM {} WHERE event_id = %s ORDER BY connector").format(
        table(pg.schema, "effect_ledger")), (event_id,))
    failures = _query(pg, sql.SQL("SELECT connector, attempted_at, latency_ms, error FROM {} WHERE event_id = %s "
                                  "ORDER BY attempted_at").format(table(pg.schema, "effect_attempts")), (event_id,))
    for row in rows:
        row["failed_attempts"] = [{k: v for k, v in f.items() if k != "connector"}
                                  for f in failures if f["connector"] == row["connector"]]
    return rows


def parked(pg: PostgresConfig, connector: str | None = None) -> list[dict[str, Any]]:
    """Parked keys (optionally of one connector) with their head event, error and number of parked events."""
    return _query(pg, sql.SQL(
        "SELECT k.connector, k.key, k.topic, k.partition, k.head_event_id, k.error, k.parked_at, "
        "k.requested_action, (SELECT count(*) FROM {p} p WHERE p.connector = k.connector AND p.key = k.key) "
        "AS events FROM {k} k WHERE %s::text IS NULL OR k.connector = %s ORDER BY k.parked_at").format(
        k=table(pg.schema, "effect_parked_keys"), p=table(pg.schema, "effect_parked")), (connector, connector))


def request(pg: PostgresConfig, key: str, action: str, connector: str | None = None) -> str:
    """Ask the task owning `key` to `retry` its parked events in order, or `skip` the head then retry the rest.

    Returns the connector. The daemon performs the request within `request_poll_s` while it runs.
    """
    if action not in ("retry", "skip"):
        raise ValueError(f"action must be retry or skip, got {action!r}")
    keys = table(pg.schema, "effect_parked_keys")
    found = [r["connector"] for r in _query(pg, sql.SQL("SELECT connector FROM {} WHERE key = %s").format(keys),
                                            (key,)) if connector in (None, r["connector"])]
    if not found:
        where = f" of connector {connector!r}" if connector else ""
        raise KafoldError(f"key {key!r} is not parked{where}")
    if len(found) > 1:
        raise KafoldError(f"key {key!r} is parked in several connectors ({', '.join(sorted(found))}); "
                          "name one with --connector")
    _query(pg, sql.SQL("UPDATE {} SET requested_action = %s, requested_at = now() WHERE connector = %s "
                       "AND key = %s").format(keys), (action, found[0], key))
    return found[0]


def request_all(pg: PostgresConfig, connector: str | None = None) -> int:
    """Ask for a `retry` of every parked key (optionally of one connector); how many keys were asked for. Each
    key's events run again in order; keys do not wait for one another."""
    rows = _query(pg, sql.SQL("UPDATE {} SET requested_action = 'retry', requested_at = now() "
                              "WHERE %s::text IS NULL OR connector = %s RETURNING key").format(
        table(pg.schema, "effect_parked_keys")), (connector, connector))
    return len(rows)


def wait_all(pg: PostgresConfig, connector: str | None, timeout_s: float) -> tuple[int, int]:
    """After `request_all`: (keys still waiting for their retry, keys parked again) once none waits or at the
    timeout; keys released meanwhile are gone from the table."""
    keys = table(pg.schema, "effect_parked_keys")
    deadline = time.monotonic() + timeout_s
    while True:
        rows = _query(pg, sql.SQL("SELECT count(*) FILTER (WHERE requested_action IS NOT NULL) AS pending, "
                                  "count(*) FILTER (WHERE requested_action IS NULL) AS parked FROM {} "
                                  "WHERE %s::text IS NULL OR connector = %s").format(keys), (connector, connector))
        pending, parked = int(rows[0]["pending"]), int(rows[0]["parked"])
        if not pending or time.monotonic() >= deadline:
            return pending, parked
        time.sleep(0.2)


class WaitOutcome(StrEnum):
    """What became of a key's requested retry or skip, as `wait` saw it (the values are what the CLI reports)."""

    RELEASED = "released"
    PARKED = "parked"  # the retry failed again
    PENDING = "pending"  # no daemon answered within the timeout


def wait(pg: PostgresConfig, connector: str, key: str, timeout_s: float) -> WaitOutcome:
    """Once the daemon answers a request for `key`, or at the timeout: what became of it."""
    keys = table(pg.schema, "effect_parked_keys")
    deadline = time.monotonic() + timeout_s
    while True:
        rows = _query(pg, sql.SQL("SELECT requested_action FROM {} WHERE connector = %s AND key = %s").format(keys),
                      (connector, key))
        if not rows:
            return WaitOutcome.RELEASED
        if rows[0]["requested_action"] is None:
            return WaitOutcome.PARKED
        if time.monotonic() >= deadline:
            return WaitOutcome.PENDING
        time.sleep(0.2)


def reset_offsets(kafka: KafkaConfig, group: str, topics: list[str], to: str) -> dict[str, int]:
    """Commit the earliest or latest offsets of `topics` for `group`; refuses while the group has members.

    Replaying an effect connector re-runs effects the ledger does not show as finished; finished ones are skipped.
    """
    if to not in ("earliest", "latest"):
        raise ValueError(f"to must be earliest or latest, got {to!r}")
    admin = kafka_clients.admin(kafka)
    described = admin.describe_consumer_groups([group])[group].result(15)
    if described.members:
        raise KafoldError(f"consumer group {group!r} has {len(described.members)} active member(s); stop the "
                          "daemon running this connector first")
    consumer = Consumer(kafka_clients.librdkafka(kafka, **{"group.id": group, "enable.auto.commit": False}))
    try:
        offsets: list[Any] = []
        meta = consumer.list_topics(timeout=15)
        for topic in topics:
            if topic not in meta.topics:
                raise KafoldError(f"topic {topic!r} does not exist")
            for p in meta.topics[topic].partitions:
                low, high = consumer.get_watermark_offsets(KafkaTP(topic, p), timeout=15)
                offsets.append(KafkaTP(topic, p, low if to == "earliest" else high))
        consumer.commit(offsets=offsets, asynchronous=False)
        return {f"{tp.topic}[{tp.partition}]": tp.offset for tp in offsets}
    finally:
        consumer.close()
