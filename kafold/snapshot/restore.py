"""restore(partition): the latest usable snapshot per aggregate plus a replay of only the tail of the events.

Offset note: the events partition's end is captured first; snapshots claiming an offset past it are rejected
as ahead of the events. The tail is read from `Selection.start` up to that end, skipping, per aggregate, the
events its snapshot covers. Full replay is the same with no snapshots (start = the first offset).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from kafold import logs
from kafold.config import AggregateConfig, KafkaConfig
from kafold.snapshot import kafka_io
from kafold.snapshot.fold import Domain, Folder
from kafold.snapshot.select import Identity, Selection, Selector

log = logs.get(__name__)


@dataclass
class Restored:
    """The states of one partition's aggregates at `end`, and what it took to get them."""

    partition: int
    start: int
    end: int
    start_low: int  # the partition's first offset (where a full replay starts)
    states: dict[str, tuple[Any, int]]  # aggregate id -> (domain state, version)
    snapshots_used: int
    events_read: int
    events_folded: int
    bad_events: int
    rejected: dict[str, int] = field(default_factory=dict)
    duration_s: float = 0.0


def select_partition(consumer: Any, agg: AggregateConfig, identity: Identity, partition: int,
                     low: int, end: int) -> Selection:
    """Read the snapshot partition and choose the usable snapshot per aggregate (latest-per-key ourselves:
    compaction is lazy, so older versions and out-of-order writes may still be on the topic)."""
    selector = Selector(identity, partition, low, end)
    topic = agg.topic("snapshot")
    if not kafka_io.exists(consumer, topic):  # reading it would only stall: no snapshots, a full replay
        log.warning("snapshot.topic_missing", aggregate=agg.name, topic=topic, partition=partition,
                    fallback="full replay", fix="run `kafold topics ensure`")
        return selector.result()
    for key, value, offset in kafka_io.records(consumer, topic, partition):
        selector.feed(key, value, offset)
    return selector.result()


def restore(kafka: KafkaConfig, agg: AggregateConfig, domain: Domain, partition: int, *,
            use_snapshots: bool = True, consumer: Any = None) -> Restored:
    """Restore every aggregate of one events partition: usable snapshots + tail (or a full replay)."""
    began = time.monotonic()
    own = consumer is None
    consumer = consumer or kafka_io.reader(kafka)
    try:
        events = agg.topic("events")
        low, end = kafka_io.bounds(consumer, events, partition)
        if use_snapshots:
            sel = select_partition(consumer, agg, domain.identity, partition, low, end)
        else:
            sel = Selection(partition, low, end)
        folder = Folder(domain, sel.bases)
        folder.fold_messages(kafka_io.read_range(consumer, events, partition, sel.start, end))
        folder.log_bad(partition)
    finally:
        if own:
            consumer.close()
    out = Restored(partition, sel.start, end, low, folder.states(), len(sel.bases), folder.read, folder.folded,
                   folder.bad, dict(sel.rejected), time.monotonic() - began)
    log.info("snapshot.restored", aggregate=agg.name, partition=partition, start=out.start, end=end,
             aggregates=len(out.states), snapshots_used=out.snapshots_used, events_read=out.events_read,
             events_folded=out.events_folded, rejected=out.rejected or None,
             duration_ms=round(out.duration_s * 1000, 1))
    return out
