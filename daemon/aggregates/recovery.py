"""Recovery of one events partition: `restore(partition)` gives base states + a start offset, then the tail is folded.

Offset note: `FullReplay.restore` returns no base states and the partition's first offset, i.e. a full replay; the
snapshot restorer (daemon.aggregates.restorer) plugs in through the same `Restorer` protocol, returning each
aggregate's snapshot state and version plus the offset the tail starts at. The fold skips an event whose version is
not above its aggregate's current version (covered by a snapshot, or a duplicate write), so a replay never folds an
event twice. Events are read with read_committed: those of aborted transactions never enter a state. Where the
replay stops is the catch-up gate's business (`gate.PartitionGate`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

from confluent_kafka import KafkaError, TopicPartition

from kafold import kafka_clients, logs
from kafold.config import KafkaConfig
from kafold.daemon.aggregates.store import Entry, StateStore
from kafold.daemon.aggregates.window import accepted, event_ids, rejected, time_of
from kafold.domain import AggregateDomain
from kafold.envelope import epoch_ms
from kafold.errors import RetriableError
from kafold.fold import Folder, fields
from kafold.kafka_message import Message
from kafold.messages import REJECTED, decode_result

log = logs.get(__name__)


@dataclass
class Base:
    """Where a partition's recovery starts: base states (id -> (state, version)), the idempotency window each
    snapshot carried (id -> [[command id, time ms, version after, events], ...]) and the tail's first offset."""

    start: int
    states: dict[str, tuple[Any, int]] = field(default_factory=dict)
    snapshot_version: int | None = None  # e.g. the snapshot run's offset; None = no snapshot used
    windows: dict[str, list[list[Any]]] = field(default_factory=dict)
    # aggregates whose snapshot carried only the ids decided from this time (ms) on: the rest is read back
    partial: dict[str, int] = field(default_factory=dict)
    # a trusted local store's results offset: the window's results are read from there on (None: the whole window)
    results_start: int | None = None


class Restorer(Protocol):
    def restore(self, partition: int, low: int, end: int) -> Base: ...


class FullReplay:
    """No snapshots: every partition replays from its first offset."""

    def restore(self, partition: int, low: int, end: int) -> Base:
        return Base(start=low)


def reader(kafka: KafkaConfig, name: str) -> Any:
    """A group-less events reader (assign only, never commits) that reports partition EOF, read_committed."""
    return kafka_clients.range_reader(kafka, f"kafold.aggregate.{name}.reader")


@contextmanager
def probing(kafka: KafkaConfig, name: str) -> Iterator[Any]:
    """A group-less consumer that only lists offsets, read_uncommitted (its `bounds` end is the high watermark),
    closed after use. A fresh one per lookup: one kept for long, never assigned, answered offsets_for_times with
    "Unknown partition" for minutes after a broker kill (its metadata for a topic it does not fetch went stale)."""
    made = kafka_clients.consumer(kafka, f"kafold.aggregate.{name}.probe", **{"isolation.level": "read_uncommitted"})
    try:
        yield made
    finally:
        made.close()


def bounds(consumer: Any, topic: str, partition: int) -> tuple[int, int]:
    """(first offset, end offset) as ListOffsets reports them: under read_committed the end is the last stable
    offset (the first offset of a transaction still open), under read_uncommitted the high watermark."""
    try:
        low, high = consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=10, cached=False)
    except Exception as e:
        raise RetriableError(f"{topic}[{partition}]: cannot list offsets: {e}") from e
    return max(0, low), max(0, high, low)


class Recovering:
    """A Folder's `States` for the runtime: one partition's aggregates in the runtime's StateStore (an id evicted
    from it is not folded: it is reloaded from its events on demand), each folded event's command id noted in the
    idempotency window."""

    def __init__(self, domain: AggregateDomain, store: StateStore, partition: int) -> None:
        self.domain, self.store, self.partition = domain, store, partition
        self.entries, self.add_event = store.entries, store.window.add_event  # a store keeps its window for life

    def new(self, aggregate_id: str) -> Entry | None:
        if self.store.backing is not None:  # evicted to the local store: folded on from its record there
            found = self.store.backing.load(self.partition, aggregate_id)
            if found is not None:
                return found
        elif self.store.is_evicted(self.partition, aggregate_id):
            return None  # reloaded on demand, from scratch
        return Entry(self.domain.initial(), 0, self.partition)

    def add(self, aggregate_id: str, entry: Entry) -> None:
        self.store.put(aggregate_id, entry)

    def thaw(self, entry: Entry) -> Any:
        return entry.state  # the runtime's entries always hold their state

    def note(self, entry: Entry, aggregate_id: str, cause: str, occurred_at: Any, version: int,
             event_id: Any) -> None:
        seen = entry.recent.get(cause)
        t = time_of(seen) if type(seen) is int else epoch_ms(occurred_at)
        self.add_event(entry, aggregate_id, cause, t, version, event_id)


