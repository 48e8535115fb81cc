"""Prometheus metrics of the daemon: counters fed per batch, lag and states read from the tasks at scrape time.

Every family is declared in daemon.metric_catalog; the collectors here build theirs from it. The registry also
carries prometheus_client's process and platform collectors (`process_*`, `python_*`): they describe the daemon's
own process. Sink tasks in child processes (`task_processes`) keep no registry: they report their batches to the
daemon, which counts them here, and their CPU and memory are read from the OS per task
(`kafold_task_process_*`), not in `process_*`.
"""

from __future__ import annotations

import collections
import os
import platform
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import confluent_kafka
import psutil
from prometheus_client import (
    CollectorRegistry,
    Counter,
    GCCollector,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

import kafold
from kafold import logs
from kafold.connectors.api import Metric, TaskView
from kafold.daemon.aggregates.gate import LIVE, RECOVERING, STOPPED
from kafold.daemon.metric_catalog import daemon_family
from kafold.daemon.runner import BatchStats, RunnerView
from kafold.daemon.tasks import ConnectorGroup
from kafold.snapshot.select import REJECTED

if TYPE_CHECKING:
    from kafold.protect import Protector
    from kafold.snapshot.scheduler import SnapshotScheduler

log = logs.get(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TASK_STATES = ("UNASSIGNED", "RUNNING", "PAUSED", "FAILED", "RESTARTING", "STOPPED")
BATCH_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# a wait answers within wait_view.MAX_TIMEOUT_MS (60 s); most are covered within a batch or two
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class DaemonMetrics:
    """One registry per daemon (so several can live in one process, e.g. in tests)."""

    def __init__(self, groups: Callable[[], list[ConnectorGroup]],
                 aggregates: Callable[[], dict[str, Any]] | None = None,
                 scheduler: Callable[[], SnapshotScheduler | None] | None = None,
                 protector: Callable[[], Protector | None] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        # prometheus_client's defaults, which a private registry does not get by itself
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        build = _declared(Info, "kafold_build", self.registry)
        build.info(dict(zip(daemon_family("kafold_build").labels, (
            kafold.__version__, platform.python_version(), platform.python_implementation(),
            confluent_kafka.libversion()[0]), strict=True)))
        self.events = _declared(Counter, "kafold_events_processed", self.registry)
        self.dead = _declared(Counter, "kafold_dead_letters", self.registry)
        self.skipped = _declared(Counter, "kafold_events_skipped", self.registry)
        self.batches = _declared(Histogram, "kafold_batch_duration_seconds", self.registry, buckets=BATCH_BUCKETS)
        self.waits = _declared(Counter, "kafold_consistency_waits", self.registry)
        self.wait_time = _declared(Histogram, "kafold_consistency_wait_duration_seconds", self.registry,
                                   buckets=WAIT_BUCKETS)
        self.registry.register(_TaskCollector(groups))
        self.registry.register(_TaskProcessCollector(groups))
        self.registry.register(_AccountingCollector(groups))
        self.registry.register(ConnectorCollector(groups))
        self.registry.register(_SnapshotCollector(scheduler or (lambda: None)))
        self.registry.register(_PrivacyCollector(protector or (lambda: None)))
        if aggregates is not None:
            self.registry.register(_AggregateCollector(aggregates))

    def observe(self, runner: RunnerView, stats: BatchStats) -> None:
        """The runners' on_batch hook (runs in the task's thread; prometheus_client is thread-safe)."""
        key = (runner.connector.name, str(runner.task_id))
        # a batch's records are processed, dead-lettered (at decode or by the sink) or skipped: one counter each
        self.events.labels(*key).inc(stats.records - stats.dead_lettered - stats.skipped)
        if stats.dead_lettered:
            self.dead.labels(*key).inc(stats.dead_lettered)
        if stats.skipped:
            self.skipped.labels(*key).inc(stats.skipped)
        self.batches.labels(*key).observe(stats.duration_s)

    def waited(self, connector: str, result: str, seconds: float | None = None) -> None:
        """One answered wait for a consistency token (daemon/visibility.py): covered, timeout or unreadable after
        `seconds`; refused (too many at once) without a wait."""
        self.waits.labels(connector, result).inc()
        if seconds is not None:
            self.wait_time.labels(connector).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _declared(kind: Any, name: str, registry: CollectorRegistry, **kwargs: Any) -> Any:
    """A prometheus_client metric (Counter, Histogram, Info) made as daemon.metric_catalog declares `name`."""
    f = daemon_family(name)
    labels = () if kind is Info else f.labels  # an Info's declared labels are its keys, given to `.info()`
    return kind(f.name, f.help, labels, registry=registry, **kwargs)


def _new(name: str) -> Any:
    """An empty family of a collector, as daemon.metric_catalog declares `name`."""
    f = daemon_family(name)
    kind = CounterMetricFamily if f.kind == "counter" else GaugeMetricFamily
    return kind(f.name, f.help, labels=list(f.labels))


class _Declared(Collector):
    """A collector whose families are known before any scrape: the registry learns their names from `describe`
    (and refuses a second collector with one of them)."""

    FAMILIES: tuple[str, ...] = ()

    def describe(self) -> list[Any]:
        return [_new(name) for name in self.FAMILIES]


class _TaskCollector(_Declared):
    """Per-partition lag (records and event-time seconds), caught-up flags and task states, at scrape time."""

    FAMILIES = ("kafold_consumer_lag_records", "kafold_consumer_lag_seconds", "kafold_consumer_position",
                "kafold_partition_caught_up", "kafold_task_state", "kafold_task_runners_started",
                "kafold_task_runners_stopped", "kafold_task_runners_running")

    def __init__(self, groups: Callable[[], list[ConnectorGroup]]) -> None:
        self.groups = groups

    def collect(self) -> Iterator[Any]:
        lag = _new("kafold_consumer_lag_records")
        lag_s = _new("kafold_consumer_lag_seconds")
        position = _new("kafold_consumer_position")
        caught = _new("kafold_partition_caught_up")
        state = _new("kafold_task_state")
        started = _new("kafold_task_runners_started")
        stopped = _new("kafold_task_runners_stopped")
        running = _new("kafold_task_runners_running")
        now_ms = int(time.time() * 1000)
        for group in self.groups():
            for slot in group.slots:
                counts, key = slot.runners, [group.name, str(slot.task_id)]
                started.add_metric(key, counts["started"])
                stopped.add_metric(key, counts["stopped"])
                running.add_metric(key, counts["running"])
                current = slot.state
                for s in TASK_STATES:
                    state.add_metric([group.name, str(slot.task_id), s], 1.0 if s == current else 0.0)
                for p in slot.runner.progress.snapshot.values():
                    labels = [group.name, p.tp.topic, str(p.tp.partition)]
                    if p.lag is not None:
                        lag.add_metric(labels, float(p.lag))
                        lag_s.add_metric(labels, p.lag_seconds(now_ms))
                    if p.position is not None:
                        position.add_metric(labels, float(p.position))
                    caught.add_metric(labels, 1.0 if p.caught_up else 0.0)
        yield from (lag, lag_s, position, caught, state, started, stopped, running)


class _TaskProcessCollector(_Declared):
    """CPU and memory of the sink tasks run as child processes (daemon/task_process.py), which the daemon's own
    process_* families do not include; read from the operating system at scrape time."""

    FAMILIES = ("kafold_task_process_cpu_seconds", "kafold_task_process_resident_memory_bytes")

    def __init__(self, groups: Callable[[], list[ConnectorGroup]]) -> None:
        self.groups = groups

    def collect(self) -> Iterator[Any]:
        cpu, rss = (_new(name) for name in self.FAMILIES)
        for group in self.groups():
            for slot in group.slots:
                pid = getattr(slot.runner, "pid", None)  # only a RemoteRunner has a process of its own
                if pid is None or slot.runner.stopped:
                    continue
                try:
                    with (proc := psutil.Process(pid)).oneshot():
                        if proc.ppid() != os.getpid():  # the child ended and its pid went to another process
                            continue
                        times, memory = proc.cpu_times(), proc.memory_info()
                except psutil.Error:  # the child just ended: the daemon notices and reports it elsewhere
                    continue
                key = [group.name, str(slot.task_id)]
                cpu.add_metric(key, times.user + times.system)
                rss.add_metric(key, float(memory.rss))
        yield from (cpu, rss)


class _AccountingCollector(_Declared):
    """The offset accounting (daemon/accounting.py) per connector, task and partition: records seen, what became
    of them by outcome, and the records unaccounted for (seen minus the outcomes: a write in flight, else lost)."""

    OUTCOMES = ("applied", "duplicates", "stale", "dead_lettered", "skipped")
    FAMILIES = ("kafold_records_seen", "kafold_records_outcome", "kafold_records_unaccounted")

    def __init__(self, groups: Callable[[], list[ConnectorGroup]]) -> None:
        self.groups = groups

    def collect(self) -> Iterator[Any]:
        seen = _new("kafold_records_seen")
        outcome = _new("kafold_records_outcome")
        gap = _new("kafold_records_unaccounted")
        for group in self.groups():
            for slot in group.slots:
                try:
                    accounts = slot.runner.accounts
                except Exception as e:  # a view must never fail the scrape
                    log.warning("metrics.offsets_unread", connector=group.name, error=str(e))
                    continue
                for a in accounts.values():
                    key = [group.name, str(slot.task_id), a.tp.topic, str(a.tp.partition)]
                    seen.add_metric(key, a.seen)
                    for name in self.OUTCOMES:
                        outcome.add_metric([*key, name], getattr(a, name))
                    gap.add_metric(key, a.unaccounted)
        yield from (seen, outcome, gap)


class ConnectorCollector(Collector):
    """The metrics connectors declare (`Connector.metrics`), sampled from each connector and its running tasks at
    scrape time: one family per metric name, shared by the connectors of a class."""

    def __init__(self, groups: Callable[[], list[ConnectorGroup]]) -> None:
        self.groups = groups

    def describe(self) -> list[Any]:
        return []  # the plugins' families: known once the connectors are built

    def collect(self) -> Iterator[Any]:
        families: dict[str, Any] = {}
        first: dict[str, Metric] = {}
        for group in self.groups():
            connector = group.connector
            declared = {}
            for metric in connector.metrics:
                kept = first.setdefault(metric.name, metric)
                if (kept.kind, kept.labels) != (metric.kind, metric.labels):
                    log.warning("metrics.declared_twice", connector=group.name, metric=metric.name,
                                hint="declared twice, differently: the first declaration is kept")
                    continue
                families.setdefault(metric.name, _connector_family(metric))
                declared[metric.name] = metric
            if not declared:
                continue
            tasks = [TaskView(slot.task_id, slot.runner.task_status, slot.task_config) for slot in group.slots]
            try:
                samples = list(connector.sample_metrics(tasks))
            except Exception as e:  # a plugin's failing metrics must not take the scrape down
                log.warning("metrics.sample_failed", connector=group.name, error=str(e))
                continue
            for name, labels, value in samples:
                if name not in declared:
                    log.warning("metrics.undeclared_sampled", connector=group.name, metric=name)
                    continue
                families[name].add_metric(list(labels), value)
        yield from families.values()


def _connector_family(metric: Metric) -> Any:
    kind = CounterMetricFamily if metric.kind == "counter" else GaugeMetricFamily
    return kind(metric.name, metric.help, labels=list(metric.labels))


class _SnapshotCollector(_Declared):
    """Snapshot records restore refused to use (checksum, fingerprint, schema, ahead of the events, ...), and the
    runs of the daemon's [snapshots] schedule when it has one."""

    FAMILIES = ("kafold_snapshots_rejected", "kafold_snapshot_runs", "kafold_snapshot_last_success_timestamp_seconds")

    def __init__(self, scheduler: Callable[[], SnapshotScheduler | None]) -> None:
        self.scheduler = scheduler

    def collect(self) -> Iterator[Any]:
        rejected, runs, last = (_new(name) for name in self.FAMILIES)
        for (aggregate, reason), n in sorted(REJECTED.items()):
            rejected.add_metric([aggregate, reason], n)
        sched = self.scheduler()
        if sched is not None:
            runs.add_metric(["ok"], float(sched.runs - sched.failures))
            runs.add_metric(["failed"], float(sched.failures))
            if sched.last_success_at is not None:
                last.add_metric([], sched.last_success_at)
        yield from (rejected, runs, last)


class _PrivacyCollector(_Declared):
    """The daemon process's key ring ([privacy]): keys cached, store reads, cache drops; absent without rules."""

    FAMILIES = ("kafold_privacy_keys_cached", "kafold_privacy_key_store_reads", "kafold_privacy_key_cache_drops")

    def __init__(self, protector: Callable[[], Protector | None]) -> None:
        self.protector = protector

    def collect(self) -> Iterator[Any]:
        cached, reads, drops = (_new(name) for name in self.FAMILIES)
        protector = self.protector()
        if protector is not None:
            ring = protector.ring
            cached.add_metric([], float(len(ring.cache)))
            reads.add_metric([], float(ring.store_reads))
            drops.add_metric([], float(ring.generation))
        yield from (cached, reads, drops)


# The aggregate runtime's counts (AggregateRuntime.counts) exported as outcomes, under their own names (as the
# projections' are: `duplicates`, `dead_lettered`).
COMMAND_OUTCOMES = ("accepted", "rejected", "duplicates", "dead_lettered", "refetched")
GATE_PHASES = (RECOVERING, LIVE, STOPPED)


class _AggregateCollector(_Declared):
    """The aggregates' figures: commands by outcome, producers renewed, fold errors and parked events, partitions by
    gate phase, and the idempotency windows (ids tracked, and ids forgotten: expired, or early for the bound)."""

    FAMILIES = ("kafold_aggregate_commands", "kafold_aggregate_producers_renewed", "kafold_aggregate_fold_errors",
                "kafold_aggregate_events_parked", "kafold_aggregate_partitions", "kafold_aggregate_idempotency_ids",
                "kafold_aggregate_idempotency_expired", "kafold_aggregate_idempotency_dropped_early",
                "kafold_aggregate_local_store_bytes", "kafold_aggregate_local_store_reads")

    def __init__(self, aggregates: Callable[[], dict[str, Any]]) -> None:
        self.aggregates = aggregates

    def collect(self) -> Iterator[Any]:
        (commands, renewed, fold_errors, parked, phases, held, expired, early, disk,
         disk_reads) = (_new(n) for n in self.FAMILIES)
        for name, slot in sorted(self.aggregates().items()):
            # AggregateRuntime.figures, or the sum over its worker processes (aggregate_processes > 1)
            figures = slot.runtime.figures() if hasattr(slot.runtime, "figures") else {}
            if "local_store_bytes" in figures:  # absent: no state_dir
                disk.add_metric([name], figures["local_store_bytes"])
                disk_reads.add_metric([name], figures["local_store_reads"])
            counts = getattr(slot.runtime, "counts", None)
            if counts is not None:
                for outcome in COMMAND_OUTCOMES:
                    commands.add_metric([name, outcome], float(counts.get(outcome, 0)))
                renewed.add_metric([name], float(counts.get("producers_renewed", 0)))
                fold_errors.add_metric([name], float(counts.get("fold_errors", 0)))
                parked.add_metric([name], float(counts.get("events_parked", 0)))
            gates = getattr(slot.runtime, "gates", None)
            if gates is not None:
                # a copy first: the runtime's thread adds and removes gates on assignments
                by_phase = collections.Counter(g.phase for g in list(gates.values()))
                for phase in GATE_PHASES:
                    phases.add_metric([name, phase], float(by_phase[phase]))
            if "window_ids" in figures:  # a runtime that keeps no window has no figures
                held.add_metric([name], figures["window_ids"])
                expired.add_metric([name], figures["window_expired"])
                early.add_metric([name], figures["window_dropped_early"])
        yield from (commands, renewed, fold_errors, parked, phases, held, expired, early, disk, disk_reads)
