"""Apache Kafka for the dev stack: a pinned broker fetched once with Maven, KRaft storage, one or three nodes."""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kafold import logs
from kafold.devstack import DevStackError, read_json, replication

log = logs.get(__name__)

POM = Path(__file__).with_name("pom.xml")
LOG4J = Path(__file__).with_name("log4j2.properties")
INSTALL_HINT = "apt-get install openjdk-17-jre-headless maven"
MIN_JAVA = 17
FETCH_TIMEOUT_S = 1800.0
FORMAT_TIMEOUT_S = 120.0
# A broker for development and tests on a small machine, not a production sizing.
JVM_OPTS = ("-Xms256m", "-Xmx512m", "-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20", "-XX:+ExitOnOutOfMemoryError",
            "-Djava.awt.headless=true")
CLUSTER_FILE = "cluster.json"


class ToolMissingError(DevStackError):
    """Java 17+ or Maven, which the Apache Kafka dev broker needs, is not installed."""


@dataclass(frozen=True)
class Node:
    """One KRaft node (broker and controller in one process) on loopback."""

    node_id: int
    port: int
    controller_port: int
    home: Path

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def properties(self) -> Path:
        return self.home / "server.properties"

    @property
    def data(self) -> Path:
        return self.home / "data"

    @property
    def log_file(self) -> Path:
        return self.home / "broker.log"


def version() -> str:
    """The pinned Apache Kafka version (from the shipped pom)."""
    found = re.search(r"<kafka\.version>([^<]+)</kafka\.version>", POM.read_text(encoding="utf-8"))
    return found.group(1) if found else "unknown"


