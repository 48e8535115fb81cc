"""Snapshot job fold rate (Spark), incremental run cost, and restore (snapshot + tail) vs full replay."""

from __future__ import annotations

import argparse
import contextlib
import random
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kafold import devstack, kafka_clients, logs, topics
from kafold.config import SNAPSHOT_TOPIC_CONFIGS, AggregateConfig, KafkaConfig, TopicSpec, load_file
from kafold.envelope import Event, encode
from kafold.snapshot import Domain, folder, kafka_io, restore
from kafold.snapshot.record import Marker
from kafold.spark_jobs import runs
from kafold.spark_jobs.session import session
from kafold.tools.bench import embedded_stack

log = logs.get(__name__)
BANK = Path(__file__).resolve().parents[3] / "examples" / "bank"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="histories scaled down ~10x (for a smoke run)")
    p.add_argument("--master", default="local[2]", help="Spark master for the fold measurement (default local[2])")
    p.add_argument("-c", "--config", help="kafold.toml giving [kafka] (default: the dev stack, started if needed)")


@contextlib.contextmanager
def _broker(config: str | None, broker: str | None) -> Iterator[Any]:
    if config:
        yield devstack.effective(load_file(config).config, need=("kafka",)).kafka
        return
    with embedded_stack("snapshots", broker) as (bootstrap, _):
        yield KafkaConfig(bootstrap_servers=bootstrap)


class AccountHistory:
    """A bank-account history (open, then deposits and withdrawals) for `aggregates` accounts, produced to an
    aggregate's events topic; remembers each account's version so it can be extended."""

    def __init__(self, kafka: Any, agg: Any, aggregates: int, seed: int = 7) -> None:
        self.agg, self.rng = agg, random.Random(seed)
        self.ids = [f"acc-{i:07d}" for i in range(aggregates)]
        self.versions = dict.fromkeys(self.ids, 0)
        settings: dict[str, Any] = {"enable.idempotence": True, "linger.ms": 50, "batch.num.messages": 10000}
        self.producer = kafka_clients.producer(kafka, **settings)

    def produce(self, n: int) -> None:
        topic, name, at, rng, versions = self.agg.topic("events"), self.agg.name, "2024-05-01T12:00:00.000000Z", \
            self.rng, self.versions
        for i in range(n):
            aid = self.ids[i % len(self.ids)] if i < len(self.ids) and versions[self.ids[i]] == 0 \
                else rng.choice(self.ids)
            v = versions[aid] = versions[aid] + 1
            payload: dict[str, Any]
            if v == 1:
                kind, payload = "AccountOpened", {"owner": f"owner {aid}", "currency": "EUR"}
            elif rng.random() < 0.6:
                kind, payload = "MoneyDeposited", {"amount": rng.randint(1, 500) * 100}
            else:
                kind, payload = "MoneyWithdrawn", {"amount": rng.randint(1, 300) * 100}
            key, value, headers = encode(Event(f"{aid}/{v}", kind, name, aid, v, at, f"{aid}/{v}", payload))
            kafka_clients.produce(self.producer, topic, value, key, headers)
            if i % 5000 == 0:
                self.producer.poll(0)
        self.producer.flush(120)


def _aggregate(name: str, partitions: int) -> Any:
    return AggregateConfig(name=name, initial="bank_domain:initial", evolve="bank_domain:evolve",
                           decide="bank_domain:decide", partitions=partitions, fingerprint="bench-v1")


def _topics(kafka: Any, agg: Any) -> None:
    topics.ensure(kafka, [TopicSpec(agg.topic("events"), agg.partitions, 1, {}),
                          TopicSpec(agg.topic("snapshot"), agg.partitions, 1, dict(SNAPSHOT_TOPIC_CONFIGS))])


def _pass_through(batches: Iterator[Any]) -> Iterator[Any]:
    yield from batches


def _job_floor(spark: Any, partitions: int, runs: int = 3) -> float:
    """The fixed cost of a Spark job of the snapshot job's shape doing nothing: a Python data source with
    `partitions` input partitions, one row each, through a mapInArrow stage (best of `runs`)."""
    # pyspark: kafold[spark], only where a Spark job runs
    from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

    class _Reader(DataSourceReader):
        def __init__(self, n: int) -> None:
            self.n = n

        def partitions(self) -> list[InputPartition]:
            return [InputPartition(i) for i in range(self.n)]

        def read(self, partition: InputPartition) -> Iterator[Any]:
            # pyarrow: kafold[spark], only where a Spark job runs
            import pyarrow as pa

            yield pa.RecordBatch.from_pylist([{"x": partition.value}], schema=pa.schema([("x", pa.int64())]))

    class _Noop(DataSource):
        @classmethod
        def name(cls) -> str:
            return "kafold_bench_noop"

        def schema(self) -> str:
            return "x long"

        def reader(self, schema: Any) -> DataSourceReader:
            return _Reader(int(self.options["partitions"]))

    spark.dataSource.register(_Noop)
    best = float("inf")
    for _ in range(runs):
        began = time.monotonic()
        (spark.read.format("kafold_bench_noop").schema("x long").option("partitions", str(partitions)).load()
         .mapInArrow(_pass_through, "x long").collect())
        best = min(best, time.monotonic() - began)
    return best


