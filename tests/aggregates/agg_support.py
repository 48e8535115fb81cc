"""Helpers for the aggregate tests: the bank aggregate on unique topics, a runtime in a thread, topic readers, a
client that is not kafold's, and the customer aggregate with a protected email (crypto-shredding tests)."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest
from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition

from kafold import config, kafka_clients, topics
from kafold.config import AggregateConfig, DaemonConfig, KafkaConfig, KafoldConfig, TopicSpec
from kafold.daemon.aggregates import AggregateRuntime, dlq_topic
from kafold.domain import AggregateDomain
from kafold.envelope import Event, encode
from tests.daemon.daemon_support import Running as RunningDaemon
from tests.daemon.daemon_support import daemon_in_process, state_path
from tests.support import EXAMPLES, ROOT, child_env, kafka_toml, wait_for

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


def committed_state(rt: AggregateRuntime, aggregate_id: str, version: int) -> Any:
    """The runtime's state of `aggregate_id` once it has reached `version` (bounded wait). The runtime serves
    committed state only, and a client sees a result the moment its transaction commits on the broker, a moment
    before the runtime's thread has marked it committed (CI saw None read straight after a result)."""
    wait_for(lambda: (got := rt.get(aggregate_id)) is not None and got[1] >= version, timeout=10,
             what=f"{aggregate_id} committed at version {version}")
    return rt.get_state(aggregate_id)


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


class Outside:
    """A client that is not kafold's: plain confluent-kafka, the command JSON written by hand, record timestamps
    chosen by the caller, results read from the results topic by command id."""

    def __init__(self, kafka: KafkaConfig, agg: AggregateConfig) -> None:
        self.agg = agg
        self.producer = Producer({"bootstrap.servers": kafka.bootstrap_servers, "enable.idempotence": True,
                                  "partitioner": "murmur2_random"})
        self.consumer = Consumer({"bootstrap.servers": kafka.bootstrap_servers, "group.id": "outside",
                                  "isolation.level": "read_committed", "enable.auto.commit": False,
                                  "auto.offset.reset": "earliest"})
        self.consumer.assign([TopicPartition(agg.topic("results"), p, 0) for p in range(agg.partitions)])
        self.results: dict[str, list[dict[str, Any]]] = {}
        self.sent: Counter[str] = Counter()

    def send(self, cid: str, aid: str, kind: str, data: dict[str, Any], at_ms: int | None = None) -> None:
        body = {"command_id": cid, "type": kind, "aggregate_id": aid, "data": data}
        self.producer.produce(self.agg.topic("commands"), key=aid.encode(), value=orjson.dumps(body),
                              headers=[("kafold-command-id", cid.encode())], timestamp=at_ms or 0)
        self.sent[cid] += 1

    def wait(self, timeout: float = 60.0) -> None:
        """Until every command sent has its result (one per send)."""
        assert self.producer.flush(30) == 0
        deadline = time.monotonic() + timeout
        while any(len(self.results.get(c, ())) < n for c, n in self.sent.items()):
            assert time.monotonic() < deadline, "results missing"
            for m in self.consumer.consume(5000, 0.2):
                if m.error() is None:
                    r = orjson.loads(m.value())
                    self.results.setdefault(r["command_id"], []).append(r)
                elif m.error().code() != KafkaError._PARTITION_EOF:
                    raise AssertionError(m.error().str())

    def ask(self, cid: str, aid: str, kind: str, data: dict[str, Any], at_ms: int | None = None) -> dict[str, Any]:
        self.send(cid, aid, kind, data, at_ms)
        self.wait()
        return self.results[cid][-1]

    def close(self) -> None:
        self.consumer.close()


# ---- the customer aggregate with a protected email (its domain: tests/aggregates/test_protect_daemon.py) -------
KAFOLD = str(Path(sys.executable).parent / "kafold")
PROTECTED = "tests.aggregates.test_protect_daemon"
EMAILS = {"c-1": "ann.secret@example.com", "c-2": "bob.secret@example.com"}
PLACEHOLDER = "[erased]"
MASTER_VAR = "KAFOLD_TEST_PROTECT_MASTER"


def master_key(monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh master key in MASTER_VAR (each test its own: the tests share one PostgreSQL and its key table)."""
    key = base64.b64encode(os.urandom(32)).decode()
    monkeypatch.setenv(MASTER_VAR, key)
    return key


def protected_customer_toml(kafka: KafkaConfig, pg_url: str, prefix: str, port: int, *, table: str | None = None,
                            hook: str | None = None, snapshots: bool = False, task_processes: bool = False,
                            schema: str | None = None) -> str:
    """A daemon's kafold.toml hosting the `customer` aggregate whose `email` is protected (master key in
    MASTER_VAR), on topics `<prefix>.events` etc.; with `snapshots`, local snapshot runs; with `hook`, a webhook of
    its events to that URL; with `table`, a projection of them into that table; with `schema`, kafold's tables (the
    subjects' keys, the erasures) in that schema rather than the session's shared `kafold`."""
    out = f"""
{kafka_toml(kafka)}
[daemon]
task_processes = {str(task_processes).lower()}
group_prefix = "{prefix}"
http_port = {port}
python_path = ["{ROOT}"]
batch_max_wait_ms = 50

