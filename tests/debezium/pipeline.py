"""The pipeline the real-Debezium tests drive: a source table, Debezium's topic read by the test (`Tail`), a
Connect worker running the PostgreSQL connector, and `kafold daemon` projecting the topic into a table of the same
column types; `caught_up` waits for a change to be projected and compares the two tables."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from confluent_kafka import Consumer, TopicPartition

from kafold import db, kafka_clients
from kafold.config import KafkaConfig, PostgresConfig
from kafold.schema import toml_value
from tests.debezium.connect import ConnectWorker
from tests.debezium.source_pg import SourcePostgres
from tests.projection.projection_support import stored_offsets, table_name
from tests.projection.test_projection_kill9 import start_daemon
from tests.support import create_topic, wait_for

PLACEHOLDER = "__debezium_unavailable_value"
COLUMNS = {"id": "bigint", "amount": "numeric(12,2)", "ratio": "numeric", "day": "date", "at": "timestamptz",
           "local_at": "timestamp", "clock": "time", "doc": "jsonb", "flag": "boolean", "ref": "uuid",
           "blob": "bytea", "note": "text", "big": "text"}
# A TOASTed value: 20 kB of random hex compresses to ~10 kB, above PostgreSQL's 2 kB threshold, so it is stored out
# of line and an UPDATE that leaves it alone sends it as "unchanged" (Debezium: the placeholder).
BIG = "(SELECT string_agg(md5(random()::text), '') FROM generate_series(1, 640))"
JSON_CONVERTER = "org.apache.kafka.connect.json.JsonConverter"
WAIT_S = 90


@dataclass(frozen=True)
class Variant:
    """Debezium's settings on the worker and connector, and the kafold converter options that mirror them."""

    schemas: bool
    worker: dict[str, Any] = field(default_factory=dict)
    connector: dict[str, str] = field(default_factory=dict)
    convert: dict[str, str] = field(default_factory=dict)


class Tail:
    """The Debezium topic read from its start: every record as (key, op, lsn, value text)."""

    def __init__(self, kafka: KafkaConfig, topic: str, schemas: bool) -> None:
        self.schemas = schemas
        self.tp = TopicPartition(topic, 0, 0)
        self.consumer: Consumer = kafka_clients.consumer(kafka, f"tail-{uuid.uuid4().hex[:8]}")
        self.consumer.assign([self.tp])
        self.records: list[tuple[Any, str | None, int | None, str | None]] = []
        self.headers: list[dict[str, bytes | None]] = []  # each record's headers, beside `records`

    def poll(self) -> None:
        for msg in self.consumer.consume(500, 0.5):
            if msg.error():
                continue
            key = self._payload(msg.key())
            value = self._payload(msg.value())
            op = value.get("op") if value else None
            lsn = value.get("source", {}).get("lsn") if value else None
            self.records.append((key, op, lsn, msg.value().decode() if msg.value() else None))
            self.headers.append(dict(msg.headers() or ()))

    def _payload(self, raw: bytes | None) -> Any:
        if raw is None:
            return None
        body = orjson.loads(raw)
        return body["payload"] if self.schemas else body

    def seen(self, lsn: int) -> bool:
        """True once a change at or after `lsn` is on the topic."""
        self.poll()
        return any(r[2] is not None and r[2] >= lsn for r in self.records)

    def end(self) -> int:
        return int(self.consumer.get_watermark_offsets(self.tp, timeout=10)[1])

    def snapshots_ended(self) -> int:
        """How many of Debezium's snapshots have their last record among those read (marked `"snapshot":"last"`)."""
        return sum('"snapshot":"last"' in (r[3] or "") for r in self.records)

    def wait_until(self, done: Callable[[], bool], what: str) -> None:
        """Read on until `done()`."""
        wait_for(lambda: self.poll() or done(), what, WAIT_S)

    def read_to_end(self) -> None:
        """Every record up to the topic's end now: `seen` stops reading at the first record at or past its lsn (the
        second record of a key change at the same lsn, or the rest of a snapshot, may still be unread)."""
        end = self.end()
        self.wait_until(lambda: self.consumer.position([self.tp])[0].offset >= end, "the topic read to its end")

    def close(self) -> None:
        self.consumer.close()


