"""`kafold status`: the table comes from the running daemon, else from Kafka's committed and end offsets."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kafold.config import KafkaConfig
from kafold.envelope import encode
from kafold.testing import free_port
from kafold.tools.commands import status
from tests.daemon.daemon_support import daemon_in_process, write_config
from tests.support import committed, create_topic, make_event, produce, wait_for

KAFOLD = str(Path(sys.executable).parent / "kafold")


def test_status_reads_the_daemon_when_running_and_kafka_otherwise(
        tmp_path: Path, kafka_config: KafkaConfig, unique: str) -> None:
    topic = f"{unique}.events"
    create_topic(kafka_config, topic, partitions=2)
    produce(kafka_config, topic, [(v % 2, *encode(make_event("a", v))) for v in range(1, 8)])
    path = write_config(tmp_path, kafka_config, unique, topic, port=free_port())
    with daemon_in_process(path) as d:
        wait_for(lambda: committed(kafka_config, f"{unique}.sink", topic, 2) == {0: 3, 1: 4}, "the commits")
        wait_for(lambda: d.host.ready_report()[0], "caught up")
        out = subprocess.run([KAFOLD, "status", "-c", str(path), "--json"], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0, out.stderr
        live = json.loads(out.stdout)
        assert live["source"] == "daemon"
        rows = {r["partition"]: r for r in live["partitions"]}
        assert {p: (r["committed"], r["end_offset"], r["lag"], r["state"]) for p, r in rows.items()} == {
            0: (3, 3, 0, "RUNNING"), 1: (4, 4, 0, "RUNNING")}
    out = subprocess.run([KAFOLD, "status", "-c", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "source: kafka"
    assert lines[1].split() == [c.upper() for c in status.COLUMNS]
    cells = [line.split() for line in lines[2:]]
    assert [(c[0], c[2], c[3], c[4]) for c in cells] == [("sink", topic, "0", "3"), ("sink", topic, "1", "4")]


def test_status_table_renders_missing_values_as_dashes() -> None:
    text = status.table([{"connector": "c", "task": 0, "topic": "t", "partition": 1, "committed": None}])
    header, row = text.splitlines()
    assert header.split()[0] == "CONNECTOR" and row.split() == ["c", "0", "t", "1", "-", "-", "-", "-", "-"]
