"""A snapshot run of one aggregate type: plan it, then fold small increments in this process and large ones in Spark.

A Spark job has a fixed cost whatever it folds (a JVM and its session, ~6 s here; then ~0.5-1 s a job for
planning the Python data source, starting Python workers and scheduling tasks, see docs/benchmarks.md). An
incremental run over a few thousand new events is a few tenths of a second of folding, so with `engine = "auto"`
a run first plans each partition (its end, its usable snapshots, so the events still to fold) and folds in this
process when the total is at most `local_max_events`; bigger runs, first runs over a long history and
`engine = "spark"` go to Spark. Both fold with the same code (kafold.snapshot.partition) and write the same
records, so a snapshot does not say, and does not need to say, which engine made it.

Offset note: the local run writes exactly what the Spark tasks write: per partition the snapshots at the end
captured when the partition was planned and then the marker, written only once every snapshot of the run is
acknowledged (kafold.snapshot.partition). Plans keep their
selections (the base snapshots) for the local run, up to KEEP_BASES of them; past that a partition is planned
again when it is folded, which reads its snapshots twice but bounds the memory a plan holds.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kafold import kafka_clients, logs
from kafold.config import AggregateConfig, KafkaConfig
from kafold.errors import ConfigError, FatalError
from kafold.protect import AGGREGATE_ID, Protector, Setup
from kafold.snapshot import kafka_io
from kafold.snapshot.fold import Domain
from kafold.snapshot.partition import (
    Prefetched,
    fold_partition,
    fold_partitions,
    marker,
    progress_logger,
    select_partitions,
)
from kafold.snapshot.select import Selection

log = logs.get(__name__)
KEEP_BASES = 200_000
PLAN_TOGETHER = 8  # partitions planned at a time (their selections are in memory together)
PREFETCH_MAX = 50_000  # new events a plan may read ahead for the local run (held in memory until folded)
# Unchanged aggregates whose snapshot lags the range end by more than this many offsets get theirs moved
# forward, so dormant aggregates do not hold every later run and restore back at an old offset.
REFRESH_LAG = 100_000
Reporter = Callable[[int, int, int], None]  # (partitions done, partitions in all, events read so far)


@dataclass
class JobResult:
    """What one run did for one aggregate type."""

    aggregate: str
    partitions: int = 0
    events_read: int = 0
    events_folded: int = 0
    snapshots: int = 0
    aggregates: int = 0
    bad: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    duration_s: float = 0.0
    rows: list[dict[str, Any]] = field(default_factory=list)
    engine: str = "spark"
    plan_s: float = 0.0  # planning (auto): reading each partition's end and snapshots before choosing

    @property
    def events_per_s(self) -> float:
        return self.events_read / self.duration_s if self.duration_s > 0 else 0.0

    def add_row(self, row: dict[str, Any], rejected: dict[str, int]) -> None:
        self.rows.append(row)
        self.partitions += 1
        for name in ("events_read", "events_folded", "snapshots", "aggregates", "bad"):
            setattr(self, name, getattr(self, name) + row[name])
        for reason, n in rejected.items():
            self.rejected[reason] = self.rejected.get(reason, 0) + n


def partitions_of(kafka: KafkaConfig, agg: AggregateConfig, client: Any = None) -> list[int]:
    """The events topic's partitions (from the broker); the snapshot topic must have as many."""
    meta = (client or kafka_clients.admin(kafka)).list_topics(timeout=15)
    counts = {t: len(meta.topics[t].partitions) for t in (agg.topic("events"), agg.topic("snapshot"))
              if t in meta.topics and meta.topics[t].error is None}
    events, snaps = counts.get(agg.topic("events")), counts.get(agg.topic("snapshot"))
    if events is None or snaps is None:
        missing = agg.topic("events") if events is None else agg.topic("snapshot")
        raise FatalError(f"aggregate {agg.name!r}: topic {missing!r} does not exist; run `kafold topics ensure`")
    if events != snaps:
        raise FatalError(f"aggregate {agg.name!r}: snapshot topic {agg.topic('snapshot')!r} has {snaps} partitions "
                         f"but must be co-partitioned with {agg.topic('events')!r} ({events})")
    return list(range(events))


@dataclass
class RunPlan:
    """Per partition, the range still to fold; `selections` keeps the plans a local run can reuse."""

    pending: dict[int, int] = field(default_factory=dict)  # partition -> events in [start, end)
    selections: dict[int, Selection] = field(default_factory=dict)
    prefetched: dict[int, Prefetched] = field(default_factory=dict)  # new events read while planning
    duration_s: float = 0.0

    @property
    def events(self) -> int:
        return sum(self.pending.values())


