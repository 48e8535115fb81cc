"""The daemon's workers: one thread per sink task (restartable; or a child process, following it from a thread)
and per aggregate runtime, with their states.

Note on commits at stop and restart: stopping a slot sets its runner's stop event; the runner finishes or
abandons the in-flight batch, commits what is done and closes its partitions (see `daemon.runner`). A restart
is a stop followed by a fresh runner on a fresh consumer, which resumes from the committed offsets.

Note on control calls: pause, resume and restarts of a connector (the REST API) and a reload's stop and start of
it go through the connector's `Control`: applied one at a time, in the order they were asked for, each holding the
connector's lock across stop, join and start. So a task never has two runners, and the last call's state is the
connector's (the pause asked through the API is the connector's, kept across restarts and reloads).
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Protocol

from kafold import logs, protect
from kafold.config import (
    AggregateConfig,
    DaemonConfig,
    KafkaConfig,
    PostgresConfig,
    RegistryConfig,
    TracingConfig,
)
from kafold.connectors.api import Connector, TaskConfig, TopicPartition
from kafold.daemon.runner import BatchStats, RunnerView, SinkRunner
from kafold.daemon.task_process import RemoteRunner, TaskSpec, in_processes
from kafold.protect import Protector

log = logs.get(__name__)

POLL_STALL_WARN_S = 60.0  # a running task whose loop has not served its consumer this long is logged, with its stack


class AggregateRuntimeView(Protocol):
    """What the daemon needs from an aggregate runtime (kafold.daemon.aggregates.AggregateRuntime, or a test's
    stand-in): a thread-friendly loop."""

    def run(self) -> None: ...

    def stop(self) -> None: ...

    def get_state(self, aggregate_id: str) -> Any: ...

    def get(self, aggregate_id: str) -> tuple[Any, int, str] | None: ...

    def partitions(self) -> list[dict[str, object]]: ...

    def forget(self, aggregate_id: str) -> None: ...


class TaskSlot:
    """One sink task: its current SinkRunner and thread; `restart` replaces both."""

    def __init__(self, connector: Connector[Any], task_config: TaskConfig[Any], kafka: KafkaConfig,
                 daemon: DaemonConfig, on_batch: Callable[[RunnerView, BatchStats], None] | None = None,
                 on_exit: Callable[[TaskSlot], None] | None = None, registry: RegistryConfig | None = None) -> None:
        self.connector = connector
        self.registry = registry  # [registry], for a connector reading Schema Registry formats
        self.task_config = task_config
        self.task_id = task_config.task_id
        self.kafka, self.daemon = kafka, daemon
        self.on_batch, self.on_exit = on_batch, on_exit
        self.restarts_pending = 0  # restarts asked for and not yet done (the state shows RESTARTING meanwhile)
        self.stopping = False
        self.runner = self._new_runner()
        self.thread: threading.Thread | None = None
        self._stall_logged = float("-inf")
        self._lock = threading.Lock()  # the runner's swap and start, and the counts below
        self.runners_started = self.runners_stopped = 0
        self._live: list[RunnerView] = []  # runners whose `run` has not returned (one at most: the current one)
        self._stop_asked: RunnerView | None = None  # the runner a restart stopped (its end is not a failure)

    @property
    def name(self) -> str:
        return f"{self.connector.name}[{self.task_id}]"

    def _new_runner(self) -> RunnerView:
        runner = self._runner()
        if self.on_batch is not None:
            hook = self.on_batch
            runner.on_batch = lambda stats: hook(runner, stats)
        return runner

    def _runner(self) -> RunnerView:
        return SinkRunner(self.connector, self.task_config, kafka=self.kafka, daemon=self.daemon,
                          registry=self.registry)

    def start(self) -> None:
        """Start the current runner in a thread; nothing if it was started already or the slot is stopping."""
        with self._lock:
            runner = self.runner
            if self.stopping or runner in self._live or runner.started or runner.stopped:
                return
            self.runners_started += 1
            self._live.append(runner)
            self.thread = threading.Thread(target=self._run, args=(runner,), daemon=True,
                                           name=f"kafold-{self.connector.name}-{self.task_id}")
            self.thread.start()

    def _run(self, runner: RunnerView) -> None:
        try:
            runner.run()
        finally:
            with self._lock:
                self.runners_stopped += 1
                self._live.remove(runner)
                asked = self.stopping or runner is self._stop_asked
        if asked:
            return
        if runner is self.runner and self.on_exit is not None:
            self.on_exit(self)  # the host logs it and fails fast
        else:
            log.error("task.runner_stopped_by_itself", task=self.name, state=runner.state,
                      error=str(runner.error) if runner.error is not None else None)

    @property
    def runners(self) -> dict[str, int]:
        with self._lock:
            return {"started": self.runners_started, "stopped": self.runners_stopped,
                    "running": sum(r is self.runner for r in self._live)}

    @property
    def failed(self) -> bool:
        return self.runner.error is not None

    @property
    def state(self) -> str:
        return "RESTARTING" if self.restarts_pending else self.runner.state

    def stop(self) -> None:
        self.stopping = True
        self.runner.stop()

    def check_polling(self, now: float | None = None) -> bool:
        """Log a running task whose loop has not served its consumer for POLL_STALL_WARN_S (at most once per that
        period), with where its thread is; True when it is stalled. The consumer leaves the group once this
        reaches the rebalance timeout, so the stack is what to look at."""
        r, now = self.runner, time.monotonic() if now is None else now
        if not r.started or r.stopped or self.thread is None or now - r.last_poll < POLL_STALL_WARN_S:
            return False
        if now - self._stall_logged >= POLL_STALL_WARN_S:
            self._stall_logged = now
            log.warning("task.not_polling", task=self.name, since_s=round(now - r.last_poll, 1),
                        stack=self._stack())
        return True

    def _stack(self) -> str:
        """Where the task's thread is (for the stall warning)."""
        frame = sys._current_frames().get(self.thread.ident or -1) if self.thread is not None else None
        return "".join(traceback.format_stack(frame, limit=12)) if frame is not None else "(thread gone)"

    def join(self, timeout: float) -> bool:
        """Wait for the thread; True when it ended."""
        if self.thread is None:
            return True
        self.thread.join(max(0.0, timeout))
        return not self.thread.is_alive()

    def count_restart(self, delta: int) -> None:
        with self._lock:
            self.restarts_pending += delta

    def stop_runner(self) -> None:
        """Ask the current runner to stop (committing what is done), for a restart: its end is then no failure.
        A restart is `stop_runner` then `replace_runner`, through the connector's `Control` (one at a time)."""
        with self._lock:
            self._stop_asked = self.runner
        self.runner.stop()

    def replace_runner(self, timeout: float, paused: bool) -> bool:
        """Wait up to `timeout` for the runner `stop_runner` stopped, then start a fresh one (paused if `paused`);
        False, keeping the old one, when it did not end in time or the slot is stopping."""
        if not self.join(timeout):
            log.error("task.restart_not_stopped", task=self.name, hint="it keeps its runner")
            return False
        with self._lock:
            if self.stopping:  # the daemon is stopping: no fresh runner
                return False
            self.runner = self._new_runner()
            if paused:
                self.runner.request_pause(True)
        self.start()
        log.info("task.restarted", task=self.name, paused=paused)
        return True


