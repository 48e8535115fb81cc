"""SnapshotScheduler: run snapshot jobs on an interval or after N new events, never two runs at once."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from confluent_kafka import TopicPartition

from kafold import kafka_clients, logs
from kafold.config import AggregateConfig, KafkaConfig, SnapshotConfig

log = logs.get(__name__)


def events_end_total(kafka: KafkaConfig, aggregates: Sequence[AggregateConfig]) -> int:
    """The sum of the end offsets (ListOffsets) of the aggregates' events topics: grows with every event."""
    consumer = kafka_clients.consumer(kafka, "kafold.snapshot.scheduler")
    try:
        meta = consumer.list_topics(timeout=10)
        total = 0
        for agg in aggregates:
            topic = meta.topics.get(agg.topic("events"))
            for p in (topic.partitions if topic is not None else ()):
                total += consumer.get_watermark_offsets(TopicPartition(agg.topic("events"), p), timeout=10)[1]
        return total
    finally:
        consumer.close()


def subprocess_job(config_path: Path, master: str | None = None) -> Callable[[], int]:
    """A job that runs `kafold snapshot run -c FILE` in a child process (the Spark driver and its JVM stay out
    of the daemon's memory; a crashed job cannot take the daemon down).

    The child writes where the daemon logs: its stdout and stderr (its log lines, its summary, its Spark JVM's
    log4j output) are appended to the daemon's log file when it has one (`kafold run` on a terminal, whose live
    view they would tear), else inherited. Nobody watches a scheduled run, so it draws no progress bar."""
    def run() -> int:
        cmd = [sys.executable, "-m", "kafold.tools.cli", "--log-format", "json", "snapshot", "run", "-c",
               str(config_path), "--no-progress"]
        if master:
            cmd += ["--master", master]
        log_file = logs.current()[2]
        with contextlib.ExitStack() as files:
            out = None if log_file is None else files.enter_context(open(log_file, "ab"))
            return subprocess.run(cmd, check=False, stdin=subprocess.DEVNULL, stdout=out,
                                  stderr=None if out is None else subprocess.STDOUT).returncode
    return run


class SnapshotScheduler:
    """Triggers `job` every `interval_s`, and also once `every_n_events` new events arrived (0 = off).

    A lock guarantees that two runs never overlap: a trigger while a run is in progress is skipped (and
    `trigger()` says so). The daemon drives it from a Faust/mode timer every `poll_s` (daemon.host.TasksService):
    `check()` off the event loop, then `start_run(reason)` unless `busy`; `run_once()` is the unit of work.
    """

    def __init__(self, job: Callable[[], Any], *, interval_s: float, every_n_events: int = 0,
                 new_events: Callable[[], int] | None = None, poll_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if every_n_events and new_events is None:
            raise ValueError("every_n_events needs a new_events() counter")
        self.job, self.interval_s, self.every_n_events = job, interval_s, every_n_events
        self.new_events, self.poll_s, self.clock = new_events, poll_s, clock
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.last_run: float | None = None
        self.events_at_last_run: int | None = None
        self.runs = 0
        self.failures = 0
        self.last_success_at: float | None = None  # Unix time the last good run ended (/metrics: snapshot age)

    @classmethod
    def from_config(cls, config_path: Path, snapshots: SnapshotConfig, kafka: KafkaConfig,
                    aggregates: Sequence[AggregateConfig]) -> SnapshotScheduler:
        """The scheduler `[snapshots]` asks for: a `kafold snapshot run` child process per trigger."""
        return cls(subprocess_job(config_path, snapshots.spark_master), interval_s=snapshots.interval_s,
                   every_n_events=snapshots.every_n_events,
                   new_events=(lambda: events_end_total(kafka, aggregates)) if snapshots.every_n_events else None)

    def due(self) -> str | None:
        """Why a run is due now ("interval" / "new-events"), or None."""
        if self.last_run is None:
            self.last_run = self.clock()  # the first interval counts from the first check, not from zero
        if self.clock() - self.last_run >= self.interval_s:
            return "interval"
        if self.every_n_events and self.new_events is not None:
            now = self.new_events()
            if self.events_at_last_run is None:
                self.events_at_last_run = now
            elif now - self.events_at_last_run >= self.every_n_events:
                return "new-events"
        return None

    def run_once(self, reason: str = "manual") -> bool:
        """Run the job now unless one is running; False if skipped."""
        if not self._lock.acquire(blocking=False):
            log.info("snapshot.schedule.skipped", reason=reason, why="a run is in progress")
            return False
        try:
            self.last_run = self.clock()
            if self.new_events is not None:
                try:
                    self.events_at_last_run = self.new_events()
                except Exception as e:  # the broker is unreachable: the interval trigger still works
                    log.warning("snapshot.schedule.count_failed", error=str(e))
            began = time.monotonic()
            log.info("snapshot.schedule.run", reason=reason)
            try:
                code = self.job()
            except Exception as e:
                code = repr(e)
            self.runs += 1
            if code not in (0, None):
                self.failures += 1
                log.warning("snapshot.schedule.failed", reason=reason, result=code)
            else:
                self.last_success_at = time.time()
                log.info("snapshot.schedule.done", reason=reason, duration_s=round(time.monotonic() - began, 2))
            return True
        finally:
            self._lock.release()

    trigger = run_once

    @property
    def busy(self) -> bool:
        """True while a run is in progress."""
        return self._lock.locked()

    def check(self) -> str | None:
        """One check of the triggers (blocking: the new-events count asks the broker): the reason a run is due, or
        None; a failing check is logged and counts as not due."""
        try:
            return self.due()
        except Exception as e:
            log.warning("snapshot.schedule.check_failed", error=str(e))
            return None

    def start_run(self, reason: str) -> threading.Thread:
        """`run_once(reason)` in a daemon thread of its own: the trigger never waits for a run, and a run still in
        progress at exit does not hold the process (a snapshot run is idempotent)."""
        thread = threading.Thread(target=self.run_once, args=(reason,), name="kafold-snapshot-run", daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        """Stop triggering (the daemon's timer checks this); a run in progress finishes on its own."""
        self._stop.set()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()
