"""Aggregate worker processes (`daemon.aggregate_processes` > 1): one aggregate decided on several cores by one daemon.

Each worker is a child interpreter (started as the sink task processes are: daemon.task_process.start_child) that
runs a whole `AggregateRuntime` in the aggregate's one consumer group, so the commands partitions split between the
workers exactly as between daemons, each with its catch-up gates and its local state stores (`state_dir`: one
folder per partition, so a partition moving to another worker of the host opens the store its last owner sealed).
Started together, the workers go through one start-up (startup.py: its phases and its one deadline): they join the
group together (each waits, built, for the others: `_joins`) and decide only once each has had its first assignment
(`_merge`), so no partition is decided by one right after the start and moved to another at once (its new owner
would replay it). The parent keeps `AggregateWorkers`, the view the daemon
reads (gates, counts, readiness, figures: reported after every batch and at least every STATUS_INTERVAL_S) and
the reads it serves (`get`: asked of the worker that holds the partition, over the pipe).

Offsets and commits: nothing moves across the pipe but status and reads. Each worker commits its batches in its
own transactions, with its own transactional id (worker 0: the instance's, so going from one process to several
keeps it; worker k: `<instance>.w<k>`), stable across restarts so a restarted worker's `init_transactions` aborts
what its killed predecessor left open. A worker that dies (kill -9, the OOM killer) is started again; meanwhile
the group gives its partitions to the others once its session times out, and their gates wait for its open
transaction to end (gate.py's offset note): exactly once holds as across daemons. A worker whose runtime failed
(it reported an error) fails the aggregate, as the runtime in a thread does: the daemon fails fast.
"""

from __future__ import annotations

import itertools
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from kafold import interpreter, logs, protect, tracing
from kafold.config import AggregateConfig, DaemonConfig, KafkaConfig, TracingConfig
from kafold.daemon.aggregates.gate import PartitionGate
from kafold.daemon.aggregates.restorer import SnapshotRestorer
from kafold.daemon.aggregates.runtime import AggregateRuntime
from kafold.daemon.aggregates.startup import Phase, StartUp
from kafold.daemon.task_process import STATUS_INTERVAL_S, serve_parent, start_child
from kafold.domain import AggregateDomain
from kafold.errors import FatalError
from kafold.partitioning import partition_for

log = logs.get(__name__)

READ_TIMEOUT_S = 10.0  # a read asked of a worker that does not answer in this time is answered "unknown here"
RESTART_DELAY_S = 1.0  # before a dead worker is started again


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker process needs to build its runtime, all picklable: the domain is loaded again in the child."""

    kafka: KafkaConfig
    daemon: DaemonConfig
    agg: AggregateConfig
    base: Path
    instance_id: str  # this worker's: its transactional id's last part
    log: tuple[str, str, str | None]
    tracing: TracingConfig | None = None
    protect: protect.Setup | None = None
    consumer_extra: dict[str, Any] = field(default_factory=dict)

    def run_child(self, conn: Connection) -> None:
        worker_main(conn, self)


def worker_instance_id(instance_id: str, worker: int) -> str:
    return instance_id if worker == 0 else f"{instance_id}.w{worker}"


@dataclass
class WorkerReport:
    """A worker's last status report."""

    gates: list[PartitionGate] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    figures: dict[str, float] = field(default_factory=dict)
    ready: bool = False
    joined: bool = False  # had its first assignment (perhaps an empty one)


