"""The snapshot job on a Spark standalone cluster (a master and two workers on loopback, `spark_master =
"spark://…"`): its snapshots equal those of a local run over the same history."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest

from kafold.config import KafkaConfig
from kafold.snapshot import record
from kafold.spark_jobs import snapshot_job
from tests.snapshots import spark_cluster
from tests.snapshots.snaphelpers import (
    BANK,
    Bank,
    assert_restore_equals_full_replay,
    make_bank,
    snapshot_records,
    write_config,
)

pytestmark = pytest.mark.spark

# Executors sized to fit a worker's offer (else the application waits for resources forever).
CLUSTER_CONF = '[snapshots]\nspark_master = "{master}"\nengine = "spark"\n' \
               'spark_conf = {{ "spark.executor.memory" = "{memory}", "spark.executor.cores" = "1" }}\n'


def _written(bank: Bank) -> dict[int, list[tuple[Any, ...]]]:
    """Per partition, what the snapshot topic says (everything but the aggregate type's name and write times)."""
    out: dict[int, list[tuple[Any, ...]]] = {}
    for p in bank.partitions():
        rows: list[tuple[Any, ...]] = []
        for key, value, _ in snapshot_records(bank, p):
            if record.is_marker(key):
                rows.append(("marker", record.decode_marker(key, value).offset))
            else:
                s = record.decode(key, value)
                rows.append(("snapshot", s.aggregate_id, s.version, s.offset, repr(s.state)))
        out[p] = sorted(rows)
    return out


def _leftovers(state_dir: Path) -> list[int]:
    """Processes working in the cluster's dirs (executors run in their worker's work dir)."""
    found = []
    for p in psutil.process_iter(["cwd", "cmdline"]):
        info = p.info
        if str(state_dir) in (info["cwd"] or "") or any(str(state_dir) in a for a in info["cmdline"] or ()):
            found.append(p.pid)
    return found


def test_the_job_on_a_standalone_cluster_writes_what_a_local_run_writes(spark: Any, kafka_config: KafkaConfig,
                                                                        unique: str, tmp_path: Path) -> None:
    on_cluster, local = make_bank(kafka_config, f"{unique}.c"), make_bank(kafka_config, f"{unique}.l")
    for bank in (on_cluster, local):
        bank.produce(400)  # the same seeded history, partition by partition
    expected = snapshot_job.run(spark, local.kafka, local.agg, [BANK])
    assert expected.events_folded == 400 and expected.snapshots == len(local.versions)

    state_dir = tmp_path / "spark"
    state_dir.mkdir()
    toml = write_config(on_cluster, tmp_path)
    with spark_cluster.standalone(state_dir, workers=2) as cluster:
        toml.write_text(toml.read_text() + CLUSTER_CONF.format(master=cluster.master_url,
                                                                memory=spark_cluster.WORKER_MEMORY))
        # its own process: this one's SparkSession is local, and a process has one
        done = subprocess.run([str(Path(sys.executable).with_name("kafold")), "snapshot", "run", "-c", str(toml)],
                              capture_output=True, text=True, timeout=300, check=False)
        assert done.returncode == 0, done.stdout + done.stderr
    row = next(line.split() for line in done.stdout.splitlines() if line.startswith(on_cluster.agg.name))
    assert row[1:4] == ["spark", str(on_cluster.agg.partitions), "400"]  # engine, partitions, events folded
    # both workers ran an executor of the job (each keeps a work dir per application)
    assert all(list((state_dir / f"work-{i}").glob("app-*")) for i in (1, 2)), sorted(state_dir.rglob("app-*"))
    assert _leftovers(state_dir) == []  # master, workers, executors and their Python workers all stopped

    assert _written(on_cluster) == _written(local)
    assert_restore_equals_full_replay(on_cluster)
