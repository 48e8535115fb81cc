"""A real Schema Registry for the dev stack and tests: Apicurio Registry built once from Maven Central, run in memory.

Apicurio publishes its server only as a Quarkus application jar (no `-runner` jar on Maven Central), which cannot
run from a plain classpath: the shipped pom re-augments it with the Quarkus Maven plugin into a runner jar and its
`lib/`, once per pom digest, in the same cache as the Apache Kafka dev broker. Its storage is in
memory (H2): a restarted registry has forgotten every schema, see `Registry.restart`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from kafold import logs
from kafold.devstack import DevStackError
from kafold.tools.dev.apache_kafka import INSTALL_HINT, ToolMissingError, cache_dir, file_lock, java

log = logs.get(__name__)

POM = Path(__file__).with_name("pom.xml")
PRODUCER = Path(__file__).with_name("DynamicConfigProducer.java")
RUNNER = "apicurio-registry-runner.jar"
BUILD_TIMEOUT_S = 1800.0
READY_TIMEOUT_S = 180.0
CCOMPAT_PATH = "/apis/ccompat/v7"
JVM_OPTS = ("-Xms128m", "-Xmx384m", "-XX:+UseSerialGC", "-XX:+ExitOnOutOfMemoryError", "-Djava.awt.headless=true")


def version() -> str:
    """The pinned Apicurio Registry version (from the shipped pom)."""
    found = re.search(r"<apicurio\.version>([^<]+)</apicurio\.version>", POM.read_text(encoding="utf-8"))
    return found.group(1) if found else "unknown"


def app() -> Path:
    """The built runner jar (its jars in `lib/` beside it): built with Maven into the cache on first use; later
    starts reuse it offline. The folder is named after the digest of the pom and the producer source."""
    digest = hashlib.sha256(POM.read_bytes() + PRODUCER.read_bytes()).hexdigest()[:12]
    target = cache_dir() / "apicurio-registry" / digest
    runner = target / "app" / RUNNER
    if (target / ".complete").exists():
        return runner
    target.mkdir(parents=True, exist_ok=True)
    with file_lock(target / ".lock"):  # parallel test sessions build once
        if (target / ".complete").exists():
            return runner
        mvn = shutil.which("mvn")
        if mvn is None:
            raise ToolMissingError(f"building Apicurio Registry {version()} needs Maven and no `mvn` is on PATH; "
                                   f"install it: {INSTALL_HINT}")
        work = target / "build"
        shutil.rmtree(work, ignore_errors=True)
        src = work / "src" / "main" / "java" / "io" / "kafold" / "dev" / "registry"
        src.mkdir(parents=True)
        shutil.copy(POM, work / "pom.xml")
        shutil.copy(PRODUCER, src / PRODUCER.name)
        started = time.monotonic()
        log.info("registry_server.build.start", version=version(), into=str(target))
        try:
            out = subprocess.run([mvn, "-B", "-q", "package"], capture_output=True, text=True,
                                 timeout=BUILD_TIMEOUT_S, cwd=work, stdin=subprocess.DEVNULL, check=False)
        except subprocess.TimeoutExpired as e:
            raise DevStackError(f"building Apicurio Registry with Maven took over {BUILD_TIMEOUT_S:.0f}s") from e
        built = list((work / "target").glob("*-runner.jar"))
        if out.returncode != 0 or not built or not (work / "target" / "lib").is_dir():
            errors = [ln for ln in (out.stdout + out.stderr).splitlines() if "ERROR" in ln] or ["(no output)"]
            raise DevStackError(f"building Apicurio Registry {version()} with Maven failed (exit "
                                f"{out.returncode}): {errors[0].strip()[:500]}")
        staging = target / "app.partial"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        built[0].replace(staging / RUNNER)
        (work / "target" / "lib").replace(staging / "lib")  # the runner's manifest names lib/...
        shutil.rmtree(target / "app", ignore_errors=True)
        staging.replace(target / "app")
        shutil.rmtree(work, ignore_errors=True)
        (target / ".complete").write_text(version() + "\n", encoding="utf-8")
        log.info("registry_server.build.done", version=version(), seconds=round(time.monotonic() - started, 1))
    return runner


class Registry:
    """One Apicurio Registry process on loopback `port`, in-memory storage, its log in `home`."""

    def __init__(self, home: Path, port: int) -> None:
        self.home, self.port = home, port
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The Confluent-compatible API, what `[registry] url` takes."""
        return f"http://127.0.0.1:{self.port}{CCOMPAT_PATH}"

    @property
    def log_file(self) -> Path:
        return self.home / "registry.log"

    def start(self, timeout_s: float = READY_TIMEOUT_S) -> Registry:
        """Start the process and wait until its health check says ready."""
        runner = app()
        self.home.mkdir(parents=True, exist_ok=True)
        cmd = [java(), *JVM_OPTS, f"-Dquarkus.http.port={self.port}", "-Dquarkus.http.host=127.0.0.1",
               "-Dquarkus.log.level=INFO", "-jar", str(runner)]
        with open(self.log_file, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         cwd=self.home, start_new_session=True)
        self.wait_ready(timeout_s)
        log.info("registry_server.started", url=self.url, pid=self.proc.pid)
        return self

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise DevStackError(f"Apicurio Registry exited with {self.proc.returncode} while starting; see "
                                    f"{self.log_file}")
            try:
                with urllib.request.urlopen(f"{self.url}/subjects", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise DevStackError(f"Apicurio Registry not ready on port {self.port} after {timeout_s:.0f}s; see "
                                    f"{self.log_file}")
            time.sleep(0.5)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM, then SIGKILL after `timeout_s`."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.info("registry_server.stopped", port=self.port)

    def restart(self) -> Registry:
        """Start again on the same port. In-memory storage: every schema is gone and ids start over, so a caller
        that needs the old ids re-registers the same schemas in the same order."""
        self.stop()
        return self.start()


def free_port() -> int:
    # kafold.tools.dev.stack imports psutil (kafold[daemon]): only a test registry asks for a port
    from kafold.tools.dev import stack as devstack

    return devstack.free_port()


def start(home: Path, port: int | None = None) -> Registry:
    """A registry in `home` on `port` (default a free one), started and ready."""
    return Registry(home, port or free_port()).start()


# ---------------------------------------------------------------------------- `kafold dev up --registry`

DEV_FILE = "registry.json"


def dev_up(state_dir: Path) -> str:
    """The dev stack's registry (started detached unless it runs); its URL. Its pid and port are in the state dir."""
    home = state_dir / "registry"
    running = dev_url(state_dir)
    if running:
        return running
    reg = Registry(home, free_port()).start()
    assert reg.proc is not None
    (home / DEV_FILE).write_text(json.dumps({"pid": reg.proc.pid, "port": reg.port}), encoding="utf-8")
    return reg.url


def dev_url(state_dir: Path) -> str | None:
    """The URL of the dev stack's registry if it runs."""
    info = _dev_info(state_dir)
    return Registry(state_dir / "registry", int(info["port"])).url if info else None


def dev_down(state_dir: Path) -> bool:
    """Stop the dev stack's registry; True if it ran."""
    info = _dev_info(state_dir)
    (state_dir / "registry" / DEV_FILE).unlink(missing_ok=True)
    if info is None:
        return False
    pid = int(info["pid"])
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if _alive(pid):
        os.kill(pid, signal.SIGKILL)
    return True


def _dev_info(state_dir: Path) -> dict[str, Any] | None:
    path = state_dir / "registry" / DEV_FILE
    if not path.exists():
        return None
    info: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return info if _alive(int(info["pid"])) else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:  # a zombie is not running
            return fh.read().split(") ", 1)[1][:1] != "Z"
    except (OSError, IndexError):
        return False