def folder(domain: AggregateDomain, store: StateStore, partition: int) -> Folder[Recovering]:
    """The Folder of one events partition into the runtime's store."""
    return Folder(domain, Recovering(domain, store, partition), partition)


def seed(store: StateStore, partition: int, base: Base) -> None:
    """Put a partition's restored base states, and the idempotency window their snapshots carried, in the store."""
    window = store.window
    for aid, (state, version) in base.states.items():
        entry = Entry(state, version, partition)
        for cid, t, version_after, n in base.windows.get(aid, ()):
            window.remember(entry, aid, cid, accepted(t, version_after, n), event_ids(cid, version_after - n, n))
        store.put(aid, entry)


def read_until_eof(consumer: Any, topic: str, partition: int, start: int, on_batch: Any,
                   batch: int = 20000, stall_s: float = 30.0, until: int = 0) -> int:
    """Feed records [start, partition EOF) to `on_batch(msgs)`; the offset EOF was reported at (the true end).
    An EOF below `until` (a high watermark: a transaction still open below it) is read past: the reading waits
    for what that transaction's end makes readable (RetriableError after `stall_s` without progress)."""
    consumer.assign([TopicPartition(topic, partition, start)])
    last, eof = time.monotonic(), -1
    try:
        while True:
            msgs = consumer.consume(batch, 0.05)
            data, ended = [], False
            for m in msgs:
                err = m.error()
                if err is None:
                    data.append(m)
                elif err.code() == KafkaError._PARTITION_EOF:
                    eof, ended = int(m.offset()), True
                else:
                    raise RetriableError(f"{topic}[{partition}]: {err.str()}")
            if data:
                on_batch(data)
                last = time.monotonic()
            if ended and eof >= until:
                return eof
            if not data and time.monotonic() - last > stall_s:
                waiting = f" (readable up to {eof}: a transaction open below {until})" if 0 <= eof < until else ""
                raise RetriableError(f"{topic}[{partition}]: no progress for {stall_s:.0f} s{waiting}")
    finally:
        consumer.unassign()


def reload(consumer: Any, topic: str, domain: AggregateDomain, store: StateStore, partition: int,
           ids: set[str], results: str | None = None) -> int:
    """Rebuild evicted aggregates `ids` of one partition by replaying it filtered by key (and their idempotency
    window from the results partition `results`, when given); events read."""
    low, _ = bounds(consumer, topic, partition)
    with store.lock:
        for aid in ids:
            store.put(aid, Entry(domain.initial(), 0, partition))
    folds = folder(domain, store, partition)
    read = 0

    def feed(msgs: list[Message]) -> None:
        nonlocal read
        read += len(msgs)
        # only these ids: the Folder folds an event into its key's aggregate, which must be its aggregate_id
        folds.fold_records([m for m in msgs if (k := m.key()) is not None and k.decode("utf-8", "replace") in ids])

    read_until_eof(consumer, topic, partition, low, feed)
    if results is not None:
        note_results(consumer, results, domain, store, partition, only=ids)
    log.info("aggregate.reloaded", topic=topic, partition=partition, aggregates=len(ids), events_read=read,
             folded=folds.folded, bad=folds.bad)
    return read


def offset_at(consumer: Any, topic: str, partition: int, since_ms: int) -> int:
    """The first offset whose record time is at or after `since_ms` (ListOffsets by timestamp); -1 for none."""
    try:
        found = consumer.offsets_for_times([TopicPartition(topic, partition, max(0, since_ms))], timeout=10)
    except Exception as e:
        raise RetriableError(f"{topic}[{partition}]: cannot look up offsets by time: {e}") from e
    return int(found[0].offset)


