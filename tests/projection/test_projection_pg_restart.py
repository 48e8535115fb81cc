"""Integration: PostgreSQL restarted mid-run -> the task retries with back-off; nothing lost, nothing twice."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from kafold.config import KafkaConfig, PostgresConfig
from kafold.tools.dev import stack as devstack
from tests.projection.projection_support import (
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


@pytest.fixture
def own_postgres(tmp_path: Path) -> Iterator[tuple[PostgresConfig, Path]]:
    """A PostgreSQL of this test alone (the session's is shared): started here, stopped at the end."""
    url, proc = devstack._start_postgres(tmp_path)
    try:
        yield PostgresConfig(url=url), tmp_path
    finally:
        devstack._stop(devstack._postmaster_pid(tmp_path) or proc, signal.SIGINT)


def test_postgres_restarting_mid_run_loses_nothing_and_applies_nothing_twice(
        kafka_config: KafkaConfig, own_postgres: tuple[PostgresConfig, Path], unique: str) -> None:
    pgc, state_dir = own_postgres
    topic, table = f"{unique}.events", table_name()
    create_topic(kafka_config, topic, partitions=2)
    events = history(accounts=1000, deposits=29)  # 30k events, small batches: several seconds of work
    coords = produce(kafka_config, topic, encoded(events, 2))
    ends = ends_of(coords)
    with structlog.testing.capture_logs() as logs, \
            running(kafka_config, pgc, settings(unique, topic, table), unique, batch=20) as runner:
        def progressed() -> bool:
            try:
                done = sum(stored_offsets(pgc, unique, topic).values())
            except Exception:  # not migrated yet
                return False
            return 0 < done < sum(ends.values()) - 5000
        wait_for(progressed, "some batches applied", 60)
        devstack._stop(devstack._postmaster_pid(state_dir), signal.SIGINT)  # fast shutdown: sessions killed
        time.sleep(3)  # the task keeps failing and backing off meanwhile
        devstack._start_postgres(state_dir)
        wait_for_offsets(pgc, unique, topic, ends, runner, timeout=120)
        totals = runner.task.totals  # type: ignore[attr-defined]
    retries = [e for e in logs if e["event"] == "runner.put_retrying"]
    assert len(retries) >= 2
    assert retries[1]["retry_in_s"] > retries[0]["retry_in_s"]  # backing off
    assert read_table(pgc, table) == fold(events)
    assert totals.upserted <= len(events)  # every upsert is a distinct event's row change
