"""Fault injection: `kafold daemon` is killed with SIGKILL at >= 20 random points of a 100k-event run and restarted
each time; the table equals an independent fold, no event is missing or applied twice, offsets reach the end."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kafold.config import KafkaConfig, PostgresConfig
from kafold.envelope import Event
from kafold.schema import toml_value
from tests.projection.projection_support import (
    COLUMNS,
    RULES,
    encoded,
    ends_of,
    fold,
    history,
    read_table,
    stored_offsets,
    table_name,
)
from tests.projection.test_projection_whole_rows import WHOLE, closed, expected, state
from tests.support import create_topic, produce, wait_for

KILLS = 20
PARTITIONS = 4


def write_config(path: Path, kafka: KafkaConfig, pg_url: str, unique: str, topic: str, table: str,
                 rules_given: list[dict[str, Any]] = RULES) -> Path:
    rules = "".join("\n[[connectors.config.on]]\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in rule.items())
                    for rule in rules_given)
    path.write_text(f"""
[kafka]
bootstrap_servers = "{kafka.bootstrap_servers}"
# A SIGKILLed member stays in the group until its session times out (real Kafka does the same), and the next
# join waits for it: short timeouts keep 20 restarts within the test's time budget.
session_timeout_ms = 2500
rebalance_timeout_ms = 3000
heartbeat_interval_ms = 500

[postgres]
url = "{pg_url}"

[daemon]
group_prefix = "{unique}"
http_port = 0
batch_max_records = 100
shutdown_grace_s = 5

[[connectors]]
name = "{unique}"
class = "postgres-projection"
topics = ["{topic}"]

[connectors.config]
table = "{table}"
key_columns = ["account_id"]
columns = {toml_value(COLUMNS)}
{rules}
""")
    return path


def start_daemon(conf: Path, pg_url: str, log: Path) -> subprocess.Popen[bytes]:
    # The URL in the environment as well, as the systemd unit passes it (it overrides the file's: the same here).
    env = {**os.environ, "KAFOLD_POSTGRES__URL": pg_url}
    with open(log, "ab") as out:
        return subprocess.Popen([str(Path(sys.executable).parent / "kafold"), "--log-format", "json", "daemon",
                                 "-c", str(conf)], stdout=out, stderr=subprocess.STDOUT, env=env)


@pytest.mark.slow
@pytest.mark.apache_kafka
@pytest.mark.timeout(420)
def test_kill_9_at_random_points_loses_nothing_and_applies_nothing_twice(
        kafka_config: KafkaConfig, pg_config: PostgresConfig, pg_url: str, unique: str, tmp_path: Path) -> None:
    events = history(accounts=2000, deposits=49, close_every=13)  # 100,154 events
    killed_at_random(kafka_config, pg_config, pg_url, unique, tmp_path, events, RULES, fold(events))


@pytest.mark.slow
@pytest.mark.apache_kafka
@pytest.mark.timeout(420)
def test_kill_9_with_whole_row_events_loses_nothing_and_applies_nothing_twice(
        kafka_config: KafkaConfig, pg_config: PostgresConfig, pg_url: str, unique: str, tmp_path: Path) -> None:
    """The same with events that each set their whole row (the one-statement path, whole_rows.py), some closed
    (tombstones) and some produced twice, later (stale: the careful way decides them)."""
    events = [state(f"acc-{a}", v, a * 100 + v) for v in range(1, 26) for a in range(2000)]
    events += [closed(f"acc-{a}", 26) for a in range(0, 2000, 13)]
    events += events[::50]  # produced twice: the same event ids at later offsets
    killed_at_random(kafka_config, pg_config, pg_url, unique, tmp_path, events, WHOLE, expected(events))


def killed_at_random(kafka_config: KafkaConfig, pg_config: PostgresConfig, pg_url: str, unique: str, tmp_path: Path,
                     events: list[Event], rules: list[dict[str, Any]], expected: dict[str, dict[str, Any]]) -> None:
    """`events` projected by `rules` while the daemon is killed with SIGKILL KILLS times; the table is `expected`."""
    rng = random.Random(int.from_bytes(os.urandom(4), "big"))
    topic, table = f"{unique}.events", table_name()
    create_topic(kafka_config, topic, partitions=PARTITIONS)
    items = encoded(events, PARTITIONS)
    chunks = [items[len(items) * i // KILLS: len(items) * (i + 1) // KILLS] for i in range(KILLS)]
    conf = write_config(tmp_path / "kafold.toml", kafka_config, pg_url, unique, topic, table, rules)
    log = tmp_path / "daemon.log"
    coords: list[tuple[int, int]] = []
    kills = mid_run = 0

    def applied() -> int:
        try:
            return sum(stored_offsets(pg_config, unique, topic).values())
        except Exception:  # the first daemon has not migrated yet
            return 0

    for chunk in chunks:
        coords += produce(kafka_config, topic, chunk)  # fresh work for this life of the daemon
        before = applied()
        daemon = start_daemon(conf, pg_url, log)
        try:
            wait_for(lambda before=before, daemon=daemon: applied() > before or daemon.poll() is not None,
                     "progress", 90)
            assert daemon.poll() is None, f"the daemon exited early; see {log}"
            time.sleep(rng.uniform(0.0, 0.6))  # a random point: mid-batch, between batches or mid-commit
        finally:
            daemon.send_signal(signal.SIGKILL)
            daemon.wait(10)
        kills += 1
        mid_run += applied() < len(coords)  # killed with work still outstanding
    ends = ends_of(coords)
    daemon = start_daemon(conf, pg_url, log)
    try:
        wait_for(lambda: stored_offsets(pg_config, unique, topic) == ends or daemon.poll() is not None,
                 "the last daemon to reach the end offsets", 120)
        assert daemon.poll() is None, f"the daemon exited early; see {log}"
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(20)
    assert kills >= 20 and mid_run >= kills // 2
    # The end offsets come from the producer's delivery reports, not ListOffsets (which under-reports on tansu).
    assert stored_offsets(pg_config, unique, topic) == ends
    table_now = read_table(pg_config, table)
    assert set(table_now) == set(expected)  # no missing and no extra rows
    assert table_now == expected  # every balance is the sum of each deposit exactly once
