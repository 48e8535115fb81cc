"""Integration: small batches, written in the runner's thread (task.py, INLINE_WRITE_RECORDS), whose writes keep
failing as the writer's PostgreSQL session is killed: the runner offers each failed batch again and nothing is lost
or applied twice — not the events, and not the dead letters that were to be written with them."""

from __future__ import annotations

import threading
import time

import psycopg
import pytest
import structlog

from kafold import db
from kafold.config import KafkaConfig, PostgresConfig
from kafold.connectors.projection.task import INLINE_WRITE_RECORDS
from tests.projection.projection_support import (
    dead_letters,
    encoded,
    ends_of,
    fold,
    history,
    read_table,
    running,
    settings,
    stored_offsets,
    table_name,
    wait_for_offsets,
)
from tests.support import create_topic, produce, wait_for

BATCH = 10
KILLS = 8


@pytest.mark.timeout(300)
def test_small_batches_written_inline_survive_lost_sessions_with_their_dead_letters(
        kafka_config: KafkaConfig, pg_config: PostgresConfig, unique: str) -> None:
    assert BATCH <= INLINE_WRITE_RECORDS  # every batch of this test is written inline
    topic, table = f"{unique}.events", table_name()
    cfg = settings(unique, topic, table)
    create_topic(kafka_config, topic, partitions=2)
    create_topic(kafka_config, cfg.dlq_topic)
    events = history(accounts=200, deposits=24)  # 5,000 events: ~600 batches
    items: list[tuple[int, bytes | None, bytes | None, list[tuple[str, bytes]]]] = []
    for i, item in enumerate(encoded(events, 2)):
        items.append(item)
        if i % 8 == 7:  # an undecodable record in nearly every batch: its dead letter goes with the batch's write
            items.append((item[0], item[1], b"\xff\xfe not json", []))
    poison = len(items) - len(events)
    coords = produce(kafka_config, topic, items)
    with structlog.testing.capture_logs() as logs, running(kafka_config, pg_config, cfg, unique, batch=BATCH) as runner:
        killed = threading.Event()

        def kill_sessions() -> None:
            """Kill the writer's session KILLS times while the batches flow."""
            def progressed() -> bool:
                try:
                    return sum(stored_offsets(pg_config, unique, topic).values()) > 0
                except psycopg.Error:  # not migrated yet
                    return False

            wait_for(progressed, "the first batches", 60)
            with db.connect(pg_config) as conn:
                for _ in range(KILLS):
                    time.sleep(0.15)
                    writer = getattr(runner.task, "writer", None)
                    session = writer.conn if writer is not None else None
                    if session is not None and not session.closed:
                        try:
                            conn.execute("SELECT pg_terminate_backend(%s)", (session.info.backend_pid,))
                        except psycopg.Error:
                            pass  # it just reconnected: the next round kills the new one
            killed.set()

        killer = threading.Thread(target=kill_sessions, daemon=True)
        killer.start()
        wait_for_offsets(pg_config, unique, topic, ends_of(coords), runner, timeout=180)
        killer.join(30)
        assert killed.is_set()
        totals = runner.task.totals  # type: ignore[attr-defined]
    retried = [e for e in logs if e["event"] == "runner.put_retrying"]
    assert retried, "no write failed: the sessions were not killed while batches were written"
    assert read_table(pg_config, table) == fold(events)
    assert totals.upserted <= len(events)
    dead = dead_letters(pg_config, unique)
    assert len(dead) == poison  # each undecodable record once: none lost with a failed write, none twice
    assert len({(p, o) for _t, p, o, *_ in dead}) == poison
