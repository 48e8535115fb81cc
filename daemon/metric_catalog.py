"""Every metric family kafold exports on /metrics, declared once: the collectors build their families from this
table, and the dashboards, alert rules and docs are checked against it (tests/deploy/test_observability.py).

Counters are named without `_total` here, as prometheus_client takes them: the exposition adds `_total` (and
`_created` for the counters the daemon keeps itself). The built-in connectors declare theirs on their class
(`Connector.metrics`); `exported()` adds those. The process and platform collectors of prometheus_client
(`process_*`, `python_*`) are registered too but are not kafold's: they are listed in STANDARD_PREFIXES.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from kafold.connectors import registry

Kind = Literal["counter", "gauge", "histogram", "info"]

# Dashboard rows and the catalog's grouping, in the order a reader goes through them.
AREAS = ("build", "sink tasks", "offset accounting", "projections & rebuilds", "consistency waits", "effects",
         "aggregates", "snapshots", "protected data")
# Families the daemon's registry carries that prometheus_client defines (process and platform collectors).
STANDARD_PREFIXES = ("process_", "python_")

_TASK = ("connector", "task")
_PARTITION = ("connector", "topic", "partition")
_ACCOUNT = ("connector", "task", "topic", "partition")


@dataclass(frozen=True, slots=True)
class Family:
    """One exported metric family: its name as prometheus_client takes it, kind, help, labels and area."""

    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...]
    area: str

    def series(self) -> tuple[str, ...]:
        """The sample names this family shows in the exposition."""
        if self.kind == "counter":
            return (f"{self.name}_total", f"{self.name}_created")
        if self.kind == "histogram":
            return tuple(f"{self.name}_{s}" for s in ("bucket", "sum", "count", "created"))
        if self.kind == "info":
            return (f"{self.name}_info",)
        return (self.name,)


DAEMON: tuple[Family, ...] = (
    Family("kafold_build", "info", "The kafold build serving this /metrics: its version, Python's, librdkafka's.",
           ("version", "python", "implementation", "librdkafka"), "build"),
    # sink tasks: counters fed per batch (daemon.metrics.DaemonMetrics.observe); records = processed + skipped +
    # dead_letters
    Family("kafold_events_processed", "counter", "Records a sink task handled: put to the sink and not dead-lettered "
           "(skipped and dead-lettered records are counted apart).", _TASK, "sink tasks"),
    Family("kafold_events_skipped", "counter", "Records of event types the task does not handle, skipped by rule.",
           _TASK, "sink tasks"),
    Family("kafold_dead_letters", "counter", "Records sent to a dead-letter topic.", _TASK, "sink tasks"),
    Family("kafold_batch_duration_seconds", "histogram", "Time to decode, put and commit one batch.", _TASK,
           "sink tasks"),
    # sink tasks: read from the tasks at scrape time
    Family("kafold_consumer_lag_records", "gauge", "Records between a task's position and the partition's end "
           "offset.", _PARTITION, "sink tasks"),
    Family("kafold_consumer_lag_seconds", "gauge", "Age (event time) of the last handled event of a partition while "
           "records remain behind it; 0 when caught up.", _PARTITION, "sink tasks"),
    Family("kafold_consumer_position", "gauge", "Next offset a task will handle.", _PARTITION, "sink tasks"),
    Family("kafold_partition_caught_up", "gauge", "1 once a partition reached the end offsets seen at its "
           "assignment.", _PARTITION, "sink tasks"),
    Family("kafold_task_state", "gauge", "1 for the task's current state (Kafka Connect states).",
           (*_TASK, "state"), "sink tasks"),
    Family("kafold_task_runners_started", "counter", "Runners started for a task (its first start and each restart; "
           "since the task's last reload).", _TASK, "sink tasks"),
    Family("kafold_task_runners_stopped", "counter", "Runners of a task that ended (a restart's old one, a failure); "
           "started = stopped + running.", _TASK, "sink tasks"),
    Family("kafold_task_runners_running", "gauge", "1 while the task's runner runs.", _TASK, "sink tasks"),
    # a task in a child process (task_processes = true) is not in the daemon's process_* families: its own
    Family("kafold_task_process_cpu_seconds", "counter", "CPU time (user and system) of a sink task's child process "
           "(task_processes = true; absent for tasks run as threads of the daemon).", _TASK, "sink tasks"),
    Family("kafold_task_process_resident_memory_bytes", "gauge", "Resident memory of a sink task's child process "
           "(task_processes = true; absent for tasks run as threads of the daemon).", _TASK, "sink tasks"),
    # offset accounting (daemon/accounting.py)
    Family("kafold_records_seen", "counter", "Records a sink task's runner consumed, per partition (since the runner "
           "started).", _ACCOUNT, "offset accounting"),
    Family("kafold_records_outcome", "counter", "What became of the records seen: applied, duplicates, stale, "
           "dead_lettered or skipped; their sum plus kafold_records_unaccounted is kafold_records_seen.",
           (*_ACCOUNT, "outcome"), "offset accounting"),
    Family("kafold_records_unaccounted", "gauge", "Records seen whose outcome is not known: a write in flight, 0 "
           "once done; a value that stays above 0 is a record lost on the way.", _ACCOUNT, "offset accounting"),
    # consistency waits (GET /connectors/{name}/wait, daemon/visibility.py)
    Family("kafold_consistency_waits", "counter", "Waits for a consistency token answered, by result: covered (200), "
           "timeout (408: the connector did not cover the token in time), unreadable (503: its committed positions "
           "could not be read), refused (503: daemon.max_waits waits at once).", ("connector", "result"),
           "consistency waits"),
    Family("kafold_consistency_wait_duration_seconds", "histogram", "Time a wait for a consistency token took until "
           "its answer (covered or not).", ("connector",), "consistency waits"),
    # aggregates
    Family("kafold_aggregate_commands", "counter", "Commands handled by this process's runtime, by outcome "
           "(accepted, rejected, duplicates: answered with their first decision, dead_lettered: not a command, "
           "refetched: fetched again after their commit, skipped).", ("aggregate", "outcome"), "aggregates"),
    Family("kafold_aggregate_producers_renewed", "counter", "Transactional producers replaced after a fatal error "
           "that was not a fence.", ("aggregate",), "aggregates"),
    Family("kafold_aggregate_fold_errors", "counter", "Events the fold could not apply with on_fold_error = \"stop\" "
           "(each stops its partition's gate: no command is decided there until fixed).", ("aggregate",),
           "aggregates"),
    Family("kafold_aggregate_events_parked", "counter", "Events the fold could not apply, sent to the aggregate's "
           "dead-letter topic (on_fold_error = \"dead-letter\").", ("aggregate",), "aggregates"),
    Family("kafold_aggregate_partitions", "gauge", "Commands partitions assigned to this process, by catch-up gate "
           "phase (RECOVERING, LIVE, STOPPED: an event the fold cannot apply).", ("aggregate", "phase"),
           "aggregates"),
    Family("kafold_aggregate_idempotency_ids", "gauge", "Command ids the idempotency window tracks (at most "
           "idempotency_max_ids).", ("aggregate",), "aggregates"),
    Family("kafold_aggregate_idempotency_expired", "counter", "Command ids forgotten once older than the window.",
           ("aggregate",), "aggregates"),
    Family("kafold_aggregate_idempotency_dropped_early", "counter", "Command ids forgotten before the window passed, "
           "to stay within idempotency_max_ids.", ("aggregate",), "aggregates"),
    Family("kafold_aggregate_local_store_bytes", "gauge", "Bytes on disk of the local state stores of the partitions "
           "this process holds (daemon.state_dir).", ("aggregate",), "aggregates"),
    Family("kafold_aggregate_local_store_reads", "counter", "Aggregates read back from the local state store (not "
           "cached).", ("aggregate",), "aggregates"),
    # snapshots
    Family("kafold_snapshots_rejected", "counter", "Snapshot records never used by a restore, by aggregate type and "
           "reason (restore fell back to an older one or a full replay).", ("aggregate", "reason"), "snapshots"),
    Family("kafold_snapshot_runs", "counter", "Snapshot runs the daemon's [snapshots] schedule started, by result "
           "(ok, failed).", ("result",), "snapshots"),
    Family("kafold_snapshot_last_success_timestamp_seconds", "gauge", "Unix time the daemon's last scheduled "
           "snapshot run ended well (absent until one did).", (), "snapshots"),
    # protected data ([privacy], kafold.protect): the daemon process's key ring (its aggregates and the sink tasks
    # run as its threads; a task process has a ring of its own)
    Family("kafold_privacy_keys_cached", "gauge", "Subjects whose data key (or its absence) the daemon process has "
           "cached (at most [privacy] key_cache_max).", (), "protected data"),
    Family("kafold_privacy_key_store_reads", "counter", "Reads of the key store for data keys: cache misses and "
           "batch prefetches (a steady rise with a full cache: raise key_cache_max).", (), "protected data"),
    Family("kafold_privacy_key_cache_drops", "counter", "Times cached data keys were dropped: an erasure seen (the "
           "store's erasure mark moved) or the cache full.", (), "protected data"),
)

# Built-in connectors' metrics (declared on their classes) by name prefix, for the area they belong to.
_CONNECTOR_AREAS = (("kafold_effect_", "effects"), ("kafold_rebuild_", "projections & rebuilds"),
                    ("kafold_projection_", "projections & rebuilds"))


def daemon_family(name: str) -> Family:
    """The declaration of one of the daemon's own families (KeyError: a collector exports an undeclared one)."""
    return _BY_NAME[name]


def connector_families() -> list[Family]:
    """The metrics the built-in connectors declare (`Connector.metrics`), as families, once each (a third-party
    plugin's are its own to document and chart)."""
    seen: dict[str, Family] = {}
    for plugin in registry.available():
        connector = registry.resolve(plugin)
        if not connector.__module__.startswith("kafold."):
            continue
        for m in connector.metrics:
            area = next((a for prefix, a in _CONNECTOR_AREAS if m.name.startswith(prefix)), "connectors")
            seen.setdefault(m.name, Family(m.name, m.kind, m.help, m.labels, area))
    return list(seen.values())


def exported() -> list[Family]:
    """Every kafold family /metrics can show: the daemon's own and the built-in connectors'."""
    return [*DAEMON, *connector_families()]


def series_names(families: Iterable[Family]) -> set[str]:
    """Every sample name the families can show (what a PromQL selector may name)."""
    return {s for f in families for s in f.series()}


_BY_NAME = {f.name: f for f in DAEMON}
