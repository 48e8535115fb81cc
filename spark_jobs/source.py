"""A PySpark Python Data Source over Kafka that folds where it reads: one input partition per events partition.

Each input partition reads, with confluent-kafka, the partition's usable base snapshots and then the events at
offsets [start, end) (`start`: the lowest offset a base snapshot leaves unfolded), folds them with the aggregate's
own `evolve` (kafold.snapshot.partition: the code restore, verify and local runs use) and yields, in order: one
header row (the range: start..end, and what snapshot selection rejected), one row per snapshot to write (key,
encoded value; checksummed here), and one stats row (counts and timings). While it folds it logs its progress
every 5 s.

Why the fold happens inside the source: handing every event to the JVM and on to a second Python worker cost more
than the fold itself (~5.5 µs an event of ~10.5 µs, see docs/benchmarks.md). Folded this way the JVM moves one row
per changed aggregate, and still no shuffle is needed: an aggregate's events all live in one Kafka partition.

Offset note: the range end is captured when the partition is read (see kafka_io); snapshots claim exactly that
end, so a snapshot never claims events that were not folded.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterator
from typing import Any

import orjson

from kafold import logs
from kafold.config import AggregateConfig, FoldErrorPolicy, KafkaConfig
from kafold.schema import Secret
from kafold.snapshot import kafka_io
from kafold.snapshot.fold import Domain
from kafold.snapshot.partition import fold_partition, progress_logger
from kafold.upcast import UpcasterConfig

try:
    from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition
except ImportError:  # pragma: no cover - pyspark is the optional `spark` extra
    DataSource = DataSourceReader = InputPartition = object  # type: ignore[assignment,misc]

NAME = "kafold_fold"
SCHEMA = "kind byte, partition int, offset long, key binary, value binary"
HEADER, SNAPSHOT, STATS = 0, 2, 3
LOG_EVERY_S = 5.0
SNAPSHOT_ROWS = 5000  # snapshot rows per Arrow batch

log = logs.get(__name__)
_DOMAINS: dict[str, Any] = {}  # per Python worker process: import the domain once


def spec_json(kafka: KafkaConfig, agg: AggregateConfig, python_path: list[str], partitions: list[int],
              refresh_lag: int) -> str:
    """Everything an executor needs, as a JSON option (secrets stay references: `env:NAME` / `file:PATH`)."""
    return json.dumps({"kafka": dataclasses.asdict(kafka), "aggregate": dataclasses.asdict(agg),
                       "python_path": python_path, "partitions": partitions, "refresh_lag": refresh_lag})


def load_spec(spec: str | dict[str, Any]) -> tuple[KafkaConfig, AggregateConfig, list[str], list[int]]:
    raw = json.loads(spec) if isinstance(spec, str) else spec
    kafka: dict[str, Any] = {k: (Secret(v["source"]) if isinstance(v, dict) else v) for k, v in raw["kafka"].items()}
    agg = dict(raw["aggregate"])  # JSON gave the nested settings back as plain values: their types again
    agg["upcasters"] = [UpcasterConfig(**u) for u in agg.get("upcasters", ())]
    agg["on_fold_error"] = FoldErrorPolicy(agg.get("on_fold_error", FoldErrorPolicy.STOP))
    return KafkaConfig(**kafka), AggregateConfig(**agg), raw["python_path"], raw["partitions"]


def domain_of(agg: AggregateConfig, python_path: list[str]) -> Any:
    key = f"{agg.name}|{agg.initial}|{agg.evolve}|{agg.fingerprint}|{agg.state_schema_version}|" \
          f"{agg.idempotency_window_s}|{agg.on_fold_error}|{agg.upcasters!r}"
    if key not in _DOMAINS:
        _DOMAINS[key] = Domain.load(agg, python_path)
    return _DOMAINS[key]


class KafkaFoldSource(DataSource):
    """`spark.read.format("kafold_fold").option("spec", spec_json(...)).load()`."""

    @classmethod
    def name(cls) -> str:
        return NAME

    def schema(self) -> str:
        return SCHEMA

    def reader(self, schema: Any) -> DataSourceReader:
        return _Reader(self.options["spec"])


class _Reader(DataSourceReader):
    def __init__(self, spec: str) -> None:
        self.spec = spec

    def partitions(self) -> list[InputPartition]:
        return [InputPartition(p) for p in load_spec(self.spec)[3]]

    def read(self, partition: InputPartition) -> Iterator[Any]:
        import pyarrow as pa

        raw = json.loads(self.spec)
        kafka, agg, python_path, _ = load_spec(raw)
        refresh_lag = int(raw["refresh_lag"])
        domain = domain_of(agg, python_path)
        p = partition.value  # InputPartition(value): the Kafka partition number
        consumer = kafka_io.reader(kafka)
        try:
            folded = fold_partition(consumer, agg, domain, p, on_batch=progress_logger(agg, p, LOG_EVERY_S))
        finally:
            consumer.close()
        sel, folder, end = folded.selection, folded.folder, folded.selection.end
        header = orjson.dumps({"low": sel.low, "end": end, "rejected": dict(sel.rejected),
                               "full_replay": len(sel.orphans)})
        yield _batch(pa, [HEADER], p, [sel.start], [None], [header])
        folded_at = time.monotonic()
        snapshots = 0
        rows: tuple[list[bytes | None], list[bytes | None]] = ([], [])
        for key, value, _ in folder.held.encoded_snapshots(p, end, refresh_lag):
            rows[0].append(key)
            rows[1].append(value)
            if len(rows[0]) >= SNAPSHOT_ROWS:
                snapshots += len(rows[0])
                yield _batch(pa, [SNAPSHOT] * len(rows[0]), p, [end] * len(rows[0]), *rows)
                rows = ([], [])
        if rows[0]:
            snapshots += len(rows[0])
            yield _batch(pa, [SNAPSHOT] * len(rows[0]), p, [end] * len(rows[0]), *rows)
        stats = {"events_read": folder.read, "events_folded": folder.folded, "skipped": folder.skipped,
                 "bad": folder.bad, "aggregates": len(folder.held.entries), "snapshots": snapshots,
                 "fold_s": folded.fold_s, "encode_s": time.monotonic() - folded_at}
        yield _batch(pa, [STATS], p, [end], [None], [orjson.dumps(stats)])


def _batch(pa: Any, kinds: list[int], partition: int, offsets: list[int], keys: list[bytes | None],
           values: list[bytes | None]) -> Any:
    n = len(kinds)
    return pa.RecordBatch.from_arrays(
        [pa.array(kinds, pa.int8()), pa.array([partition] * n, pa.int32()), pa.array(offsets, pa.int64()),
         pa.array(keys, pa.binary()), pa.array(values, pa.binary())],
        names=["kind", "partition", "offset", "key", "value"])
