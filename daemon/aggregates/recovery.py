"""Recovery of one events partition: `restore(partition)` gives base states + a start offset, then the tail is folded.

Offset note: today `FullReplay.restore` returns no base states and the partition's first offset, i.e. a full
replay; a snapshot restorer (issue 6) plugs in through the same `Restorer` protocol, returning each aggregate's
snapshot state and version plus the offset the tail starts at. The fold skips an event whose version is not
above its aggregate's current version (covered by a snapshot, or a duplicate write), so a replay never folds an
event twice. Events are read with read_committed: those of aborted transactions never enter a state. Where the
replay stops is the catch-up gate's business (`gate.PartitionGate`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson
from confluent_kafka import KafkaError, TopicPartition

from kafold import kafka_clients, logs
from kafold.config import KafkaConfig
from kafold.daemon.aggregates.store import Entry, StateStore
from kafold.domain import AggregateDomain
from kafold.errors import RetriableError

log = logs.get(__name__)


@dataclass
class Base:
    """Where a partition's recovery starts: base states (id -> (state, version)) and the tail's first offset."""

    start: int
    states: dict[str, tuple[Any, int]] = field(default_factory=dict)
    snapshot_version: int | None = None  # e.g. the snapshot run's offset; None = no snapshot used


class Restorer(Protocol):
    def restore(self, partition: int, low: int, end: int) -> Base: ...


class FullReplay:
    """No snapshots: every partition replays from its first offset."""

    def restore(self, partition: int, low: int, end: int) -> Base:
        return Base(start=low)


def reader(kafka: KafkaConfig, name: str) -> Any:
    """A group-less events reader (assign only, never commits) that reports partition EOF, read_committed."""
    return kafka_clients.range_reader(kafka, f"kafold.aggregate.{name}.reader")


def bounds(consumer: Any, topic: str, partition: int) -> tuple[int, int]:
    """(first offset, end offset) as ListOffsets reports them (under read_committed: the last stable offset)."""
    try:
        low, high = consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=10, cached=False)
    except Exception as e:
        raise RetriableError(f"{topic}[{partition}]: cannot list offsets: {e}") from e
    return max(0, low), max(0, high, low)


class Folder:
    """Folds event records of one partition into a StateStore (skipping evicted ids and covered versions)."""

    def __init__(self, domain: AggregateDomain, store: StateStore, partition: int,
                 only: set[str] | None = None) -> None:
        self.domain, self.store, self.partition, self.only = domain, store, partition, only
        self.folded = self.skipped = self.bad = 0
        self.first_bad: list[tuple[int, str]] = []

    def seed(self, base: Base) -> None:
        for aid, (state, version) in base.states.items():
            self.store.put(aid, Entry(state, version, self.partition))

    def fold(self, msgs: Iterable[Any]) -> None:
        """Fold data records (errors and EOFs must be filtered out by the caller)."""
        entries, evicted = self.store.entries, self.store.evicted.get(self.partition, ())
        loads, evolve, make, initial = orjson.loads, self.domain.evolve, self.domain.event, self.domain.initial
        only, partition = self.only, self.partition
        folded = skipped = 0
        for m in msgs:
            try:
                body = loads(m.value())
                aid = body["aggregate_id"]
                if only is not None and aid not in only:
                    continue
                version = body["version"]
                entry = entries.get(aid)
                if entry is None:
                    if aid in evicted:
                        continue  # reloaded on demand, from scratch
                    entry = Entry(initial(), 0, partition)
                    self.store.put(aid, entry)
                if type(version) is not int:
                    raise TypeError("version is not an integer")
                if version <= entry.version:
                    skipped += 1
                    continue
                entry.state = evolve(entry.state, make(body["type"], body["payload"]))
                entry.version = version
                cause = body.get("causation_id")
                if cause:
                    entry.note(cause, version, 1)
                folded += 1
            except Exception as e:  # a bad event is left out of every state; counted and logged per partition
                self.bad += 1
                if len(self.first_bad) < 5:
                    self.first_bad.append((m.offset(), type(e).__name__))
        self.folded += folded
        self.skipped += skipped


def read_until_eof(consumer: Any, topic: str, partition: int, start: int, on_batch: Any,
                   batch: int = 20000, stall_s: float = 30.0) -> int:
    """Feed records [start, partition EOF) to `on_batch(msgs)`; the offset EOF was reported at (the true end)."""
    import time

    consumer.assign([TopicPartition(topic, partition, start)])
    last = time.monotonic()
    try:
        while True:
            msgs = consumer.consume(batch, 0.05)
            data = []
            for m in msgs:
                err = m.error()
                if err is None:
                    data.append(m)
                elif err.code() == KafkaError._PARTITION_EOF:
                    if data:
                        on_batch(data)
                    return int(m.offset())
                else:
                    raise RetriableError(f"{topic}[{partition}]: {err.str()}")
            if data:
                on_batch(data)
                last = time.monotonic()
            elif time.monotonic() - last > stall_s:
                raise RetriableError(f"{topic}[{partition}]: no progress for {stall_s:.0f} s")
    finally:
        consumer.unassign()


def reload(consumer: Any, topic: str, domain: AggregateDomain, store: StateStore, partition: int,
           ids: set[str]) -> int:
    """Rebuild evicted aggregates `ids` of one partition by replaying it filtered by key; events read."""
    low, _ = bounds(consumer, topic, partition)
    with store.lock:
        for aid in ids:
            store.put(aid, Entry(domain.initial(), 0, partition))
    folder = Folder(domain, store, partition, only=set(ids))
    read = 0

    def feed(msgs: list[Any]) -> None:
        nonlocal read
        read += len(msgs)
        wanted = [m for m in msgs if m.key() is not None and m.key().decode("utf-8", "replace") in ids]
        folder.fold(wanted)

    read_until_eof(consumer, topic, partition, low, feed)
    log.info("aggregate.reloaded", topic=topic, partition=partition, aggregates=len(ids), events_read=read,
             folded=folder.folded, bad=folder.bad)
    return read
