"""Sink tasks in child processes (`daemon.task_processes`): one interpreter per task, so a connector's tasks use cores.

A sink task is GIL-bound: one interpreter runs the runner's decoding and the writer's folding at about one core
(docs/benchmarks.md). With `task_processes = true` each task's SinkRunner runs in its own process, a fresh
interpreter (`python -c ...`, never a fork of a threaded parent holding librdkafka handles) talking to the parent
over a socket pair, with its own consumer — the same group, so the partitions split between the tasks exactly as
between threads — and its own PostgreSQL connection. The parent keeps a `RemoteRunner` per task: the same
attributes the daemon's views read from a SinkRunner (state, progress, counts, error), updated from the child's
status messages, and the same calls (stop, request_pause).

Note on offsets and commits: nothing moves across the pipe but status and requests. The child's runner commits
exactly as it does in a thread (PostgreSQL first, then Kafka, see daemon.runner and the projection's writer), so
a child that dies — kill -9 included — leaves what a crashed daemon leaves: the records after its last commit
are delivered again to whichever task gets the partitions, and the sinks' idempotence makes that harmless.
A child whose parent is gone (the pipe closes, kill -9 of the daemon included) stops its runner the graceful way:
it finishes or abandons its batch within the grace period, commits what is done and exits. SIGTERM and SIGINT sent
to the child itself (systemd signals the whole control group; Ctrl-C the foreground process group) do the same.
A child that exits by itself is a task that stopped by itself: the daemon fails fast (exit 1), as with threads.
kafold's migrations (`postgres.migrate_on_start`) run in the daemon before any task starts (daemon.host), never in a
child: children do not load SQLAlchemy and Alembic (~20 MB each).
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Protocol

from kafold import interpreter, logs, protect, tracing
from kafold.config import ConnectorConfig, DaemonConfig, KafkaConfig, PostgresConfig, RegistryConfig, TracingConfig
from kafold.connectors.api import Connector, TopicPartition
from kafold.connectors.registry import instantiate
from kafold.daemon.accounting import Account
from kafold.daemon.progress import BatchStats, PartitionProgress
from kafold.daemon.runner import SinkRunner
from kafold.errors import KafoldError

log = logs.get(__name__)

STATUS_INTERVAL_S = 0.25  # the child reports at least this often (and after every batch)
# Child interpreters started ahead (`prestart`, by `kafold daemon` before it imports Faust), each waiting for its
# spec; a RemoteRunner takes one before it starts a new one.
_PRESTARTED: list[tuple[subprocess.Popen[bytes], Connection]] = []


class TaskProcessError(KafoldError):
    """A task in a child process failed or its process died; `trace` is what Connect's status shows."""

    def __init__(self, message: str, trace: str) -> None:
        super().__init__(message)
        self.trace = trace


class ChildSpec(Protocol):
    """What a child process is sent first (picklable): it runs the child over the connection to its parent."""

    def run_child(self, conn: Connection) -> None: ...


@dataclass(frozen=True)
class TaskSpec:
    """What a child needs to build its task, all picklable: the connector is built again from its settings."""

    settings: ConnectorConfig
    base: Path
    python_path: tuple[str, ...]
    task_index: int  # which of connector.task_configs(tasks_max) this child runs
    tasks_max: int
    kafka: KafkaConfig
    postgres: PostgresConfig
    daemon: DaemonConfig
    log: tuple[str, str, str | None]
    registry: RegistryConfig | None = None  # [registry], for Schema Registry formats
    tracing: TracingConfig | None = None  # [tracing]: the child makes its own spans
    protect: protect.Setup | None = None  # protected fields: the child opens them with its own key ring

    def run_child(self, conn: Connection) -> None:
        child_main(conn, self)


@dataclass(frozen=True)
class Published:
    """A child's per-partition progress as its last report carried it (runner.ProgressView)."""

    snapshot: dict[TopicPartition, PartitionProgress]