class ProcessTaskSlot(TaskSlot):
    """A sink task whose runner runs in a child process (`daemon.task_processes`, see daemon.task_process); the
    slot's thread follows the child, and `runner` is the parent's view of it."""

    def __init__(self, connector: Connector[Any], task_config: TaskConfig[Any], kafka: KafkaConfig,
                 daemon: DaemonConfig, spec: TaskSpec,
                 on_batch: Callable[[RunnerView, BatchStats], None] | None = None,
                 on_exit: Callable[[TaskSlot], None] | None = None) -> None:
        self.spec = spec
        super().__init__(connector, task_config, kafka, daemon, on_batch, on_exit)

    def _runner(self) -> RunnerView:
        return RemoteRunner(self.connector, self.task_config.task_id, self.spec)

    def _stack(self) -> str:
        pid = getattr(self.runner, "pid", None)
        return f"(in task process {pid}: py-spy dump --pid {pid} shows where)"


def task_slots(connector: Connector[Any], kafka: KafkaConfig, postgres: PostgresConfig, daemon: DaemonConfig,
               base: Path, python_paths: list[str],
               on_batch: Callable[[RunnerView, BatchStats], None] | None = None,
               on_exit: Callable[[TaskSlot], None] | None = None, registry: RegistryConfig | None = None,
               tracing: TracingConfig | None = None, protector: Protector | None = None,
               on_stored: Callable[[str, Mapping[TopicPartition, int]], None] | None = None) -> list[TaskSlot]:
    """The slots of a connector's tasks (at most `tasks_max`): threads, or child processes (`in_processes`). Each
    task gets the configured services with its task config (Connect's worker config): the host's `protector`
    (kafold.protect), or in a child process one of its own, built from the protector's Setup it is sent. A thread
    task also gets `on_stored` (with the connector's name): the host hears of its commits as they happen; a child
    process's commits are seen by reading them back (daemon.visibility)."""
    n = connector.settings.tasks_max
    configs = [tc.with_services(kafka, postgres, protector) for tc in connector.task_configs(n)[:n]]
    if not in_processes(connector.settings, daemon):
        if on_stored is not None:
            configs = [dataclasses.replace(tc, on_stored=functools.partial(on_stored, connector.name))
                       for tc in configs]
        return [TaskSlot(connector, tc, kafka, daemon, on_batch, on_exit, registry) for tc in configs]
    return [ProcessTaskSlot(connector, tc, kafka, daemon, TaskSpec(
        connector.settings, base, tuple(python_paths), i, n, kafka, postgres, daemon, logs.current(), registry,
        tracing, protect.sent(protector)), on_batch, on_exit) for i, tc in enumerate(configs)]


