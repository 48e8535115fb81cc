"""Helpers for the daemon tests: test connectors, a config writer, and an in-process daemon with an HTTP client."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kafold.config import KafkaConfig
from kafold.daemon.host import DaemonHost
from tests.daemon.daemon_plugins import GATES, RECEIVED
from tests.support import ROOT, kafka_toml, wait_for
from tests.support.daemons import daemon_thread


def write_config(tmp_path: Path, kafka: KafkaConfig, unique: str, topic: str, *, port: int = 0,
                 connector: str = "log", config_toml: str = "{}", daemon_extra: str = "") -> Path:
    path = tmp_path / "kafold.toml"
    path.write_text(f"""
{kafka_toml(kafka)}
[daemon]
group_prefix = "{unique}"
http_port = {port}
shutdown_grace_s = 4.0
batch_max_records = 5
batch_max_wait_ms = 100
python_path = ["{ROOT}"]
{daemon_extra}

[[connectors]]
name = "sink"
class = "{connector}"
topics = ["{topic}"]
config = {config_toml}
""")
    return path


@dataclass
class Running:
    host: DaemonHost
    port: int
    token: str | None = None

    def call(self, method: str, path: str, token: str | None = "default") -> tuple[int, Any]:
        """(status, parsed JSON body or text or None)."""
        token = self.token if token == "default" else token
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", method=method,
                                     data=b"" if method in ("PUT", "POST") else None)
        if token:
            req.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(req, timeout=15) as resp:
                return resp.status, _parse(resp.read(), resp.headers.get("Content-Type", ""))
        except urllib.error.HTTPError as e:
            return e.code, _parse(e.read(), e.headers.get("Content-Type", ""))

    def get(self, path: str, token: str | None = "default") -> tuple[int, Any]:
        return self.call("GET", path, token)

    @property
    def runner(self) -> Any:
        return self.host.groups[0].slots[0].runner


def state_path(aggregate: str, aggregate_id: str, version: int) -> str:
    """`GET /aggregates/..` of a state once it has reached `version` (`?min_version`, the documented read of one's
    writes: a command's result is readable a moment before its owner has marked the transaction committed)."""
    return f"/aggregates/{aggregate}/{aggregate_id}?min_version={version}&timeout_ms=10000"


def get_json(port: int, path: str) -> tuple[int, Any]:
    """GET a daemon's `path` without a token: (status, JSON body); (0, None) while nothing listens."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")
    except OSError:
        return 0, None


def _parse(body: bytes, content_type: str) -> Any:
    if not body:
        return None
    return json.loads(body) if "json" in content_type else body.decode()


@contextmanager
def daemon_in_process(path: Path, token: str | None = None) -> Iterator[Running]:
    """Run `kafold daemon` on the config in a thread; stop it (and check it stopped cleanly) at the end."""
    RECEIVED.clear()
    with daemon_thread(path) as (host, _):
        running = Running(host, host.cfg.daemon.http_port, token)
        try:
            wait_for(lambda: _up(running), "the daemon's HTTP server")
            yield running
        finally:
            for gate in GATES.values():
                gate.release(1000)


def _up(running: Running) -> bool:
    try:
        return running.get("/health")[0] == 200
    except OSError:
        return False
