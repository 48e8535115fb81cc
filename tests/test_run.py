"""`kafold run` (what `make run` calls): stack up, topics, traffic through the daemon, clean Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import psycopg
import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.integration
@pytest.mark.slow
def test_run_flows_events_and_stops_cleanly(tmp_path: Path) -> None:
    """Commands become events, reach the log connector and the projection; SIGINT leaves no process."""
    env = {**os.environ, "KAFOLD_DEV_DIR": str(tmp_path / "dev")}
    for var in ("KAFOLD_KAFKA__BOOTSTRAP_SERVERS", "KAFOLD_POSTGRES__URL"):
        env.pop(var, None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "kafold.cli", "--log-format", "json", "run", "-c",
         str(ROOT / "examples" / "bank" / "kafold.toml"), "--rate", "500"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stack_pids: list[int] = []
    committed: dict[str, int] = {}
    try:
        deadline = time.monotonic() + 120
        assert proc.stderr is not None
        for line in proc.stderr:
            if not stack_pids and (tmp_path / "dev" / "stack.json").exists():
                state = json.loads((tmp_path / "dev" / "stack.json").read_text())
                stack_pids = [state[k]["pid"] for k in ("broker", "postgres") if k in state]
            if line.startswith("{"):
                entry = json.loads(line)
                # A batch may commit nothing when its partitions were revoked meanwhile (the groups are still
                # settling while the aggregate and both connectors join): wait for one that committed.
                if entry.get("event") == "batch" and entry.get("put", 0) > 0 and entry.get("committed"):
                    committed = entry["committed"]
                    break
            assert time.monotonic() < deadline, "no batch reached the log connector in time"
        assert committed and all(offset > 0 for offset in committed.values())
        assert stack_pids, "the dev stack was not recorded"
        # Commands went through the aggregate into events, and the events into the `accounts` projection.
        url = json.loads((tmp_path / "dev" / "stack.json").read_text())["postgres_url"]
        rows = 0
        while rows == 0 and time.monotonic() < deadline:
            with psycopg.connect(url) as conn:
                exists = conn.execute("SELECT to_regclass('public.accounts')").fetchone()
                rows = conn.execute("SELECT count(*) FROM accounts").fetchone()[0] if exists and exists[0] else 0
            time.sleep(0.5)
        assert rows > 0, "no projection row appeared"
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "dev stack stopped" in out
    assert not [p for p in stack_pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