class Source:
    """The source table in the source PostgreSQL; each change in its own transaction."""

    def __init__(self, pg: SourcePostgres, table: str) -> None:
        self.pg, self.table = pg, table

    def sql(self, *statements: str) -> int:
        """Run `statements`; the WAL insert position before the last one (its change's lsn is at or after it)."""
        with self.pg.connect() as conn:
            for s in statements[:-1]:
                conn.execute(s.format(t=self.table, big=BIG))
            lsn = int(conn.execute("SELECT (pg_current_wal_insert_lsn() - '0/0')::bigint").fetchone()[0])
            conn.execute(statements[-1].format(t=self.table, big=BIG))
        return lsn

    def rows(self) -> dict[int, tuple[Any, ...]]:
        with self.pg.connect() as conn:
            return _rows(conn, self.table)


def _rows(conn: Any, table: str) -> dict[int, tuple[Any, ...]]:
    """Every row as text per column (the server's own rendering: numeric scale, jsonb, bytea hex, times in UTC)."""
    conn.execute("SET TimeZone = 'UTC'")
    cols = ", ".join(f"{c}::text" for c in COLUMNS)
    return {int(r[0]): r for r in conn.execute(f"SELECT {cols} FROM {table}").fetchall()}


def projected(pgc: PostgresConfig, table: str) -> dict[int, tuple[Any, ...]]:
    with db.connect(pgc) as conn:
        return _rows(conn, table)


def same_as_source(src: Source, pgc: PostgresConfig, target: str, when: str) -> None:
    """The projected table equals the source table: the same keys, and every column of every row."""
    expected, got = src.rows(), projected(pgc, target)
    assert sorted(got) == sorted(expected), f"{when}: projected keys {sorted(got)}, source keys {sorted(expected)}"
    wrong = [f"row {key} column {col}: projected {have!r:.120}, source {want!r:.120}"
             for key, row in sorted(expected.items())
             for col, want, have in zip(COLUMNS, row, got[key], strict=True) if have != want]
    assert not wrong, f"{when}: {len(wrong)} values differ:\n" + "\n".join(wrong[:20])


def write_config(path: Path, kafka: KafkaConfig, pg_url: str, unique: str, topic: str, table: str,
                 variant: Variant) -> Path:
    convert = {"schemas": variant.schemas, "truncate": "delete", **variant.convert}
    path.write_text(f"""
[kafka]
bootstrap_servers = "{kafka.bootstrap_servers}"
session_timeout_ms = 2500
rebalance_timeout_ms = 3000
heartbeat_interval_ms = 500

[postgres]
url = "{pg_url}"

[daemon]
group_prefix = "{unique}"
http_port = 0
batch_max_records = 20
shutdown_grace_s = 5

[[connectors]]
name = "{unique}"
class = "postgres-projection"
topics = ["{topic}"]
converter = "debezium"

[connectors.convert]
{"".join(f"{k} = {toml_value(v)}{chr(10)}" for k, v in convert.items())}
[connectors.config]
table = "{table}"
key_columns = ["id"]
columns = {toml_value(COLUMNS)}
key = {{id = "payload.id"}}

[[connectors.config.on]]
type = ["create", "update", "read"]
set = {toml_value({c: f"payload.{c}" for c in COLUMNS if c != "id"})}

[[connectors.config.on]]
type = "delete"
action = "delete"
""")
    return path


@dataclass(frozen=True)
class Services:
    """What a pipeline runs on: the assembled worker, the source PostgreSQL, the session's broker and database."""

    dist: Path
    source_pg: SourcePostgres
    kafka: KafkaConfig
    pgc: PostgresConfig
    pg_url: str


