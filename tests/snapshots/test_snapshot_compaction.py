"""Compaction for real: Apache Kafka's log cleaner removes superseded snapshots and run markers from the snapshot
topic; restores, `snapshot verify` and the next incremental run stay correct on what it leaves."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from kafold.config import KafkaConfig
from kafold.snapshot import record, restore
from kafold.spark_jobs import runs
from tests.snapshots.snaphelpers import (
    BANK,
    Bank,
    assert_restore_equals_full_replay,
    make_bank,
    snapshot_records,
    write_config,
)
from tests.snapshots.snaphelpers import assert_every_snapshot_true_at_its_offset as assert_every_snapshot_true

pytestmark = pytest.mark.apache_kafka

# The log cleaner never touches a partition's active segment: with `segment.ms` a segment rolls at the first
# write that comes this long after it opened, so each run's records leave the active segment at the next run's
# first write. A low dirty ratio makes any superseded record worth a cleaning pass (the broker's
# log.cleaner.backoff.ms sets how soon the cleaner looks again).
SEGMENT_MS = 1000
FAST_COMPACTION = {"cleanup.policy": "compact", "segment.ms": str(SEGMENT_MS), "min.cleanable.dirty.ratio": "0.01",
                   "min.compaction.lag.ms": "0"}
COMPACTION_WAIT_S = 60.0

Records = dict[int, list[tuple[bytes | None, bytes | None, int]]]


@pytest.fixture
def bank(kafka_config: KafkaConfig, unique: str, broker_kind: str) -> Bank:
    if broker_kind != "kafka":
        pytest.skip("needs a broker with a log cleaner (tansu never compacts): KAFOLD_TEST_BROKER=kafka")
    return make_bank(kafka_config, unique, FAST_COMPACTION)


def _no_spark() -> Any:
    raise AssertionError("this run should not have needed Spark")


def _run(bank: Bank, events: int) -> runs.JobResult:
    """Append `events`, then a snapshot run (in process), its first write at least a segment.ms after the last."""
    time.sleep(SEGMENT_MS / 1000 + 0.2)
    bank.produce(events)
    result = runs.run(bank.kafka, bank.agg, [BANK], _no_spark, engine="local")
    assert result.events_folded == events and result.bad == 0 and result.rejected == {}
    return result


def _all_records(bank: Bank) -> Records:
    return {p: snapshot_records(bank, p) for p in bank.partitions()}


def _markers(records: Records) -> dict[int, list[int]]:
    return {p: [offset for key, _, offset in recs if record.is_marker(key)] for p, recs in records.items()}


def _wait_for_cleaner(bank: Bank, gone: dict[int, int]) -> Records:
    """The snapshot partitions once the record at offset gone[p] of each partition p has been cleaned away."""
    deadline = time.monotonic() + COMPACTION_WAIT_S
    while True:
        now = _all_records(bank)
        left = {p for p, offset in gone.items() if any(o == offset for _, _, o in now[p])}
        if not left:
            return now
        assert time.monotonic() < deadline, f"the log cleaner did not compact partitions {sorted(left)} " \
                                            f"within {COMPACTION_WAIT_S:.0f}s"
        time.sleep(0.5)


def test_compaction_removes_superseded_snapshots_and_runs_stay_correct(bank: Bank, tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    from kafold.tools import cli

    first = _run(bank, 600)
    assert first.snapshots == len(bank.versions)
    # Two incremental runs: the second's first write closes the segment holding the first increment's records,
    # so the cleaner sees the first run's markers and snapshots superseded in closed segments.
    _run(bank, 60)
    before = _all_records(bank)  # complete: nothing superseded has left the active segment yet
    _run(bank, 60)
    for p, recs in _all_records(bank).items():  # the third run's records (the cleaner may already be at work)
        before[p] += [r for r in recs if r[2] > before[p][-1][2]]
    first_markers = {p: offsets[0] for p, offsets in _markers(before).items()}
    assert all(len(offsets) == 3 for offsets in _markers(before).values())

    after = _wait_for_cleaner(bank, first_markers)  # the first run's marker has gone: the cleaner has been
    for p in bank.partitions():  # through every partition
        kept = {offset for _, _, offset in after[p]}
        latest = {key: offset for key, _, offset in before[p]}  # log order: the last offset per key wins
        assert len(after[p]) < len(before[p])  # reading from the beginning yields fewer records
        assert set(latest.values()) <= kept  # Kafka keeps each key's latest record
        # ... and what it removed was superseded: a later record with the same key was written
        removed = [(key, offset) for key, _, offset in before[p] if offset not in kept]
        assert removed and all(latest[key] > offset for key, offset in removed)
        assert _markers(after)[p][-1] == _markers(before)[p][-1]  # the latest run's marker is there

    for p in bank.partitions():  # the runs left nothing to fold: restore folds no event
        assert restore(bank.kafka, bank.agg, bank.domain, p).events_folded == 0
    assert_restore_equals_full_replay(bank)
    assert cli.main(["snapshot", "verify", "-c", str(write_config(bank, tmp_path))]) == 0
    assert "0 mismatches" in capsys.readouterr().out

    _run(bank, 40)  # incremental on the compacted topic: only the new events are folded
    assert_restore_equals_full_replay(bank)
    assert_every_snapshot_true(bank)