class Worker:
    """One worker process, followed by a thread of the parent; started again when it dies without a last report."""

    def __init__(self, index: int, spec: WorkerSpec, on_report: Any, on_joining: Any) -> None:
        self.index, self.spec, self.on_report, self.on_joining = index, spec, on_report, on_joining
        # Its start as the parent knows it (startup.py): JOINING once it said it is built, HOLDING once let into the
        # group (AggregateWorkers._joins), DECIDING once told it may decide (_merge)
        self.phase = Phase.BUILDING
        self.report = WorkerReport()
        self.counted: dict[str, int] = {}  # counts of the worker's earlier processes (a counter never goes back)
        self.restarts = 0
        self.pid: int | None = None
        self.error: FatalError | None = None
        self.alive = self.report_seen = False
        self.stopping = threading.Event()
        self.conn: Connection | None = None
        self.lock = threading.Lock()
        self.asked: dict[int, Future[Any]] = {}
        self.ids = itertools.count()
        self.thread = threading.Thread(target=self._follow, daemon=True,
                                       name=f"kafold-aggregate-{spec.agg.name}-w{index}")

    @property
    def counts(self) -> dict[str, int]:
        return {k: self.counted.get(k, 0) + self.report.counts.get(k, 0)
                for k in {*self.counted, *self.report.counts}}

    def send(self, message: tuple[Any, ...]) -> bool:
        with self.lock:
            if self.conn is None:
                return False
            try:
                self.conn.send(message)
                return True
            except OSError:
                return False  # gone: its end is handled by `_follow`

    def ask(self, aggregate_id: str) -> Any:
        """The worker's runtime's `get(aggregate_id)`, None when it does not answer in time."""
        future: Future[Any] = Future()
        n = next(self.ids)
        self.asked[n] = future
        try:
            if not self.send(("get", n, aggregate_id)):
                return None
            return future.result(READ_TIMEOUT_S)
        except TimeoutError:
            return None
        finally:
            self.asked.pop(n, None)

    def _follow(self) -> None:
        while not self.stopping.is_set():
            final = self._run_once()
            if final or self.stopping.is_set():
                return
            if not self.report_seen:  # died before its first report (a start that cannot succeed): no restart loop
                self.error = FatalError(f"aggregate worker {self.index} (pid {self.pid}) exited before it started")
                return
            self.restarts += 1
            self.counted = self.counts
            self.report = WorkerReport()
            self.on_report(self)
            log.error("aggregate.worker_died", aggregate=self.spec.agg.name, worker=self.index, pid=self.pid,
                      action=f"started again in {RESTART_DELAY_S} s")
            self.stopping.wait(RESTART_DELAY_S)

    def _run_once(self) -> bool:
        """Start the process and follow it until it exits; True when it ended with a last report."""
        process, conn = start_child(self.spec, f"{self.spec.agg.name}#w{self.index}")
        self.pid = process.pid
        with self.lock:
            self.conn = conn
        self.alive = True
        self.report_seen = False
        self.phase = Phase.BUILDING
        if self.stopping.is_set():
            self.send(("stop",))
        log.info("aggregate.worker_started", aggregate=self.spec.agg.name, worker=self.index, pid=self.pid,
                 transactional_instance=self.spec.instance_id)
        final = False
        try:
            while True:
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    break
                except Exception as e:  # a message read whole that does not unpickle: the next one is intact
                    log.error("aggregate.worker_message_unreadable", aggregate=self.spec.agg.name, worker=self.index,
                              error_class=type(e).__name__, error=str(e))
                    continue
                final = self.apply(message) or final
        finally:
            process.wait()
            with self.lock:
                self.conn = None
            conn.close()
            self.alive = False
            for future in list(self.asked.values()):
                if not future.done():
                    future.set_result(None)
        return final

    def apply(self, message: dict[str, Any]) -> bool:
        """A message of the worker process: built (its start at JOINING), a read's answer, or a report (True: its
        last one)."""
        if "joining" in message:
            self.phase = max(self.phase, Phase.JOINING)
            self.on_joining()
            return False
        if "reply" in message:
            future = self.asked.get(message["reply"])
            if future is not None and not future.done():
                future.set_result(message["got"])
            return False
        self.report_seen = True
        self.report = WorkerReport(message["gates"], message["counts"], message["figures"], message["ready"],
                                   message.get("joined", False))
        if message.get("error") is not None:
            self.error = FatalError(f"aggregate worker {self.index} (pid {self.pid}) failed: {message['error']}")
        self.on_report(self)
        return bool(message.get("final"))


