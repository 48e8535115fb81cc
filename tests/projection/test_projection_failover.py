"""Two daemon processes in one consumer group: partitions split, one is killed -9, the survivor takes over — and
every event is still projected exactly once."""

from __future__ import annotations

import re
import signal
import subprocess
import urllib.request
from pathlib import Path

import pytest

from kafold.config import KafkaConfig, PostgresConfig
from tests.projection.projection_support import (
    encoded,
    ends_of,
    fold,
    history,
    read_table,
    stored_offsets,
    table_name,
    thirds,
)
from tests.projection.test_projection_kill9 import start_daemon, write_config
from tests.support import create_topic, free_port, produce, wait_for

PARTITIONS = 4


def _assigned(port: int, connector: str) -> set[int]:
    """The partitions a daemon reports on its /metrics (kafold_consumer_position of the connector's task)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return set()
    return {int(p) for c, p in re.findall(r'kafold_consumer_position\{connector="([^"]+)",partition="(\d+)"', text)
            if c == connector}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_second_daemon_splits_partitions_then_survives_a_kill_9_exactly_once(
        kafka_config: KafkaConfig, pg_config: PostgresConfig, pg_url: str, unique: str, tmp_path: Path) -> None:
    topic, table = f"{unique}.events", table_name()
    create_topic(kafka_config, topic, partitions=PARTITIONS)
    events = history(accounts=600, deposits=29, close_every=11)  # ~18k events
    items = encoded(events, PARTITIONS)
    parts = thirds(items)
    ports = [free_port(), free_port()]
    confs = []
    for i, port in enumerate(ports):  # the same group and connector; only the HTTP port differs
        conf = write_config(tmp_path / f"kafold-{i}.toml", kafka_config, pg_url, unique, topic, table)
        conf.write_text(conf.read_text().replace("http_port = 0", f"http_port = {port}"))
        confs.append(conf)
    coords = produce(kafka_config, topic, parts[0])
    daemons: list[subprocess.Popen[bytes]] = []
    try:
        daemons.append(start_daemon(confs[0], pg_url, tmp_path / "daemon-0.log"))
        wait_for(lambda: _assigned(ports[0], unique) == set(range(PARTITIONS)), "the first daemon owns all", 90)
        daemons.append(start_daemon(confs[1], pg_url, tmp_path / "daemon-1.log"))

        def split() -> bool:
            a, b = _assigned(ports[0], unique), _assigned(ports[1], unique)
            return bool(a) and bool(b) and not a & b and a | b == set(range(PARTITIONS))
        wait_for(split, "the partitions to split between the two daemons", 90)
        coords += produce(kafka_config, topic, parts[1])  # both work on it
        wait_for(lambda: sum(stored_offsets(pg_config, unique, topic).values()) > len(parts[0]), "progress", 60)
        victim = daemons[1]
        victim.send_signal(signal.SIGKILL)  # mid-work: its in-flight batch and uncommitted offsets are lost
        victim.wait(10)
        assert all(d.poll() is None for d in daemons[:1])
        coords += produce(kafka_config, topic, parts[2])
        wait_for(lambda: _assigned(ports[0], unique) == set(range(PARTITIONS)), "the survivor takes over", 90)
        ends = ends_of(coords)
        wait_for(lambda: stored_offsets(pg_config, unique, topic) == ends, "the survivor reaches the end", 120)
    finally:
        for d in daemons:
            if d.poll() is None:
                d.send_signal(signal.SIGTERM)
                d.wait(20)
    assert read_table(pg_config, table) == fold(events)  # no missing, no extra row, every deposit once
