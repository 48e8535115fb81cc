"""The Spark snapshot job (local mode, real broker): correct, incremental, and safe to kill and re-run."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import Any

import pytest

from kafold.snapshot import kafka_io, record, restore
from kafold.spark_jobs import runs, snapshot_job
from tests.snapshots.snaphelpers import BANK, Bank, assert_restore_equals_full_replay, snapshot_records, write_config
from tests.snapshots.snaphelpers import assert_every_snapshot_true_at_its_offset as assert_every_snapshot_true
from tests.support import child_env

pytestmark = pytest.mark.spark


def _job(spark: Any, bank: Bank) -> runs.JobResult:
    return snapshot_job.run(spark, bank.kafka, bank.agg, [BANK])


def _no_spark() -> Any:
    raise AssertionError("this run should not have needed Spark")


def _local(bank: Bank) -> runs.JobResult:
    return runs.run(bank.kafka, bank.agg, [BANK], _no_spark, engine="local")


def test_job_snapshots_equal_full_replay_and_the_next_run_reads_only_new_events(spark: Any, bank: Bank) -> None:
    bank.produce(800)
    first = _job(spark, bank)
    assert first.events_read == 800 and first.events_folded == 800 and first.bad == 0
    assert first.snapshots == len(bank.versions) == first.aggregates
    for p in bank.partitions():  # right after a run, restore reads no events at all
        assert restore(bank.kafka, bank.agg, bank.domain, p).events_read == 0
    assert_restore_equals_full_replay(bank)
    bank.produce(50)
    second = _job(spark, bank)
    assert second.events_read == 50 and second.events_folded == 50  # incremental: only the new events
    assert 0 < second.snapshots <= 50  # only aggregates that changed get a new snapshot
    assert_restore_equals_full_replay(bank)
    assert_every_snapshot_true(bank)


KILLER = textwrap.dedent("""
    import os, signal, sys
    from tests.snapshots.snaphelpers import Bank, bank_aggregate, snapshot_partition
    from kafold.config import KafkaConfig
    from kafold.snapshot import kafka_io

    bank = Bank(KafkaConfig(bootstrap_servers=sys.argv[1]), bank_aggregate(sys.argv[2]))
    # Like a job task killed between its snapshot writes and its marker: half the snapshots, flushed, no marker.
    snapshot_partition(bank, 0, limit=int(sys.argv[3]))
    os.kill(os.getpid(), signal.SIGKILL)
""")


@pytest.mark.parametrize("engine", ["spark", "local"])
def test_a_job_killed_halfway_then_rerun_is_consistent_and_folds_nothing_twice(spark: Any, bank: Bank,
                                                                              engine: str) -> None:
    bank.produce(500)
    proc = subprocess.run([sys.executable, "-c", KILLER, bank.kafka.bootstrap_servers, bank.agg.name, "5"],
                          env=child_env(), capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == -9, proc.stderr
    left = snapshot_records(bank, 0)
    assert len(left) == 5 and not any(record.is_marker(k) for k, _, _ in left)
    # Restore after the crash is already correct: no marker, so the aggregates without snapshots are replayed.
    assert_restore_equals_full_replay(bank)
    bank.produce(40)
    job = (lambda: _job(spark, bank)) if engine == "spark" else (lambda: _local(bank))
    rerun = job()
    assert rerun.engine == engine and rerun.bad == 0 and rerun.rejected == {}
    assert_restore_equals_full_replay(bank)
    assert_every_snapshot_true(bank)
    again = job()  # nothing new: nothing folded, nothing written
    # (it may re-read events below an unchanged snapshot's offset and skip them: see REFRESH_LAG)
    assert again.events_folded == 0 and again.snapshots == 0


def test_auto_folds_a_small_increment_in_process_with_the_same_result(spark: Any, bank: Bank) -> None:
    """After a Spark run, an increment under local_max_events is folded without Spark: only the new events are
    read, and the snapshots it writes are as true as the Spark job's."""
    bank.produce(800)
    first = runs.run(bank.kafka, bank.agg, [BANK], lambda: spark, engine="auto", local_max_events=500)
    assert first.engine == "spark" and first.events_folded == 800  # 800 pending > 500: Spark
    bank.produce(60)
    second = runs.run(bank.kafka, bank.agg, [BANK], _no_spark, engine="auto", local_max_events=500)
    assert second.engine == "local"
    assert second.events_read == 60 and second.events_folded == 60 and 0 < second.snapshots <= 60
    assert second.partitions == bank.agg.partitions and second.bad == 0
    for p in bank.partitions():  # right after the local run, restore folds nothing (unchanged aggregates' older
        assert restore(bank.kafka, bank.agg, bank.domain, p).events_folded == 0  # snapshots: re-read, skipped)
    assert_restore_equals_full_replay(bank)
    assert_every_snapshot_true(bank)
    bank.produce(30)
    third = _job(spark, bank)  # and Spark carries on from the local run's snapshots and markers
    assert third.events_folded == 30 and third.events_read <= 60 + 30  # (re-reads the local run's range)
    assert_restore_equals_full_replay(bank)


