"""The daemon triggers snapshot runs from its Faust/mode timer: due runs start, never two at once, none after stop."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from kafold import config
from kafold.daemon.host import DaemonHost
from kafold.snapshot.scheduler import SnapshotScheduler


def test_the_daemons_timer_runs_due_snapshots_one_at_a_time(tmp_path: Path) -> None:
    path = tmp_path / "kafold.toml"
    path.write_text('[kafka]\nbootstrap_servers = "127.0.0.1:9"\n[daemon]\nhttp_port = 0\n')  # no connector: no Kafka
    lock = threading.Lock()
    overlapped: list[bool] = []

    def job() -> int:  # a run longer than the interval: the timer must skip while it lasts
        overlapped.append(not lock.acquire(blocking=False))
        try:
            time.sleep(0.5)
        finally:
            lock.release()
        return 0

    loaded = config.load_file(path)
    stop = threading.Event()
    host = DaemonHost(loaded.config, loaded.base, stop)
    sched = host.scheduler = SnapshotScheduler(job, interval_s=0.1, poll_s=0.05)
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(host.run()), name="test-daemon")
    thread.start()
    deadline = time.monotonic() + 60
    while sched.runs < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    stop.set()
    thread.join(30)
    assert not thread.is_alive() and result == [0]
    assert sched.runs >= 3 and sched.failures == 0 and sched.stopped
    runs = sched.runs
    time.sleep(0.5)
    assert sched.runs <= runs + 1  # at most the run in progress at stop finishes; the timer starts no other
    assert overlapped and not any(overlapped)
