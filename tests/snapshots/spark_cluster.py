"""A Spark standalone cluster on loopback for tests: a master and workers started with the pyspark wheel's own
`spark-class`, small memory, every process (executors and their Python workers included) stopped at the end."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil

from tests.support import free_port

START_TIMEOUT_S = 120.0  # two or three JVMs starting on a busy small machine
DAEMON_MEMORY = "256m"  # the master's and each worker's own heap
WORKER_MEMORY = "512m"  # what a worker offers its executors (apps ask for spark.executor.memory <= this)


@dataclass(frozen=True)
class Cluster:
    master_url: str  # spark://127.0.0.1:PORT
    procs: tuple[subprocess.Popen[bytes], ...]


def _spark_class() -> str:
    import pyspark

    return str(Path(pyspark.__file__).parent / "bin" / "spark-class")


def _alive_workers(ui_port: int) -> int:
    """How many workers the master counts alive (its web UI's JSON), 0 while it does not answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{ui_port}/json/", timeout=2) as r:
            return int(json.load(r).get("aliveworkers", 0))
    except (OSError, ValueError):
        return 0


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM each daemon (a worker kills its executors), then SIGKILL whatever of their trees is left."""
    tree: list[psutil.Process] = []
    for p in procs:
        with contextlib.suppress(psutil.Error):
            tree += [psutil.Process(p.pid), *psutil.Process(p.pid).children(recursive=True)]
    for p in reversed(procs):  # workers first, then the master
        with contextlib.suppress(ProcessLookupError):
            p.send_signal(signal.SIGTERM)
    _, alive = psutil.wait_procs(tree, timeout=20)
    for q in alive:
        with contextlib.suppress(psutil.Error):
            q.kill()
    psutil.wait_procs(alive, timeout=10)
    for p in procs:
        p.wait(10)


@contextlib.contextmanager
def standalone(state_dir: Path, workers: int = 2) -> Iterator[Cluster]:
    """A master and `workers` workers (one core each) on 127.0.0.1, ready (all workers registered) on entry."""
    from kafold.spark_jobs.session import find_java_home

    env = {**os.environ, "JAVA_HOME": os.environ.get("JAVA_HOME") or find_java_home(),
           "SPARK_LOCAL_IP": "127.0.0.1", "SPARK_DAEMON_MEMORY": DAEMON_MEMORY,
           "SPARK_LOG_DIR": str(state_dir), "SPARK_LOCAL_DIRS": str(state_dir / "local")}
    port, ui_port = free_port(), free_port()
    master_url = f"spark://127.0.0.1:{port}"
    procs: list[subprocess.Popen[bytes]] = []

    def start(name: str, *args: str) -> None:
        with open(state_dir / f"{name}.log", "ab") as out:
            procs.append(subprocess.Popen([_spark_class(), *args], env=env, stdin=subprocess.DEVNULL, stdout=out,
                                          stderr=subprocess.STDOUT, start_new_session=True))

    try:
        start("master", "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port", str(port),
              "--webui-port", str(ui_port))
        for i in range(workers):
            start(f"worker-{i + 1}", "org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1",
                  "--cores", "1", "--memory", WORKER_MEMORY, "--webui-port", str(free_port()),
                  "--work-dir", str(state_dir / f"work-{i + 1}"), master_url)
        deadline = time.monotonic() + START_TIMEOUT_S
        while _alive_workers(ui_port) < workers:
            dead = [p.args[1] for p in procs if p.poll() is not None]
            assert not dead, f"Spark {dead} exited during start-up; see the logs in {state_dir}"
            assert time.monotonic() < deadline, f"Spark's {workers} workers did not register within " \
                                                f"{START_TIMEOUT_S:.0f}s; see the logs in {state_dir}"
            time.sleep(0.5)
        yield Cluster(master_url, tuple(procs))
    finally:
        _stop(procs)
