"""One events partition folded on its usable snapshots, and the snapshots + marker that record the result.

Shared by restore, verify, the Spark job's data source and the in-process (local) snapshot run, so every reader of
state folds the same way.

Offset note: the range end is the fetch path's end (`kafka_io.Probe`: read to partition EOF from the last record
ListOffsets lists, in the same read as the snapshot partition); snapshots claiming an offset past it are rejected as
ahead of the events, and the tail is read from `Selection.start` up to that end (some of it possibly already read
with the probe: `Prefetched`).
When writing, the snapshots are flushed (idempotent producer, acks=all) before the partition's marker, so a marker
is only ever seen after every snapshot it vouches for; a run killed in between leaves snapshots that are each true
at the offset they claim, and no marker.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import OFFSET_BEGINNING

from kafold import logs
from kafold.config import AggregateConfig
from kafold.fold import Folder
from kafold.snapshot import kafka_io
from kafold.snapshot.fold import Domain, Tail, folder, log_bad
from kafold.snapshot.record import Marker
from kafold.snapshot.select import Identity, Selection, Selector

log = logs.get(__name__)
BATCH = 20000  # events read from Kafka (and folded) at a time
OnBatch = Callable[[Folder[Tail], int, int], None]  # (folder, last offset folded, range end)


def select_partition(consumer: Any, agg: AggregateConfig, identity: Identity, partition: int,
                     low: int, end: int) -> Selection:
    """Read the snapshot partition and choose the usable snapshot per aggregate (latest-per-key ourselves:
    compaction is lazy, so older versions and out-of-order writes may still be on the topic)."""
    selector = Selector(identity, partition, low, end)
    topic = agg.topic("snapshot")
    if _readable(consumer, agg, [partition]):
        for _, key, value, offset in kafka_io.records_many(consumer, topic, [partition]):
            selector.feed(key, value, offset)
    return selector.result()


def _readable(consumer: Any, agg: AggregateConfig, partitions: list[int], topic_exists: bool = False) -> bool:
    """Whether the snapshot topic can be read; when missing, reading it would only stall: warn (a full replay)."""
    if topic_exists or kafka_io.exists(consumer, agg.topic("snapshot")):
        return True
    log.warning("snapshot.topic_missing", aggregate=agg.name, topic=agg.topic("snapshot"), partitions=partitions,
                fallback="full replay", fix="run `kafold topics ensure`")
    return False


@dataclass
class Prefetched:
    """Events of one partition read while planning: every record at offsets [first, until), in offset order."""

    first: int
    until: int
    offsets: list[int] = field(default_factory=list)
    keys: list[bytes | None] = field(default_factory=list)
    values: list[bytes | None] = field(default_factory=list)

    def add(self, offsets: list[int], keys: list[bytes | None], values: list[bytes | None]) -> None:
        self.offsets += offsets
        self.keys += keys
        self.values += values


def select_partitions(consumer: Any, agg: AggregateConfig, identity: Identity, partitions: list[int], *,
                      topic_exists: bool = False, prefetch: dict[int, int] | None = None,
                      prefetch_max: int = 0, prefetched: dict[int, Prefetched] | None = None) -> list[Selection]:
    """`plan_partition` for several partitions at once, in one read: the events partitions' ends probed and the
    snapshot partitions read together (one assignment: the probe's wait for its EOFs overlaps the snapshot read;
    each partition's snapshot records still fed in log order to its own selector). `topic_exists`: the caller has
    just seen the snapshot topic in the broker's metadata (no need to ask again).

    `prefetch` (partition -> offset, from `kafka_io.progress`): the probe reads those partitions from that offset
    instead of from their last record, keeping the events in `prefetched` (while their total, by the listed ends,
    stays within `prefetch_max`), so a fold need not fetch them again (`fold_partitions`).

    Offset note: while the read runs, each selector knows only the end ListOffsets listed, which the probe's end
    is never below; a snapshot claiming an offset past it waits (`Selector` defers it) until the probe settles
    the end, and is then accepted or rejected as ahead of the events. A prefetch only moves where the probe starts
    reading; it changes no selection."""
    topic, events = agg.topic("snapshot"), agg.topic("events")
    probe = kafka_io.Probe(events, partitions)
    ranges = probe.ranges(consumer)
    early: dict[int, Prefetched] = {}
    budget = prefetch_max if prefetched is not None else 0
    for p, at in sorted((prefetch or {}).items()):
        low, listed = probe.listed.get(p, (0, 0))
        start = max(low, min(at, listed))
        if (events, p) in ranges and start < listed and listed - start <= budget:
            early[p], budget = Prefetched(start, start), budget - (listed - start)
            ranges[(events, p)] = (start, None)
    selectors = {p: Selector(identity, p, *probe.listed[p], end_final=False) for p in partitions}
    if _readable(consumer, agg, partitions, topic_exists):
        ranges.update({(topic, p): (OFFSET_BEGINNING, None) for p in partitions})
    for (t, p), offsets, keys, values in kafka_io.read_many(consumer, ranges, probe.positions):
        if t == events:
            probe.saw(p, offsets)
            if p in early:
                early[p].add(offsets, keys, values)
        else:
            feed = selectors[p].feed
            for key, value, offset in zip(keys, values, offsets, strict=True):
                feed(key, value, offset)
    ends = probe.bounds()
    for p, pre in early.items():
        pre.until = max(pre.first, pre.offsets[-1] + 1 if pre.offsets else pre.first,
                        probe.positions.get((events, p), -1))
    if prefetched is not None:
        prefetched.update(early)
    return [selectors[p].settle(*ends[p]).result() for p in partitions]


def plan_partition(consumer: Any, agg: AggregateConfig, identity: Identity, partition: int,
                   use_snapshots: bool = True) -> Selection:
    """The partition's range end and its usable snapshots (or none: a full replay)."""
    if not use_snapshots:
        low, end = kafka_io.bounds(consumer, agg.topic("events"), partition)
        return Selection(partition, low, end)
    return select_partitions(consumer, agg, identity, [partition])[0]


@dataclass
class FoldedPartition:
    """A partition folded from `selection.start` to `selection.end` on the selection's bases."""

    selection: Selection
    folder: Folder[Tail]
    fold_s: float


def fold_partition(consumer: Any, agg: AggregateConfig, domain: Domain, partition: int, *,
                   selection: Selection | None = None, use_snapshots: bool = True,
                   on_batch: OnBatch | None = None) -> FoldedPartition:
    """Fold one events partition: its usable snapshots (`selection`, planned here when not given) + the tail."""
    sel = selection or plan_partition(consumer, agg, domain.identity, partition, use_snapshots)
    began = time.monotonic()
    folds = folder(domain, sel.bases, partition)
    keys_for = _keys_prefetch(domain)
    for offsets, keys, values in kafka_io.read_range(consumer, agg.topic("events"), partition, sel.start, sel.end,
                                                     batch=BATCH):
        if keys_for is not None:
            keys_for(keys)
        folds.fold(offsets, keys, values)
        if on_batch is not None:
            on_batch(folds, offsets[-1], sel.end)
    log_bad(folds, partition)
    return FoldedPartition(sel, folds, time.monotonic() - began)


def _keys_prefetch(domain: Domain) -> Callable[[list[bytes | None]], None] | None:
    """For a fold whose states are sealed (kafold.protect: every subject is the aggregate id, the record key), the
    batch key lookup the sink intake uses: a batch's subject keys in one round trip to PostgreSQL before it is
    folded, instead of one for each aggregate first seen (the seal at the end then finds them cached)."""
    sealer = domain.identity.sealer
    return None if sealer is None else sealer.prefetch


def fold_partitions(consumer: Any, agg: AggregateConfig, domain: Domain, selections: list[Selection], *,
                    prefetched: dict[int, Prefetched] | None = None,
                    on_batch: Callable[[int], OnBatch] | None = None) -> list[FoldedPartition]:
    """`fold_partition` for several planned partitions, their tails read together (one assignment: the fetch
    rounds are shared instead of paid per partition); each partition folded in offset order by its own Folder.
    Events `prefetched` while planning are folded from memory: only what they do not cover is read (before them,
    then after them). `on_batch(partition)` gives a partition's hook. Each result's `fold_s` is an even share."""
    began = time.monotonic()
    topic = agg.topic("events")
    folders = {sel.partition: folder(domain, sel.bases, sel.partition) for sel in selections}
    hooks = {sel.partition: on_batch(sel.partition) for sel in selections} if on_batch is not None else {}
    ends = {sel.partition: sel.end for sel in selections}
    pre = {sel.partition: prefetched[sel.partition] for sel in selections
           if prefetched and sel.partition in prefetched and prefetched[sel.partition].until <= sel.end}
    before: dict[kafka_io.TP, tuple[int, int | None]] = {}
    after: dict[kafka_io.TP, tuple[int, int | None]] = {}
    for sel in selections:
        got = pre.get(sel.partition)
        if got is None:
            before[(topic, sel.partition)] = (sel.start, sel.end)
        else:
            before[(topic, sel.partition)] = (sel.start, min(got.first, sel.end))
            after[(topic, sel.partition)] = (max(sel.start, got.until), sel.end)

    keys_for = _keys_prefetch(domain)

    def fold(p: int, offsets: list[int], keys: list[bytes | None], values: list[bytes | None]) -> None:
        if keys_for is not None:
            keys_for(keys)
        folders[p].fold(offsets, keys, values)
        if p in hooks:
            hooks[p](folders[p], offsets[-1], ends[p])

    for (_, p), offsets, keys, values in kafka_io.read_many(consumer, before):
        fold(p, offsets, keys, values)
    for sel in selections:
        got = pre.get(sel.partition)
        if got is not None and got.offsets:
            skip = bisect.bisect_left(got.offsets, sel.start)  # a snapshot may cover some of them
            if skip < len(got.offsets):
                fold(sel.partition, got.offsets[skip:], got.keys[skip:], got.values[skip:])
    for (_, p), offsets, keys, values in kafka_io.read_many(consumer, after):
        fold(p, offsets, keys, values)
    share = (time.monotonic() - began) / max(1, len(selections))
    for p, folds in folders.items():
        log_bad(folds, p)
    return [FoldedPartition(sel, folders[sel.partition], share) for sel in selections]


def progress_logger(agg: AggregateConfig, partition: int, every_s: float = 5.0) -> OnBatch:
    """An `on_batch` hook logging `snapshot.partition_progress` at most every `every_s` seconds."""
    began = logged = time.monotonic()

    def report(folds: Folder[Tail], offset: int, end: int) -> None:
        nonlocal logged
        now = time.monotonic()
        if now - logged >= every_s:
            logged = now
            log.info("snapshot.partition_progress", aggregate=agg.name, partition=partition, offset=offset, end=end,
                     events_read=folds.read, events_per_s=round(folds.read / (now - began)))
    return report


def marker(ident: Identity, partition: int, end: int) -> Marker:
    """The marker of a finished partition, vouching for the fold `ident` names (its fingerprint comes from the
    loaded domain, as the snapshots'); write it only once its snapshots are acknowledged (see the note above)."""
    return Marker(ident.aggregate_type, partition, end, ident.fingerprint, ident.state_schema_version)


def write_marker(producer: Any, agg: AggregateConfig, ident: Identity, partition: int, end: int) -> None:
    """Write `marker(...)` and wait for it (call only once the partition's snapshots are acknowledged)."""
    kafka_io.write(producer, agg.topic("snapshot"), partition, [marker(ident, partition, end)])

