"""The pure fold of a projection batch: loaded rows + events -> new rows, deletes, tombstones and outcomes (no I/O).

Both writers (the live one and a rebuild's shadow) read the rows of a batch's keys, fold the batch here, and write
what this returns; the version guard, tombstones and the per-partition outcome counts (the task's offset
accounting) are decided here, once. Everything is passed in and returned as values: a fold keeps no state.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kafold.connectors.api import Outcomes, SinkRecord, TopicPartition
from kafold.connectors.projection.config import VERSION_COLUMN
from kafold.connectors.projection.mapping import UNCHANGED, Mapping, MappingError, Row
from kafold.connectors.projection.rekey import moved
from kafold.connectors.projection.snapshot_sweep import ends_snapshot, sweep
from kafold.errors import RecordError

Key = tuple[Any, ...]
# id(record) -> (tracking key, or the record's id when deduplicating by version; row key)
Prepared = dict[int, tuple["bytes | int", "Key | MappingError"]]

APPLIED, DUPLICATE, STALE, DEAD = range(4)  # slots of BatchResult.by_partition


@dataclass
class BatchResult:
    """What one batch did to the projection."""

    events: int = 0
    duplicates: int = 0
    stale: int = 0
    upserted: int = 0
    deleted: int = 0
    unchanged: int = 0
    dead_lettered: int = 0
    held: int = 0  # events held behind a dead letter of their row key
    transactions: int = 0
    checkpoints: dict[TopicPartition, int] = field(default_factory=dict)
    # Per (topic, partition), [applied, duplicates, stale, dead-lettered or held] of the events handed over, each
    # counted where it is decided: the task's offset accounting (SinkTask.outcomes).
    by_partition: dict[tuple[str, int], list[int]] = field(default_factory=dict)

    def add(self, other: BatchResult) -> None:
        for name in ("events", "duplicates", "stale", "upserted", "deleted", "unchanged", "dead_lettered", "held",
                     "transactions"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.checkpoints.update(other.checkpoints)
        for k, counts in other.by_partition.items():
            mine = self.by_partition.setdefault(k, [0, 0, 0, 0])
            for i, n in enumerate(counts):
                mine[i] += n

    def outcomes(self) -> dict[TopicPartition, Outcomes]:
        """`by_partition` as the SinkTask contract has it."""
        return {TopicPartition(*k): Outcomes(*counts) for k, counts in self.by_partition.items()}


def tally(into: dict[tuple[str, int], list[int]], records: Iterable[Any], slot: int) -> None:
    """Count `records` (SinkRecords or RawRecords) per partition into `slot` of BatchResult.by_partition."""
    for r in records:
        counts = into.get((r.topic, r.partition))
        if counts is None:
            counts = into[(r.topic, r.partition)] = [0, 0, 0, 0]
        counts[slot] += 1


@dataclass
class Folded:
    """A batch folded onto the rows it read: the rows after it (None: removed), and what it skipped or refused;
    deduplicating by version, the tombstones this batch made or raised (`buried`)."""

    state: dict[Key, Row | None]
    loaded: dict[Key, Row]
    stale: int
    unchanged: int
    bad: list[tuple[SinkRecord, RecordError]]
    buried: dict[Key, int] = field(default_factory=dict)
    stale_records: list[SinkRecord] = field(default_factory=list)
    applied: dict[tuple[str, int], int] = field(default_factory=dict)  # events folded in, per (topic, partition)
    truncated: bool = False  # a truncate came first: every row of the table goes before the rows below are written
    swept: int = 0  # a completed snapshot's sweep: every stored row older than this version goes (snapshot_sweep.py)

    def changes(self) -> tuple[list[Row], list[Key]]:
        """What to write: the rows that differ from those loaded, and the keys of loaded rows now removed (after a
        truncate: every row the batch made after it, and nothing to remove one by one)."""
        state, loaded = self.state, self.loaded
        if self.truncated:
            return [row for row in state.values() if row is not None], []
        upserts = [row for key, row in state.items() if row is not None and row != loaded.get(key)]
        deletes = [key for key, row in state.items() if row is None and key in loaded]
        return upserts, deletes


def empty() -> Folded:
    return Folded({}, {}, 0, 0, [])


@dataclass
class Candidates:
    """The events of a batch to try: the first of each tracking key, in order, and their row keys (a key error
    counts only if the event turns out to be new)."""

    first: dict[bytes | int, SinkRecord]  # tracking key (see Prepared) -> record
    record_keys: dict[int, Key]  # id(record) -> row key
    key_errors: dict[int, MappingError]  # id(record) -> why it has no row key
    keys: list[Key]  # the distinct row keys, in order (not a truncate's `()`)


def prepare(mapping: Mapping, records: Sequence[SinkRecord], prefix: bytes | None) -> Prepared:
    """Per record (by id): its tracking key (BLAKE2b-128 of `prefix` and the event id; `prefix` None:
    deduplicating by version, where every record is a candidate and its identity stands for the tracking key) and
    its row key (or the MappingError). Pure, thread-safe."""
    hashed, key_of = hashlib.blake2b, mapping.key
    out: Prepared = {}
    for r in records:
        try:
            key: Key | MappingError = key_of(r.event)
        except MappingError as e:
            key = e
        out[id(r)] = (hashed(prefix + r.event.event_id.encode(), digest_size=16).digest() if prefix is not None
                      else id(r), key)
    return out


def candidates(records: Sequence[SinkRecord], prep: Prepared, skip: set[int]) -> Candidates:
    first: dict[bytes | int, SinkRecord] = {}
    for r in records:
        if id(r) not in skip:
            first.setdefault(prep[id(r)][0], r)
    key_errors: dict[int, MappingError] = {}
    record_keys: dict[int, Key] = {}
    for r in first.values():
        k = prep[id(r)][1]
        if type(k) is tuple:
            record_keys[id(r)] = k
        else:
            key_errors[id(r)] = k  # type: ignore[assignment]
    return Candidates(first, record_keys, key_errors, [k for k in dict.fromkeys(record_keys.values()) if k])


def next_offsets(records: Sequence[SinkRecord]) -> dict[TopicPartition, int]:
    """The next offset of every partition `records` cover."""
    last: dict[tuple[str, int], int] = {}  # plain tuples: TopicPartition per record costs ~1 µs
    for r in records:
        k = (r.topic, r.partition)
        if last.get(k, -1) <= r.offset:
            last[k] = r.offset + 1
    return {TopicPartition(*k): off for k, off in last.items()}


def fold(mapping: Mapping, fresh: list[SinkRecord], loaded: dict[Key, Row], record_keys: dict[int, Key],
         key_errors: dict[int, MappingError], gone: dict[Key, int] | None = None) -> Folded:
    """Fold the new events (`fresh`, in order) onto the rows read (`loaded`); nothing is written (pure but for a
    mapper). An event whose version is at most its row's `_kafold_version` is stale (with the version guard);
    `gone`: deduplicating by version, the tombstones of the keys (a deleted row's version still guards), updated
    with the tombstones this fold makes."""
    folded = Folded({}, loaded, 0, 0, [])
    bad, buried, applied = folded.bad, folded.buried, folded.applied
    state: dict[Key, Row | None] = dict(loaded)
    is_stale, apply = mapping.is_stale, mapping.apply
    for r in fresh:
        key = record_keys.get(id(r))
        if key is None:
            bad.append((r, MappingError(str(key_errors[id(r)]), raw=r)))
            continue
        if not key:  # a truncate (TRUNCATE): every row goes, the ones read and the ones not; later events start anew
            state = dict.fromkeys(state)
            folded.truncated = True
            tp = (r.topic, r.partition)
            applied[tp] = applied.get(tp, 0) + 1
            continue
        row = state.get(key)
        if is_stale(row, r.event) or (gone and row is None and r.event.version <= gone.get(key, 0)):
            folded.stale += 1
            folded.stale_records.append(r)
            if ends_snapshot(r.event):
                folded.swept = max(folded.swept, r.event.version)
                sweep(state, r.event.version, gone, buried)
            continue
        try:
            new = apply(row, r.event, key)
        except MappingError as e:
            bad.append((r, MappingError(str(e), raw=r)))
            continue
        tp = (r.topic, r.partition)  # counted here, where it is decided: a record lost before shows as a gap
        applied[tp] = applied.get(tp, 0) + 1
        if new is UNCHANGED:
            folded.unchanged += 1
            continue
        if new is None and gone is not None:  # deleted: its tombstone keeps the highest version it reached
            assert row is not None
            gone[key] = buried[key] = max(row.get(VERSION_COLUMN) or 0, r.event.version, gone.get(key, 0))
        state[key] = new  # type: ignore[assignment]
        if new is None and row is not None and (move := moved(mapping, r.event, row)) is not None:
            to, moved_row = move  # a Debezium key change: the old row goes to its new key (rekey.py)
            if state.get(to) is None and not (gone and gone.get(to, 0) >= r.event.version):
                state[to] = moved_row
        if ends_snapshot(r.event):  # after its own row: that row has the snapshot's version and stays
            folded.swept = max(folded.swept, r.event.version)
            sweep(state, r.event.version, gone, buried)
    folded.state = state
    return folded