def cache_dir() -> Path:
    """`$KAFOLD_CACHE_DIR`, else `$XDG_CACHE_HOME/kafold` (default `~/.cache/kafold`)."""
    if os.environ.get("KAFOLD_CACHE_DIR"):
        return Path(os.environ["KAFOLD_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "kafold"


def java() -> str:
    """The `java` on PATH, checked to be 17 or newer."""
    path = shutil.which("java")
    if path is None:
        raise ToolMissingError(f"Apache Kafka needs Java {MIN_JAVA}+ and no `java` is on PATH; install it: "
                               f"{INSTALL_HINT}")
    try:
        out = subprocess.run([path, "-version"], capture_output=True, text=True, timeout=60,
                             stdin=subprocess.DEVNULL, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ToolMissingError(f"{path} -version failed ({e}); install Java {MIN_JAVA}+: {INSTALL_HINT}") from e
    major = _java_major(out.stderr + out.stdout)
    if major < MIN_JAVA:
        raise ToolMissingError(f"Apache Kafka needs Java {MIN_JAVA}+, {path} is Java {major or 'unknown'}; "
                               f"install it: {INSTALL_HINT}")
    return path


def _java_major(text: str) -> int:
    """17 from 'openjdk version "17.0.15"', 8 from 'java version "1.8.0_392"'."""
    found = re.search(r'version "(\d+)(?:\.(\d+))?', text)
    if not found:
        return 0
    major = int(found.group(1))
    return int(found.group(2) or 0) if major == 1 else major


def libs() -> Path:
    """The broker's jars: copied from Maven Central into the cache on first use; later starts reuse them offline.

    The folder is named after the pom's digest, so a new pin fetches a new classpath and never mixes jars."""
    target = cache_dir() / "apache-kafka" / hashlib.sha256(POM.read_bytes()).hexdigest()[:12] / "libs"
    if (target / ".complete").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(target.parent / ".lock"):  # parallel test sessions fetch once
        if (target / ".complete").exists():
            return target
        mvn = shutil.which("mvn")
        if mvn is None:
            raise ToolMissingError(f"fetching Apache Kafka {version()} needs Maven and no `mvn` is on PATH; "
                                   f"install it: {INSTALL_HINT}")
        staging = target.with_name("libs.partial")
        shutil.rmtree(staging, ignore_errors=True)
        started = time.monotonic()
        log.info("apache_kafka.fetch.start", version=version(), into=str(target))
        # The goal's plugin version is the one pinned in the pom's <build>; -B -q: errors only, no progress bars.
        cmd = [mvn, "-B", "-q", "-f", str(POM), "dependency:copy-dependencies", f"-DoutputDirectory={staging}",
               "-DincludeScope=runtime"]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=FETCH_TIMEOUT_S,
                                  stdin=subprocess.DEVNULL, cwd=target.parent, check=False)
        except subprocess.TimeoutExpired as e:
            raise DevStackError(f"fetching Apache Kafka with Maven took over {FETCH_TIMEOUT_S:.0f}s") from e
        if done.returncode != 0 or not any(staging.glob("kafka_2.13-*.jar")):
            errors = [ln for ln in (done.stdout + done.stderr).splitlines() if "ERROR" in ln] or ["(no output)"]
            raise DevStackError(f"fetching Apache Kafka {version()} with Maven failed (exit {done.returncode}): "
                              f"{errors[0].strip()}")
        (staging / ".complete").write_text(version() + "\n", encoding="utf-8")
        shutil.rmtree(target, ignore_errors=True)
        staging.replace(target)
        log.info("apache_kafka.fetch.done", version=version(), seconds=round(time.monotonic() - started, 1))
    return target


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def classpath(jars: Path) -> str:
    return f"{jars}/*"  # the JVM expands the wildcard


# ---------------------------------------------------------------------------- cluster layout

def read_cluster(home: Path) -> dict[str, Any]:
    return read_json(home / CLUSTER_FILE, f"remove {home} to start a new cluster")


def new_cluster_id() -> str:
    """A random cluster id as Kafka's own `Uuid.randomUuid` makes them: base64url of 16 bytes, never starting with
    '-' (kafka-storage's argument parser reads such an id as an option: one id in 64 failed to format)."""
    while True:
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        if not cid.startswith("-"):
            return cid


def layout(home: Path, nodes: int, ports: list[tuple[int, int]], cluster_id: str | None = None) -> list[Node]:
    """The cluster's nodes, their properties written and the layout recorded (the cluster id outlives restarts:
    the formatted storage is bound to it)."""
    cid = cluster_id or new_cluster_id()
    out = [Node(i + 1, p, c, home / f"node-{i + 1}") for i, (p, c) in enumerate(ports[:nodes])]
    rf, min_isr = replication(nodes)
    voters = ",".join(f"{n.node_id}@127.0.0.1:{n.controller_port}" for n in out)
    for n in out:
        n.home.mkdir(parents=True, exist_ok=True)
        props = {
            "process.roles": "broker,controller",
            "node.id": n.node_id,
            "controller.quorum.voters": voters,  # static voters: ports may change between starts
            "listeners": f"PLAINTEXT://127.0.0.1:{n.port},CONTROLLER://127.0.0.1:{n.controller_port}",
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{n.port}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
            "log.dirs": n.data,
            "default.replication.factor": rf,
            "min.insync.replicas": min_isr,
            "offsets.topic.replication.factor": rf,
            "transaction.state.log.replication.factor": rf,
            "transaction.state.log.min.isr": min_isr,
            "share.coordinator.state.topic.replication.factor": rf,
            "share.coordinator.state.topic.min.isr": min_isr,
            # Development sizing: fewer internal partitions and threads start faster on a small machine; a
            # first group join need not wait for more members (production keeps Kafka's 3 s default); and
            # members may ask for session timeouts below Kafka's 6 s floor, so that tests which kill a member
            # see its partitions move within seconds.
            "offsets.topic.num.partitions": 10,
            "transaction.state.log.num.partitions": 10,
            "group.initial.rebalance.delay.ms": 0,
            "group.min.session.timeout.ms": 1000,
            # the same for the consumer group protocol (KIP-848), whose members cannot ask: its session timeout
            # and heartbeat interval are the broker's (production keeps Kafka's 45 s and 5 s)
            "group.consumer.min.session.timeout.ms": 1000,
            "group.consumer.session.timeout.ms": 6000,
            "group.consumer.min.heartbeat.interval.ms": 500,
            "group.consumer.heartbeat.interval.ms": 1000,
            # the log cleaner looks for compactable logs every second (Kafka's default waits 15 s), so that
            # compacted topics (snapshots, offsets) shed superseded records soon after a segment closes
            "log.cleaner.backoff.ms": 1000,
            "num.network.threads": 2,
            "num.io.threads": 2,
        }
        n.properties.write_text("".join(f"{k}={v}\n" for k, v in props.items()), encoding="utf-8")
    (home / CLUSTER_FILE).write_text(json.dumps({"cluster_id": cid, "nodes": nodes, "ports": ports[:nodes],
                                                 "version": version()}) + "\n", encoding="utf-8")
    return out


def format_storage(java_bin: str, jars: Path, cluster_id: str, nodes: list[Node]) -> None:
    """Format the KRaft storage of the nodes that have none yet (in parallel: one JVM each)."""
    todo = [n for n in nodes if not (n.data / "meta.properties").exists()]
    procs = [(n, subprocess.Popen(
        [java_bin, f"-Dlog4j2.configurationFile={LOG4J}", "-cp", classpath(jars), "kafka.tools.StorageTool",
         "format", f"--cluster-id={cluster_id}", "-c", str(n.properties)],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)) for n in todo]
    for n, p in procs:
        try:
            out, _ = p.communicate(timeout=FORMAT_TIMEOUT_S)
        except subprocess.TimeoutExpired as e:
            p.kill()
            raise DevStackError(f"formatting the storage of Kafka node {n.node_id} took over "
                              f"{FORMAT_TIMEOUT_S:.0f}s") from e
        if p.returncode != 0:
            raise DevStackError(f"formatting {n.data} failed: {(out.strip().splitlines() or ['(no output)'])[-1]}")


def start_node(java_bin: str, jars: Path, node: Node) -> subprocess.Popen[bytes]:
    """Start one node detached (its own session), its output appended to the node's broker.log."""
    with open(node.log_file, "ab") as out:
        return subprocess.Popen(
            [java_bin, *JVM_OPTS, f"-Dlog4j2.configurationFile={LOG4J}", "-cp", classpath(jars), "kafka.Kafka",
             str(node.properties)],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            close_fds=True)
