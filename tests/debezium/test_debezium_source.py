"""A real Debezium PostgreSQL source (Kafka Connect 4.3.1 + debezium-connector-postgres 3.6.1.Final, pgoutput,
REPLICA IDENTITY DEFAULT) feeding `kafold daemon`: the snapshot, inserts, updates that leave a TOASTed column alone,
deletes, a key change, a TRUNCATE, a kill -9 of the daemon and of the Connect worker; the projected table equals the
source table row by row, every column, and holds no unavailable-value placeholder. Debezium's defaults (schemas in
each record, precise decimals, adaptive time), then schema-less records with string decimals and ISO times."""

from __future__ import annotations

import signal
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pytest
from confluent_kafka import Consumer, TopicPartition

from kafold import db, kafka_clients, logs
from kafold.config import KafkaConfig, PostgresConfig
from kafold.schema import toml_value
from tests.debezium.connect import ConnectWorker, build
from tests.debezium.source_pg import SourcePostgres
from tests.projection.projection_support import dead_letters, stored_offsets, table_name
from tests.projection.test_projection_kill9 import start_daemon
from tests.support import create_topic, wait_for

log = logs.get(__name__)

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


VARIANTS = {
    # Connect's default offset flush (60 s): the worker is killed before its first flush, so it snapshots again.
    "defaults": Variant(schemas=True),
    # A flush every 5 s: the worker is killed after one, so it streams again from there (what it sent since comes
    # twice, unless a flush fell between those changes and the kill).
    "strings": Variant(schemas=False, worker={"offset.flush.interval.ms": 5000},
                       connector={"decimal.handling.mode": "string", "time.precision.mode": "isostring",
                                  "binary.handling.mode": "hex"},
                       convert={"decimal_handling_mode": "string", "time_precision_mode": "isostring",
                                "binary_handling_mode": "hex"}),
}


@pytest.fixture(scope="session")
def debezium_dist() -> Path:
    """Kafka Connect and Debezium's plugin, assembled with Maven on first use (cached)."""
    return build()


@pytest.fixture(scope="module")
def source_pg(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SourcePostgres]:
    src = SourcePostgres(tmp_path_factory.mktemp("debezium-source") / "pgdata")
    try:
        yield src.start()
    finally:
        src.stop()


class Tail:
    """The Debezium topic read from its start: every record as (key, op, lsn, value text)."""

    def __init__(self, kafka: KafkaConfig, topic: str, schemas: bool) -> None:
        self.schemas = schemas
        self.tp = TopicPartition(topic, 0, 0)
        self.consumer: Consumer = kafka_clients.consumer(kafka, f"tail-{uuid.uuid4().hex[:8]}")
        self.consumer.assign([self.tp])
        self.records: list[tuple[Any, str | None, int | None, str | None]] = []

    def poll(self) -> None:
        for msg in self.consumer.consume(500, 0.5):
            if msg.error():
                continue
            key = self._payload(msg.key())
            value = self._payload(msg.value())
            op = value.get("op") if value else None
            lsn = value.get("source", {}).get("lsn") if value else None
            self.records.append((key, op, lsn, msg.value().decode() if msg.value() else None))

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


SNAPSHOT_ROWS = (
    "INSERT INTO {t} VALUES (1, 12.50, 3.14159, '2024-02-29', '2024-01-02 03:04:05.123456+02', "
    "'2024-01-02 03:04:05.5', '13:14:15.25', '{{\"a\": [1, 2.5, null], \"é\": \"ü\"}}', true, "
    "'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11', '\\x00ff10', 'grüße 😀', {big})",
    "INSERT INTO {t} (id) VALUES (2)",  # every other column NULL
    "INSERT INTO {t} VALUES (3, -0.01, 1e-20, '1970-01-01', '1999-12-31 23:59:59.999999-08', "
    "'0001-01-01 00:00:00', '00:00:00', '[]', false, gen_random_uuid(), '\\x', '', 'short, inline')",
    "INSERT INTO {t} VALUES (4, 99999999.99, 123456789012345678901234567890.123456789, '9999-12-31', "
    "'2038-01-19 03:14:08+00', '2262-04-11 23:47:16.854775', '23:59:59.999999', "
    "'{{\"n\": 1e100, \"s\": \"tab\\tx\", \"k\": {{\"z\": 1, \"a\": 2}}}}', NULL, gen_random_uuid(), "
    "decode(repeat('ab', 3000), 'hex'), 'ναί 中文 \\t\"''', {big})",
)


