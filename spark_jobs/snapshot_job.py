"""The snapshot job: fold each events partition (incrementally, on its base snapshots) and write snapshots.

Runs as `kafold snapshot run -c FILE` or through spark-submit on any cluster:
    JOB=$(python -c 'import kafold.spark_jobs.snapshot_job as m; print(m.__file__)')
    spark-submit --master spark://host:7077 "$JOB" -c kafold.toml

Per Kafka partition (one Spark task each, no shuffle: an aggregate's events all live in one partition) the data
source (kafold.spark_jobs.source) reads the base snapshots and the events after the lowest covered offset, folds
them with the aggregate's own `evolve`, and hands over one encoded snapshot per aggregate that changed; the
mapInArrow stage here writes them and the partition's marker, and reports progress and a summary row.

Offset note: snapshots are flushed (idempotent producer, acks=all) before the partition's marker is written, so a
marker is only ever seen after every snapshot it vouches for. A task or job killed halfway leaves snapshots that
are each correct for the offset they claim (restore and the next run just use them) and no new marker; a re-run
starts from the lowest usable covered offset and writes the same states again: nothing is folded twice.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
import time
from collections.abc import Iterator
from typing import Any

import orjson

from kafold import logs
from kafold.config import AggregateConfig, KafkaConfig
from kafold.errors import FatalError
from kafold.protect import Setup
from kafold.snapshot import kafka_io
from kafold.snapshot.partition import write_marker
from kafold.snapshot.record import H_KIND, KIND_SNAPSHOT
from kafold.snapshot.select import Identity
from kafold.spark_jobs import source
from kafold.spark_jobs.progress import watch
from kafold.spark_jobs.runs import REFRESH_LAG, JobResult, check_protected, partitions_of
from kafold.spark_jobs.source import HEADER, SNAPSHOT, STATS

log = logs.get(__name__)

SUMMARY = ("partition int, start long, end long, events_read long, events_folded long, skipped long, bad long, "
           "snapshots long, aggregates long, rejected string, fold_s double, write_s double")
_SNAPSHOT_HEADERS = [(H_KIND, KIND_SNAPSHOT)]


def write_partition(spec: str, progress: Any, batches: Iterator[Any]) -> Iterator[Any]:
    """mapInArrow body: the header, snapshot and stats rows of one Kafka partition in, one summary row out."""
    kafka, agg, python_path, _ = source.load_spec(spec)
    ident = source.identity_of(agg, python_path)  # the fold's identity, as the snapshots carry it
    producer = kafka_io.writer(kafka)
    producer.poll(0)  # start the producer's handshake now, while the fold runs
    topic = agg.topic("snapshot")
    current: dict[str, Any] = {}
    for batch in batches:
        kinds = batch.column(0).to_pylist()
        if kinds.count(SNAPSHOT) == len(kinds):  # the bulk: a batch of snapshots, all of one partition
            current["writes"].add(zip(batch.column(3).to_pylist(), batch.column(4).to_pylist(),
                                      itertools.repeat(_SNAPSHOT_HEADERS, len(kinds)), strict=True))
            continue
        for kind, part, off, key, value in zip(kinds, *(c.to_pylist() for c in batch.columns[1:]), strict=True):
            if kind == HEADER:
                if current:
                    yield _finish(producer, agg, ident, current)
                current = {"partition": part, "start": off, "header": orjson.loads(value), "stats": None,
                           "writes": kafka_io.Writes(producer, topic, part)}
            elif kind == SNAPSHOT:
                current["writes"].add([(key, value, _SNAPSHOT_HEADERS)])
            elif kind == STATS:
                current["stats"] = orjson.loads(value)
                if progress is not None:  # an accumulator: the driver sees it when the task ends
                    progress.add(current["stats"]["events_read"])
    if current:
        yield _finish(producer, agg, ident, current)


def _finish(producer: Any, agg: AggregateConfig, ident: Identity, current: dict[str, Any]) -> Any:
    # pyarrow: kafold[spark], only where a Spark job runs
    import pyarrow as pa

    p, end, stats = current["partition"], current["header"]["end"], current["stats"]
    if stats is None:  # the source stopped before its stats row: never vouch for an unfinished partition
        raise FatalError(f"aggregate {agg.name!r}: partition {p}: the fold ended before its last row")
    write_began = time.monotonic()
    written = current["writes"].flush()
    write_marker(producer, agg, ident, p, end)  # only after every snapshot above is acknowledged
    row = {"partition": p, "start": current["start"], "end": end, "events_read": stats["events_read"],
           "events_folded": stats["events_folded"], "skipped": stats["skipped"], "bad": stats["bad"],
           "snapshots": written, "aggregates": stats["aggregates"],
           "rejected": orjson.dumps(current["header"]["rejected"]).decode(), "fold_s": stats["fold_s"],
           "write_s": stats["encode_s"] + time.monotonic() - write_began}
    log.info("snapshot.partition", aggregate=agg.name, **{k: v for k, v in row.items() if k != "rejected"})
    return pa.RecordBatch.from_pylist([row], schema=_summary_schema(pa))


def _summary_schema(pa: Any) -> Any:
    types = {"int": pa.int32(), "long": pa.int64(), "string": pa.string(), "double": pa.float64()}
    return pa.schema([(name, types[kind]) for name, kind in (f.split() for f in SUMMARY.split(", "))])


def run(spark: Any, kafka: KafkaConfig, agg: AggregateConfig, python_path: list[str], *,
        partitions: list[int] | None = None, refresh_lag: int = REFRESH_LAG, reporter: Any = None,
        protection: Setup | None = None) -> JobResult:
    """Snapshot one aggregate type: one Spark task per events partition. `reporter(done, total, events)` is
    called while it runs (see kafold.tools.commands.snapshot for the progress display). `protection`
    (kafold.protect.setup of the configuration) is needed for an aggregate with protected fields: its tasks open
    their own key rings from it (kafold.spark_jobs.source)."""
    if agg.protect:  # refused here, in the driver, rather than in every task
        check_protected(agg, "spark", protection)
    began = time.monotonic()
    parts = partitions if partitions is not None else partitions_of(kafka, agg)
    spark.dataSource.register(source.KafkaFoldSource)
    spec = source.spec_json(kafka, agg, python_path, parts, refresh_lag, protection)
    counter = spark.sparkContext.accumulator(0)
    # the schema is given: no schema() round trip to a Python worker
    df = spark.read.format(source.NAME).schema(source.SCHEMA).option("spec", spec).load()
    out = df.mapInArrow(functools.partial(write_partition, spec, counter), SUMMARY)
    spark.sparkContext.setJobGroup(f"kafold-snapshot-{agg.name}", f"snapshot {agg.name}")
    with watch(spark, len(parts), counter, reporter):
        rows = [r.asDict() for r in out.collect()]
    result = JobResult(agg.name, engine="spark")
    for r in rows:
        result.add_row(r, orjson.loads(r["rejected"]))
    result.duration_s = time.monotonic() - began
    log.info("snapshot.job", aggregate=agg.name, engine="spark", partitions=result.partitions,
             events_read=result.events_read, events_folded=result.events_folded, snapshots=result.snapshots,
             aggregates=result.aggregates, bad=result.bad, rejected=result.rejected or None,
             duration_s=round(result.duration_s, 2), events_per_s=round(result.events_per_s))
    return result


def main(argv: list[str] | None = None) -> int:
    """spark-submit entry point: the same arguments as `kafold snapshot run`."""
    from kafold.tools.commands.snapshot import add_run_arguments, handle_run  # a layer up, as pyproject allows

    parser = argparse.ArgumentParser(prog="snapshot_job", description="kafold snapshot job")
    parser.add_argument("--log-format", choices=("auto", "json", "console"), default="auto")
    add_run_arguments(parser)
    args = parser.parse_args(argv)
    logs.configure("info", args.log_format)
    return handle_run(args)


if __name__ == "__main__":
    sys.exit(main())
