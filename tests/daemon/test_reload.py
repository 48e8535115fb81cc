"""SIGHUP and POST /reload: connectors added, removed and changed without dropping the process; a bad file changes
nothing."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from kafold.config import KafkaConfig
from kafold.testing import free_port
from tests.support import create_topic, wait_for

pytestmark = pytest.mark.integration


def _config(path: Path, kafka: KafkaConfig, unique: str, topic: str, port: int,
            connectors: dict[str, str]) -> None:
    blocks = "".join(f'\n[[connectors]]\nname = "{name}"\nclass = "log"\ntopics = ["{topic}"]\n'
                     f'config = {{ level = "{level}" }}\n' for name, level in connectors.items())
    path.write_text(f"""
[kafka]
bootstrap_servers = "{kafka.bootstrap_servers}"
session_timeout_ms = 6000
heartbeat_interval_ms = 1000

[daemon]
group_prefix = "{unique}"
http_port = {port}
shutdown_grace_s = 10.0
{blocks}""")


def _call(port: int, method: str, path: str) -> tuple[int, Any]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method,
                                 data=b"" if method == "POST" else None)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")
    except OSError:
        return 0, None


def _started(log: Path, connector: str, event: str = "runner.started") -> int:
    """How many times a task of `connector` started (its consumer subscribed), from the daemon's JSON log."""
    count = 0
    for line in log.read_text().splitlines():
        if line.startswith("{"):
            entry = json.loads(line)
            count += entry.get("event") == event and entry.get("connector") == connector
    return count


@pytest.mark.timeout(240)
def test_sighup_and_post_reload_apply_connector_changes_and_refuse_a_bad_file(
        kafka_config: KafkaConfig, unique: str, tmp_path: Path) -> None:
    topic = f"{unique}.events"
    create_topic(kafka_config, topic, 1)
    port, conf, log = free_port(), tmp_path / "kafold.toml", tmp_path / "daemon.log"
    _config(conf, kafka_config, unique, topic, port, {"a": "info", "b": "info"})
    with open(log, "ab") as out:
        daemon = subprocess.Popen([str(Path(sys.executable).parent / "kafold"), "--log-format", "json", "daemon",
                                   "-c", str(conf)], stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: _call(port, "GET", "/connectors") == (200, ["a", "b"]), "the daemon", 60)
        wait_for(lambda: _started(log, "a") == 1 and _started(log, "b") == 1, "both tasks started", 60)

        # SIGHUP: b removed, a changed (level), c added.
        _config(conf, kafka_config, unique, topic, port, {"a": "debug", "c": "info"})
        daemon.send_signal(signal.SIGHUP)
        wait_for(lambda: _call(port, "GET", "/connectors") == (200, ["a", "c"]), "the reload by SIGHUP", 60)
        wait_for(lambda: _started(log, "a") == 2 and _started(log, "c") == 1, "a restarted, c started", 60)
        assert _call(port, "GET", "/connectors/b/status")[0] == 404

        # POST /reload with an invalid file: 400 naming the problem, nothing changes.
        conf.write_text(conf.read_text().replace('level = "debug"', 'level = "loud"'))
        status, body = _call(port, "POST", "/reload")
        assert status == 400 and any("level" in p for p in body["problems"]), body
        daemon.send_signal(signal.SIGHUP)  # the same bad file by signal: logged, refused
        wait_for(lambda: "daemon.reload_refused" in log.read_text(), "the refusal in the log", 30)
        assert _call(port, "GET", "/connectors") == (200, ["a", "c"]) and daemon.poll() is None

        # POST /reload adding d: a and c are unchanged and keep running (not restarted).
        _config(conf, kafka_config, unique, topic, port, {"a": "debug", "c": "info", "d": "info"})
        status, body = _call(port, "POST", "/reload")
        assert status == 200 and body["added"] == ["d"] and body["unchanged"] == ["a", "c"], body
        # Stop only once d joined its group: a member leaving in the middle of its first join can stall the group
        # on the embedded broker (see docs/brokers.md).
        wait_for(lambda: _started(log, "d", "runner.partitions_assigned") == 1, "d started", 60)
        assert _started(log, "a") == 2 and _started(log, "c") == 1
        assert _call(port, "GET", "/connectors/a/status")[1]["connector"]["state"] == "RUNNING"
    finally:
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(30) == 0
