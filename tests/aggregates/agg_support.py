"""Helpers for the aggregate tests: the bank aggregate on unique topics, a runtime in a thread, topic readers."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import orjson
from confluent_kafka import KafkaError, TopicPartition

from kafold import kafka_clients, topics
from kafold.config import AggregateConfig, DaemonConfig, KafkaConfig, TopicSpec
from kafold.daemon.aggregates import AggregateRuntime, dlq_topic
from kafold.domain import AggregateDomain
from kafold.envelope import Event, encode
from tests.support import EXAMPLES, ROOT, kafka_toml

BANK = EXAMPLES / "bank"
DAEMON = DaemonConfig(group_prefix="kt", batch_max_records=2000, batch_max_wait_ms=50)


def bank_daemon_toml(kafka: KafkaConfig, unique: str, port: int, *, partitions: int = 1,
                     python_path: tuple[str, ...] = (str(BANK),), daemon_extra: str = "") -> str:
    """A daemon's kafold.toml hosting the bank aggregate `account` on topics named after `unique` (append
    connectors to it)."""
    return f"""
{kafka_toml(kafka)}
[daemon]
group_prefix = "{unique}"
http_port = {port}
python_path = {list(python_path)!r}
batch_max_wait_ms = 100
{daemon_extra}

[[aggregates]]
name = "account"
initial = "bank_domain:initial"
evolve = "bank_domain:evolve"
decide = "bank_domain:decide"
partitions = {partitions}
events_topic = "{unique}.events"
commands_topic = "{unique}.commands"
results_topic = "{unique}.results"
snapshot_topic = "{unique}.snapshots"
"""


def accounts_projection_toml(name: str, topic: str, table: str) -> str:
    """A `[[connectors]]` table projecting the bank's events into `table` with the example's row mapper."""
    return f"""[[connectors]]
name = "{name}"
class = "postgres-projection"
topics = ["{topic}"]

[connectors.config]
table = "{table}"
key_columns = ["account_id"]
mapper = "bank_projection:account_row"

[connectors.config.columns]
account_id = "text"
owner = "text"
currency = "text"
balance = "bigint"
status = "text"
opened_at = "timestamptz"
updated_at = "timestamptz"
"""


def cart_daemon_toml(kafka: KafkaConfig, unique: str, port: int, prefix: str, extra: str = "") -> str:
    """A daemon's kafold.toml head hosting the cart aggregate (tests/aggregates/cart_domain.py) on topics named
    `<prefix>.events` etc., one partition; `extra` goes into its [[aggregates]] table (append connectors after)."""
    m = "tests.aggregates.cart_domain"
    return f"""
{kafka_toml(kafka)}
[daemon]
group_prefix = "{unique}"
http_port = {port}
python_path = ["{ROOT}"]
batch_max_wait_ms = 50

