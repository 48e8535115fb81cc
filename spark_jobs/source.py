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

Protected fields (kafold.protect): each task builds its own key ring on PostgreSQL from the spec's privacy and
postgres settings, which carry secrets as references only (`env:NAME` / `file:PATH`): the master key is read from
the executor's own environment or file, never shipped in the spec or in Spark conf (the Spark UI shows both). The
task folds with decryption and seals each state as the in-process run does (the same Domain), and closes the
ring's connection when done. A ring per task, not per reused Python worker: a subject forgotten between two runs
is never opened from a key an earlier task cached.

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

from kafold import logs, protect
from kafold.config import (
    AggregateConfig,
    FoldErrorPolicy,
    KafkaConfig,
    KafoldConfig,
    PostgresConfig,
    PrivacyConfig,
    ProtectConfig,
)
from kafold.domain import AggregateDomain
from kafold.errors import FatalError
from kafold.protect import PgKeyStore, Protector, Setup
from kafold.schema import Secret
from kafold.snapshot import kafka_io
from kafold.snapshot.fold import Domain
from kafold.snapshot.partition import fold_partition, progress_logger
from kafold.snapshot.select import Identity
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
              refresh_lag: int, protection: Setup | None = None) -> str:
    """Everything an executor needs, as a JSON option (secrets stay references: `env:NAME` / `file:PATH`);
    `protection` (kafold.protect.setup) for an aggregate with protected fields."""
    keys = None
    if agg.protect and protection is not None:
        keys = {"privacy": dataclasses.asdict(protection.privacy), "postgres": dataclasses.asdict(protection.postgres)}
    return json.dumps({"kafka": dataclasses.asdict(kafka), "aggregate": dataclasses.asdict(agg),
                       "python_path": python_path, "partitions": partitions, "refresh_lag": refresh_lag,
                       "keys": keys})


def _secrets(settings: dict[str, Any]) -> dict[str, Any]:
    """A settings table from JSON with its secret references (`{"source": ...}`) as Secrets again."""
    return {k: (Secret(v["source"]) if isinstance(v, dict) else v) for k, v in settings.items()}


def load_spec(spec: str | dict[str, Any]) -> tuple[KafkaConfig, AggregateConfig, list[str], list[int]]:
    raw = json.loads(spec) if isinstance(spec, str) else spec
    kafka = _secrets(raw["kafka"])
    agg = dict(raw["aggregate"])  # JSON gave the nested settings back as plain values: their types again
    agg["upcasters"] = [UpcasterConfig(**u) for u in agg.get("upcasters", ())]
    agg["protect"] = [ProtectConfig(**p) for p in agg.get("protect", ())]
    agg["on_fold_error"] = FoldErrorPolicy(agg.get("on_fold_error", FoldErrorPolicy.STOP))
    return KafkaConfig(**kafka), AggregateConfig(**agg), raw["python_path"], raw["partitions"]


def domain_of(agg: AggregateConfig, python_path: list[str]) -> Any:
    key = f"{agg.name}|{agg.initial}|{agg.evolve}|{agg.fingerprint}|{agg.state_schema_version}|" \
          f"{agg.idempotency_window_s}|{agg.on_fold_error}|{agg.upcasters!r}"
    if key not in _DOMAINS:
        _DOMAINS[key] = Domain.load(agg, python_path)
    return _DOMAINS[key]


def identity_of(agg: AggregateConfig, python_path: list[str]) -> Identity:
    """The fold's identity (what markers vouch for), without the keys a protected aggregate's fold needs."""
    if not agg.protect:
        ident: Identity = domain_of(agg, python_path).identity
        return ident
    return Identity(agg.name, AggregateDomain.load(agg, tuple(python_path)).fingerprint, agg.state_schema_version)


def protector_of(spec: str | dict[str, Any]) -> Protector | None:
    """A new Protector (its own key ring on PostgreSQL) for the spec's aggregate, None when it protects nothing;
    the master key is read here, from the reference (ConfigError naming it when it is not set)."""
    raw = json.loads(spec) if isinstance(spec, str) else spec
    _, agg, _, _ = load_spec(raw)
    if not agg.protect:
        return None
    keys = raw.get("keys")
    if keys is None:
        raise FatalError(f"aggregate {agg.name!r} has protected fields but the job was given no privacy settings "
                         "(snapshot_job.run(..., protection=kafold.protect.setup(cfg)))")
    cfg = KafoldConfig(postgres=PostgresConfig(**_secrets(keys["postgres"])),
                       privacy=PrivacyConfig(**_secrets(keys["privacy"])), aggregates=[agg])
    return protect.build(cfg)


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
        raw = json.loads(self.spec)
        kafka, agg, python_path, _ = load_spec(raw)
        protector = protector_of(raw)
        try:
            yield from self._read(raw, kafka, agg, python_path, protector, partition.value)
        finally:
            if protector is not None and isinstance(protector.ring.store, PgKeyStore):
                protector.ring.store.close()  # the task's own connection to the subject keys

    def _read(self, raw: dict[str, Any], kafka: KafkaConfig, agg: AggregateConfig, python_path: list[str],
              protector: Protector | None, p: int) -> Iterator[Any]:
        """One Kafka partition `p` (InputPartition(value)) folded: the header, snapshot and stats rows."""
        # pyarrow: kafold[spark], only where a Spark job runs
        import pyarrow as pa

        refresh_lag = int(raw["refresh_lag"])
        # a protected fold's domain holds this task's key ring: loaded per task, not cached in the worker
        domain = domain_of(agg, python_path) if protector is None else Domain.load(agg, python_path, protector)
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