def streaming(src: Source, phase: int) -> int:
    """One round of changes after the snapshot; the lsn before its last change."""
    base = 100 * phase
    return src.sql(
        f"INSERT INTO {{t}} VALUES ({base + 1}, 1.10, 0.5, '2025-06-01', now(), '2025-06-01 12:00:00.000001', "
        f"'08:30:00.000001', '{{{{\"phase\": {phase}}}}}', true, gen_random_uuid(), '\\xdeadbeef', 'new ✓', {{big}})",
        f"INSERT INTO {{t}} (id, note, big) VALUES ({base + 2}, 'no big', NULL)",
        f"UPDATE {{t}} SET note = 'touched {phase}', amount = amount + 1 WHERE id IN (1, 4, {base + 1})",  # big kept
        "UPDATE {t} SET flag = NOT coalesce(flag, false), doc = NULL WHERE id = 1",  # big kept again
        f"UPDATE {{t}} SET big = {{big}} WHERE id = {base + 1}",  # a new TOASTed value
        "UPDATE {t} SET ratio = NULL, blob = NULL WHERE id = 3",
        "UPDATE {t} SET clock = '01:02:03', at = now() WHERE id = 4",  # big kept
        f"DELETE FROM {{t}} WHERE id = {base + 2}",
        f"UPDATE {{t}} SET local_at = now(), note = NULL WHERE id = {base + 1}",  # big kept; always a change
    )


