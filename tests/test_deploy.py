"""Deployment files that can be checked offline: the systemd units pass systemd-analyze verify."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
UNITS = sorted((ROOT / "deploy" / "systemd").glob("*.service")) + sorted((ROOT / "deploy" / "systemd").glob("*.timer"))


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze missing: apt-get install systemd")
@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_systemd_unit_verifies(unit: Path, tmp_path: Path) -> None:
    """Each unit passes `systemd-analyze verify` with its ExecStart pointing at a real kafold."""
    kafold = Path(sys.executable).with_name("kafold")
    for other in UNITS:  # a timer verifies together with the service it triggers
        text = other.read_text().replace("/opt/kafold/venv/bin/kafold", str(kafold))
        (tmp_path / other.name).write_text(text)
    res = subprocess.run(["systemd-analyze", "verify", "--man=no", str(tmp_path / unit.name)],
                         capture_output=True, text=True, check=False)
    problems = [line for line in res.stderr.splitlines()
                if str(tmp_path) in line or "kafold" in line]  # ignore warnings about the host's own units
    assert res.returncode == 0 and not problems, res.stderr