class RemoteRunner:
    """The parent's view of a SinkRunner running in a child process; `run` starts the child and follows it."""

    def __init__(self, connector: Connector[Any], task_id: int, spec: TaskSpec) -> None:
        self.connector = connector
        self.spec = spec
        self.task_id = task_id
        self.group_id = f"{spec.daemon.group_prefix}.{connector.name}"
        self.progress = Published({})  # the child's last report, replaced whole
        self.counts: dict[str, int] = {"batches": 0, "records": 0, "dead_lettered": 0, "skipped": 0, "polls": 0,
                                       "assignments": 0, "rejoins": 0}
        self.on_batch: Any = None  # called with BatchStats in the parent's follower thread
        self.error: BaseException | None = None
        self.failed = self.started = self.stopped = self.api_paused = False
        self.last_poll = time.monotonic()
        self.task_status: dict[str, Any] = {}
        self.accounts: dict[TopicPartition, Account] = {}  # the child's offset accounting, as last reported
        self.pid: int | None = None
        self._state = "UNASSIGNED"
        self._conn: Connection | None = None
        self._lock = threading.Lock()
        self._stop_event = threading.Event()
        self._pause: bool | None = None
        # The child interpreter is running by now (`prestart`) or starts now, when the daemon builds its tasks: its
        # imports (~0.3-1 s) run while the daemon imports and boots Faust and applies the migrations; it builds
        # nothing before `run` sends its spec.
        self._spawned: tuple[subprocess.Popen[bytes], Connection] | None = (
            _PRESTARTED.pop() if _PRESTARTED else _spawn(f"{connector.name}#{task_id}"))

    @property
    def state(self) -> str:
        if self.failed and self.error is not None:
            return "FAILED"
        return self._state

    def stop(self) -> None:
        self._stop_event.set()
        self._send(("stop",))

    def request_pause(self, paused: bool) -> None:
        self._pause = paused
        self._send(("pause", paused))

    def _send(self, message: tuple[Any, ...]) -> None:
        with self._lock:
            if self._conn is None:
                return  # not started yet: `run` sends what was requested
            try:
                self._conn.send(message)
            except OSError:
                pass  # the child is gone; its end is handled by `run`

    def run(self) -> None:
        """Start the child and follow its reports until it exits (blocks; the TaskSlot's thread)."""
        spawned, self._spawned = self._spawned, None
        process, parent = spawned or _spawn(f"{self.connector.name}#{self.task_id}")
        try:
            parent.send(self.spec)
        except OSError:
            pass  # the child is gone already: followed below as a child that died
        self.pid = process.pid
        with self._lock:
            self._conn = parent
        if self._pause is not None:
            self._send(("pause", self._pause))
        if self._stop_event.is_set():
            self._send(("stop",))
        log.info("task.process_started", connector=self.connector.name, task=self.task_id, pid=self.pid)
        final = False
        try:
            while True:
                try:
                    message = parent.recv()
                except (EOFError, OSError):
                    break
                final = self._apply(message) or final
        finally:
            process.wait()
            with self._lock:
                self._conn = None
            parent.close()
        if not final:  # no last report: the process died (kill -9, OOM killer, a crash in C)
            self.failed = True
            self.error = TaskProcessError(f"task process {self.pid} exited with code {process.returncode}",
                                          f"task process exited with code {process.returncode}")
            log.error("task.process_died", connector=self.connector.name, task=self.task_id, pid=self.pid,
                      exitcode=process.returncode)
        self.stopped = True

    def _apply(self, message: dict[str, Any]) -> bool:
        """Take one status report; True when it is the child's last."""
        for stats in message.get("batches", ()):
            if self.on_batch is not None:
                self.on_batch(stats)
        self.counts = message["counts"]
        self.progress = Published(message["snapshot"])
        self.task_status = message.get("task_status", {})
        self.accounts = message.get("accounts", {})
        self.last_poll = message["last_poll"]  # CLOCK_MONOTONIC: one clock for every process of the machine
        self.started, self.api_paused, self._state = message["started"], message["api_paused"], message["state"]
        if message.get("error") is not None:
            kind, text = message["error"]
            self.error = TaskProcessError(text, f"{kind}: {text}")
            self.failed = True
        return bool(message.get("final"))


def in_processes(settings: ConnectorConfig, daemon: DaemonConfig) -> bool:
    """Whether the connector's tasks run as child processes: its own `task_processes`, else the daemon's."""
    return daemon.task_processes if settings.task_processes is None else settings.task_processes


def prestart(connectors: list[ConnectorConfig], daemon: DaemonConfig) -> None:
    """Start a child interpreter for each task that will run in a process (at most `tasks_max` a connector), before
    the daemon's own imports: they import in parallel with it. `release_prestarted` ends those left unused."""
    wanted = sum(c.tasks_max for c in connectors if in_processes(c, daemon))
    _PRESTARTED.extend(_spawn("kafold task") for _ in range(wanted - len(_PRESTARTED)))


def release_prestarted() -> None:
    """End the prestarted children no task took (a connector with fewer tasks than `tasks_max`): each sees its
    connection close before any spec and exits."""
    while _PRESTARTED:
        process, conn = _PRESTARTED.pop()
        conn.close()
        process.wait()


# A child never draws on a terminal, but structlog imports rich when it is installed (the CLI's tables need it), for
# its console renderer's tracebacks: ~8 MB of memory in every child (docs/benchmarks.md, issue 56). A None in
# sys.modules makes that import fail, and structlog falls back to plain tracebacks.
CHILD_SETUP = "import sys; sys.modules['rich'] = None"
_CHILD_MAIN = f"{CHILD_SETUP}; from kafold.daemon.task_process import main; main()"


