"""An aggregate's history: its events page by page, and its state at a version, read through the history index.

`History.events` and `History.state_at` find an aggregate's events in the index (kafold.event_index, caught up
first), fetch exactly those offsets from its events partition, check each record against its row, and read them
the way every other path does: the envelope's reader (`kafold.fold.fields`), protected fields opened and upcasters
applied (`kafold.fold.domain_event`), and, for a state, the one fold (`kafold.snapshot.fold.folder`, as
`kafold state get` and restore use it).

Offset note: records are fetched with read_committed. A row whose offset holds no committed record of that
aggregate, version and event id (an aborted transaction's record, which read_committed skips; a record deleted by
retention; a topic recreated) is never served: it is dropped from the index and logged, and the listing goes on
without it. Offsets are read in runs: offsets less than `RUN_GAP` apart are read through rather than sought, so
an aggregate whose events lie close together costs one fetch, and one far apart costs one fetch per event.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import orjson
from confluent_kafka import KafkaError, KafkaException, TopicPartition

from kafold import kafka_clients, logs
from kafold.config import AggregateConfig, KafkaConfig, PostgresConfig
from kafold.errors import KafoldError, RetriableError
from kafold.event_index import CaughtUp, EventIndex, IndexRow
from kafold.fold import domain_event, fields
from kafold.partitioning import partition_for
from kafold.snapshot import kafka_io
from kafold.snapshot.fold import Domain, folder

log = logs.get(__name__)
DEFAULT_LIMIT = 100
MAX_LIMIT = 1000  # events per page: a page's memory and time stay bounded whatever a caller asks
# Offsets this close are read through instead of sought (see the offset note): a record read through costs a poll
# (~30 µs), a seek a fetch round trip (1-2 ms on a local Apache Kafka); 50 and 500 gave the same pages, 5000 pages
# 7x slower (docs/benchmarks.md, history).
RUN_GAP = 64
FETCH_TIMEOUT_S = 10.0
# Point readers per aggregate type, fetching a page's runs side by side: one reader has one fetch of a partition
# in flight. With 8 KB fetches a seek costs ~0.15 ms on an idle broker, mostly CPU (the broker sending the record
# batch, librdkafka parsing it), so on a loaded machine readers side by side gain less than the round trips
# suggest: 4 readers 10.3 / 94.1 ms page p50 / p99 against 1 reader 12.8 / 184.3, alternated on the same reads
# (docs/benchmarks.md, history).
READERS = 4
# How long the broker holds a fetch at the partition's end. A seek waits for the fetch in flight, which at the end
# of a run is often the one past it: 25 ms (the range readers') cost each seek up to that; Apache Kafka answers
# a fetch with data at once whatever this is.
POINT_FETCH_WAIT_MS = 5


class NotFound(KafoldError):
    """The aggregate has no events (or none at the version asked for)."""


@dataclass(frozen=True)
class StoredEvent:
    """One event of the history as stored: where it lies, its record's key and value, and its body's fields."""

    partition: int
    offset: int
    key: bytes
    value: bytes
    body: Any


@dataclass(frozen=True)
class Page:
    """A page of one aggregate's events; `next_version` is where the next page starts (None: this is the last)."""

    events: list[dict[str, Any]]
    next_version: int | None
    partition: int


def jsonable(value: Any) -> Any:
    """A domain event as JSON data (dataclasses as objects; datetime, Decimal, UUID and enums as orjson or `str`
    writes them): what the history shows, not a form to read back."""
    return orjson.loads(orjson.dumps(value, default=str, option=orjson.OPT_NON_STR_KEYS))


def row_of(domain: Domain, event: StoredEvent) -> dict[str, Any]:
    """One event as `kafold events list` and `GET /aggregates/{name}/{id}/events` show it; `data` is its payload
    as the fold reads it (protected fields opened, or the placeholder once forgotten; upcast to today's shape)."""
    b = event.body
    return {"version": b.version, "type": b.type, "schema_version": b.schema_version, "occurred_at": b.occurred_at,
            "event_id": b.event_id, "command_id": b.causation_id, "partition": event.partition,
            "offset": event.offset, "data": jsonable(domain_event(domain, b))}


def point_reader(kafka: KafkaConfig, name: str, fetch_wait_ms: int = POINT_FETCH_WAIT_MS) -> Any:
    """A group-less read_committed reader for a few offsets at a time, partition EOF reported. Small fetches: a
    seek fetches from the offset on and a history read wants one record there, not a replay's 16 MB; the broker
    still sends the whole first record batch, however large, so no event is too big for it. 8 KB instead of 256 KB
    took a page of ~50 spread events from 26 to 18 ms (p50; docs/benchmarks.md, history)."""
    return kafka_clients.consumer(kafka, f"kafold.history.{name}", **{
        "enable.partition.eof": True, "isolation.level": "read_committed",
        "fetch.max.bytes": 1024 * 1024, "max.partition.fetch.bytes": 8 * 1024,
        "fetch.wait.max.ms": fetch_wait_ms})


