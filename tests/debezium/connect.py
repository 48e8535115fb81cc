"""A Kafka Connect standalone worker running Debezium's PostgreSQL source connector: assembled once with Maven from
the pom beside this file (cached by its digest beside the Apache Kafka dev broker's jars), started on the test
session's broker, killed or stopped by the test."""

from __future__ import annotations

import hashlib
import json
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kafold import logs
from kafold.tools.dev.apache_kafka import INSTALL_HINT, ToolMissingError, cache_dir, file_lock, java
from tests.support import free_port

log = logs.get(__name__)

POM = Path(__file__).with_name("pom.xml")
LOG4J = Path(__file__).with_name("log4j2.properties")
BUILD_TIMEOUT_S = 1800.0
READY_TIMEOUT_S = 120.0
PLUGIN = "debezium-connector-postgres"
# A worker for tests on a small shared machine: C1 only and the serial collector start it with the least CPU.
JVM_OPTS = ("-Xms128m", "-Xmx512m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1", "-XX:+ExitOnOutOfMemoryError",
            "-Djava.awt.headless=true")


def build() -> Path:
    """The folder holding `libs/` (the worker's classpath) and `plugins/` (Debezium's plugin, for plugin.path):
    assembled with Maven on first use, then reused offline. Named after the pom's digest: a new pin builds anew."""
    target = cache_dir() / "debezium-connect" / hashlib.sha256(POM.read_bytes()).hexdigest()[:12]
    dist = target / "dist"
    if (dist / ".complete").exists():
        return dist
    target.mkdir(parents=True, exist_ok=True)
    with file_lock(target / ".lock"):  # parallel test sessions build once
        if (dist / ".complete").exists():
            return dist
        mvn = shutil.which("mvn")
        if mvn is None:
            raise ToolMissingError(f"assembling Kafka Connect and Debezium needs Maven; install it: {INSTALL_HINT}")
        staging = target / "dist.partial"
        shutil.rmtree(staging, ignore_errors=True)
        started = time.monotonic()
        log.info("debezium_connect.build.start", into=str(dist))
        cmd = [mvn, "-B", "-q", "-f", str(POM), "dependency:copy-dependencies@worker",
               "dependency:unpack-dependencies@plugin", f"-Dkafold.libs={staging / 'libs'}",
               f"-Dkafold.plugins={staging / 'plugins'}"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, cwd=target,
                              stdin=subprocess.DEVNULL, check=False)
        if (done.returncode != 0 or not any((staging / "libs").glob("connect-runtime-*.jar"))
                or not any((staging / "plugins" / PLUGIN).glob(f"{PLUGIN}-*.jar"))):
            errors = [ln for ln in (done.stdout + done.stderr).splitlines() if "ERROR" in ln] or ["(no output)"]
            raise RuntimeError(f"assembling Kafka Connect and Debezium with Maven failed (exit {done.returncode}): "
                               f"{errors[0].strip()[:500]}")
        shutil.rmtree(staging / "maven", ignore_errors=True)
        (staging / ".complete").write_text(POM.read_text(encoding="utf-8"), encoding="utf-8")
        shutil.rmtree(dist, ignore_errors=True)
        staging.replace(dist)
        log.info("debezium_connect.build.done", seconds=round(time.monotonic() - started, 1))
    return dist


def _properties(values: Mapping[str, Any]) -> str:
    return "".join(f"{k}={v}\n" for k, v in values.items())


class ConnectWorker:
    """One standalone worker in `home` running one connector (`connector`, with its `name`). Offsets go to a file
    in `home`, flushed every `offset.flush.interval.ms`: a worker killed with SIGKILL starts again from the last
    flush and delivers the changes after it once more, as a real deployment does."""

    def __init__(self, dist: Path, home: Path, bootstrap: str, worker: Mapping[str, Any],
                 connector: Mapping[str, Any]) -> None:
        self.dist, self.home = dist, home
        self.port = free_port()
        self.name = str(connector["name"])
        self.worker = {
            "bootstrap.servers": bootstrap,
            "plugin.path": dist / "plugins",
            "offset.storage.file.filename": self.offsets_file,
            "listeners": f"http://127.0.0.1:{self.port}",
            **worker,
        }
        self.connector = dict(connector)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def offsets_file(self) -> Path:
        return self.home / "connect.offsets"

    @property
    def log_file(self) -> Path:
        return self.home / "connect.log"

    def start(self, timeout_s: float = READY_TIMEOUT_S) -> ConnectWorker:
        """Start the worker and wait until its connector's task runs."""
        self.home.mkdir(parents=True, exist_ok=True)
        (self.home / "worker.properties").write_text(_properties(self.worker), encoding="utf-8")
        (self.home / "connector.properties").write_text(_properties(self.connector), encoding="utf-8")
        cmd = [java(), *JVM_OPTS, f"-Dlog4j2.configurationFile={LOG4J}", f"-Dconnect.log.file={self.log_file}",
               "-cp", f"{self.dist / 'libs'}/*", "org.apache.kafka.connect.cli.ConnectStandalone",
               str(self.home / "worker.properties"), str(self.home / "connector.properties")]
        with open(self.home / "connect.out", "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         cwd=self.home, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while (state := self.state()) != "RUNNING":
            if self.proc.poll() is not None:
                raise RuntimeError(f"the Connect worker exited with {self.proc.returncode}; see {self.log_file}")
            if state == "FAILED" or time.monotonic() > deadline:
                raise RuntimeError(f"connector {self.name} is {state} after {timeout_s:.0f}s; see {self.log_file}")
            time.sleep(0.5)
        log.info("debezium_connect.started", connector=self.name, pid=self.proc.pid, port=self.port)
        return self

    def state(self) -> str | None:
        """The connector's task state from the REST API (RUNNING, FAILED, ...); None while it does not answer."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/connectors/{self.name}/status",
                                        timeout=5) as r:
                status = json.loads(r.read())
        except (urllib.error.URLError, OSError, ValueError):
            return None
        tasks = status.get("tasks") or []
        states = {status.get("connector", {}).get("state"), *(t.get("state") for t in tasks)}
        if "FAILED" in states:
            return "FAILED"
        return "RUNNING" if tasks and states == {"RUNNING"} else "STARTING"

    def kill(self) -> None:
        """SIGKILL: no offset flush, no clean stop of the replication stream."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
            log.info("debezium_connect.killed", connector=self.name)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM (the worker flushes its offsets and stops the task), then SIGKILL after `timeout_s`."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.info("debezium_connect.stopped", connector=self.name)
