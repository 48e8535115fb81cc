"""`kafold run` whatever its output is: a pipe whose reader exited (`make run | tee` after Ctrl-C) does not keep it
from stopping on SIGINT, and on a terminal the live view is not torn by log lines (they go to the file it names)."""

from __future__ import annotations

import os
import pty
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from kafold.config import DaemonConfig
from tests.support import ROOT

GRACE_S = DaemonConfig().shutdown_grace_s + 30  # the daemon's grace, the dev stack's stop and a loaded machine


def start(tmp_path: Path, out: int) -> subprocess.Popen[bytes]:
    # PYTHONFAULTHANDLER: a SIGABRT sent when it does not stop prints every thread's stack, for the failure message
    env = {**os.environ, "KAFOLD_DEV_DIR": str(tmp_path / "dev"), "PYTHONFAULTHANDLER": "1"}
    for var in ("KAFOLD_KAFKA__BOOTSTRAP_SERVERS", "KAFOLD_POSTGRES__URL"):
        env.pop(var, None)
    return subprocess.Popen([sys.executable, "-m", "kafold.cli", "run", "-c", str(ROOT / "examples" / "bank" /
                             "kafold.toml"), "--rate", "100", "--receiver-port", "0"],
                            env=env, stdout=out, stderr=out, stdin=subprocess.DEVNULL)


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


@pytest.mark.integration
@pytest.mark.tansu  # `kafold run` on the embedded default's own stack
@pytest.mark.timeout(300)
def test_on_a_terminal_the_live_view_stays_in_place_and_the_logs_go_to_the_file_it_names(tmp_path: Path) -> None:
    controller, terminal = pty.openpty()
    proc = start(tmp_path, terminal)
    os.close(terminal)
    printed: list[bytes] = []
    try:
        printed.append(read_until(controller, "kafold run — live".encode(), 120))  # the table's title
        printed.append(read_for(controller, 15))  # the live view redrawn, meanwhile the daemon logs
    finally:
        stop_and_check(proc, drain(controller))
        os.close(controller)
    text = b"".join(printed).decode(errors="replace")
    log_file = tmp_path / "run.log"
    assert f"logs: {log_file}" in text
    after = text.split("logs: ", 1)[1]
    assert '"event"' not in after and "[info" not in after, after[-2000:]  # no log line through the table
    lines = log_file.read_text().splitlines()
    assert any('"daemon started"' in line for line in lines), lines[-20:]