def _spawn(label: str) -> tuple[subprocess.Popen[bytes], Connection]:
    """A child interpreter running `main`, waiting for its spec, and the parent's end of its connection. A plain
    subprocess rather than multiprocessing's spawn: no resource tracker process (~13 MB) and no re-import of the
    daemon's __main__ in the child. The label (connector#task, aggregate#worker) only names the process in `ps`."""
    ours, theirs = socket.socketpair()
    with theirs:
        process = subprocess.Popen([sys.executable, "-c", _CHILD_MAIN, str(theirs.fileno()), label],
                                   pass_fds=(theirs.fileno(),))
    return process, Connection(ours.detach())


def start_child(spec: ChildSpec, label: str) -> tuple[subprocess.Popen[bytes], Connection]:
    """A child started and sent its spec: the one way to start a child, also for the aggregates' worker processes
    (daemon.aggregates.workers). A child gone before the spec reached it is followed by its caller as one that died."""
    process, conn = _spawn(label)
    try:
        conn.send(spec)
    except OSError:
        pass
    return process, conn


def main() -> None:
    """The child's entry point: argv[1] is its end of the socket pair; the first message is its spec, which runs
    the child (a TaskSpec: a sink task; an aggregate's WorkerSpec: an aggregate worker)."""
    conn = Connection(int(sys.argv[1]))
    # Until its spec comes, a stop is the daemon's to give (the connection closes): SIGTERM / SIGINT sent to the
    # whole process group would otherwise end a prestarted child with a traceback, or as a task that died.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    try:
        spec = conn.recv()
    except (EOFError, OSError):  # the daemon stopped (or failed) before starting this task: nothing to do
        return
    spec.run_child(conn)


def child_main(conn: Connection, spec: TaskSpec) -> None:
    """The child process: build the task's SinkRunner, run it in a thread, report, follow the parent's requests."""
    logs.configure(*spec.log)
    sys.path[:0] = [p for p in spec.python_path if p not in sys.path]
    connector = instantiate(spec.settings, spec.base)
    if spec.tracing is not None:
        tracing.configure(spec.tracing)
    # the child's own Protector (its own key ring), built from the Setup it was sent, handed to its task's config
    protector = protect.build_setup(spec.protect) if spec.protect is not None else None
    task_config = connector.task_configs(spec.tasks_max)[spec.task_index].with_services(spec.kafka, spec.postgres,
                                                                                         protector)
    runner = SinkRunner(connector, task_config, kafka=spec.kafka, daemon=spec.daemon, registry=spec.registry)
    interpreter.set_up()  # as the daemon's process: whatever the task is, the same GC and switch interval
    batches: list[BatchStats] = []
    send_lock = threading.Lock()

    def report(final: bool = False) -> None:
        error = runner.error
        with send_lock:
            done = batches[:]
            del batches[:]
            conn.send({"state": runner.state, "started": runner.started, "api_paused": runner.api_paused,
                       "counts": dict(runner.counts), "snapshot": dict(runner.progress.snapshot),
                       "last_poll": runner.last_poll, "batches": done, "final": final,
                       "task_status": runner.task_status, "accounts": dict(runner.accounts),
                       "error": (type(error).__name__, str(error)) if error is not None else None})

    def on_batch(stats: BatchStats) -> None:
        with send_lock:
            batches.append(stats)
        try:
            report()
        except OSError:
            runner.stop()  # the parent is gone

    runner.on_batch = on_batch
    serve_parent(conn, name=f"kafold-{connector.name}-{spec.task_index}", run=runner.run, stop=runner.stop,
                 handlers={"pause": lambda paused: runner.request_pause(bool(paused))}, report=report,
                 failed=lambda: runner.failed)


def serve_parent(conn: Connection, *, name: str, run: Callable[[], None], stop: Callable[[], None],
                 handlers: Mapping[str, Callable[..., None]], report: Callable[[bool], None],
                 failed: Callable[[], bool]) -> None:
    """The loop of every child (a sink task, an aggregate worker): `run` in a thread named `name`, the parent's
    requests answered (("stop",) by `stop`, the others by `handlers`, called with the request's arguments),
    `report(False)` at least every STATUS_INTERVAL_S; when `run` returns, `report(True)` and the process exits with
    1 when `failed()`, else 0. A parent gone (the pipe closes, kill -9 of the daemon included) stops the child the
    graceful way, as SIGTERM or SIGINT sent to the child itself does (systemd signals the whole control group; Ctrl-C
    the foreground process group): its work ends or commits within the grace period before it exits."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop())
    thread = threading.Thread(target=run, name=name)
    thread.start()
    while thread.is_alive():
        try:
            if conn.poll(STATUS_INTERVAL_S):
                request = conn.recv()
                if request[0] == "stop":
                    stop()
                elif request[0] in handlers:
                    handlers[request[0]](*request[1:])
            report(False)
        except (EOFError, OSError):  # the parent is gone: stop as on SIGTERM, then exit
            stop()
            thread.join()
            return
    thread.join()
    try:
        report(True)
    except OSError:
        pass
    conn.close()
    tracing.shutdown()  # export the spans still buffered
    sys.exit(1 if failed() else 0)

