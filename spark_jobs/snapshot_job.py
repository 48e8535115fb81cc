"""The snapshot job: fold each events partition (incrementally, on its base snapshots) and write snapshots.

Runs as `kafold snapshot run -c FILE` or through spark-submit on any cluster:
    JOB=$(python -c 'import kafold.spark_jobs.snapshot_job as m; print(m.__file__)')
    spark-submit --master spark://host:7077 "$JOB" -c kafold.toml

Per Kafka partition (one Spark task each, no shuffle: an aggregate's events all live in one partition) the task
gets its header, base snapshots and the events after the lowest covered offset from the data source, folds them
with the aggregate's own `evolve`, and writes a snapshot at the range end for every aggregate that changed.

Offset note: snapshots are flushed (idempotent producer, acks=all) before the partition's marker is written, so a
marker is only ever seen after every snapshot it vouches for. A task or job killed halfway leaves snapshots that
are each correct for the offset they claim (restore and the next run just use them) and no new marker; a re-run
starts from the lowest usable covered offset and writes the same states again: nothing is folded twice.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson

from kafold import kafka_clients, logs
from kafold.config import AggregateConfig, KafkaConfig
from kafold.errors import FatalError
from kafold.snapshot import kafka_io
from kafold.snapshot.fold import Domain, Folder
from kafold.snapshot.record import Marker
from kafold.spark_jobs.source import BASE, HEADER, NAME, SCHEMA, KafkaEventsSource, load_spec, spec_json, unpack

log = logs.get(__name__)

# Unchanged aggregates whose snapshot lags the range end by more than this many offsets get theirs moved
# forward, so dormant aggregates do not hold every later run and restore back at an old offset.
REFRESH_LAG = 100_000
SUMMARY = ("partition int, start long, end long, events_read long, events_folded long, skipped long, bad long, "
           "snapshots long, aggregates long, rejected string, fold_s double, write_s double")

_DOMAINS: dict[str, Domain] = {}  # per Python worker process: import the domain once


def _domain(agg: AggregateConfig, python_path: list[str]) -> Domain:
    key = f"{agg.name}|{agg.initial}|{agg.evolve}|{agg.fingerprint}|{agg.state_schema_version}"
    if key not in _DOMAINS:
        _DOMAINS[key] = Domain.load(agg, python_path)
    return _DOMAINS[key]


def fold_partition(spec: str, refresh_lag: int, progress: Any, batches: Iterator[Any]) -> Iterator[Any]:
    """mapInArrow body: header + bases + events of one Kafka partition in, one summary row out."""
    import pyarrow as pa
    import pyarrow.compute as pc

    kafka, agg, python_path, _ = load_spec(spec)
    domain = _domain(agg, python_path)
    kafka_io.writer(kafka).poll(0)  # start the producer's handshake now, while the fold runs
    current: dict[str, Any] = {}
    began = time.monotonic()
    for batch in batches:
        head = int(pc.sum(pc.less(batch.column(0), BASE + 1)).as_py() or 0)  # header/base rows come first
        if head:
            for kind, part, off, key, value in zip(*(c.to_pylist() for c in batch.slice(0, head).columns),
                                                   strict=True):
                if kind == HEADER:
                    if current:
                        yield _finish(kafka, agg, current, refresh_lag, began)
                    current = {"partition": part, "start": off, "header": orjson.loads(value),
                               "folder": Folder(domain)}
                    began = time.monotonic()
                else:
                    version, covered, state = orjson.loads(value)
                    current["folder"].add_base(key, version, covered, state)
            batch = batch.slice(head)
        folder: Folder = current["folder"] if current else None  # type: ignore[assignment]
        for packed in batch.column(4):
            offsets, keys, values = unpack(pa, packed)
            folder.fold(offsets, keys, values)
            if progress is not None:
                progress.add(len(offsets))
    if current:
        yield _finish(kafka, agg, current, refresh_lag, began)


def _finish(kafka: KafkaConfig, agg: AggregateConfig, current: dict[str, Any], refresh_lag: int,
            began: float) -> Any:
    import pyarrow as pa

    folder: Folder = current["folder"]
    p, end = current["partition"], current["header"]["end"]
    folded_at = time.monotonic()
    folder.log_bad(p)
    producer = kafka_io.writer(kafka)
    ident = folder.domain.identity
    written = kafka_io.write(producer, agg.topic("snapshot"), p, folder.snapshots(p, end, refresh_lag))
    # Only after every snapshot above is acknowledged: the marker vouching for them.
    kafka_io.write(producer, agg.topic("snapshot"), p,
                   [Marker(ident.aggregate_type, p, end, ident.fingerprint, ident.state_schema_version)])
    done = time.monotonic()
    row = {"partition": p, "start": current["start"], "end": end, "events_read": folder.read,
           "events_folded": folder.folded, "skipped": folder.skipped, "bad": folder.bad, "snapshots": written,
           "aggregates": len(folder.entries), "rejected": orjson.dumps(current["header"]["rejected"]).decode(),
           "fold_s": folded_at - began, "write_s": done - folded_at}
    log.info("snapshot.partition", aggregate=agg.name, **{k: v for k, v in row.items() if k != "rejected"})
    return pa.RecordBatch.from_pylist([row], schema=_summary_schema(pa))


def _summary_schema(pa: Any) -> Any:
    types = {"int": pa.int32(), "long": pa.int64(), "string": pa.string(), "double": pa.float64()}
    return pa.schema([(name, types[kind]) for name, kind in (f.split() for f in SUMMARY.split(", "))])


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

    @property
    def events_per_s(self) -> float:
        return self.events_read / self.duration_s if self.duration_s > 0 else 0.0


def partitions_of(kafka: KafkaConfig, agg: AggregateConfig) -> list[int]:
    """The events topic's partitions (from the broker); the snapshot topic must have as many."""
    meta = kafka_clients.admin(kafka).list_topics(timeout=15)
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