def plan(kafka: KafkaConfig, agg: AggregateConfig, domain: Domain, partitions: list[int],
         stop_above: int | None = None, reader: Any = None) -> RunPlan:
    """Plan every partition (stops early once more than `stop_above` events are pending: Spark will run).
    `partitions` come from `partitions_of`, which found both topics.

    Partitions are planned PLAN_TOGETHER at a time with one reader (their ends and snapshot partitions read
    together: one fetch wait for the ends instead of one per partition) and the same selection restore uses.
    Where the last run ended is known (`kafka_io.progress`), the events since are fetched in the same read, up
    to PREFETCH_MAX of them, for the local run to fold without fetching them again."""
    began = time.monotonic()
    out = RunPlan()
    kept = 0
    consumer = reader or kafka_io.reader(kafka)
    try:
        hints = kafka_io.progress(consumer, agg.topic("events"), partitions)
        for i in range(0, len(partitions), PLAN_TOGETHER):
            chunk = partitions[i:i + PLAN_TOGETHER]
            budget = PREFETCH_MAX - sum(len(pre.offsets) for pre in out.prefetched.values())
            for sel in select_partitions(consumer, agg, domain.identity, chunk, topic_exists=True,
                                         prefetch=hints, prefetch_max=budget, prefetched=out.prefetched):
                out.pending[sel.partition] = sel.end - sel.start
                if kept + len(sel.bases) <= KEEP_BASES:
                    out.selections[sel.partition] = sel
                    kept += len(sel.bases)
            if stop_above is not None and out.events > stop_above:
                break
    finally:
        if reader is None:
            consumer.close()
    out.duration_s = time.monotonic() - began
    return out


def run_local(kafka: KafkaConfig, agg: AggregateConfig, domain: Domain, partitions: list[int], *,
              refresh_lag: int = REFRESH_LAG, planned: RunPlan | None = None,
              reporter: Reporter | None = None, reader: Any = None) -> JobResult:
    """Fold every partition in this process: the planned ones with their tails read together, the others (plans
    past KEEP_BASES) one after the other; hand each one's snapshots to the producer, then wait for all of them to
    be acknowledged and write the markers (what the Spark tasks do per partition, with two waits for the broker
    instead of two per partition). A partition's folded states are dropped once its snapshots are encoded."""
    began = time.monotonic()
    result = JobResult(agg.name, engine="local", plan_s=planned.duration_s if planned else 0.0)
    selections = planned.selections if planned else {}
    consumer = reader or kafka_io.reader(kafka)
    producer = kafka_io.writer(kafka)
    topic = agg.topic("snapshot")
    done: list[tuple[dict[str, Any], kafka_io.Writes, Selection]] = []
    try:
        planned_together = fold_partitions(consumer, agg, domain, [selections.pop(p) for p in partitions
                                                                    if p in selections],
                                           prefetched=planned.prefetched if planned else None,
                                           on_batch=lambda p: progress_logger(agg, p))
        together = {f.selection.partition: f for f in planned_together}
        for n, p in enumerate(partitions):
            folded = together.pop(p, None) or fold_partition(consumer, agg, domain, p,
                                                             on_batch=progress_logger(agg, p))
            write_began = time.monotonic()
            sel, folder = folded.selection, folded.folder
            writes = kafka_io.Writes(producer, topic, p)
            writes.add(folder.held.encoded_snapshots(p, sel.end, refresh_lag))
            done.append(({"partition": p, "start": sel.start, "end": sel.end, "events_read": folder.read,
                          "events_folded": folder.folded, "skipped": folder.skipped, "bad": folder.bad,
                          "snapshots": writes.count, "aggregates": len(folder.held.entries), "fold_s": folded.fold_s,
                          "write_s": time.monotonic() - write_began}, writes, sel))
            if reporter is not None:
                reporter(n + 1, len(partitions), sum(row["events_read"] for row, _, _ in done))
        flush_began = time.monotonic()
        for _, writes, _ in done:
            writes.flush()  # every snapshot acknowledged before any marker that vouches for it is written
        markers = [kafka_io.Writes(producer, topic, sel.partition) for _, _, sel in done]
        for writes, (_, _, sel) in zip(markers, done, strict=True):
            writes.add([marker(domain.identity, sel.partition, sel.end).encode()])
        for writes in markers:
            writes.flush()
        flush_s = time.monotonic() - flush_began
    finally:
        if reader is None:
            consumer.close()
    for row, _, sel in done:
        row["write_s"] += flush_s / len(done)  # the shared waits, spread evenly
        log.info("snapshot.partition", aggregate=agg.name, engine="local", **row)
        result.add_row(row, dict(sel.rejected))
    result.duration_s = time.monotonic() - began + result.plan_s
    log.info("snapshot.job", aggregate=agg.name, engine="local", partitions=result.partitions,
             events_read=result.events_read, events_folded=result.events_folded, snapshots=result.snapshots,
             aggregates=result.aggregates, bad=result.bad, rejected=result.rejected or None,
             plan_s=round(result.plan_s, 3), duration_s=round(result.duration_s, 3),
             events_per_s=round(result.events_per_s))
    return result


