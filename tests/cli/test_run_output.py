"""`kafold run` whatever its output is: a pipe whose reader exited (`make run | tee` after Ctrl-C) does not keep it
from stopping on SIGINT, and on a terminal the live view is not torn by log lines, snapshot runs' progress bars or
Spark's output (all of it goes to the file the view names)."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from kafold.config import DaemonConfig
from tests.support import ROOT, wait_for

GRACE_S = DaemonConfig().shutdown_grace_s + 30  # the daemon's grace, the dev stack's stop and a loaded machine


def start(tmp_path: Path, out: int, *, stdin: int = subprocess.DEVNULL,
          env_extra: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    # PYTHONFAULTHANDLER: a SIGABRT sent when it does not stop prints every thread's stack, for the failure message
    env = {**os.environ, "KAFOLD_DEV_DIR": str(tmp_path / "dev"), "PYTHONFAULTHANDLER": "1", **(env_extra or {})}
    for var in ("KAFOLD_KAFKA__BOOTSTRAP_SERVERS", "KAFOLD_POSTGRES__URL"):
        env.pop(var, None)
    return subprocess.Popen([sys.executable, "-m", "kafold.tools.cli", "run", "-c", str(ROOT / "examples" / "bank" /
                             "kafold.toml"), "--rate", "100", "--receiver-port", "0"],
                            env=env, stdout=out, stderr=out, stdin=stdin)


def read_until(fd: int, marker: bytes, timeout: float) -> bytes:
    seen, deadline = b"", time.monotonic() + timeout
    while marker not in seen:
        assert time.monotonic() < deadline, f"{marker!r} not printed in time; printed:\n{seen[-3000:]!r}"
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # a pty whose other side closed
            break
        if not chunk:
            break
        seen += chunk
    return seen


def read_for(fd: int, seconds: float) -> bytes:
    seen, deadline = b"", time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            try:
                seen += os.read(fd, 65536)
            except OSError:
                break
    return seen


def drain(fd: int) -> list[bytes]:
    """Read `fd` until it closes, as a terminal does: a pty nobody reads blocks its writer once its buffer fills,
    which would stop `kafold run` for a reason no user's terminal gives it."""
    got: list[bytes] = []

    def loop() -> None:
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                return
            if not chunk:
                return
            got.append(chunk)

    threading.Thread(target=loop, name="drain", daemon=True).start()
    return got


def stop_and_check(proc: subprocess.Popen[bytes], printed: list[bytes] | None = None) -> None:
    """SIGINT, then exit 0 within the grace and no process left; `printed` (what a drain read) goes into the message
    when it does not stop, with the stacks faulthandler prints on SIGABRT."""
    descendants = psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(GRACE_S)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        time.sleep(3)
        proc.kill()
        tail = b"".join(printed or []).decode(errors="replace")[-12000:]
        raise AssertionError(f"kafold run did not stop within {GRACE_S} s of SIGINT; it printed:\n{tail}") from None
    assert proc.returncode == 0
    _, alive = psutil.wait_procs(descendants, timeout=10)
    assert not alive, f"processes left behind: {[p.pid for p in alive]}"


@pytest.mark.integration
@pytest.mark.tansu  # `kafold run` on the embedded default's own stack
@pytest.mark.timeout(300)
def test_sigint_stops_kafold_run_after_the_reader_of_its_output_pipe_exited(tmp_path: Path) -> None:
    read_end, write_end = os.pipe()
    proc = start(tmp_path, write_end)
    os.close(write_end)
    try:
        read_until(read_end, b"Ctrl-C stops everything", 120)
        time.sleep(2)  # running, with log lines on the way
    finally:
        os.close(read_end)  # the reader is gone: every later write meets a closed pipe
    time.sleep(3)
    assert proc.poll() is None, "kafold run died of its closed output instead of waiting for a signal"
    stop_and_check(proc)


# What must never reach the terminal under the live view: a JSON or console log line, a snapshot run's progress bar
# or summary table, Spark's and log4j's output, a Python warning.
LEAKS = re.compile(r'"event"|\[info|\[warn|snapshot account|partitions ·|AGGREGATE +ENGINE|spark start-up|log4j|'
                   r"WARN |ERROR |INFO |SparkContext|Warning:|Traceback")


def read_while_draining(fd: int, until: Callable[[], bool], timeout: float) -> bytes:
    """What the terminal shows until `until()` holds (checked every second), reading it all the while."""
    seen, deadline = b"", time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline, f"not in time; the terminal showed:\n{seen[-3000:]!r}"
        seen += read_for(fd, 1.0)
    return seen


@pytest.mark.integration
@pytest.mark.tansu  # `kafold run` on the embedded default's own stack
@pytest.mark.timeout(400)
def test_on_a_terminal_the_live_view_stays_in_place_and_the_logs_go_to_the_file_it_names(tmp_path: Path) -> None:
    """A 160x45 terminal, a snapshot run every few hundred events: the terminal shows the view's frames only; the
    daemon's and the snapshot runs' lines are in the log file. (The runs fold in-process, as `make run`'s first
    minutes do: a Spark run's JVM writes to the same inherited descriptors, but takes minutes on a small machine.)"""
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 45, 160, 0, 0))
    proc = start(tmp_path, terminal, stdin=terminal, env_extra={"KAFOLD_SNAPSHOTS__EVERY_N_EVENTS": "300"})
    os.close(terminal)
    log_file = tmp_path / "run.log"

    def snapshot_runs() -> int:
        text = log_file.read_text() if log_file.exists() else ""
        return text.count('"snapshot.schedule.done"')  # the daemon's line after each child that succeeded

    printed: list[bytes] = []
    last: list[bytes] = []
    try:
        printed.append(read_until(controller, "kafold run — live".encode(), 120))  # the table's title
        printed.append(read_while_draining(controller, lambda: snapshot_runs() >= 2, 240))
        printed.append(read_for(controller, 5))  # the view redrawn after the runs
    finally:
        stop_and_check(proc, last := drain(controller))
        wait_for(lambda: b"dev stack stopped" in b"".join(last), "the stop printed", 10)
        os.close(controller)
    final = b"".join(last).decode(errors="replace").rsplit("kafold run — live", 1)[-1]
    assert "connector accounts" in final and "dev stack stopped" in final, final  # the last frame keeps its figures
    text = b"".join([*printed, *last]).decode(errors="replace")  # until the end, the stop included
    assert f"logs: {log_file}" in text
    after = text.split("logs: ", 1)[1]
    leak = LEAKS.search(after)
    around = after[max(0, leak.start() - 1500):][:3000] if leak else ""
    assert leak is None, f"{leak.group()!r} printed through the live view:\n{around}"
    assert "kafold run — live" in after and "snapshots written" in after
    lines = log_file.read_text().splitlines()
    assert any('"daemon.started"' in line for line in lines), lines[-20:]
    summary = next((line for line in lines if '"snapshot.summary"' in line), "no snapshot run's line in the log")
    assert '"events_folded"' in summary, summary
