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
from kafold.snapshot.fold import Domain
from kafold.snapshot.partition import fold_partition, select_partition

__all__ = ["Restored", "restore", "select_partition"]

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


def restore(kafka: KafkaConfig, agg: AggregateConfig, domain: Domain, partition: int, *,
            use_snapshots: bool = True, consumer: Any = None) -> Restored:
    """Restore every aggregate of one events partition: usable snapshots + tail (or a full replay)."""
    began = time.monotonic()
    own = consumer is None
    consumer = consumer or kafka_io.reader(kafka)
    try:
        folded = fold_partition(consumer, agg, domain, partition, use_snapshots=use_snapshots)
    finally:
        if own:
            consumer.close()
    sel, folder = folded.selection, folded.folder
    out = Restored(partition, sel.start, sel.end, sel.low, folder.held.states(), len(sel.bases), folder.read,
                   folder.folded, folder.bad, dict(sel.rejected), time.monotonic() - began)
    log.info("snapshot.restored", aggregate=agg.name, partition=partition, start=out.start, end=out.end,
             aggregates=len(out.states), snapshots_used=out.snapshots_used, events_read=out.events_read,
             events_folded=out.events_folded, rejected=out.rejected or None,
             duration_ms=round(out.duration_s * 1000, 1))
    return out
