"""Prometheus metrics of the daemon: counters fed per batch, lag and states read from the tasks at scrape time."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kafold import logs
from kafold.connectors.api import Metric, TaskView
from kafold.daemon.runner import BatchStats, RunnerView
from kafold.daemon.tasks import ConnectorGroup
from kafold.snapshot.select import REJECTED

log = logs.get(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TASK_STATES = ("UNASSIGNED", "RUNNING", "PAUSED", "FAILED", "RESTARTING", "STOPPED")
BATCH_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class DaemonMetrics:
    """One registry per daemon (so several can live in one process, e.g. in tests)."""

    def __init__(self, groups: Callable[[], list[ConnectorGroup]],
                 aggregates: Callable[[], dict[str, Any]] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ("connector", "task")
        self.events = Counter("kafold_events_processed", "Records handled by sink tasks (put, dead-lettered or "
                              "skipped).", labels, registry=self.registry)
        self.dead = Counter("kafold_dead_letters", "Records sent to a dead-letter topic.", labels,
                            registry=self.registry)
        self.skipped = Counter("kafold_events_skipped", "Records of event types the task does not handle, skipped "
                               "by rule.", labels, registry=self.registry)
        self.batches = Histogram("kafold_batch_duration_seconds", "Time to decode, put and commit one batch.",
                                 labels, buckets=BATCH_BUCKETS, registry=self.registry)
        self.registry.register(_TaskCollector(groups))
        self.registry.register(_AccountingCollector(groups))
        self.registry.register(ConnectorCollector(groups))
        self.registry.register(_SnapshotCollector())
        if aggregates is not None:
            self.registry.register(_AggregateCollector(aggregates))

    def observe(self, runner: RunnerView, stats: BatchStats) -> None:
        """The runners' on_batch hook (runs in the task's thread; prometheus_client is thread-safe)."""
        key = (runner.connector.name, str(runner.task_id))
        self.events.labels(*key).inc(stats.records)
        if stats.dead_lettered:
            self.dead.labels(*key).inc(stats.dead_lettered)
        if stats.skipped:
            self.skipped.labels(*key).inc(stats.skipped)
        self.batches.labels(*key).observe(stats.duration_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _TaskCollector(Collector):
    """Per-partition lag (records and event-time seconds), caught-up flags and task states, at scrape time."""

    def __init__(self, groups: Callable[[], list[ConnectorGroup]]) -> None:
        self.groups = groups

    def describe(self) -> list[Any]:
        return []  # dynamic: collected on each scrape

    def collect(self) -> Iterator[Any]:
        part = ("connector", "topic", "partition")
        lag = GaugeMetricFamily("kafold_consumer_lag_records", "Records between a task's position and the "
                                "partition's end offset.", labels=part)
        lag_s = GaugeMetricFamily("kafold_consumer_lag_seconds", "Age (event time) of the last handled event of a "
                                  "partition while records remain behind it; 0 when caught up.", labels=part)
        position = GaugeMetricFamily("kafold_consumer_position", "Next offset a task will handle.", labels=part)
        caught = GaugeMetricFamily("kafold_partition_caught_up", "1 once a partition reached the end offsets seen "
                                   "at its assignment.", labels=part)
        state = GaugeMetricFamily("kafold_task_state", "1 for the task's current state (Kafka Connect states).",
                                  labels=("connector", "task", "state"))
        task = ("connector", "task")
        started = CounterMetricFamily("kafold_task_runners_started", "Runners started for a task (its first start "
                                      "and each restart; since the task's last reload).", labels=task)
        stopped = CounterMetricFamily("kafold_task_runners_stopped", "Runners of a task that ended (a restart's old "
                                      "one, a failure); started = stopped + running.", labels=task)
        running = GaugeMetricFamily("kafold_task_runners_running", "1 while the task's runner runs.", labels=task)
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


class _AccountingCollector(Collector):
    """The offset accounting (daemon/accounting.py) per connector, task and partition: records seen, what became
    of them by outcome, and the records unaccounted for (seen minus the outcomes: a write in flight, else lost)."""

    OUTCOMES = ("applied", "duplicates", "stale", "dead_lettered", "skipped")

    def __init__(self, groups: Callable[[], list[ConnectorGroup]]) -> None:
        self.groups = groups

    def describe(self) -> list[Any]:
        return []  # dynamic: collected on each scrape

    def collect(self) -> Iterator[Any]:
        labels = ("connector", "task", "topic", "partition")
        seen = CounterMetricFamily("kafold_records_seen", "Records a sink task's runner consumed, per partition "
                                   "(since the runner started).", labels=labels)
        outcome = CounterMetricFamily("kafold_records_outcome", "What became of the records seen: applied, "
                                      "duplicates, stale, dead_lettered or skipped; their sum plus "
                                      "kafold_records_unaccounted is kafold_records_seen.", labels=(*labels, "outcome"))
        gap = GaugeMetricFamily("kafold_records_unaccounted", "Records seen whose outcome is not known: a write in "
                                "flight, 0 once done; a value that stays above 0 is a record lost on the way.",
                                labels=labels)
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
        return []  # dynamic: collected on each scrape

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
                families.setdefault(metric.name, _family(metric))
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


def _family(metric: Metric) -> Any:
    kind = CounterMetricFamily if metric.kind == "counter" else GaugeMetricFamily
    return kind(metric.name, metric.help, labels=list(metric.labels))


class _SnapshotCollector(Collector):
    """Snapshot records restore refused to use (checksum, fingerprint, schema, ahead of the events, ...)."""

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        family = CounterMetricFamily("kafold_snapshots_rejected", "Snapshot records never used by a restore, by "
                                     "aggregate type and reason (restore fell back to an older one or a full "
                                     "replay).", labels=("aggregate", "reason"))
        for (aggregate, reason), n in sorted(REJECTED.items()):
            family.add_metric([aggregate, reason], n)
        yield family


# The aggregate runtime's counts (AggregateRuntime.counts) exported as outcomes, under their own names (as the
# projections' are: `duplicates`, `dead_lettered`).
COMMAND_OUTCOMES = ("accepted", "rejected", "duplicates", "dead_lettered", "refetched")


class _AggregateCollector(Collector):
    """The aggregates' figures: commands by outcome, producers renewed, and the idempotency windows (ids tracked,
    and ids forgotten: expired, or early for the bound)."""

    def __init__(self, aggregates: Callable[[], dict[str, Any]]) -> None:
        self.aggregates = aggregates

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        commands = CounterMetricFamily("kafold_aggregate_commands", "Commands handled by this process's runtime, "
                                       "by outcome (accepted, rejected, duplicates: answered with their first "
                                       "decision, dead_lettered: not a command, refetched: fetched again after "
                                       "their commit, skipped).",
                                       labels=("aggregate", "outcome"))
        renewed = CounterMetricFamily("kafold_aggregate_producers_renewed", "Transactional producers replaced "
                                      "after a fatal error that was not a fence.", labels=("aggregate",))
        held = GaugeMetricFamily("kafold_aggregate_idempotency_ids", "Command ids the idempotency window tracks "
                                 "(at most idempotency_max_ids).", labels=("aggregate",))
        expired = CounterMetricFamily("kafold_aggregate_idempotency_expired", "Command ids forgotten once older "
                                      "than the window.", labels=("aggregate",))
        early = CounterMetricFamily("kafold_aggregate_idempotency_dropped_early", "Command ids forgotten before "
                                    "the window passed, to stay within idempotency_max_ids.", labels=("aggregate",))
        disk = GaugeMetricFamily("kafold_aggregate_local_store_bytes", "Bytes on disk of the local state stores "
                                 "of the partitions this process holds (daemon.state_dir).", labels=("aggregate",))
        disk_reads = CounterMetricFamily("kafold_aggregate_local_store_reads", "Aggregates read back from the local "
                                         "state store (not cached).", labels=("aggregate",))
        for name, slot in sorted(self.aggregates().items()):
            local = getattr(slot.runtime, "local", None)  # None: no state_dir
            if local is not None:
                disk.add_metric([name], float(local.disk_bytes()))
                disk_reads.add_metric([name], float(local.reads))
            counts = getattr(slot.runtime, "counts", None)
            if counts is not None:
                for outcome in COMMAND_OUTCOMES:
                    commands.add_metric([name, outcome], float(counts.get(outcome, 0)))
                renewed.add_metric([name], float(counts.get("producers_renewed", 0)))
            store = getattr(slot.runtime, "store", None)  # a runtime that keeps no window has no figures
            if store is None:
                continue
            w = store.window
            held.add_metric([name], float(len(w.times)))
            expired.add_metric([name], float(w.expired))
            early.add_metric([name], float(w.dropped_early))
        yield from (commands, renewed, held, expired, early, disk, disk_reads)