def runs(offsets: Sequence[int], gap: int = RUN_GAP) -> list[list[int]]:
    """Sorted `offsets` split where two lie `gap` or more apart."""
    out: list[list[int]] = []
    for o in sorted(offsets):
        if out and o - out[-1][-1] < gap:
            out[-1].append(o)
        else:
            out.append([o])
    return out


def fetch(consumer: Any, topic: str, partition: int, offsets: Sequence[int],
          timeout_s: float = FETCH_TIMEOUT_S) -> dict[int, tuple[bytes | None, bytes | None]]:
    """The committed records at `offsets` (offset -> (key, value)); an offset without one (aborted, deleted, past
    the end) is absent. One seek per run of close offsets (`runs`)."""
    got: dict[int, tuple[bytes | None, bytes | None]] = {}
    assigned = False
    try:
        for run in runs(offsets):
            wanted, last = set(run), run[-1]
            at = TopicPartition(topic, partition, run[0])
            if assigned:
                try:
                    consumer.seek(at)  # cheaper than a new assignment (no fetch state rebuilt)
                except KafkaException:
                    consumer.assign([at])
            else:
                consumer.assign([at])
                assigned = True
            deadline = time.monotonic() + timeout_s
            while True:
                m = consumer.poll(max(0.0, min(1.0, deadline - time.monotonic())))
                if m is None:
                    if time.monotonic() > deadline:
                        raise RetriableError(f"{topic}[{partition}]: no record at or after offset {run[0]} within "
                                             f"{timeout_s:.0f} s")
                    continue
                err = m.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        break  # the rest of the run is not there (past the last stable offset)
                    raise RetriableError(f"{topic}[{partition}]: {err.str()}")
                offset = m.offset()
                if offset < run[0]:
                    continue  # a record of an earlier assignment still queued
                if offset in wanted:
                    got[offset] = (m.key(), m.value())
                if offset >= last:
                    break
    finally:
        consumer.unassign()
    return got