class Control:
    """The control calls of one connector, applied one at a time in the order they were submitted (by a thread
    that lives while calls are queued), each holding `lock`; a reload holds it too while it replaces the connector.

    Shared by the groups that follow each other at reloads, so a call queued before a reload applies to the
    group that runs afterwards (`ConnectorGroup.current`)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.lock = threading.RLock()
        self._queue: deque[tuple[str, Callable[[], Any], Future[Any]]] = deque()
        self._guard = threading.Lock()
        self._draining = False

    def submit(self, what: str, op: Callable[[], Any]) -> Future[Any]:
        """Queue `op`; its future holds its result (or error) once applied."""
        future: Future[Any] = Future()
        with self._guard:
            self._queue.append((what, op, future))
            if self._draining:
                return future
            self._draining = True
        threading.Thread(target=self._drain, daemon=True, name=f"kafold-control-{self.name}").start()
        return future

    def _drain(self) -> None:
        while True:
            with self._guard:
                if not self._queue:
                    self._draining = False
                    return
                what, op, future = self._queue.popleft()
            try:
                with self.lock:
                    result = op()
            except BaseException as e:  # the caller gets it; the calls queued behind still run
                log.error("connector.control_failed", connector=self.name, call=what,
                          error_class=type(e).__name__, error=str(e))
                future.set_exception(e)
            else:
                future.set_result(result)


@dataclasses.dataclass(eq=False)
class ConnectorGroup:
    """A connector instance and its task slots."""

    connector: Connector[Any]
    slots: list[TaskSlot]
    control: Control = dataclasses.field(init=False)  # shared with the groups replacing this one (`adopt`)
    paused: bool = False  # paused through the REST API: kept across restarts and reloads
    successor: ConnectorGroup | None = None  # the group a reload put in this one's place
    retired: bool = False  # stopped by a reload (its successor, if any, runs the connector now)

    def __post_init__(self) -> None:
        self.control = Control(self.connector.name)

    @property
    def name(self) -> str:
        return self.connector.name

    @property
    def state(self) -> str:
        """Connect's connector state: FAILED if any task failed, PAUSED if all are paused, else RUNNING."""
        states = {s.state for s in self.slots}
        if "FAILED" in states:
            return "FAILED"
        if states == {"PAUSED"}:
            return "PAUSED"
        if states <= {"UNASSIGNED"}:
            return "UNASSIGNED"
        return "RUNNING"

    def current(self) -> ConnectorGroup | None:
        """The group running this connector now (this one, or the one a reload put in its place); None if a
        reload removed it."""
        group: ConnectorGroup | None = self
        while group is not None and group.retired:
            group = group.successor
        return group

    def pause(self, paused: bool) -> Future[Any]:
        """Queue a pause (True) or a resume (False) of every task."""
        return self.control.submit("pause" if paused else "resume", lambda: self._pause(paused))

    def _pause(self, paused: bool) -> None:
        group = self.current()
        if group is None:
            log.warning("connector.pause_not_applied", connector=self.name, reason="a reload removed the connector")
            return
        group.paused = paused
        for s in group.slots:
            s.runner.request_pause(paused)
        log.info("connector.paused" if paused else "connector.resumed", connector=group.name)

    def restart(self, slots: list[TaskSlot], timeout: float) -> Future[bool]:
        """Queue a restart of `slots` (each stopped, joined, started afresh); shown RESTARTING meanwhile. The
        future holds True when every one restarted."""
        for s in slots:
            s.count_restart(1)
        return self.control.submit("restart", lambda: self._restart(slots, timeout))

    def _restart(self, slots: list[TaskSlot], timeout: float) -> bool:
        try:
            group = self.current()
            if group is not self:  # a reload restarted (or removed) the connector meanwhile: done already
                log.info("connector.restart_skipped", connector=self.name, reason="a reload replaced its tasks")
                return group is not None
            for s in slots:  # all stop together: one rebalance, not one per task
                s.stop_runner()
            deadline = time.monotonic() + timeout
            return all([s.replace_runner(deadline - time.monotonic(), self.paused) for s in slots])
        finally:
            for s in slots:
                s.count_restart(-1)

    def adopt(self, old: ConnectorGroup) -> None:
        """Take `old`'s place at a reload (call with `old.control.lock` held and `old` stopped): its control
        calls and its pause."""
        self.control, self.paused = old.control, old.paused
        old.successor, old.retired = self, True
        if self.paused:
            for s in self.slots:
                s.runner.request_pause(True)


class AggregateSlot:
    """One aggregate runtime in its own thread."""

    def __init__(self, config: AggregateConfig, runtime: AggregateRuntimeView,
                 on_exit: Callable[[AggregateSlot], None] | None = None) -> None:
        self.config = config
        self.runtime = runtime
        self.on_exit = on_exit
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"kafold-aggregate-{config.name}")
        self.stopping = False

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def failed(self) -> bool:
        return self.error is not None

    @property
    def ready(self) -> bool:
        return bool(getattr(self.runtime, "ready", True)) and self.thread.is_alive()

    def _run(self) -> None:
        try:
            self.runtime.run()
        except Exception as e:
            self.error = e
            log.error("aggregate.runtime_failed", aggregate=self.name, error_class=type(e).__name__, error=str(e),
                      exc_info=True)
        if self.on_exit is not None:
            self.on_exit(self)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping = True
        self.runtime.stop()

    def join(self, timeout: float) -> bool:
        self.thread.join(max(0.0, timeout))
        return not self.thread.is_alive()


def join_all(workers: list[Any], deadline: float) -> list[str]:
    """Join every worker by the monotonic `deadline`; the names of those still running."""
    return [w.name for w in workers if not w.join(deadline - time.monotonic())]
