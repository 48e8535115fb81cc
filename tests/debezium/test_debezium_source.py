"""A real Debezium PostgreSQL source (Kafka Connect 4.3.1 + debezium-connector-postgres 3.6.1.Final, pgoutput,
REPLICA IDENTITY DEFAULT) feeding `kafold daemon`: the snapshot, inserts, updates that leave a TOASTed column alone,
deletes, a key change, a TRUNCATE, a kill -9 of the daemon and of the Connect worker; the projected table equals the
source table row by row, every column, after every step, and holds no unavailable-value placeholder. Debezium's
defaults (schemas in each record, precise decimals, adaptive time), then schema-less records with string decimals
and ISO times. Then two cases where Debezium's defaults leave a value out of the stream: a row deleted while a
Connect worker that never flushed its offsets is down, and a key change of a row with a TOASTed value."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest

from kafold import db, logs
from kafold.config import KafkaConfig, PostgresConfig
from tests.debezium.connect import build
from tests.debezium.pipeline import PLACEHOLDER, Services, Source, Variant, pipeline
from tests.debezium.source_pg import SourcePostgres
from tests.projection.projection_support import dead_letters
from tests.support import wait_for

log = logs.get(__name__)

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


@pytest.fixture
def services(debezium_dist: Path, source_pg: SourcePostgres, kafka_config: KafkaConfig, pg_config: PostgresConfig,
             pg_url: str) -> Services:
    return Services(debezium_dist, source_pg, kafka_config, pg_config, pg_url)


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
    # a TOASTed jsonb and bytea: Debezium's placeholder comes as a Json string and as bytes
    "INSERT INTO {t} (id, doc, blob, note) VALUES (5, jsonb_build_object('pad', {big}, 'n', 5), decode({big}, 'hex'), "
    "'toasted json and bytes')",
)


def streaming(src: Source, phase: int) -> int:
    """One round of changes after the snapshot; the lsn before its last change."""
    base = 100 * phase
    return src.sql(
        f"INSERT INTO {{t}} VALUES ({base + 1}, 1.10, 0.5, '2025-06-01', now(), '2025-06-01 12:00:00.000001', "
        f"'08:30:00.000001', '{{{{\"phase\": {phase}}}}}', true, gen_random_uuid(), '\\xdeadbeef', 'new ✓', {{big}})",
        f"INSERT INTO {{t}} (id, note, big) VALUES ({base + 2}, 'no big', NULL)",
        f"UPDATE {{t}} SET note = 'touched {phase}', amount = amount + 1 WHERE id IN (1, 4, 5, {base + 1})",  # big kept
        "UPDATE {t} SET flag = NOT coalesce(flag, false), doc = NULL WHERE id = 1",  # big kept again
        f"UPDATE {{t}} SET big = {{big}} WHERE id = {base + 1}",  # a new TOASTed value
        "UPDATE {t} SET ratio = NULL, blob = NULL WHERE id = 3",
        "UPDATE {t} SET clock = '01:02:03', at = now() WHERE id = 4",  # big kept
        f"DELETE FROM {{t}} WHERE id = {base + 2}",
        f"UPDATE {{t}} SET local_at = now(), note = NULL WHERE id = {base + 1}",  # big kept; always a change
    )


@pytest.mark.apache_kafka
@pytest.mark.timeout(300)
@pytest.mark.parametrize("variant_name", [
    "defaults",
    # without schemas: jsonb and bytea decoded by the projection's declared column types
    "strings",
])
def test_real_debezium_changes_project_like_the_source_table(
        variant_name: str, services: Services, pg_config: PostgresConfig, unique: str, tmp_path: Path) -> None:
    variant = VARIANTS[variant_name]
    with pipeline(services, variant, unique, tmp_path, SNAPSHOT_ROWS) as p:
        src = p.src
        p.caught_up(streaming(src, 1), "the first changes")
        # A key change (Debezium: a delete of the old key, its tombstone, a create of the new one), on a row whose
        # values are all inline (a TOASTed value: test_a_key_change_keeps_the_rows_toasted_value).
        p.caught_up(src.sql("UPDATE {t} SET id = 30 WHERE id = 3"), "the key change")

        # kill -9 of the daemon with work outstanding, then a new one
        before = p.tail.end()
        last = src.sql(*(f"UPDATE {{t}} SET amount = {i}.25, note = 'burst {i}' WHERE id = {1 + i % 2}"
                         for i in range(150)))
        wait_for(lambda: p.tail.seen(last), "the burst on the topic", 90)
        wait_for(lambda: p.offsets().get(0, 0) > before, "the burst started", 90)
        p.kill_daemon()
        p.start_daemon()
        p.caught_up(last, "the burst")

        # kill -9 of the Connect worker: it starts again from its last offset flush (none: a new snapshot)
        if "offset.flush.interval.ms" in variant.worker:
            wait_for(lambda: p.worker.offsets_file.exists() and p.worker.offsets_file.stat().st_size > 0,
                     "the worker's first offset flush", 90)
        p.caught_up(streaming(src, 2), "the second changes")
        p.worker.kill()
        down = streaming(src, 3)  # made while the worker is down
        p.worker.start()
        p.caught_up(down, "the changes made while Connect was down")

        p.caught_up(src.sql("TRUNCATE {t}"), "the truncate")
        p.caught_up(streaming(src, 4), "the changes after the truncate")
        p.caught_up(src.sql("INSERT INTO {t} SELECT 500 + id, amount, ratio, day, at, local_at, clock, doc, flag, "
                            "ref, blob, note, big FROM {t}"), "the last inserts")

    records = p.tail.records
    ops = [r[1] for r in records]
    log.info("debezium_test.topic", variant=variant_name, records=len(ops),
             redelivered=len(records) - len({(str(r[0]), r[1], r[2]) for r in records}),
             placeholders=sum(PLACEHOLDER in (r[3] or "") for r in records),
             ops={op: ops.count(op) for op in set(ops) if op})
    # the run exercised what it claims: Debezium sent placeholders, deletes, a truncate
    assert any(PLACEHOLDER in (r[3] or "") for r in records)
    assert {"r", "c", "u", "d", "t"} <= set(ops)
    assert dead_letters(pg_config, unique) == []
    with db.connect(pg_config) as conn:
        leaked = conn.execute(f"SELECT count(*) FROM {p.target} t WHERE strpos(t::text, %s) > 0 OR "
                              "strpos(t::text, %s) > 0",
                              (PLACEHOLDER, "X19kZWJleml1bV91bmF2YWlsYWJsZV92YWx1ZQ")).fetchone()
    assert leaked == (0,)


@pytest.mark.apache_kafka
@pytest.mark.timeout(300)
@pytest.mark.parametrize("variant_name", ["defaults", "strings"])
def test_a_row_deleted_while_connect_is_down_before_its_first_offset_flush_is_deleted(
        variant_name: str, services: Services, unique: str, tmp_path: Path) -> None:
    """Connect flushes source offsets every 60 s by default; a worker killed before its first flush has none on
    restart, so Debezium (snapshot.mode initial) takes a new snapshot and streams from there: a row deleted while
    it was down is not in that snapshot and no delete event for it is ever sent."""
    # No offset flush before the kill: Connect's default (60 s) can pass on a loaded machine before the worker is
    # killed, so the interval is set past the test's length
    variant = dataclasses.replace(VARIANTS[variant_name], worker={"offset.flush.interval.ms": 600_000})
    with pipeline(services, variant, unique, tmp_path, SNAPSHOT_ROWS) as p:
        p.caught_up(streaming(p.src, 1), "the first changes")
        p.worker.kill()
        p.src.sql("DELETE FROM {t} WHERE id = 2", "UPDATE {t} SET note = 'while down' WHERE id = 4")
        p.worker.start()
        p.caught_up(p.src.sql("UPDATE {t} SET note = 'back' WHERE id = 1"), "the changes made while Connect was down")
        # the run exercised what it claims: Debezium snapshotted the table a second time (its snapshot may still be
        # going on once the change after it is on the topic: its records carry the lsn where it started)
        p.tail.wait_until(lambda: p.tail.snapshots_ended() >= 2, "the second snapshot's last record")
        p.caught_up(0, "the second snapshot")
        p.rebuilt("the topic holds both snapshots")
    assert p.tail.snapshots_ended() == 2


@pytest.mark.apache_kafka
@pytest.mark.timeout(300)
@pytest.mark.parametrize("variant_name", ["defaults", "strings"])
def test_a_key_change_keeps_the_rows_toasted_value(variant_name: str, services: Services, unique: str,
                                                   tmp_path: Path) -> None:
    """An UPDATE of the primary key comes from Debezium as a delete of the old key and a create of the new one, both
    at the same lsn; with REPLICA IDENTITY DEFAULT an unchanged TOASTed value is the placeholder in that create, so
    the value is only in the row the delete removes."""
    with pipeline(services, VARIANTS[variant_name], unique, tmp_path, SNAPSHOT_ROWS) as p:
        p.caught_up(p.src.sql("UPDATE {t} SET id = 50 WHERE id = 1"), "the key change")
        p.rebuilt("the key change replayed")
    # the run exercised what it claims: the new key's create came with the placeholder, the old key's delete named
    # the new key in a header (as the worker's default header converter writes it)
    assert any(r[1] == "c" and PLACEHOLDER in (r[3] or "") for r in p.tail.records)
    named = [h["__debezium.newkey"] for r, h in zip(p.tail.records, p.tail.headers, strict=True)
             if r[1] == "d" and "__debezium.newkey" in h]
    log.info("debezium_test.newkey_header", variant=variant_name, header=[str(v) for v in named])
    assert len(named) == 1
