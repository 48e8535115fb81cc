"""One events partition folded on its usable snapshots, and the snapshots + marker that record the result.

Shared by restore, verify, the Spark job's data source and the in-process (local) snapshot run, so every reader of
state folds the same way.

Offset note: the range end is captured first (`kafka_io.bounds`, the fetch path's end), snapshots claiming an
offset past it are rejected as ahead of the events, and the tail is read from `Selection.start` up to that end.
When writing, the snapshots are flushed (idempotent producer, acks=all) before the partition's marker, so a marker
is only ever seen after every snapshot it vouches for; a run killed in between leaves snapshots that are each true
at the offset they claim, and no marker.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kafold import logs
from kafold.config import AggregateConfig
from kafold.snapshot import kafka_io
from kafold.snapshot.fold import Domain, Folder
from kafold.snapshot.record import Marker
from kafold.snapshot.select import Identity, Selection, Selector

log = logs.get(__name__)
BATCH = 20000  # events read from Kafka (and folded) at a time
OnBatch = Callable[[Folder, int, int], None]  # (folder, last offset folded, range end)


def select_partition(consumer: Any, agg: AggregateConfig, identity: Identity, partition: int,
                     low: int, end: int) -> Selection:
    """Read the snapshot partition and choose the usable snapshot per aggregate (latest-per-key ourselves:
    compaction is lazy, so older versions and out-of-order writes may still be on the topic)."""
    return _select(consumer, agg, {partition: Selector(identity, partition, low, end)})[0]


def select_partitions(consumer: Any, agg: AggregateConfig, identity: Identity, partitions: list[int], *,
                      topic_exists: bool = False) -> list[Selection]:
    """`plan_partition` for several partitions at once: their ends probed together and their snapshot partitions
    read together (each partition's records still fed in log order to its own selector). `topic_exists`: the
    caller has just seen the snapshot topic in the broker's metadata (no need to ask again)."""
    ends = kafka_io.bounds_many(consumer, agg.topic("events"), partitions)
    return _select(consumer, agg, {p: Selector(identity, p, *ends[p]) for p in partitions}, topic_exists)


def _select(consumer: Any, agg: AggregateConfig, selectors: dict[int, Selector], topic_exists: bool = False
            ) -> list[Selection]:
    topic = agg.topic("snapshot")
    if topic_exists or kafka_io.exists(consumer, topic):
        for p, key, value, offset in kafka_io.records_many(consumer, topic, list(selectors)):
            selectors[p].feed(key, value, offset)
    else:  # reading it would only stall: no snapshots, a full replay
        log.warning("snapshot.topic_missing", aggregate=agg.name, topic=topic, partitions=list(selectors),
                    fallback="full replay", fix="run `kafold topics ensure`")
    return [sel.result() for sel in selectors.values()]


def plan_partition(consumer: Any, agg: AggregateConfig, identity: Identity, partition: int,
                   use_snapshots: bool = True) -> Selection:
    """The partition's range end and its usable snapshots (or none: a full replay)."""
    low, end = kafka_io.bounds(consumer, agg.topic("events"), partition)
    if not use_snapshots:
        return Selection(partition, low, end)
    return select_partition(consumer, agg, identity, partition, low, end)


@dataclass
class Folded:
    """A partition folded from `selection.start` to `selection.end` on the selection's bases."""

    selection: Selection
    folder: Folder
    fold_s: float


def fold_partition(consumer: Any, agg: AggregateConfig, domain: Domain, partition: int, *,
                   selection: Selection | None = None, use_snapshots: bool = True,
                   on_batch: OnBatch | None = None) -> Folded:
    """Fold one events partition: its usable snapshots (`selection`, planned here when not given) + the tail."""
    sel = selection or plan_partition(consumer, agg, domain.identity, partition, use_snapshots)
    began = time.monotonic()
    folder = Folder(domain, sel.bases)
    for offsets, keys, values in kafka_io.read_range(consumer, agg.topic("events"), partition, sel.start, sel.end,
                                                     batch=BATCH):
        folder.fold(offsets, keys, values)
        if on_batch is not None:
            on_batch(folder, offsets[-1], sel.end)
    folder.log_bad(partition)
    return Folded(sel, folder, time.monotonic() - began)


def progress_logger(agg: AggregateConfig, partition: int, every_s: float = 5.0) -> OnBatch:
    """An `on_batch` hook logging `snapshot.partition_progress` at most every `every_s` seconds."""
    began = logged = time.monotonic()

    def report(folder: Folder, offset: int, end: int) -> None:
        nonlocal logged
        now = time.monotonic()
        if now - logged >= every_s:
            logged = now
            log.info("snapshot.partition_progress", aggregate=agg.name, partition=partition, offset=offset, end=end,
                     events_read=folder.read, events_per_s=round(folder.read / (now - began)))
    return report


def marker(agg: AggregateConfig, partition: int, end: int) -> Marker:
    """The marker of a finished partition; write it only once its snapshots are acknowledged (see the note above)."""
    return Marker(agg.name, partition, end, agg.fingerprint, agg.state_schema_version)


def write_marker(producer: Any, agg: AggregateConfig, partition: int, end: int) -> None:
    """Write `marker(...)` and wait for it (call only once the partition's snapshots are acknowledged)."""
    kafka_io.write(producer, agg.topic("snapshot"), partition, [marker(agg, partition, end)])