def _ends(result: JobResult) -> dict[int, int]:
    """Each partition's end a finished run snapshotted up to (its marker's offset)."""
    return {row["partition"]: row["end"] for row in result.rows}


@contextlib.contextmanager
def _cyclic_gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while a run plans and folds in this process. The plan and fold
    allocate tens of thousands of objects that stay alive (snapshots, states), which sets off full collections
    that scan the whole heap: 20-45 ms of a 0.3 s increment, measured (docs/benchmarks.md). The run makes no
    reference cycles of its own, so nothing waits for the collector but what a domain's code might leave; the
    collector runs again once the run is over. Runs past `local_max_events` go to Spark outside this."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def choose(engine: str, planned: RunPlan | None, local_max_events: int) -> str:
    """"local" or "spark" for a run: the configured engine, or with auto the plan's size against the limit."""
    if engine != "auto":
        return engine
    return "local" if planned is not None and planned.events <= local_max_events else "spark"


def check_protected(agg: AggregateConfig, engine: str, protection: Setup | None) -> None:
    """A snapshot's state is sealed whole under the aggregate id's key: refused when a rule takes its subject from
    a payload path (the state would mix subjects' data, and would be written in clear); a Spark run needs the
    privacy settings its tasks open their key rings with."""
    if any(rule.subject != AGGREGATE_ID for rule in agg.protect):
        raise ConfigError([f"aggregate {agg.name!r}: snapshots of aggregates with protected fields are supported "
                           "only when every protect rule's subject is `aggregate_id`"])
    if engine != "local" and protection is None:
        raise ConfigError([f"aggregate {agg.name!r} has protected fields: a Spark run needs the configuration's "
                           "privacy settings (runs.run(..., protector=kafold.protect.build(cfg)))"])


def run(kafka: KafkaConfig, agg: AggregateConfig, python_path: list[str], spark: Callable[[], Any], *,
        engine: str = "auto", local_max_events: int = 200_000, refresh_lag: int = REFRESH_LAG,
        reporter: Reporter | None = None, protector: Protector | None = None) -> JobResult:
    """Snapshot one aggregate type with the engine `engine` asks for; `spark()` gives the SparkSession (started
    only when a run needs it). The result's duration is the whole run but the SparkSession's start.
    `protector` (kafold.protect.build of the caller's configuration), for an aggregate with protected fields: an
    in-process run folds with it; a Spark run's tasks open key rings of their own, from its Setup."""
    protection = protector.setup if protector is not None else None
    if agg.protect:
        check_protected(agg, engine, protection)
    began = time.monotonic()
    planned: RunPlan | None = None
    if engine == "spark":
        parts = partitions_of(kafka, agg)
        log.info("snapshot.plan", aggregate=agg.name, engine="spark", configured=engine, partitions=len(parts))
    else:
        kafka_io.writer(kafka)  # first: the idempotent producer's handshake runs while the plan reads
        reader = kafka_io.reader(kafka)  # one reader (one connection) for the metadata, the plan and the fold
        try:
            with _cyclic_gc_paused():
                parts = partitions_of(kafka, agg, reader)
                domain = Domain.load(agg, python_path, protector)
                planned = plan(kafka, agg, domain, parts, stop_above=local_max_events if engine == "auto" else None,
                               reader=reader)
                chosen = choose(engine, planned, local_max_events)
                log.info("snapshot.plan", aggregate=agg.name, engine=chosen, configured=engine, partitions=len(parts),
                         pending_events=planned.events, plan_s=round(planned.duration_s, 3))
                if chosen == "local":
                    result = run_local(kafka, agg, domain, parts, refresh_lag=refresh_lag, planned=planned,
                                       reporter=reporter, reader=reader)
                    kafka_io.record_progress(reader, agg.topic("events"), _ends(result))
                    result.duration_s = time.monotonic() - began
                    return result
                planned.prefetched.clear()  # Spark reads for itself
        finally:
            reader.close()
    from kafold.spark_jobs import snapshot_job  # a cycle: snapshot_job builds on this module

    before_job = time.monotonic() - began
    result = snapshot_job.run(spark(), kafka, agg, python_path, partitions=parts, refresh_lag=refresh_lag,
                              reporter=reporter, protection=protection)
    reader = kafka_io.reader(kafka)
    try:
        kafka_io.record_progress(reader, agg.topic("events"), _ends(result))
    finally:
        reader.close()
    result.plan_s = planned.duration_s if planned is not None else 0.0
    result.duration_s += before_job
    return result
