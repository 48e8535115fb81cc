"""Per-partition progress of a sink task: position, end offsets seen at assignment, caught-up, lag, event time.

Note on "caught up" (what /ready reports)
-----------------------------------------
When a partition is assigned, the task records its start (the committed offset, else where
`auto.offset.reset` puts it) and a *target*: the end offset seen at assignment — the larger of ListOffsets(latest)
at assignment and the high watermark carried by the first fetch response after it. The partition is caught up
once a fetch response was seen and the task's position (the next offset after the records it handled) reached
the target; the flag then stays set for that assignment, so later traffic does not make the daemon "unready".
Some brokers under-report ListOffsets (only the base offset of the last batch + 1); the fetch watermark is exact,
which is why the target takes both. On Apache Kafka the two agree (both the high watermark, or the last stable
offset under read_committed), so taking the larger changes nothing there. A paused partition is not fetched, so
its cached watermark stops moving: while partitions are paused (a sink holding back, e.g. effects waiting on a
down endpoint) their end offsets are listed every PAUSED_END_QUERY_S instead, so the lag keeps growing as records
arrive. The published `PartitionProgress` values are immutable snapshots, replaced as a whole after each poll, so
other threads (HTTP, metrics) read them without locks.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from confluent_kafka import TopicPartition as KafkaTP

from kafold.connectors.api import SinkRecord, TopicPartition
from kafold.envelope import epoch_ms
from kafold.kafka_message import Message

OFFSET_INVALID = -1001
QUERY_TIMEOUT_S = 5.0
PAUSED_END_QUERY_S = 5.0
LATEST, EARLIEST = -1, -2  # ListOffsets' logical timestamps


@dataclass(frozen=True, slots=True)
class PartitionProgress:
    """A snapshot of one assigned partition."""

    tp: TopicPartition
    position: int | None = None  # next offset to handle
    committed: int | None = None  # last offset committed to the group (next to read)
    listed_end: int | None = None  # ListOffsets(latest) at assignment
    fetched_end: int | None = None  # high watermark of the first fetch response after assignment
    high_watermark: int | None = None  # latest end offset seen in a fetch response
    caught_up: bool = False
    event_time_ms: int | None = None  # event time of the last handled record
    paused: bool = False

    @property
    def target(self) -> int | None:
        """The end offset seen at assignment (None until both ListOffsets and a fetch response were seen)."""
        if self.listed_end is None or self.fetched_end is None:
            return None
        return max(self.listed_end, self.fetched_end)

    @property
    def lag(self) -> int | None:
        """Records between the position and the latest known end offset."""
        end = self.high_watermark if self.high_watermark is not None else self.listed_end
        if end is None or self.position is None:
            return None
        return max(0, end - self.position)

    def lag_seconds(self, now_ms: int | None = None) -> float:
        """Event-time lag: how old the last handled event is, while records remain; 0 when nothing is behind."""
        if not self.lag or self.event_time_ms is None:
            return 0.0
        now = int(time.time() * 1000) if now_ms is None else now_ms
        return max(0.0, (now - self.event_time_ms) / 1000)

    def advance(self, position: int | None = None, high_watermark: int | None = None) -> PartitionProgress:
        """A copy with a new position / fetch watermark, re-deciding `caught_up` (which never unsets)."""
        new = self
        if position is not None:
            new = replace(new, position=position)
        if high_watermark is not None and high_watermark >= 0:
            first = high_watermark if new.fetched_end is None else new.fetched_end
            new = replace(new, high_watermark=high_watermark, fetched_end=first)
        target = new.target
        if not new.caught_up and target is not None and new.position is not None and new.position >= target:
            new = replace(new, caught_up=True)
        return new


@dataclass(frozen=True, slots=True)
class BatchStats:
    """What one batch did (handed to `SinkRunner.on_batch`, e.g. for metrics)."""

    records: int
    put: int
    dead_lettered: int
    skipped: int
    duration_s: float


class ProgressTracker:
    """Kept by the runner's thread only; `snapshot` is what other threads read."""

    def __init__(self, reset: str = "earliest") -> None:
        self.reset = reset
        self.snapshot: dict[TopicPartition, PartitionProgress] = {}
        self._pending: set[TopicPartition] = set()  # assigned, start and target not yet queried
        self._paused_ends: dict[TopicPartition, int] = {}  # listed end offsets of paused partitions
        self._paused_listed_at = float("-inf")

    def assigned(self, tps: list[TopicPartition]) -> None:
        for tp in tps:
            self._pending.add(tp)
        self.snapshot = {**self.snapshot, **{tp: PartitionProgress(tp) for tp in tps}}

    def released(self, tps: list[TopicPartition]) -> None:
        self._pending.difference_update(tps)
        self.snapshot = {tp: p for tp, p in self.snapshot.items() if tp not in tps}

    def refresh(self, consumer: Any, positions: dict[TopicPartition, int], paused: set[TopicPartition],
                committed: dict[TopicPartition, int], event_times: dict[TopicPartition, int]) -> None:
        """Query start and target of newly assigned partitions, then fold in positions and cached watermarks."""
        if self._pending:
            self._query(consumer, positions)
        self._list_paused(consumer, paused)
        out: dict[TopicPartition, PartitionProgress] = {}
        for tp, p in self.snapshot.items():
            _lo, hi = consumer.get_watermark_offsets(KafkaTP(tp.topic, tp.partition), cached=True)
            pos = positions.get(tp)
            p = p.advance(pos if pos is not None and pos >= 0 else None, hi if hi >= 0 else None)
            if tp in committed:
                p = replace(p, committed=committed[tp])
            if tp in event_times:
                p = replace(p, event_time_ms=event_times[tp])
            if p.paused != (tp in paused):
                p = replace(p, paused=tp in paused)
            end = self._paused_ends.get(tp) if tp in paused else None
            if end is not None and (p.high_watermark is None or end > p.high_watermark):
                p = replace(p, high_watermark=end)
            out[tp] = p
        self.snapshot = out

    def _list_paused(self, consumer: Any, paused: set[TopicPartition]) -> None:
        tps = [tp for tp in paused if tp in self.snapshot]
        if not tps:
            self._paused_ends.clear()
            return
        if time.monotonic() - self._paused_listed_at < PAUSED_END_QUERY_S:
            return
        self._paused_listed_at = time.monotonic()
        try:
            self._paused_ends = self._list(consumer, tps, LATEST)
        except Exception:  # tried again after the interval; the lag reads low meanwhile
            return

    def _query(self, consumer: Any, positions: dict[TopicPartition, int]) -> None:
        # One ListOffsets request for every pending partition (offsets_for_times with the logical timestamps
        # -1 = latest, -2 = earliest) instead of get_watermark_offsets per partition: under a full fetch pipeline
        # each of those took ~0.4 s against the embedded broker, inside the hot loop.
        tps = [tp for tp in self._pending if tp in self.snapshot]
        try:
            # A partition's own error comes back in its entry (offset -1001, "none committed"): it stays pending.
            found = [k for k in consumer.committed([KafkaTP(tp.topic, tp.partition) for tp in tps],
                                                   timeout=QUERY_TIMEOUT_S) if k.error is None]
            ends = self._list(consumer, tps, LATEST)
            unstarted = [tp for tp in tps if self.reset == "earliest" and not any(
                k.offset >= 0 for k in found if (k.topic, k.partition) == (tp.topic, tp.partition))]
            starts = self._list(consumer, unstarted, EARLIEST) if unstarted else {}
        except Exception:  # retried on the next poll; the partition stays "not caught up" meanwhile
            return
        for k in found:
            tp = TopicPartition(k.topic, k.partition)
            if tp not in ends:
                continue
            hi = ends[tp]
            start = k.offset if k.offset >= 0 else (starts.get(tp, 0) if self.reset == "earliest" else hi)
            position = positions.get(tp, start)
            if position < 0:  # a logical offset (a seek to "beginning"/"end" before any fetch): where it points
                position = start
            p = self.snapshot[tp]
            self.snapshot[tp] = replace(p, position=position, listed_end=hi,
                                        committed=k.offset if k.offset >= 0 else None).advance()
            self._pending.discard(tp)

    @staticmethod
    def _list(consumer: Any, tps: list[TopicPartition], which: int) -> dict[TopicPartition, int]:
        listed = consumer.offsets_for_times([KafkaTP(tp.topic, tp.partition, which) for tp in tps],
                                            timeout=QUERY_TIMEOUT_S)
        out: dict[TopicPartition, int] = {}
        for k in listed:
            if k.error is None and k.offset >= 0:
                out[TopicPartition(k.topic, k.partition)] = k.offset
        return out

    @property
    def caught_up(self) -> bool:
        return bool(self.snapshot) and all(p.caught_up for p in self.snapshot.values())


def last_event_times(records: Sequence[SinkRecord], msgs: Sequence[Message]) -> dict[TopicPartition, int]:
    """Event time (ms) of the last record per partition: the envelope's occurred_at, else the record timestamp."""
    last: dict[tuple[str, int], SinkRecord] = {}
    for r in records:  # keyed by a plain tuple: hashing TopicPartition per record cost ~30 ms per 5,000
        last[(r.topic, r.partition)] = r
    out = {TopicPartition(*k): epoch_ms(r.event.occurred_at) for k, r in last.items()}  # as a BatchReader's
    if len(records) == len(msgs):
        return out  # every message became a record: no partition is left without an event time
    stamps: dict[tuple[str, int], int] = {}
    for m in msgs:
        if m.error() is None:
            kind, ts = m.timestamp()
            if kind:
                stamps[(m.topic(), m.partition())] = ts
    for k, ts in stamps.items():
        out.setdefault(TopicPartition(*k), ts)
    return out
