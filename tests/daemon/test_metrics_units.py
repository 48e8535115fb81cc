"""The daemon's metrics without a broker: counters that count what their names say, the aggregates' gate phases and
fold errors, the snapshot schedule's runs, consistency waits and the key ring of protected data."""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kafold import protect
from kafold.daemon.aggregates.gate import LIVE, RECOVERING, STOPPED
from kafold.daemon.metrics import DaemonMetrics
from kafold.daemon.progress import BatchStats
from kafold.snapshot.scheduler import SnapshotScheduler


def _samples(metrics: DaemonMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples}


def test_a_batch_counts_each_record_once_as_processed_skipped_or_dead_lettered() -> None:
    """10 records: 2 skipped, 3 dead-lettered (at decode or by the sink), so 5 processed, not 10."""
    metrics = DaemonMetrics(lambda: [])
    runner: Any = SimpleNamespace(connector=SimpleNamespace(name="sink"), task_id=0)
    metrics.observe(runner, BatchStats(records=10, put=8, dead_lettered=3, skipped=2, duration_s=0.01))
    got = _samples(metrics)
    key = (("connector", "sink"), ("task", "0"))
    assert got[("kafold_events_processed_total", key)] == 5
    assert got[("kafold_events_skipped_total", key)] == 2
    assert got[("kafold_dead_letters_total", key)] == 3


def test_aggregates_show_partitions_by_gate_phase_and_fold_errors() -> None:
    gates = {0: SimpleNamespace(phase=LIVE), 1: SimpleNamespace(phase=STOPPED), 2: SimpleNamespace(phase=LIVE)}
    runtime = SimpleNamespace(counts={"accepted": 4, "fold_errors": 1, "events_parked": 2}, gates=gates, store=None)
    metrics = DaemonMetrics(lambda: [], lambda: {"account": SimpleNamespace(runtime=runtime)})
    got = _samples(metrics)
    phases = {p: got[("kafold_aggregate_partitions", (("aggregate", "account"), ("phase", p)))]
              for p in (RECOVERING, LIVE, STOPPED)}
    assert phases == {RECOVERING: 0, LIVE: 2, STOPPED: 1}
    assert got[("kafold_aggregate_fold_errors_total", (("aggregate", "account"),))] == 1
    assert got[("kafold_aggregate_events_parked_total", (("aggregate", "account"),))] == 2


def test_scheduled_snapshot_runs_by_result_and_the_last_good_one() -> None:
    results = iter([0, 1, 0])
    sched = SnapshotScheduler(lambda: next(results), interval_s=60)
    metrics = DaemonMetrics(lambda: [], scheduler=lambda: sched)
    assert ("kafold_snapshot_last_success_timestamp_seconds", ()) not in _samples(metrics)  # none ran yet
    for _ in range(3):
        sched.run_once()
    got = _samples(metrics)
    assert got[("kafold_snapshot_runs_total", (("result", "ok"),))] == 2
    assert got[("kafold_snapshot_runs_total", (("result", "failed"),))] == 1
    assert sched.last_success_at is not None
    assert got[("kafold_snapshot_last_success_timestamp_seconds", ())] == sched.last_success_at


def test_build_info_and_the_process_collectors_are_exported() -> None:
    got = _samples(DaemonMetrics(lambda: []))
    build = [labels for name, labels in got if name == "kafold_build_info"]
    assert len(build) == 1 and dict(build[0])["version"] and dict(build[0])["librdkafka"]
    assert got[("process_cpu_seconds_total", ())] >= 0
    assert any(name == "python_info" for name, _ in got)


def test_consistency_waits_are_counted_by_result_and_timed() -> None:
    metrics = DaemonMetrics(lambda: [])
    metrics.waited("accounts", "covered", 0.004)
    metrics.waited("accounts", "timeout", 0.3)
    metrics.waited("accounts", "timeout", 0.3)
    got = _samples(metrics)
    assert got[("kafold_consistency_waits_total", (("connector", "accounts"), ("result", "covered")))] == 1
    assert got[("kafold_consistency_waits_total", (("connector", "accounts"), ("result", "timeout")))] == 2
    assert got[("kafold_consistency_wait_duration_seconds_count", (("connector", "accounts"),))] == 3
    assert got[("kafold_consistency_wait_duration_seconds_bucket", (("connector", "accounts"), ("le", "0.005")))] == 1


def test_the_key_ring_shows_keys_cached_store_reads_and_drops() -> None:
    """A miss reads the store once, a hit does not; an erasure seen drops the cache."""
    ring = protect.KeyRing(protect.Cipher(os.urandom(32)), protect.MemoryKeyStore())
    holder: dict[str, Any] = {"p": None}
    metrics = DaemonMetrics(lambda: [], protector=lambda: holder["p"])
    assert not any(name.startswith("kafold_privacy_") for name, _ in _samples(metrics))  # no [privacy] rules
    holder["p"] = protect.Protector({}, ring)
    ring.lookup("alice")
    ring.lookup("alice")
    ring.lookup("bob")
    got = _samples(metrics)
    assert got[("kafold_privacy_keys_cached", ())] == 2
    assert got[("kafold_privacy_key_store_reads_total", ())] == 2
    drops = got[("kafold_privacy_key_cache_drops_total", ())]  # the first look at the erasure mark counts as one
    ring.drop()
    got = _samples(metrics)
    assert got[("kafold_privacy_keys_cached", ())] == 0
    assert got[("kafold_privacy_key_cache_drops_total", ())] == drops + 1