def _fold(kafka: Any, master: str, events: int, aggregates: int) -> dict[str, Any]:
    """The full run (Spark, forced: a --quick history is small enough for auto to fold it in-process), then 1% new
    events folded as `kafold snapshot run` does by default (engine auto: in-process), then another 1% with Spark
    forced, so both incremental costs are shown against the full run."""
    from kafold.spark_jobs import snapshot_job  # lazy: it imports pyspark, which only this case needs

    began = time.monotonic()
    spark = session(master)
    startup = time.monotonic() - began
    run_id = uuid.uuid4().hex[:6]
    warm = _aggregate(f"bench.warm.{run_id}", 4)  # first query starts the Python workers: not steady state
    _topics(kafka, warm)
    AccountHistory(kafka, warm, 1000).produce(20_000)
    snapshot_job.run(spark, kafka, warm, [str(BANK)])
    floor = _job_floor(spark, warm.partitions)
    agg = _aggregate(f"bench.fold.{run_id}", 4)
    _topics(kafka, agg)
    history = AccountHistory(kafka, agg, aggregates)
    history.produce(events)
    full = runs.run(kafka, agg, [str(BANK)], lambda: spark, engine="spark")  # the Spark fold rate (target)
    history.produce(events // 100)
    incremental = runs.run(kafka, agg, [str(BANK)], lambda: spark, engine="auto")
    history.produce(events // 100)
    incremental_spark = runs.run(kafka, agg, [str(BANK)], lambda: spark, engine="spark")
    task_fold = sum(r["events_read"] for r in full.rows) / max(1e-9, max(r["fold_s"] for r in full.rows))
    return {"spark_startup_s": round(startup, 2), "fold_engine": full.engine, "fold_events": full.events_read,
            "fold_aggregates": aggregates, "fold_job_s": round(full.duration_s, 2),
            "fold_events_per_s": round(full.events_per_s), "fold_task_events_per_s": round(task_fold),
            "incremental_engine": incremental.engine, "incremental_events": incremental.events_read,
            "incremental_snapshots": incremental.snapshots, "incremental_plan_s": round(incremental.plan_s, 3),
            "incremental_job_s": round(incremental.duration_s, 3),
            "incremental_cost_ratio": round(incremental.duration_s / full.duration_s, 4),
            "incremental_spark_events": incremental_spark.events_read,
            "incremental_spark_job_s": round(incremental_spark.duration_s, 3),
            "incremental_spark_cost_ratio": round(incremental_spark.duration_s / full.duration_s, 4),
            "spark_job_floor_s": round(floor, 3)}


def _restore_case(kafka: Any, history_events: int, tail: int, aggregates: int) -> tuple[float, float, int]:
    """(restore seconds, full replay seconds, events read by restore) for one 1-partition history."""
    agg = _aggregate(f"bench.restore.{uuid.uuid4().hex[:6]}", 1)
    _topics(kafka, agg)
    history = AccountHistory(kafka, agg, aggregates)
    history.produce(history_events - tail)
    domain = Domain.load(agg, [str(BANK)])
    consumer = kafka_io.reader(kafka)
    low, end = kafka_io.bounds(consumer, agg.topic("events"), 0)
    folds = folder(domain)  # the same fold and writes a snapshot job task does
    folds.fold_messages(kafka_io.read_range(consumer, agg.topic("events"), 0, low, end))
    producer = kafka_io.writer(kafka)
    kafka_io.write(producer, agg.topic("snapshot"), 0, folds.held.snapshots(0, end))
    ident = domain.identity
    kafka_io.write(producer, agg.topic("snapshot"), 0,
                   [Marker(ident.aggregate_type, 0, end, ident.fingerprint, ident.state_schema_version)])
    history.produce(tail)
    fast = [restore(kafka, agg, domain, 0, consumer=consumer) for _ in range(3)]
    slow = restore(kafka, agg, domain, 0, use_snapshots=False, consumer=consumer)
    consumer.close()
    if fast[-1].states != slow.states:
        raise AssertionError("restore from snapshot + tail differs from the full replay")
    return min(r.duration_s for r in fast), slow.duration_s, fast[-1].events_read


def run(args: argparse.Namespace) -> dict[str, Any]:
    scale = 10 if args.quick else 1
    figures: dict[str, Any] = {"quick": bool(args.quick), "master": args.master}
    with _broker(args.config, args.broker) as kafka:
        figures.update(_fold(kafka, args.master, 2_000_000 // scale, 20_000 // scale))
        tail = 10_000 // scale
        small_restore, small_replay, read = _restore_case(kafka, 1_000_000 // scale, tail, 10_000 // scale)
        big_restore, big_replay, _ = _restore_case(kafka, 4_000_000 // scale, tail, 10_000 // scale)
    figures.update({
        "restore_events": 1_000_000 // scale, "restore_tail": tail, "restore_events_read": read,
        "restore_s": round(small_restore, 3), "full_replay_s": round(small_replay, 3),
        "restore_speedup": round(small_replay / small_restore, 1),
        "restore_4x_history_s": round(big_restore, 3), "full_replay_4x_history_s": round(big_replay, 3),
        "restore_flatness": round(big_restore / small_restore, 2)})
    return figures
