"""`kafold run` (what `make run` calls): stack up, topics, traffic through the daemon, clean Ctrl-C."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import psycopg
import pytest

from tests.support import ROOT


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.tansu  # `make run`'s smoke test: the embedded default's own stack
@pytest.mark.timeout(400)
def test_run_flows_events_and_stops_cleanly(tmp_path: Path) -> None:
    """Commands become events, reach the log connector, the projection and the webhook receiver; a snapshot is
    written (with Java); the live view reports them; SIGINT leaves no process."""
    env = {**os.environ, "KAFOLD_DEV_DIR": str(tmp_path / "dev")}
    for var in ("KAFOLD_KAFKA__BOOTSTRAP_SERVERS", "KAFOLD_POSTGRES__URL"):
        env.pop(var, None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "kafold.tools.cli", "--log-format", "json", "run", "-c",
         str(ROOT / "examples" / "bank" / "kafold.toml"), "--rate", "500"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out_lines: list[str] = []
    err_lines: list[str] = []
    readers = [threading.Thread(target=lambda s=s, into=into: into.extend(s), daemon=True)
               for s, into in ((proc.stdout, out_lines), (proc.stderr, err_lines))]
    for r in readers:
        r.start()
    stack_pids: list[int] = []
    descendants: list[psutil.Process] = []
    java = shutil.which("java") is not None
    try:
        deadline = time.monotonic() + 240

        def until(what: str, check: Callable[[], bool]) -> None:
            while not check():
                assert proc.poll() is None, f"kafold run exited early:\n{''.join(err_lines[-20:])}"
                assert time.monotonic() < deadline, f"{what}: not in time; last log lines:\n{''.join(err_lines[-25:])}"
                time.sleep(0.5)
                if not stack_pids and (tmp_path / "dev" / "stack.json").exists():
                    state = json.loads((tmp_path / "dev" / "stack.json").read_text())
                    stack_pids.extend(b["pid"] for b in [*state.get("brokers", []), state.get("postgres")] if b)
                descendants.extend(p for p in psutil.Process(proc.pid).children(recursive=True)
                                   if p not in descendants)

        def committed_batch() -> bool:
            # A batch may commit nothing when its partitions were revoked meanwhile (the groups are still
            # settling while the aggregate and the connectors join): wait for one that committed.
            # (An early batch may also report a partition still at offset 0: look on to a later one, not stop.)
            for line in list(err_lines):
                if line.startswith("{"):
                    e = json.loads(line)
                    if e.get("event") == "runner.batch" and e.get("put", 0) > 0 and e.get("committed") \
                            and all(offset > 0 for offset in e["committed"].values()):
                        return True
            return False

        until("a batch committed by a connector", committed_batch)

        def query(sql: str) -> int:
            url = json.loads((tmp_path / "dev" / "stack.json").read_text())["postgres_url"]
            with psycopg.connect(url) as conn:
                return int(conn.execute(sql).fetchone()[0])  # type: ignore[index]

        # Commands went through the aggregate into events, and the events into the `accounts` projection...
        until("a projection row", lambda: query("SELECT count(*) FROM pg_class WHERE relname = 'accounts'") > 0
              and query("SELECT count(*) FROM accounts") > 0)
        # ...and to the demo receiver through the webhook connector, as the ledger and the live view say.
        until("an effect delivered", lambda: query(
            "SELECT count(*) FROM kafold.effect_ledger WHERE connector = 'notify' AND status = 'succeeded'") > 0)
        until("the live view reporting deliveries", lambda: any(
            int((m.group(1) or "0").replace(",", "")) > 0
            for m in (re.search(r"effects delivered ([\d,]+)", line) for line in list(out_lines)) if m))
        if java:  # a snapshot job (Spark) runs after 5,000 new events and writes the snapshot topic
            until("a snapshot written", lambda: any(
                int(m.group(1).replace(",", "")) > 0
                for m in (re.search(r"snapshots ([\d,]+)", line) for line in list(out_lines)) if m))
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(90)
        for r in readers:
            r.join(10)
    out = "".join(out_lines)
    assert proc.returncode == 0, out + "".join(err_lines[-30:])
    assert "dev stack stopped" in out and "psql '" in out and "/metrics" in out
    assert stack_pids, "the dev stack was not recorded"
    left = [p for p in [*descendants, *(psutil.Process(pid) for pid in stack_pids if psutil.pid_exists(pid))]
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, f"processes left behind: {[p.pid for p in left]}"