class Pipeline:
    """One source table, its Debezium connector and topic, and the daemon projecting it (see the module docstring)."""

    def __init__(self, services: Services, variant: Variant, unique: str, home: Path) -> None:
        self.sv, self.variant, self.unique = services, variant, unique
        table = f"src_{uuid.uuid4().hex[:10]}"
        prefix = unique.replace("kt.", "dbz.")
        self.topic, self.target = f"{prefix}.public.{table}", table_name()
        self.src = Source(services.source_pg, table)
        converters = "true" if variant.schemas else "false"
        self.worker = ConnectWorker(services.dist, home / "connect", services.kafka.bootstrap_servers, {
            "key.converter": JSON_CONVERTER, "value.converter": JSON_CONVERTER,
            "key.converter.schemas.enable": converters, "value.converter.schemas.enable": converters,
            "plugin.discovery": "service_load",  # Debezium's plugin has its ServiceLoader manifests: no class scan
            **variant.worker,
        }, {
            "name": prefix, "connector.class": "io.debezium.connector.postgresql.PostgresConnector", "tasks.max": 1,
            "database.hostname": "127.0.0.1", "database.port": services.source_pg.port, "database.user": "postgres",
            "database.dbname": "postgres", "topic.prefix": prefix, "plugin.name": "pgoutput",
            "table.include.list": f"public.{table}", "slot.name": table, "publication.name": f"pub_{table}",
            "publication.autocreate.mode": "filtered",
            "skipped.operations": "none",  # Debezium's default skips truncates ("t"); kafold applies them here
            **variant.connector,
        })
        self.tail = Tail(services.kafka, self.topic, variant.schemas)
        self.conf = write_config(home / "kafold.toml", services.kafka, services.pg_url, unique, self.topic,
                                 self.target, variant)
        self.daemon_log = home / "daemon.log"
        self.daemon: subprocess.Popen[bytes] | None = None

    def start(self, rows: Sequence[str]) -> None:
        """The source table with `rows`, the connector's snapshot of them on the topic, then the daemon on it."""
        self.src.sql(f"CREATE TABLE {{t}} ({', '.join(f'{c} {tp}' for c, tp in COLUMNS.items())}, "
                     "PRIMARY KEY (id))", *rows)
        create_topic(self.sv.kafka, self.topic, partitions=1)
        self.worker.start()
        # The snapshot first: a change made while it runs may be in it or not (a TRUNCATE even empties it).
        self.tail.wait_until(lambda: self.tail.snapshots_ended() >= 1, "the snapshot's last record")
        self.start_daemon()
        self.caught_up(0, "the snapshot")

    def start_daemon(self) -> None:
        self.daemon = start_daemon(self.conf, self.sv.pg_url, self.daemon_log)

    def kill_daemon(self) -> None:
        if self.daemon is not None:
            self.daemon.send_signal(signal.SIGKILL)
            self.daemon.wait(10)

    def offsets(self) -> dict[int, int]:
        try:
            return stored_offsets(self.sv.pgc, self.unique, self.topic)
        except Exception:  # the daemon has not migrated yet
            return {}

    def caught_up(self, lsn: int, what: str) -> None:
        """The change at `lsn` is on the topic, the daemon's stored offsets reached the topic's end, and the
        projected table equals the source table."""
        wait_for(lambda: self.tail.seen(lsn) or self.worker.state() == "FAILED", f"{what} on the topic", WAIT_S)
        assert self.worker.state() != "FAILED", f"the connector failed; see {self.worker.log_file}"
        wait_for(lambda: self.offsets() == {0: self.tail.end()}
                 or (self.daemon is not None and self.daemon.poll() is not None), f"{what} projected", WAIT_S)
        assert self.daemon is not None and self.daemon.poll() is None, f"the daemon exited; see {self.daemon_log}"
        same_as_source(self.src, self.sv.pgc, self.target, f"after {what}")
        self.tail.read_to_end()  # what the tests count in `tail.records` is what the daemon projected, at least

    def drop_slot(self) -> None:
        """The connector's replication slot goes with its test: the source server has a few (max_replication_slots),
        and a slot left behind keeps its WAL."""
        with self.src.pg.connect() as conn:
            conn.execute("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
                         "WHERE slot_name = %s AND NOT active", (self.src.table,))

    def rebuilt(self, what: str) -> None:
        """`kafold projection rebuild` replays the whole topic into a fresh table (the rebuild's own writer, folding
        ahead) and swaps it in: it equals the source table too."""
        done = subprocess.run([str(Path(sys.executable).parent / "kafold"), "projection", "rebuild", self.unique,
                               "-c", str(self.conf)], capture_output=True, text=True, timeout=WAIT_S * 2,
                              env={**os.environ, "KAFOLD_POSTGRES__URL": self.sv.pg_url}, check=False)
        assert done.returncode == 0, f"the rebuild failed: {done.stderr[-2000:]}"
        same_as_source(self.src, self.sv.pgc, self.target, f"after a rebuild ({what})")

    def close(self) -> None:
        try:
            if self.daemon is not None and self.daemon.poll() is None:
                self.daemon.send_signal(signal.SIGTERM)
                try:
                    self.daemon.wait(20)
                except subprocess.TimeoutExpired:
                    self.daemon.kill()
                    self.daemon.wait()
        finally:
            try:
                self.worker.stop()
                self.drop_slot()
            finally:
                self.tail.close()


@contextmanager
def pipeline(services: Services, variant: Variant, unique: str, home: Path,
             rows: Sequence[str]) -> Iterator[Pipeline]:
    """A started pipeline (see `Pipeline.start`); its daemon, worker and reader stopped at the end."""
    p = Pipeline(services, variant, unique, home)
    try:
        p.start(rows)
        yield p
    finally:
        p.close()