[[aggregates]]
name = "cart"
initial = "{m}:initial"
evolve = "{m}:evolve"
decide = "{m}:decide"
partitions = 1
events_topic = "{prefix}.events"
commands_topic = "{prefix}.commands"
results_topic = "{prefix}.results"
snapshot_topic = "{prefix}.snapshots"
{extra}
"""


def bank_config(unique: str, partitions: int = 1, **extra: Any) -> AggregateConfig:
    return AggregateConfig(name=unique, initial="bank_domain:initial", evolve="bank_domain:evolve",
                           decide="bank_domain:decide", partitions=partitions, **extra)


def bank_domain(agg: AggregateConfig) -> AggregateDomain:
    return AggregateDomain.load(agg, [str(BANK)])


def create_topics(kafka: KafkaConfig, agg: AggregateConfig, configs: dict[str, str] | None = None) -> None:
    specs = [TopicSpec(agg.topic(k), agg.partitions, 1, dict(configs or {})) for k in ("events", "commands",
                                                                                     "results")]
    topics.ensure(kafka, [*specs, TopicSpec(dlq_topic(agg), 1, 1, {})])


def runtime(kafka: KafkaConfig, agg: AggregateConfig, instance: str = "i1", **kw: Any) -> AggregateRuntime:
    return AggregateRuntime(kafka, DAEMON, agg, bank_domain(agg), instance_id=instance, **kw)


@dataclass
class Running:
    runtime: AggregateRuntime
    thread: threading.Thread
    error: list[BaseException]


@contextmanager
def running(rt: AggregateRuntime) -> Iterator[Running]:
    """Run `rt` in a thread; stop and join it on exit."""
    errors: list[BaseException] = []

    def target() -> None:
        try:
            rt.run()
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=target, daemon=True)
    t.start()
    try:
        yield Running(rt, t, errors)
    finally:
        rt.stop()
        t.join(30)


def read_all(kafka: KafkaConfig, topic: str, committed_only: bool = True) -> list[Any]:
    """Every record of `topic` (all partitions) up to partition EOF, read_committed by default."""
    c = kafka_clients.consumer(kafka, "kt.reader", **{
        "enable.partition.eof": True, "isolation.level": "read_committed" if committed_only else "read_uncommitted"})
    try:
        meta = c.list_topics(topic, timeout=10).topics[topic]
        parts = sorted(meta.partitions)
        c.assign([TopicPartition(topic, p, 0) for p in parts])
        done: set[int] = set()
        out: list[Any] = []
        deadline = time.monotonic() + 60
        while len(done) < len(parts) and time.monotonic() < deadline:
            for m in c.consume(10000, 0.2):
                if m.error() is None:
                    out.append(m)
                elif m.error().code() == KafkaError._PARTITION_EOF:
                    done.add(m.partition())
        assert len(done) == len(parts), f"{topic}: did not reach the end of every partition"
        return out
    finally:
        c.close()


def results(kafka: KafkaConfig, agg: AggregateConfig) -> list[dict[str, Any]]:
    return [orjson.loads(m.value()) for m in read_all(kafka, agg.topic("results"))]


def events(kafka: KafkaConfig, agg: AggregateConfig) -> list[dict[str, Any]]:
    return [orjson.loads(m.value()) for m in read_all(kafka, agg.topic("events"))]


def produce_history(kafka: KafkaConfig, agg: AggregateConfig, accounts: list[str], per_account: int,
                    partition: int = 0) -> dict[str, int]:
    """Open each account and deposit 1 cent `per_account - 1` times (in big batches); balance per account."""
    p = kafka_clients.producer(kafka, **{"enable.idempotence": True, "linger.ms": 50,
                                         "batch.num.messages": 10000})
    at = "2024-05-01T12:00:00.000000Z"
    for v in range(1, per_account + 1):
        for aid in accounts:
            kind, payload = ("AccountOpened", {"owner": aid}) if v == 1 else ("MoneyDeposited", {"amount": 1})
            key, value, headers = encode(Event(f"{aid}/{v}", kind, agg.name, aid, v, at, f"{aid}/{v}", payload))
            kafka_clients.produce(p, agg.topic("events"), value, key, headers, partition=partition)
    assert p.flush(60) == 0
    return {aid: per_account - 1 for aid in accounts}


def fold_balances(evs: list[dict[str, Any]]) -> dict[str, tuple[str, int, int]]:
    """An independent fold of bank events: id -> (status, balance, version)."""
    out: dict[str, tuple[str, int, int]] = {}
    for e in evs:
        status, balance, _ = out.get(e["aggregate_id"], ("new", 0, 0))
        t, amount = e["type"], e["payload"].get("amount", 0)
        status = "open" if t == "AccountOpened" else "closed" if t == "AccountClosed" else status
        balance += amount if t == "MoneyDeposited" else -amount if t == "MoneyWithdrawn" else 0
        out[e["aggregate_id"]] = (status, balance, e["version"])
    return out
