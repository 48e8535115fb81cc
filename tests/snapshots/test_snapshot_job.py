"""The Spark snapshot job (local mode, real broker): correct, incremental, and safe to kill and re-run."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest
from snaphelpers import BANK, Bank, snapshot_records

from kafold.snapshot import Folder, kafka_io, record, restore
from kafold.spark_jobs import snapshot_job

pytestmark = pytest.mark.spark


def _job(spark: Any, bank: Bank) -> snapshot_job.JobResult:
    return snapshot_job.run(spark, bank.kafka, bank.agg, [BANK])


def _assert_restore_equals_full_replay(bank: Bank) -> None:
    for p in bank.partitions():
        fast = restore(bank.kafka, bank.agg, bank.domain, p)
        full = restore(bank.kafka, bank.agg, bank.domain, p, use_snapshots=False)
        assert fast.states == full.states, p
        for aid, (_, version) in full.states.items():
            assert version == bank.versions[aid]  # every event folded exactly once


def _assert_every_snapshot_true_at_its_offset(bank: Bank) -> None:
    """Each snapshot on the topic equals the full replay of its aggregate's events below its offset."""
    consumer = kafka_io.reader(bank.kafka)
    for p in bank.partitions():
        events = [b for b in kafka_io.read_range(consumer, bank.agg.topic("events"), p, 0, None)]
        for key, value, _ in snapshot_records(bank, p):
            if record.is_marker(key):
                continue
            snap = record.decode(key, value)
            folder = Folder(bank.domain)
            for offsets, keys, values in events:
                picked = [i for i, (o, k) in enumerate(zip(offsets, keys, strict=True))
                          if k == key and o < snap.offset]
                folder.fold([offsets[i] for i in picked], [keys[i] for i in picked], [values[i] for i in picked])
            state, version = folder.states()[snap.aggregate_id]
            assert (bank.domain.to_json(state), version) == (snap.state, snap.version), snap.aggregate_id
    consumer.close()


def test_job_snapshots_equal_full_replay_and_the_next_run_reads_only_new_events(spark: Any, bank: Bank) -> None:
    bank.produce(800)
    first = _job(spark, bank)
    assert first.events_read == 800 and first.events_folded == 800 and first.bad == 0
    assert first.snapshots == len(bank.versions) == first.aggregates
    for p in bank.partitions():  # right after a run, restore reads no events at all
        assert restore(bank.kafka, bank.agg, bank.domain, p).events_read == 0
    _assert_restore_equals_full_replay(bank)
    bank.produce(50)
    second = _job(spark, bank)
    assert second.events_read == 50 and second.events_folded == 50  # incremental: only the new events
    assert 0 < second.snapshots <= 50  # only aggregates that changed get a new snapshot
    _assert_restore_equals_full_replay(bank)
    _assert_every_snapshot_true_at_its_offset(bank)


KILLER = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, sys.argv[1])
    from snaphelpers import Bank, bank_aggregate, snapshot_partition
    from kafold.config import KafkaConfig
    from kafold.snapshot import kafka_io

    bank = Bank(KafkaConfig(bootstrap_servers=sys.argv[2]), bank_aggregate(sys.argv[3]))
    # Like a job task killed between its snapshot writes and its marker: half the snapshots, flushed, no marker.
    snapshot_partition(bank, 0, limit=int(sys.argv[4]))
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_a_job_killed_halfway_then_rerun_is_consistent_and_folds_nothing_twice(spark: Any, bank: Bank) -> None:
    bank.produce(500)
    here = os.path.dirname(__file__)
    proc = subprocess.run([sys.executable, "-c", KILLER, here, bank.kafka.bootstrap_servers, bank.agg.name, "5"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == -9, proc.stderr
    left = snapshot_records(bank, 0)
    assert len(left) == 5 and not any(record.is_marker(k) for k, _, _ in left)
    # Restore after the crash is already correct: no marker, so the aggregates without snapshots are replayed.
    _assert_restore_equals_full_replay(bank)
    bank.produce(40)
    rerun = _job(spark, bank)
    assert rerun.bad == 0 and rerun.rejected == {}
    _assert_restore_equals_full_replay(bank)
    _assert_every_snapshot_true_at_its_offset(bank)
    again = _job(spark, bank)  # nothing new: nothing folded, nothing written
    # (it may re-read events below an unchanged snapshot's offset and skip them: see REFRESH_LAG)
    assert again.events_folded == 0 and again.snapshots == 0
