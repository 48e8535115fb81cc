"""The short chaos run inside `make test`: >= 20 faults of every kind while the workload runs, every invariant checked.

The long run is `make chaos` (tests/chaos/run_chaos.py; figures in docs/reliability.md).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.chaos.chaos_harness import KINDS, Chaos, kinds_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.tansu  # the harness's own stack on the embedded default, every kind of fault Spark's included
@pytest.mark.timeout(900)
def test_short_chaos_run_keeps_every_invariant(tmp_path: Path) -> None:
    spark = shutil.which("java") is not None
    chaos = Chaos(tmp_path, seed=11, pause_s=(2.0, 4.0), spark=spark)
    try:
        chaos.run(seconds=150, fault_every_s=4.0, items_per_s=300, commands_per_s=30)
        report = chaos.check(settle_timeout=240)
    finally:
        chaos.close()
    print(report.text())
    kinds = [k for k in KINDS if spark or k != "snapshot-kill"]
    assert sum(report.faults.values()) >= 20, report.text()
    assert set(report.faults) == set(kinds), report.text()  # every kind at least once
    assert report.events > 10_000 and report.commands > 1_000, report.text()
    assert len(report.invariants) >= 7, report.text()
    assert report.violations == [], report.text()


@pytest.mark.apache_kafka
@pytest.mark.timeout(900)
@pytest.mark.parametrize("group_protocol", ["classic", "consumer"])
def test_short_chaos_run_on_apache_kafka_with_broker_faults(tmp_path: Path, broker_kind: str, group_protocol: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The same on a three-node Apache Kafka cluster, each kind once at least, the broker faults included (kill -9
    of a broker, of a partition leader, a paused controller, all three nodes restarted); Spark's snapshot-kill is
    left to the run above. Once per consumer group protocol ([kafka] group_protocol, KIP-848's `consumer` too)."""
    if broker_kind != "kafka":
        pytest.skip("the broker faults need the three-node Apache Kafka cluster (KAFOLD_TEST_BROKER=kafka)")
    monkeypatch.setenv("KAFOLD_KAFKA__GROUP_PROTOCOL", group_protocol)  # read by the daemon the harness starts
    kinds = kinds_for("kafka", spark=False)
    chaos = Chaos(tmp_path, seed=13, pause_s=(2.0, 4.0), spark=False, broker="kafka")
    report, strict = chaos.run_strict(seconds=45, fault_every_s=2.0, items_per_s=300, commands_per_s=30,
                                      min_faults=len(kinds))
    assert set(report.faults) == set(kinds), report.text()
    assert report.faults["broker-kill"] >= 1 and report.faults["cluster-restart"] >= 1, report.text()
    assert report.events > 5_000 and report.commands > 500, report.text()
    assert report.violations == [], report.text()
    assert strict == [], strict
