"""The daemon's workers: one thread per sink task (restartable; or a child process, following it from a thread)
and per aggregate runtime, with their states.

Note on commits at stop and restart: stopping a slot sets its runner's stop event; the runner finishes or
abandons the in-flight batch, commits what is done and closes its partitions (see `daemon.runner`). A restart
is a stop followed by a fresh runner on a fresh consumer, which resumes from the committed offsets.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from kafold import logs
from kafold.config import AggregateConfig, DaemonConfig, KafkaConfig, KafoldConfig, PostgresConfig
from kafold.connectors.api import Connector, TaskConfig
from kafold.daemon.runner import BatchStats, RunnerView, SinkRunner
from kafold.daemon.task_process import RemoteRunner, TaskSpec

log = logs.get(__name__)

POLL_STALL_WARN_S = 60.0  # a running task whose loop has not served its consumer this long is logged, with its stack


class AggregateRuntime(Protocol):
    """What the daemon needs from an aggregate runtime (kafold.daemon.aggregates): a thread-friendly loop."""

    def run(self) -> None: ...

    def stop(self) -> None: ...

    def get_state(self, aggregate_id: str) -> Any: ...

    def get(self, aggregate_id: str) -> tuple[Any, int, str] | None: ...


class TaskSlot:
    """One sink task: its current SinkRunner and thread; `restart` replaces both."""

    def __init__(self, connector: Connector[Any], task_config: TaskConfig[Any], kafka: KafkaConfig,
                 daemon: DaemonConfig, on_batch: Callable[[RunnerView, BatchStats], None] | None = None,
                 on_exit: Callable[[TaskSlot], None] | None = None) -> None:
        self.connector = connector
        self.task_config = task_config
        self.task_id = task_config.task_id
        self.kafka, self.daemon = kafka, daemon
        self.on_batch, self.on_exit = on_batch, on_exit
        self.restarting = False
        self.stopping = False
        self.runner = self._new_runner()
        self.thread: threading.Thread | None = None
        self._stall_logged = float("-inf")

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
        return SinkRunner(self.connector, self.task_config, kafka=self.kafka, daemon=self.daemon)

    def start(self) -> None:
        runner = self.runner
        self.thread = threading.Thread(target=self._run, args=(runner,), daemon=True,
                                       name=f"kafold-{self.connector.name}-{self.task_id}")
        self.thread.start()

    def _run(self, runner: RunnerView) -> None:
        runner.run()
        if runner is self.runner and not self.restarting and self.on_exit is not None:
            self.on_exit(self)

    @property
    def failed(self) -> bool:
        return self.runner.error is not None

    @property
    def state(self) -> str:
        return "RESTARTING" if self.restarting else self.runner.state

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
            log.warning("sink task not polling its consumer", task=self.name, since_s=round(now - r.last_poll, 1),
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

    def restart(self, timeout: float) -> bool:
        """Stop the runner (committing what is done), then start a fresh one; blocks up to `timeout`."""
        self.restarting = True
        try:
            paused = self.runner.api_paused
            self.runner.stop()
            if not self.join(timeout):
                log.error("task did not stop for the restart", task=self.name)
                return False
            self.runner = self._new_runner()
            if paused:
                self.runner.request_pause(True)
            self.start()
            log.info("task restarted", task=self.name)
            return True
        finally:
            self.restarting = False


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
               on_exit: Callable[[TaskSlot], None] | None = None) -> list[TaskSlot]:
    """The slots of a connector's tasks (at most `tasks_max`): threads, or with `daemon.task_processes` child
    processes. Each task gets the configured services with its task config (Connect's worker config)."""
    n = connector.settings.tasks_max
    configs = [tc.with_services(kafka, postgres) for tc in connector.task_configs(n)[:n]]
    if not daemon.task_processes:
        return [TaskSlot(connector, tc, kafka, daemon, on_batch, on_exit) for tc in configs]
    return [ProcessTaskSlot(connector, tc, kafka, daemon, TaskSpec(
        connector.settings, base, tuple(python_paths), i, n, kafka, postgres, daemon, logs.current()),
        on_batch, on_exit) for i, tc in enumerate(configs)]


@dataclasses.dataclass
class ConnectorGroup:
    """A connector instance and its task slots."""

    connector: Connector[Any]
    slots: list[TaskSlot]

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

    def pause(self, paused: bool) -> None:
        for s in self.slots:
            s.runner.request_pause(paused)


class AggregateSlot:
    """One aggregate runtime in its own thread."""

    def __init__(self, config: AggregateConfig, runtime: AggregateRuntime,
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
            log.error("aggregate runtime failed", aggregate=self.name, error_class=type(e).__name__, error=str(e),
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


def aggregate_factory() -> Callable[[KafoldConfig, AggregateConfig, Path], AggregateRuntime]:
    """`kafold.daemon.aggregates.build_runtime(cfg, aggregate, base)`, imported only when aggregates are hosted."""
    from kafold.daemon.aggregates import build_runtime  # lazy: a daemon without aggregates never loads them

    return build_runtime


def join_all(workers: list[Any], deadline: float) -> list[str]:
    """Join every worker by the monotonic `deadline`; the names of those still running."""
    return [w.name for w in workers if not w.join(deadline - time.monotonic())]