[postgres]
url = "{pg_url}"
{f'schema = "{schema}"' if schema else ""}

[privacy]
master_key_env = "{MASTER_VAR}"
placeholder = "{PLACEHOLDER}"
erasure_topic = "{prefix}.erasures"
"""
    if snapshots:
        out += """
[snapshots]
enabled = true
engine = "local"
"""
    out += f"""
[[aggregates]]
name = "customer"
initial = "{PROTECTED}:initial"
evolve = "{PROTECTED}:evolve"
decide = "{PROTECTED}:decide"
partitions = 1
events_topic = "{prefix}.events"
commands_topic = "{prefix}.commands"
results_topic = "{prefix}.results"
snapshot_topic = "{prefix}.snapshots"

[[aggregates.protect]]
type = "Registered"
fields = ["email"]
subject = "aggregate_id"
"""
    if hook is not None:
        out += f"""
[[connectors]]
name = "hook-{table or prefix}"
class = "webhook"
topics = ["{prefix}.events"]
[connectors.config]
url = "{hook}"
allow_http = true
"""
    if table is not None:
        out += f"""
[[connectors]]
name = "{table}"
class = "postgres-projection"
topics = ["{prefix}.events"]
[connectors.config]
table = "{table}"
key_columns = ["customer_id"]
mapper = "{PROTECTED}:customer_row"
[connectors.config.columns]
customer_id = "text"
email = "text"
name = "text"
"""
    return out


def own_schema(unique: str) -> str:
    """A schema for kafold's tables of one test that uses the fixed subjects of EMAILS: the tests share the
    session's PostgreSQL, and a subject's key left behind wrapped under another test's master key (c-2's, which
    test_protect_snapshots keeps) does not unwrap under this test's."""
    return "pk_" + unique[-8:]


def customer_client(conf: Path, kafka: KafkaConfig) -> tuple[KafoldConfig, Outside]:
    """The configuration `conf` loaded, its topics created, and an Outside client of its (first) aggregate."""
    loaded = config.load_file(conf)
    assert topics.ensure(kafka, config.topic_map(loaded.config).values()).ok
    return loaded.config, Outside(kafka, loaded.config.aggregates[0])


@contextmanager
def ready_daemon(conf: Path, what: str = "the daemon ready") -> Iterator[RunningDaemon]:
    """`daemon_in_process(conf)`, once its /ready answers 200."""
    with daemon_in_process(conf) as d:
        wait_for(lambda: d.get("/ready")[0] == 200, what, 120)
        yield d


def register(client: Outside, emails: dict[str, str]) -> None:
    """A `Register` command per customer id -> email (named as the id upper-cased), their results awaited."""
    for cid, email in emails.items():
        client.send(f"reg-{cid}", cid, "Register", {"email": email, "name": cid.upper()})
    client.wait()


def live_state(d: RunningDaemon, aid: str, version: int = 1) -> Any:
    """The daemon's `customer` state of AID once it has reached VERSION (`state_path`)."""
    status, body = d.get(state_path("customer", aid, version))
    assert status == 200, (status, body)
    return body["state"]


def kafold_cli(*args: str, check: bool = False, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`kafold ARGS` in a child process with the tests' environment; `check`: assert it exited 0."""
    run = subprocess.run([KAFOLD, *args], capture_output=True, text=True, timeout=timeout, env=child_env())
    if check:
        assert run.returncode == 0, run.stdout + run.stderr
    return run


def state_get(conf: Path, aid: str) -> dict[str, Any]:
    """`kafold state get customer AID` (a restore from the snapshot and the events, another process)."""
    out: dict[str, Any] = orjson.loads(kafold_cli("state", "get", "customer", aid, "-c", str(conf),
                                                  check=True).stdout)
    return out


def customer_rows(pg_url: str, table: str) -> dict[str, tuple[Any, ...]]:
    """The projection's rows: customer id -> (email, name); none before the table exists."""
    try:
        with psycopg.connect(pg_url) as conn:
            return {r[0]: r[1:] for r in conn.execute(f'SELECT customer_id, email, name FROM "{table}"').fetchall()}
    except psycopg.errors.UndefinedTable:
        return {}


def raw_bytes(kafka: KafkaConfig, *names: str) -> bytes:
    """Every key, value and header of the topics, as bytes (read_uncommitted: aborted writes count too)."""
    out = bytearray()
    for name in names:
        for m in read_all(kafka, name, committed_only=False):
            out += (m.key() or b"") + (m.value() or b"")
            for _, v in m.headers() or ():
                out += v or b""
    return bytes(out)
