"""`kafold daemon` projecting records it did not write: Debezium change events made by hand from a real PostgreSQL
source table's changes (with and without the schema wrapper, a tombstone, an out-of-order redelivery, a kill -9 in
the middle) and plain JSON records without ids (read twice), each applied once; a malformed record of each kind is
dead-lettered naming its path and later records flow."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import orjson
import pytest

from kafold import db
from kafold.config import KafkaConfig, PostgresConfig
from tests.projection.projection_support import dead_letters, ends_of, stored_offsets, table_name
from tests.projection.test_projection_kill9 import start_daemon
from tests.support import create_topic, produce, wait_for


def write_config(path: Path, kafka: KafkaConfig, pg_url: str, unique: str, cdc: str, plain: str, dst: str,
                 totals: str) -> Path:
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
batch_max_records = 3
shutdown_grace_s = 5

[[connectors]]
name = "{unique}-cdc"
class = "postgres-projection"
topics = ["{cdc}"]
converter = "debezium"

[connectors.config]
table = "{dst}"
key_columns = ["id"]
columns = {{id = "bigint", name = "text", qty = "bigint"}}
key = {{id = "payload.id"}}

[[connectors.config.on]]
type = ["create", "update", "read"]
set = {{name = "payload.name", qty = "payload.qty"}}

[[connectors.config.on]]
type = "delete"
action = "delete"

[[connectors]]
name = "{unique}-json"
class = "postgres-projection"
topics = ["{plain}"]
converter = "json"

[connectors.convert]
type = "kind"

[connectors.config]
table = "{totals}"
key_columns = ["acct"]
columns = {{acct = "text", total = "bigint"}}

[[connectors.config.on]]
type = "deposit"
increment = {{total = "payload.n"}}
""")
    return path


class Source:
    """A real PostgreSQL source table whose committed changes become Debezium-shaped records, made by hand."""

    def __init__(self, pgc: PostgresConfig, table: str) -> None:
        self.pgc, self.table = pgc, table
        self.rows: dict[int, dict[str, Any]] = {}
        self.wrap = False
        with db.connect(pgc) as conn:
            conn.execute(f"CREATE TABLE {table} (id bigint PRIMARY KEY, name text, qty bigint)")

    def _record(self, op: str, key: int, before: Any, after: Any, lsn: int) -> tuple[int, bytes, bytes, Any]:
        self.wrap = not self.wrap  # every other key in the {"schema", "payload"} wrapper (values always: the default)
        body: dict[str, Any] = {"before": before, "after": after, "op": op, "ts_ms": 1,
                                "source": {"connector": "postgresql", "schema": "public", "table": self.table,
                                           "lsn": lsn, "ts_ms": 1}}
        body = {"schema": {"type": "struct", "name": "Envelope"}, "payload": body}
        k: dict[str, Any] = {"id": key}
        if self.wrap:
            k = {"schema": {"type": "struct"}, "payload": k}
        return 0, orjson.dumps(k), orjson.dumps(body), None

    def change(self, sql: str, key: int, params: tuple[Any, ...] = ()) -> list[tuple[int, bytes, bytes | None, Any]]:
        with db.connect(self.pgc) as conn:
            conn.execute(sql, params)
            conn.commit()
            got = conn.execute(f"SELECT id, name, qty FROM {self.table} WHERE id = %s", (key,)).fetchone()
            lsn = int(conn.execute("SELECT (pg_current_wal_lsn() - '0/0'::pg_lsn)::bigint").fetchone()[0])
        before = self.rows.get(key)
        if got is None:  # REPLICA IDENTITY DEFAULT: a delete's before holds the key columns only
            self.rows.pop(key, None)
            return [self._record("d", key, {"id": key, "name": None, "qty": None}, None, lsn),
                    (0, orjson.dumps({"id": key}), None, None)]  # the tombstone after it
        after = dict(zip(("id", "name", "qty"), got, strict=True))
        self.rows[key] = after
        return [self._record("c" if before is None else "u", key, before, after, lsn)]

    def snapshot(self) -> list[tuple[int, bytes, bytes | None, Any]]:
        with db.connect(self.pgc) as conn:
            rows = conn.execute(f"SELECT id, name, qty FROM {self.table} ORDER BY id").fetchall()
            lsn = int(conn.execute("SELECT (pg_current_wal_lsn() - '0/0'::pg_lsn)::bigint").fetchone()[0])
        out = []
        for r in rows:
            self.rows[r[0]] = dict(zip(("id", "name", "qty"), r, strict=True))
            out.append(self._record("r", r[0], None, self.rows[r[0]], lsn))
        return out

    def table_now(self) -> dict[int, tuple[Any, ...]]:
        with db.connect(self.pgc) as conn:
            return {r[0]: r for r in conn.execute(f"SELECT id, name, qty FROM {self.table}").fetchall()}


def projected(pgc: PostgresConfig, table: str, cols: str) -> dict[Any, tuple[Any, ...]]:
    with db.connect(pgc) as conn:
        return {r[0]: r for r in conn.execute(f"SELECT {cols} FROM {table}").fetchall()}


