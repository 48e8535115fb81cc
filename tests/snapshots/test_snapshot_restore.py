"""restore(partition) against the real broker: snapshot + tail equals full replay; bad snapshots fall back."""

from __future__ import annotations

import pytest

from kafold import topics
from kafold.config import KafkaConfig, TopicSpec
from kafold.daemon.metrics import DaemonMetrics
from kafold.snapshot import Snapshot, restore
from kafold.snapshot.select import REJECTED
from tests.snapshots.snaphelpers import Bank, bank_aggregate, partition_of, snapshot_partition, write_raw


def test_restore_after_a_snapshot_replays_only_the_tail(bank: Bank) -> None:
    """The events read after a snapshot run are exactly those produced after it; state equals full replay."""
    bank.produce(400)
    ends = {p: snapshot_partition(bank, p) for p in bank.partitions()}
    bank.produce(60)
    for p in bank.partitions():
        fast = restore(bank.kafka, bank.agg, bank.domain, p)
        full = restore(bank.kafka, bank.agg, bank.domain, p, use_snapshots=False)
        # Counted against the end the fetch path reports (this broker's ListOffsets under-reports the end).
        assert fast.start == ends[p] and fast.events_read == full.end - ends[p]
        assert full.events_read == full.end and fast.events_read < full.events_read
        assert fast.snapshots_used > 0 and fast.rejected == {}
        assert fast.states == full.states
    assert sum(len(restore(bank.kafka, bank.agg, bank.domain, p).states) for p in bank.partitions()) == \
        len(bank.versions)


def test_aggregates_without_a_snapshot_are_found_in_the_tail(bank: Bank) -> None:
    bank.produce(100)
    snapshot_partition(bank, 0)
    bank.accounts = 60  # new accounts appear only after the snapshot
    bank.produce(200)
    fast = restore(bank.kafka, bank.agg, bank.domain, 0)
    assert fast.states == restore(bank.kafka, bank.agg, bank.domain, 0, use_snapshots=False).states


@pytest.mark.parametrize("defect", ["checksum", "fingerprint", "ahead", "out-of-order"])
def test_a_bad_snapshot_is_detected_never_used_and_restore_stays_correct(bank: Bank, defect: str) -> None:
    bank.produce(300)
    end = snapshot_partition(bank, 0)
    bank.produce(50)
    victim = next(a for a in sorted(bank.versions) if partition_of(a, bank.agg.partitions) == 0)
    ident = bank.domain.identity
    forged = Snapshot(ident.aggregate_type, victim, {"status": "open", "owner": "forged", "currency": "EUR",
                                                     "balance": 10**9}, 1, 0, end, ident.fingerprint, 1)
    if defect == "checksum":
        key, value, _ = forged.encode()
        value = value.replace(b"forged", b"FORGED")
    elif defect == "fingerprint":
        key, value, _ = forged._replace(fingerprint="some-other-fold").encode()
    elif defect == "ahead":
        key, value, _ = forged._replace(offset=end + 10_000).encode()
    else:  # an older snapshot (offset 1) arriving after the newer one
        key, value, _ = forged._replace(offset=1).encode()
    write_raw(bank, 0, key, value)
    before = REJECTED[(bank.agg.name, defect)]
    fast = restore(bank.kafka, bank.agg, bank.domain, 0)
    full = restore(bank.kafka, bank.agg, bank.domain, 0, use_snapshots=False)
    assert fast.rejected == {defect: 1}
    assert REJECTED[(bank.agg.name, defect)] == before + 1
    exposed = DaemonMetrics(list).render().decode()  # the daemon's /metrics shows it
    assert f'kafold_snapshots_rejected_total{{aggregate="{bank.agg.name}",reason="{defect}"}} {before + 1}.0' in exposed
    assert fast.states[victim] == full.states[victim] and fast.states[victim][0].owner != "forged"
    assert fast.states == full.states
    assert fast.start == end  # fell back to the older, intact snapshot of the victim: still only the tail


def test_verify_reports_a_wrong_snapshot_per_aggregate(bank: Bank) -> None:
    """A snapshot that is intact (right checksum and fingerprint) but wrong is caught by the audit."""
    from kafold.snapshot.verify import verify

    bank.produce(200)
    end = snapshot_partition(bank, 0)
    assert verify(bank.kafka, bank.agg, bank.domain, bank.partitions()).mismatches == []
    victim = next(a for a in sorted(bank.versions) if partition_of(a, bank.agg.partitions) == 0)
    ident = bank.domain.identity
    wrong = Snapshot(ident.aggregate_type, victim, {"status": "open", "owner": "x", "currency": "EUR",
                                                    "balance": 1}, bank.versions[victim], 0, end, ident.fingerprint, 1)
    write_raw(bank, 0, *wrong.encode()[:2])
    report = verify(bank.kafka, bank.agg, bank.domain, bank.partitions())
    assert [(m.aggregate_id, m.partition) for m in report.mismatches] == [(victim, 0)]
    assert "state differs" in report.mismatches[0].problem
    sampled = verify(bank.kafka, bank.agg, bank.domain, [0], sample=3)
    assert sampled.checked == 3


def test_runtime_restorer_hook_gives_snapshot_states_and_the_tail_start(bank: Bank) -> None:
    """SnapshotRestorer (the aggregate runtime's Restorer) returns the same bases and start as restore()."""
    from kafold.daemon.aggregates.restorer import SnapshotRestorer
    from kafold.domain import AggregateDomain
    from tests.snapshots.snaphelpers import BANK

    bank.produce(200)
    end = snapshot_partition(bank, 1)
    bank.produce(30)
    fast = restore(bank.kafka, bank.agg, bank.domain, 1)
    base = SnapshotRestorer(bank.kafka, bank.agg, AggregateDomain.load(bank.agg, [BANK])).restore(1, 0, fast.end)
    assert base.start == end == fast.start and base.snapshot_version == end
    assert len(base.states) == fast.snapshots_used > 0


def test_a_missing_snapshot_topic_means_a_full_replay_not_an_error(kafka_config: KafkaConfig, unique: str) -> None:
    """Before: reading the absent topic stalled, then failed the restore with RetriableError."""
    agg = bank_aggregate(unique)
    topics.ensure(kafka_config, [TopicSpec(agg.topic("events"), agg.partitions, 1, {})])  # no snapshot topic
    bank = Bank(kafka_config, agg)
    bank.produce(80)
    for p in bank.partitions():
        fast = restore(bank.kafka, bank.agg, bank.domain, p)
        full = restore(bank.kafka, bank.agg, bank.domain, p, use_snapshots=False)
        assert fast.snapshots_used == 0 and fast.events_read == full.events_read > 0
        assert fast.states == full.states
