"""`kafold daemon -c FILE` as a process: SIGTERM finishes the in-flight batch, commits and exits 0; a failing task
stops the daemon with exit code 1."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from kafold.config import KafkaConfig
from kafold.envelope import encode
from tests.daemon.daemon_support import write_config
from tests.support import committed, create_topic, make_event, produce, wait_for

KAFOLD = [str(Path(sys.executable).parent / "kafold"), "--log-format", "json", "daemon", "-c"]
PLUGIN = "tests.daemon.daemon_plugins:PluginConnector"
GRACE_S = 4.0  # daemon.shutdown_grace_s in daemon_support.write_config


def test_sigterm_finishes_the_batch_commits_and_exits_0_within_the_grace_period(
        tmp_path: Path, kafka_config: KafkaConfig, unique: str) -> None:
    topic = f"{unique}.events"
    create_topic(kafka_config, topic)
    produce(kafka_config, topic, [(0, *encode(make_event("a", v))) for v in range(1, 61)])
    handled = tmp_path / "handled.txt"
    path = write_config(tmp_path, kafka_config, unique, topic, connector=PLUGIN,
                        config_toml=f'{{ record_file = "{handled}", delay_s = 0.3 }}')
    proc = subprocess.Popen([*KAFOLD, str(path)], stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: bool(committed(kafka_config, f"{unique}.sink", topic, 1).get(0, -1) > 0), "a commit")
        proc.send_signal(signal.SIGTERM)  # 5-record batches of 0.3 s each: one is in flight now
        _, err = proc.communicate(timeout=GRACE_S)  # the bound the daemon promises, not a measurement
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert '"daemon.stop_requested"' in err and '"daemon.stopped"' in err
    lines = handled.read_text().splitlines()
    offsets = [int(line.split()[1]) for line in lines]
    assert offsets == list(range(len(offsets))), "each record put once, in order"
    assert 0 < len(offsets) < 60, "the stop came mid-stream"
    # Everything put was committed (the in-flight batch was finished, not lost), and nothing beyond it.
    assert committed(kafka_config, f"{unique}.sink", topic, 1) == {0: len(offsets)}


def test_a_failing_task_stops_the_daemon_with_exit_code_1(
        tmp_path: Path, kafka_config: KafkaConfig, unique: str) -> None:
    topic = f"{unique}.events"
    create_topic(kafka_config, topic)
    produce(kafka_config, topic, [(0, *encode(make_event("a", 1)))])
    path = write_config(tmp_path, kafka_config, unique, topic, connector=PLUGIN, config_toml="{ fail = true }")
    proc = subprocess.run([*KAFOLD, str(path)], stderr=subprocess.PIPE, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "this test task always fails" in proc.stderr
    assert '"daemon.task_stopped_by_itself"' in proc.stderr
    assert committed(kafka_config, f"{unique}.sink", topic, 1) == {0: -1001}, "nothing committed past the failure"


def _catches_sigterm(pid: int) -> bool:
    """Whether the process has a handler for SIGTERM (its SigCgt mask in /proc), i.e. Python code installed one."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = next(int(line.split()[1], 16) for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(mask & (1 << (signal.SIGTERM - 1)))


def test_sigterm_while_the_daemon_is_still_starting_stops_it_gracefully_with_exit_0(
        tmp_path: Path, kafka_config: KafkaConfig, unique: str) -> None:
    topic = f"{unique}.events"
    create_topic(kafka_config, topic)
    path = write_config(tmp_path, kafka_config, unique, topic, connector=PLUGIN,
                        config_toml=f'{{ record_file = "{tmp_path / "handled.txt"}" }}')
    proc = subprocess.Popen([*KAFOLD, str(path)], stderr=subprocess.PIPE, text=True)
    try:
        # The first handler a daemon installs is the one for its start-up (the worker's own comes a second or more
        # later, after Faust's imports): SIGTERM as soon as one is there (polled every 5 ms).
        deadline = time.monotonic() + 30
        while not _catches_sigterm(proc.pid) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err  # not -15 (killed by the signal), not a KeyboardInterrupt traceback
    assert '"daemon.stop_requested"' in err and '"daemon.stopped"' in err
    assert "Traceback" not in err
    assert '"phase": "starting"' in err or '"phase":"starting"' in err, "the start-up's handler took it"
    assert '"daemon.start_skipped"' in err  # the signal came before the tasks: none started only to be stopped