def run(spark: Any, kafka: KafkaConfig, agg: AggregateConfig, python_path: list[str], *,
        partitions: list[int] | None = None, refresh_lag: int = REFRESH_LAG, reporter: Any = None) -> JobResult:
    """Snapshot one aggregate type: one Spark task per events partition. `reporter(done, total, events)` is
    called while it runs (see kafold.commands.snapshot for the progress display)."""
    from kafold.spark_jobs.progress import watch

    began = time.monotonic()
    parts = partitions if partitions is not None else partitions_of(kafka, agg)
    spark.dataSource.register(KafkaEventsSource)
    spec = spec_json(kafka, agg, python_path, parts)
    counter = spark.sparkContext.accumulator(0)
    df = spark.read.format(NAME).schema(SCHEMA).option("spec", spec).load()  # given: no schema() round trip
    out = df.mapInArrow(functools.partial(fold_partition, spec, refresh_lag, counter), SUMMARY)
    spark.sparkContext.setJobGroup(f"kafold-snapshot-{agg.name}", f"snapshot {agg.name}")
    with watch(spark, len(parts), counter, reporter):
        rows = [r.asDict() for r in out.collect()]
    result = JobResult(agg.name, len(rows), rows=rows, duration_s=time.monotonic() - began)
    for r in rows:
        result.events_read += r["events_read"]
        result.events_folded += r["events_folded"]
        result.snapshots += r["snapshots"]
        result.aggregates += r["aggregates"]
        result.bad += r["bad"]
        for reason, n in orjson.loads(r["rejected"]).items():
            result.rejected[reason] = result.rejected.get(reason, 0) + n
    log.info("snapshot.job", aggregate=agg.name, partitions=result.partitions, events_read=result.events_read,
             events_folded=result.events_folded, snapshots=result.snapshots, aggregates=result.aggregates,
             bad=result.bad, rejected=result.rejected or None, duration_s=round(result.duration_s, 2),
             events_per_s=round(result.events_per_s))
    return result


def main(argv: list[str] | None = None) -> int:
    """spark-submit entry point: the same arguments as `kafold snapshot run`."""
    from kafold.commands.snapshot import add_run_arguments, handle_run

    parser = argparse.ArgumentParser(prog="snapshot_job", description="kafold snapshot job")
    parser.add_argument("--log-format", choices=("auto", "json", "console"), default="auto")
    add_run_arguments(parser)
    args = parser.parse_args(argv)
    logs.configure("info", args.log_format)
    return handle_run(args)


if __name__ == "__main__":
    sys.exit(main())
