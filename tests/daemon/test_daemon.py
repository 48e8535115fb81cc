"""`kafold daemon`: runs the configured connectors through the registry and stops cleanly on SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from pathlib import Path

from kafold import config
from kafold.config import KafkaConfig
from kafold.envelope import encode
from kafold.tools.commands import daemon
from tests.support import committed, create_topic, kafka_toml, make_event, produce, wait_for

# The CLI module list names commands other engineers are still writing, so the test enters the daemon's
# handler directly, exactly as `kafold daemon -c FILE` does.
ENTRY = ("import argparse, sys; from kafold import logs; from kafold.tools.commands import daemon; "
         "logs.configure('info', 'json'); sys.exit(daemon.handle(argparse.Namespace(config=sys.argv[1])))")


def write_config(tmp_path: Path, kafka: KafkaConfig, unique: str, topic: str) -> Path:
    path = tmp_path / "kafold.toml"
    path.write_text(f"""
{kafka_toml(kafka)}
[daemon]
group_prefix = "{unique}"
http_port = 0  # no HTTP server: two daemons of parallel tests never meet on a port
shutdown_grace_s = 3.0
batch_max_wait_ms = 100

[[connectors]]
name = "audit"
class = "log"
topics = ["{topic}"]
config = {{ level = "info" }}
""")
    return path


def test_sigterm_stops_the_daemon_cleanly_after_committing(
        tmp_path: Path, kafka_config: KafkaConfig, unique: str) -> None:
    topic = f"{unique}.events"
    create_topic(kafka_config, topic)
    produce(kafka_config, topic, [(0, *encode(make_event("a", v))) for v in range(1, 6)])
    path = write_config(tmp_path, kafka_config, unique, topic)
    proc = subprocess.Popen([sys.executable, "-c", ENTRY, str(path)], stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: committed(kafka_config, f"{unique}.audit", topic, 1) == {0: 5},
                 "the daemon's commit")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=3.0 + 15)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert '"daemon.stop_requested"' in err and '"daemon.stopped"' in err


def test_run_returns_zero_when_stopped_in_process(tmp_path: Path, kafka_config: KafkaConfig,
                                                   unique: str) -> None:
    topic = f"{unique}.events"
    create_topic(kafka_config, topic)
    loaded = config.load_file(write_config(tmp_path, kafka_config, unique, topic))
    stop = threading.Event()
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(daemon.run(loaded.config, loaded.base, stop)))
    thread.start()
    produce(kafka_config, topic, [(0, *encode(make_event("a", 1)))])
    wait_for(lambda: committed(kafka_config, f"{unique}.audit", topic, 1) == {0: 1}, "the daemon's commit")
    stop.set()
    thread.join(30)
    assert result == [0]