def note_results(consumer: Any, topic: str, domain: AggregateDomain, store: StateStore, partition: int,
                 only: set[str] | None = None, now_ms: int | None = None, probe: Any = None,
                 since: int | None = None) -> tuple[int, int]:
    """Add to the idempotency window the outcomes on results partition `partition` within the window that events
    cannot give: rejections, and acceptances that wrote no event. (Results read, the offset below which every
    result the window needs was read: where the reading ended, or `consumer`'s end offset when no result lies within
    the window.) `since`: a trusted local store's results offset (local.py): the outcomes of results
    below it are in the store, so the reading starts there when that is later than the window's start.

    Offset note: reading starts at the first result whose record time is within the window of the latest command
    time known (ListOffsets by timestamp; results carry their command's time) and stops at the partition's end
    under read_committed, so results of aborted transactions never count. With `probe` (a read_uncommitted
    consumer, `probing`) both are looked up there: the start may then lie in a transaction still open, and the
    reading stops no earlier than the high watermark, so a transaction committed but whose marker has not yet
    reached this partition is waited for (see gate.py). Repeats (`duplicate`) are skipped: the
    first outcome is the one that counts, and an id already known from the events keeps that outcome."""
    window = store.window
    high = max(window.high, now_ms if now_ms is not None else int(time.time() * 1000))
    start = offset_at(probe or consumer, topic, partition, high - window.window_ms)
    if start < 0:  # no result at or after the window's start: every result below the committed end is older
        return 0, bounds(consumer, topic, partition)[1]
    if since is not None:
        start = max(start, since)
    until = bounds(probe, topic, partition)[1] if probe is not None else 0
    evicted = store.evicted.get(partition, ())
    read = 0

    def feed(msgs: list[Message]) -> None:
        nonlocal read
        read += len(msgs)
        with store.lock:
            for m in msgs:
                try:
                    r = decode_result(m.value())
                except Exception:
                    continue  # not a result kafold wrote; the window cannot use it
                aid = r.aggregate_id
                if r.duplicate or (r.event_ids and r.status != REJECTED) or (only is not None and aid not in only):
                    continue  # an acceptance with events is known from those events, which are the truth
                entry = store.fetch(partition, aid)  # with a local store: read back from it
                if entry is None:
                    if aid in evicted:
                        continue  # rebuilt with its events when it is reloaded
                    entry = Entry(domain.initial(), 0, partition)
                    store.put(aid, entry)
                if r.command_id in entry.recent:
                    continue
                t = epoch_ms(r.at) if r.at else m.timestamp()[1]
                window.remember(entry, aid, r.command_id, rejected(t, r.version, r.reason or "") if
                                r.status == REJECTED else accepted(t, r.version, 0))

    end = read_until_eof(consumer, topic, partition, start, feed, until=until)
    window.expire(store.entries)
    return read, end


def note_events(consumer: Any, topic: str, store: StateStore, partition: int, ids: set[str], until: int) -> int:
    """Add to the window of aggregates `ids` (restored from snapshots that carried only their newest command ids)
    the command ids of their events within the window, below offset `until` (where the tail starts); their states
    are not touched. Events read.

    Offset note: reading starts at the first event whose record time is within the window of the latest command
    time known (ListOffsets by timestamp; events carry their command's time) and stops at `until`; records past it
    belong to the tail, which the gate folds."""
    window = store.window
    start = offset_at(consumer, topic, partition, window.high - window.window_ms)
    if start < 0 or start >= until:
        return 0
    read = 0

    def feed(msgs: list[Message]) -> None:
        nonlocal read
        read += len(msgs)
        with store.lock:
            for m in msgs:
                if m.offset() >= until or (k := m.key()) is None or k.decode("utf-8", "replace") not in ids:
                    continue
                try:
                    body = fields(m.value())
                    aid, cause = body.aggregate_id, body.causation_id
                    entry = store.entries.get(aid)
                    if cause and entry is not None and cause not in entry.recent:
                        window.add_event(entry, aid, cause, epoch_ms(body.occurred_at), body.version, body.event_id)
                except Exception:
                    continue  # a bad event was left out of the state too

    read_until_eof(consumer, topic, partition, start, feed)
    return read