class AggregateWorkers:
    """One aggregate run by `daemon.aggregate_processes` worker processes; the daemon's view of it (daemon.tasks'
    AggregateRuntimeView, plus the gates, counts and figures that routing, /status and /metrics read)."""

    def __init__(self, kafka: KafkaConfig, daemon: DaemonConfig, agg: AggregateConfig, base: Path, *,
                 instance_id: str, tracing_config: TracingConfig | None = None,
                 protected: protect.Setup | None = None) -> None:
        self.kafka, self.daemon, self.agg = kafka, daemon, agg
        # Loaded here too: a broken domain fails the daemon's start as in one process, and the states the workers
        # answer reads with are instances of its classes
        self.domain = AggregateDomain.load(agg, daemon.python_path, base)
        self.group_id = f"{daemon.group_prefix}.aggregate.{agg.name}"
        self.topics = {k: agg.topic(k) for k in ("commands", "events", "results")}
        # Per partition, the gate of the worker that holds it, as its last report carried it: updated in place
        # while the same worker keeps the same assignment (routing compares a gate's identity before and after a read)
        self.gates: dict[int, PartitionGate] = {}
        self.owners: dict[int, Worker] = {}
        self.lock = threading.Lock()
        self.stop_event = threading.Event()
        self.error: BaseException | None = None
        self.workers = [Worker(k, WorkerSpec(kafka, daemon, agg, base, worker_instance_id(instance_id, k),
                                             logs.current(), tracing_config, protected), self._merge, self._joins)
                        for k in range(daemon.aggregate_processes)]

    # ---- the view ----------------------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return all(w.alive and w.report.ready for w in self.workers)

    @property
    def counts(self) -> dict[str, int]:
        total: dict[str, int] = {"workers_restarted": sum(w.restarts for w in self.workers)}
        for w in self.workers:
            for k, v in w.counts.items():
                total[k] = total.get(k, 0) + v
        return total

    def figures(self) -> dict[str, float]:
        """The workers' figures summed (AggregateRuntime.figures)."""
        total: dict[str, float] = {}
        for w in self.workers:
            for k, v in w.report.figures.items():
                total[k] = total.get(k, 0) + v
        return total

    def partitions(self) -> list[dict[str, object]]:
        return [{**g.describe(), "worker": self.owners[g.partition].index}
                for g in sorted(list(self.gates.values()), key=lambda g: g.partition) if g.partition in self.owners]

    def get(self, aggregate_id: str) -> tuple[Any, int, str] | None:
        """As AggregateRuntime.get, asked of the worker that holds the aggregate's partition."""
        owner = self.owners.get(partition_for(aggregate_id.encode(), self.agg.partitions))
        return None if owner is None else owner.ask(aggregate_id)

    def get_state(self, aggregate_id: str) -> Any:
        got = self.get(aggregate_id)
        return None if got is None else got[0]

    def forget(self, aggregate_id: str) -> None:
        for w in self.workers:
            w.send(("forget", aggregate_id))

    def pids(self) -> list[int | None]:
        return [w.pid for w in self.workers]

    # ---- running -----------------------------------------------------------------------------------------
    def stop(self) -> None:
        self.stop_event.set()

    def run(self) -> None:
        """Start the workers and follow them until stopped or one fails (raised, as the runtime's own error)."""
        for w in self.workers:
            w.thread.start()
        try:
            while not self.stop_event.wait(STATUS_INTERVAL_S):
                error = next((w.error for w in self.workers if w.error is not None), None)
                if error is not None:
                    self.error = error
                    raise error
        finally:
            for w in self.workers:
                w.stopping.set()
                w.send(("stop",))
            grace = time.monotonic() + self.daemon.shutdown_grace_s + 5
            for w in self.workers:
                w.thread.join(max(0.0, grace - time.monotonic()))

    def _joins(self) -> None:
        """Let the workers at JOINING into the group once every worker is built (at JOINING, or past it: a worker
        started again joins at once), so that they join in one rebalance (startup.py)."""
        with self.lock:
            if not all(w.phase >= Phase.JOINING for w in self.workers):
                return
            for w in self.workers:
                if w.phase is Phase.JOINING:
                    w.phase = Phase.HOLDING
                    w.send(("join",))

    def _merge(self, worker: Worker) -> None:
        """A worker's report into the merged gates: its partitions' gates, the ones it gave up removed. Once every
        worker has had its first assignment, each is told it may decide (startup.py: HOLDING until then, so no
        partition is decided right before the next sibling's join moves it)."""
        with self.lock:
            if all(w.report.joined for w in self.workers):
                for w in self.workers:
                    if w.phase < Phase.DECIDING and w.send(("decide",)):
                        w.phase = Phase.DECIDING
            held = {g.partition: g for g in worker.report.gates}
            for n, owner in list(self.owners.items()):
                if owner is worker and n not in held:
                    del self.owners[n]
                    self.gates.pop(n, None)
            for n, g in held.items():
                mine = self.gates.get(n)
                if mine is not None and self.owners.get(n) is worker and mine.began == g.began:
                    mine.__dict__.update(g.__dict__)  # the same assignment: the same gate object, updated
                else:
                    self.owners[n] = worker
                    self.gates[n] = g