@pytest.mark.apache_kafka
@pytest.mark.timeout(420)
@pytest.mark.parametrize("variant_name", list(VARIANTS))
def test_real_debezium_changes_project_like_the_source_table(
        variant_name: str, debezium_dist: Path, source_pg: SourcePostgres, kafka_config: KafkaConfig,
        pg_config: PostgresConfig, pg_url: str, unique: str, tmp_path: Path) -> None:
    variant = VARIANTS[variant_name]
    table = f"src_{uuid.uuid4().hex[:10]}"
    prefix = unique.replace("kt.", "dbz.")
    topic, target = f"{prefix}.public.{table}", table_name()
    src = Source(source_pg, table)
    src.sql(f"CREATE TABLE {{t}} ({', '.join(f'{c} {tp}' for c, tp in COLUMNS.items())}, PRIMARY KEY (id))",
            *SNAPSHOT_ROWS)
    create_topic(kafka_config, topic, partitions=1)
    converters = "true" if variant.schemas else "false"
    worker = ConnectWorker(debezium_dist, tmp_path / "connect", kafka_config.bootstrap_servers, {
        "key.converter": JSON_CONVERTER, "value.converter": JSON_CONVERTER,
        "key.converter.schemas.enable": converters, "value.converter.schemas.enable": converters,
        "plugin.discovery": "service_load",  # Debezium's plugin has its ServiceLoader manifests: no class scan
        **variant.worker,
    }, {
        "name": prefix, "connector.class": "io.debezium.connector.postgresql.PostgresConnector", "tasks.max": 1,
        "database.hostname": "127.0.0.1", "database.port": source_pg.port, "database.user": "postgres",
        "database.dbname": "postgres", "topic.prefix": prefix, "plugin.name": "pgoutput",
        "table.include.list": f"public.{table}", "slot.name": table, "publication.name": f"pub_{table}",
        "publication.autocreate.mode": "filtered",
        "skipped.operations": "none",  # Debezium's default skips truncates ("t"); kafold applies them here
        **variant.connector,
    })
    tail = Tail(kafka_config, topic, variant.schemas)
    conf = write_config(tmp_path / "kafold.toml", kafka_config, pg_url, unique, topic, target, variant)
    daemon_log = tmp_path / "daemon.log"
    daemon: subprocess.Popen[bytes] | None = None

    def caught_up(lsn: int, what: str) -> None:
        """The change at `lsn` is on the topic and the daemon's stored offsets reached the topic's end."""
        wait_for(lambda: tail.seen(lsn) or worker.state() == "FAILED", f"{what} on the topic", WAIT_S)
        assert worker.state() != "FAILED", f"the connector failed; see {worker.log_file}"
        wait_for(lambda: _offsets(pg_config, unique, topic) == {0: tail.end()}
                 or (daemon is not None and daemon.poll() is not None), f"{what} projected", WAIT_S)
        assert daemon is not None and daemon.poll() is None, f"the daemon exited; see {daemon_log}"
        same_as_source(src, pg_config, target, f"after {what}")

    try:
        worker.start()
        # The snapshot first: a change made while it runs may be in it or not (a TRUNCATE even empties it).
        wait_for(lambda: tail.poll() or any('"snapshot":"last"' in (r[3] or "") for r in tail.records),
                 "the snapshot's last record", WAIT_S)
        daemon = start_daemon(conf, pg_url, daemon_log)
        caught_up(0, "the snapshot")

        caught_up(streaming(src, 1), "the first changes")
        # A key change (Debezium: a delete of the old key, its tombstone, a create of the new one), on a row whose
        # values are all inline (see the module note on TOAST and key changes in the report).
        caught_up(src.sql("UPDATE {t} SET id = 30 WHERE id = 3"), "the key change")

        # kill -9 of the daemon with work outstanding, then a new one
        before = tail.end()
        last = src.sql(*(f"UPDATE {{t}} SET amount = {i}.25, note = 'burst {i}' WHERE id = {1 + i % 2}"
                         for i in range(150)))
        wait_for(lambda: tail.seen(last), "the burst on the topic", WAIT_S)
        wait_for(lambda: _offsets(pg_config, unique, topic).get(0, 0) > before, "the burst started", WAIT_S)
        daemon.send_signal(signal.SIGKILL)
        daemon.wait(10)
        daemon = start_daemon(conf, pg_url, daemon_log)
        caught_up(last, "the burst")

        # kill -9 of the Connect worker: it starts again from its last offset flush (none: a new snapshot)
        if "offset.flush.interval.ms" in variant.worker:
            wait_for(lambda: worker.offsets_file.exists() and worker.offsets_file.stat().st_size > 0,
                     "the worker's first offset flush", WAIT_S)
        caught_up(streaming(src, 2), "the second changes")
        worker.kill()
        src.sql("DELETE FROM {t} WHERE id = 201")  # made while the worker is down: a row the projection holds
        down = streaming(src, 3)
        worker.start()
        caught_up(down, "the changes made while Connect was down")

        caught_up(src.sql("TRUNCATE {t}"), "the truncate")
        caught_up(streaming(src, 4), "the changes after the truncate")
        caught_up(src.sql("INSERT INTO {t} SELECT 500 + id, amount, ratio, day, at, local_at, clock, doc, flag, "
                          "ref, blob, note, big FROM {t}"), "the last inserts")
    finally:
        if daemon is not None:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(20)
        worker.stop()
        tail.close()

    ops = [r[1] for r in tail.records]
    redelivered = len(tail.records) - len({(str(r[0]), r[1], r[2]) for r in tail.records})
    log.info("debezium_test.topic", variant=variant_name, records=len(ops), redelivered=redelivered,
             placeholders=sum(PLACEHOLDER in (r[3] or "") for r in tail.records),
             ops={op: ops.count(op) for op in set(ops) if op})
    # the run exercised what it claims: Debezium sent placeholders, deletes, a truncate
    assert any(PLACEHOLDER in (r[3] or "") for r in tail.records)
    assert {"r", "c", "u", "d", "t"} <= set(ops)
    assert dead_letters(pg_config, unique) == []
    same_as_source(src, pg_config, target, "at the end")
    with db.connect(pg_config) as conn:
        leaked = conn.execute(f"SELECT count(*) FROM {target} t WHERE strpos(t::text, %s) > 0 OR strpos(t::text, "
                              f"%s) > 0", (PLACEHOLDER, "X19kZWJleml1bV91bmF2YWlsYWJsZV92YWx1ZQ")).fetchone()
    assert leaked == (0,)


def _offsets(pgc: PostgresConfig, connector: str, topic: str) -> dict[int, int]:
    try:
        return stored_offsets(pgc, connector, topic)
    except Exception:  # the daemon has not migrated yet
        return {}