class History:
    """Reads the histories of one aggregate type; keeps its Kafka readers and index connection (one caller at a
    time: the daemon holds one per aggregate behind a lock)."""

    def __init__(self, kafka: KafkaConfig, pgc: PostgresConfig, agg: AggregateConfig, domain: Domain, *,
                 readers: int = READERS, fetch_wait_ms: int = POINT_FETCH_WAIT_MS) -> None:
        """`readers`, `fetch_wait_ms`: see READERS and POINT_FETCH_WAIT_MS (other values for the bench)."""
        self.agg, self.domain = agg, domain
        self.topic = agg.topic("events")
        self.index = EventIndex(pgc)
        self.indexer = EventIndex(pgc)  # catch-ups run beside the reads, on a connection of their own
        self.catching_up = ThreadPoolExecutor(1, thread_name_prefix=f"kafold-history-{agg.name}-index")
        self.scanner = kafka_io.reader(kafka)  # catch-ups read partitions through: large fetches
        self.points = [point_reader(kafka, agg.name, fetch_wait_ms) for _ in range(readers)]
        self.pool = ThreadPoolExecutor(readers, thread_name_prefix=f"kafold-history-{agg.name}")
        # partitions seen with a mark: their backfill is done, so a read skips asking (one query less per read); a
        # mark dropped since (`kafold events index --rebuild`) is rebuilt by the catch-up every read runs anyway
        self.marked: set[int] = set()

    def close(self) -> None:
        self.pool.shutdown()
        self.catching_up.shutdown()
        self.index.close()
        self.indexer.close()
        self.scanner.close()
        for reader in self.points:
            reader.close()

    def fetch(self, partition: int, offsets: Sequence[int]) -> dict[int, tuple[bytes | None, bytes | None]]:
        """`fetch` with the point readers side by side, each given every n-th run of the offsets."""
        split, n = runs(offsets), len(self.points)
        if len(split) <= 1 or n == 1:
            return fetch(self.points[0], self.topic, partition, offsets)
        shares = [[o for run in split[i::n] for o in run] for i in range(min(n, len(split)))]
        got: dict[int, tuple[bytes | None, bytes | None]] = {}
        for part in self.pool.map(lambda i: fetch(self.points[i], self.topic, partition, shares[i]),
                                  range(len(shares))):
            got.update(part)
        return got

    def partition_of(self, aggregate_id: str) -> int:
        return partition_for(aggregate_id.encode(), self.agg.partitions)

    def catch_up(self, partition: int) -> CaughtUp:
        return self.indexer.catch_up(self.scanner, self.topic, partition)

    def stored(self, aggregate_id: str, from_version: int = 1, upto: int | None = None,
               limit: int | None = None) -> list[StoredEvent]:
        """The aggregate's events from `from_version` (to `upto`; at most `limit`), in version order, each checked
        against its index row (see the module's offset note)."""
        partition = self.partition_of(aggregate_id)
        if partition not in self.marked:
            if self.index.mark(self.topic, partition) is None:
                self.catch_up(partition)  # never indexed (or dropped): the backfill first
            self.marked.add(partition)
        # The catch-up (a ListOffsets round trip, then what was written since) runs while the rows already indexed
        # are fetched: those are a prefix of the history, since a catch-up only adds events past the mark, and an
        # aggregate's later versions lie at later offsets; what it adds is fetched after.
        pending = self.catching_up.submit(self.catch_up, partition)
        rows = self.index.rows(self.topic, aggregate_id, from_version, upto, limit)
        records = self.fetch(partition, [r.offset for r in rows if r.partition == partition])
        if pending.result().indexed and (limit is None or len(rows) < limit):
            more = self.index.rows(self.topic, aggregate_id, rows[-1].version + 1 if rows else from_version, upto,
                                   None if limit is None else limit - len(rows))
            records.update(self.fetch(partition, [r.offset for r in more if r.partition == partition]))
            rows += more
        out: list[StoredEvent] = []
        for row in rows:
            found = records.get(row.offset) if row.partition == partition else None
            body = _matching(found, aggregate_id, row)
            if body is None:
                self._drop(aggregate_id, row)
                continue
            assert found is not None and found[0] is not None and found[1] is not None
            out.append(StoredEvent(partition, row.offset, found[0], found[1], body))
        return out

    def _drop(self, aggregate_id: str, row: IndexRow) -> None:
        log.warning("history.index_row_dropped", topic=self.topic, partition=row.partition, offset=row.offset,
                    aggregate=self.agg.name, version=row.version,
                    reason="no committed record of this event there (an aborted transaction's, deleted, or the "
                           "topic recreated)", fix="`kafold events index --rebuild` if events are missing")
        self.index.drop_row(self.topic, aggregate_id, row.version)

    def events(self, aggregate_id: str, from_version: int = 1, limit: int = DEFAULT_LIMIT) -> Page:
        """One page of the aggregate's events from `from_version`; NotFound when it has none at all."""
        limit = max(1, min(limit, MAX_LIMIT))
        got = self.stored(aggregate_id, from_version, limit=limit + 1)
        more = len(got) > limit
        got = got[:limit]
        if not got and (from_version <= 1 or not self.stored(aggregate_id, 1, limit=1)):
            raise NotFound(f"aggregate {self.agg.name}/{aggregate_id} has no events")
        return Page([row_of(self.domain, e) for e in got], got[-1].body.version + 1 if more else None,
                    self.partition_of(aggregate_id))

    def state_at(self, aggregate_id: str, version: int) -> tuple[Any, int]:
        """(domain state, version) after the aggregate's first `version` events, folded by the one fold;
        NotFound when it has fewer events."""
        got = self.stored(aggregate_id, 1, upto=version)
        if not got or got[-1].body.version != version:
            have = got[-1].body.version if got else 0
            raise NotFound(f"aggregate {self.agg.name}/{aggregate_id} has no version {version} (its history "
                           f"reaches version {have})")
        if [e.body.version for e in got] != list(range(1, version + 1)):  # a hole: the fold would be wrong
            raise KafoldError(f"aggregate {self.agg.name}/{aggregate_id}: its history up to version {version} is "
                              "incomplete (events deleted by retention, or the index lags: `kafold events index "
                              "--rebuild`)")
        folds = folder(self.domain, None, got[0].partition)
        folds.fold([e.offset for e in got], [e.key for e in got], [e.value for e in got])
        return folds.held.state(aggregate_id), folds.held.entries[aggregate_id].version


def _matching(found: tuple[bytes | None, bytes | None] | None, aggregate_id: str, row: IndexRow) -> Any:
    """The record's body when it is the event the row names (key, aggregate id, version, event id), else None."""
    if found is None or found[0] is None:
        return None
    try:
        body = fields(found[1])
        same = (found[0].decode() == aggregate_id and body.aggregate_id == aggregate_id
                and body.version == row.version and str(body.event_id) == row.event_id)
    except Exception:
        return None
    return body if same else None
