"""A PySpark Python Data Source over Kafka: one input partition per events partition, Arrow record batches out.

Each input partition yields, in order: one header row (the range read: start..end, and what snapshot selection
rejected), one row per usable base snapshot of the partition, then the events at offsets [start, end) — so the
fold after it needs no shuffle and no second look at Kafka to learn its base states. Events travel packed: one
row per chunk of up to BATCH events whose value is an Arrow IPC stream of (offset, key, value) columns, so the
JVM moves a few large rows instead of converting every event to a row and back (`unpack` reads a chunk).

Offset note: the range end is captured when the partition is read (see kafka_io); the fold writes snapshots
claiming exactly that end, so a snapshot never claims events that were not folded.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from typing import Any

import orjson

from kafold.config import AggregateConfig, KafkaConfig
from kafold.schema import Secret

try:
    from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition
except ImportError:  # pragma: no cover - pyspark is the optional `spark` extra
    DataSource = DataSourceReader = InputPartition = object  # type: ignore[assignment,misc]

NAME = "kafold_events"
SCHEMA = "kind byte, partition int, offset long, key binary, value binary"
HEADER, BASE, EVENTS = 0, 1, 2
_CHUNK_SCHEMA: Any = None
BATCH = 20000


def spec_json(kafka: KafkaConfig, agg: AggregateConfig, python_path: list[str], partitions: list[int]) -> str:
    """Everything an executor needs, as a JSON option (secrets stay references: `env:NAME` / `file:PATH`)."""
    return json.dumps({"kafka": dataclasses.asdict(kafka), "aggregate": dataclasses.asdict(agg),
                       "python_path": python_path, "partitions": partitions})


def load_spec(text: str) -> tuple[KafkaConfig, AggregateConfig, list[str], list[int]]:
    raw = json.loads(text)
    kafka: dict[str, Any] = {k: (Secret(v["source"]) if isinstance(v, dict) else v) for k, v in raw["kafka"].items()}
    return KafkaConfig(**kafka), AggregateConfig(**raw["aggregate"]), raw["python_path"], raw["partitions"]


class KafkaEventsSource(DataSource):
    """`spark.read.format("kafold_events").option("spec", spec_json(...)).load()`."""

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

        from kafold.snapshot import kafka_io
        from kafold.snapshot.restore import select_partition
        from kafold.snapshot.select import Identity

        kafka, agg, _, _ = load_spec(self.spec)
        p = partition.value  # InputPartition(value): the Kafka partition number
        ident = Identity(agg.name, agg.fingerprint, agg.state_schema_version)
        consumer = kafka_io.reader(kafka)
        try:
            low, end = kafka_io.bounds(consumer, agg.topic("events"), p)
            sel = select_partition(consumer, agg, ident, p, low, end)
            header = orjson.dumps({"low": low, "end": end, "rejected": dict(sel.rejected),
                                   "full_replay": len(sel.orphans)})
            keys: list[bytes | None] = [None, *sel.bases]
            values: list[bytes | None] = [header, *(orjson.dumps([s.version, s.offset, s.state])
                                                    for s in sel.bases.values())]
            kinds = [HEADER] + [BASE] * len(sel.bases)
            yield _batch(pa, kinds, p, [sel.start] * len(kinds), keys, values)
            for offsets, ekeys, evalues in kafka_io.read_range(consumer, agg.topic("events"), p, sel.start, end,
                                                               batch=BATCH):
                yield _batch(pa, [EVENTS], p, [offsets[0]], [None], [_pack(pa, offsets, ekeys, evalues)])
        finally:
            consumer.close()


def _batch(pa: Any, kinds: list[int], partition: int, offsets: list[int], keys: list[bytes | None],
           values: list[bytes | None]) -> Any:
    n = len(kinds)
    return pa.RecordBatch.from_arrays(
        [pa.array(kinds, pa.int8()), pa.array([partition] * n, pa.int32()), pa.array(offsets, pa.int64()),
         pa.array(keys, pa.binary()), pa.array(values, pa.binary())],
        names=["kind", "partition", "offset", "key", "value"])


def _pack(pa: Any, offsets: list[int], keys: list[bytes | None], values: list[bytes | None]) -> bytes:
    global _CHUNK_SCHEMA
    if _CHUNK_SCHEMA is None:
        _CHUNK_SCHEMA = pa.schema([("offset", pa.int64()), ("key", pa.binary()), ("value", pa.binary())])
    chunk = pa.RecordBatch.from_arrays([pa.array(offsets, pa.int64()), pa.array(keys, pa.binary()),
                                        pa.array(values, pa.binary())], schema=_CHUNK_SCHEMA)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, _CHUNK_SCHEMA) as stream:
        stream.write_batch(chunk)
    return sink.getvalue().to_pybytes()


def unpack(pa: Any, packed: Any) -> tuple[list[int], list[bytes | None], list[bytes | None]]:
    """(offsets, keys, values) of one packed chunk (`packed`: a pyarrow binary scalar)."""
    table = pa.ipc.open_stream(packed.as_buffer()).read_all()
    return table.column(0).to_pylist(), table.column(1).to_pylist(), table.column(2).to_pylist()