@pytest.mark.parametrize("hint", ["recorded", "ahead", "behind", "zero"])
def test_the_progress_hint_only_moves_where_reading_starts(bank: Bank, hint: str) -> None:
    """A finished run records each partition's end under the readers' group (Kafka's tooling shows the events
    since as lag); the next plan fetches the events from there together with the snapshots. Whatever the hint
    says (true, past the end, before the snapshots, zero), the runs fold the same events and write true
    snapshots: what is folded is decided by the snapshots and markers alone."""
    bank.produce(300)
    first = _local(bank)
    events = bank.agg.topic("events")
    consumer = kafka_io.reader(bank.kafka)
    try:
        recorded = kafka_io.progress(consumer, events, bank.partitions())
        assert recorded == {row["partition"]: row["end"] for row in first.rows}
        if hint != "recorded":
            kafka_io.record_progress(consumer, events, {
                p: {"ahead": end + 1000, "behind": max(0, end - 30), "zero": 0}[hint] for p, end in recorded.items()})
    finally:
        consumer.close()
    bank.produce(40)
    planned = runs.plan(bank.kafka, bank.agg, bank.domain, bank.partitions())
    prefetched = sum(len(pre.offsets) for pre in planned.prefetched.values())
    assert prefetched == {"recorded": 40, "ahead": 0, "behind": 40 + 30 * len(recorded), "zero": 340}[hint]
    second = _local(bank)
    assert second.events_folded == 40 and second.bad == 0
    bank.produce(20)  # aggregates the second run did not touch keep older snapshots: the tail starts before it
    third = _local(bank)
    assert third.events_folded == 20 and third.events_read > 20 and third.bad == 0
    assert_restore_equals_full_replay(bank)
    assert_every_snapshot_true(bank)


def test_plan_counts_the_events_each_partition_still_has_to_fold(bank: Bank, monkeypatch: pytest.MonkeyPatch) -> None:
    """The planner's pending count is what a run will read; it stops early once past the limit."""
    bank.produce(300)
    planned = runs.plan(bank.kafka, bank.agg, bank.domain, bank.partitions())
    assert planned.events == 300 and set(planned.selections) == set(bank.partitions())
    assert runs.choose("auto", planned, 300) == "local" and runs.choose("auto", planned, 299) == "spark"
    assert runs.choose("spark", planned, 10**9) == "spark" and runs.choose("local", planned, 0) == "local"
    monkeypatch.setattr(runs, "PLAN_TOGETHER", 1)  # one partition at a time: the early stop is visible
    early = runs.plan(bank.kafka, bank.agg, bank.domain, bank.partitions(), stop_above=0)
    assert len(early.pending) == 1  # the first partition was already over the limit
    _local(bank)
    assert runs.plan(bank.kafka, bank.agg, bank.domain, bank.partitions()).events == 0
    bank.produce(25)
    assert runs.plan(bank.kafka, bank.agg, bank.domain, bank.partitions()).events == 25


def test_cli_run_folds_a_small_history_in_process_and_says_so(bank: Bank, tmp_path: Any,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """`kafold snapshot run` with the default engine (auto) starts no Spark for a small run; verify agrees."""
    from kafold.tools import cli

    bank.produce(120)
    toml = write_config(bank, tmp_path)
    agg = bank.agg
    assert cli.main(["snapshot", "run", "-c", str(toml)]) == 0
    out = capsys.readouterr().out
    row = next(line.split() for line in out.splitlines() if line.startswith(agg.name))
    assert row[1:4] == ["local", str(agg.partitions), "120"]  # engine, partitions, events folded
    assert "no Spark job needed" in out
    assert_restore_equals_full_replay(bank)
    assert cli.main(["snapshot", "verify", "-c", str(toml)]) == 0
    assert "0 mismatches" in capsys.readouterr().out