@pytest.mark.apache_kafka
@pytest.mark.timeout(300)
def test_debezium_and_json_records_project_exactly_once(
        kafka_config: KafkaConfig, pg_config: PostgresConfig, pg_url: str, unique: str, tmp_path: Path) -> None:
    cdc, plain = f"{unique}.cdc", f"{unique}.plain"
    src, dst, totals = table_name(), table_name(), table_name()
    for topic in (cdc, plain):
        create_topic(kafka_config, topic, partitions=1)
    source = Source(pg_config, src)
    with db.connect(pg_config) as conn:  # rows that exist before the connector: they arrive as a snapshot (op r)
        conn.execute(f"INSERT INTO {src} VALUES (1, 'ada', 1), (2, 'bob', 2), (3, 'cy', 3)")
    first = source.snapshot()
    first += source.change(f"UPDATE {src} SET qty = 10 WHERE id = 1", 1)
    first += source.change(f"INSERT INTO {src} VALUES (4, 'dee', 4)", 4)
    old_insert_4 = first[-1]
    first += source.change(f"DELETE FROM {src} WHERE id = 3", 3)
    conf = write_config(tmp_path / "kafold.toml", kafka_config, pg_url, unique, cdc, plain, dst, totals)
    log = tmp_path / "daemon.log"
    coords = produce(kafka_config, cdc, first)
    # json: no ids; a malformed one (no `kind`, the configured type path) between good ones
    deposits = [(0, b"a", b'{"kind": "deposit", "n": 1}', None), (0, b"b", b'{"kind": "deposit", "n": 2}', None),
                (0, b"a", b'{"kind": "deposit", "n": 3}', None), (0, b"z", b'{"n": 5}', None),
                (0, b"b", b'{"kind": "deposit", "n": 4}', None)]
    json_coords = produce(kafka_config, plain, deposits)

    daemon = start_daemon(conf, pg_url, log)
    try:
        wait_for(lambda: _offsets(pg_config, f"{unique}-cdc", cdc) == ends_of(coords) or daemon.poll() is not None,
                 "the first changes projected", 90)
        assert daemon.poll() is None, f"the daemon exited early; see {log}"
        # more changes arrive, then the daemon dies mid-way with kill -9
        second = source.change(f"UPDATE {src} SET name = 'ada2' WHERE id = 1", 1)
        second += source.change(f"INSERT INTO {src} VALUES (3, 'cy again', 33)", 3)  # re-created after delete
        late = source.change(f"UPDATE {src} SET qty = 44 WHERE id = 4", 4)  # held back: produced after the next
        second += source.change(f"UPDATE {src} SET qty = 55 WHERE id = 4", 4)
        coords += produce(kafka_config, cdc, second)
    finally:
        daemon.send_signal(signal.SIGKILL)
        daemon.wait(10)
    # out-of-order redeliveries of older changes (the snapshot row of 1, 4's insert, 3's first delete + tombstone),
    # a malformed change (no op) and later changes that must still flow
    redelivered = [*late, first[0], old_insert_4, *first[-2:]]  # `late` never seen: the version guard skips it
    bad = (0, b'{"id": 99}', orjson.dumps({"schema": {"type": "struct"}, "payload": {
        "before": None, "after": {"id": 99}, "source": {"table": src}}}), None)
    coords += produce(kafka_config, cdc, [*redelivered, bad])
    coords += produce(kafka_config, cdc, source.change(f"UPDATE {src} SET qty = 20 WHERE id = 2", 2))
    daemon = start_daemon(conf, pg_url, log)
    try:
        wait_for(lambda: (_offsets(pg_config, f"{unique}-cdc", cdc) == ends_of(coords)
                 and _offsets(pg_config, f"{unique}-json", plain) == ends_of(json_coords))
                 or daemon.poll() is not None, "every record projected", 90)
        assert daemon.poll() is None, f"the daemon exited early; see {log}"
    finally:
        daemon.send_signal(signal.SIGKILL)
        daemon.wait(10)
    assert projected(pg_config, dst, "id, name, qty") == source.table_now()
    assert projected(pg_config, totals, "acct, total") == {"a": ("a", 4), "b": ("b", 6)}
    cdc_dead = dead_letters(pg_config, f"{unique}-cdc")
    assert len(cdc_dead) == 1 and cdc_dead[0][3] == "convert-failed" and "path 'op'" in cdc_dead[0][5]
    json_dead = dead_letters(pg_config, f"{unique}-json")
    assert len(json_dead) == 1 and json_dead[0][3] == "convert-failed" and "type path 'kind'" in json_dead[0][5]

    # The json records read again from the start (the stored checkpoint rewound): their derived ids dedup them.
    with db.connect(pg_config) as conn:
        conn.execute("UPDATE kafold.checkpoints SET next_offset = 0 WHERE connector = %s", (f"{unique}-json",))
        conn.execute("UPDATE kafold.checkpoints SET next_offset = 0 WHERE connector = %s", (f"{unique}-cdc",))
    more = [(0, b"a", b'{"kind": "deposit", "n": 100}', None)]
    json_coords += produce(kafka_config, plain, more)
    daemon = start_daemon(conf, pg_url, log)
    try:
        wait_for(lambda: (_offsets(pg_config, f"{unique}-json", plain) == ends_of(json_coords)
                 and _offsets(pg_config, f"{unique}-cdc", cdc) == ends_of(coords))
                 or daemon.poll() is not None, "the records read again", 90)
        assert daemon.poll() is None, f"the daemon exited early; see {log}"
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(20)
    assert projected(pg_config, totals, "acct, total") == {"a": ("a", 104), "b": ("b", 6)}
    assert projected(pg_config, dst, "id, name, qty") == source.table_now()


def _offsets(pgc: PostgresConfig, connector: str, topic: str) -> dict[int, int]:
    try:
        return stored_offsets(pgc, connector, topic)
    except Exception:  # the daemon has not migrated yet
        return {}