def worker_main(conn: Connection, spec: WorkerSpec) -> None:
    """The worker process: build the runtime, run it in a thread, report, answer reads, follow the parent."""
    # The batch settings of every kafold process (the daemon's and a task's child process get them at start): the
    # young collections at Python's 700 allocations ran every few dozen commands in a worker (docs/benchmarks.md,
    # issue 56, `ks3`). What start-up made is frozen by the runtime's loop once its clients exist (freeze_startup).
    interpreter.tune_interpreter()
    logs.configure(*spec.log)
    if spec.tracing is not None:
        tracing.configure(spec.tracing)
    protector = protect.build_setup(spec.protect) if spec.protect is not None else None
    domain = AggregateDomain.load(spec.agg, spec.daemon.python_path, spec.base).protected(protector)
    send_lock = threading.Lock()

    def send(message: dict[str, Any]) -> None:
        with send_lock:
            conn.send(message)

    startup = StartUp(spec.agg.name, announce=lambda: send({"joining": True}))  # the parent's words move it on
    runtime = AggregateRuntime(spec.kafka, spec.daemon, spec.agg, domain, instance_id=spec.instance_id,
                               restorer=SnapshotRestorer(spec.kafka, spec.agg, domain),
                               consumer_extra=spec.consumer_extra, startup=startup, after_batch=lambda: report(False))

    def report(final: bool = False) -> None:
        error = runtime.error
        send({"gates": list(runtime.gates.values()), "counts": dict(runtime.counts), "figures": runtime.figures(),
              "ready": runtime.ready, "joined": runtime.joined, "final": final,
              "error": f"{type(error).__name__}: {error}" if error is not None else None})

    def run() -> None:
        try:
            runtime.run()
        except Exception:  # kept in runtime.error and logged by it; reported to the parent
            pass

    # SIGTERM and SIGINT sent to the worker itself, and a parent gone: the graceful stop, as the daemon's (its
    # batch's transaction ends, its partitions are released)
    serve_parent(conn, name=f"kafold-aggregate-{spec.agg.name}", run=run, stop=runtime.stop,
                 handlers={"forget": runtime.forget, "join": startup.let_join, "decide": startup.let_decide,
                           "get": lambda n, aggregate_id: send({"reply": n, "got": runtime.get(aggregate_id)})},
                 report=report, failed=lambda: runtime.error is not None)
