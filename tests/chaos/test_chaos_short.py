"""The short chaos run inside `make test`: >= 20 faults of every kind while the workload runs, every invariant checked.

The long run is `make chaos` (tests/chaos/run_chaos.py; figures in docs/reliability.md).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from chaos_harness import KINDS, Chaos

pytestmark = [pytest.mark.integration, pytest.mark.slow]


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
