"""ShadowWriter: a rebuild's writer of its shadow table, which may fold batch after batch before writing them once.

Note on offsets and commits
---------------------------
The shadow's checkpoints (connector = the rebuild's key) are written in the same transaction as its rows, as the
live writer's are (writer.py): `write` is the live protocol, batch by batch. Folding ahead (`fold_ahead`, then
`flush`), deduplicating by version, a writer that is its table's only writer folds batch after batch in memory and
writes the rows they leave once: a key's row is written once per flush instead of once per batch. The rows,
tombstones, dead letters and next offsets folded ahead are written in ONE transaction, so the stored checkpoints
still describe exactly the rows. Only the clean path folds ahead: an event the mapping refuses, a row PostgreSQL
rejects or a held key raises Rewind (nothing written); the caller then reads again from the stored checkpoints
with `write`, which isolates such events batch by batch. Nothing reads the shadow before the swap, so its commits
do not wait for the WAL flush (`durable=False`): a crash loses rows and checkpoints together, and the rebuild
resumes from the checkpoints left.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import psycopg

from kafold import db
from kafold.config import PostgresConfig
from kafold.connectors.api import SinkRecord, TopicPartition
from kafold.connectors.projection.config import VERSION_COLUMN, ProjectionConfig
from kafold.connectors.projection.fold import BatchResult, Folded, Key, Prepared, candidates, fold
from kafold.connectors.projection.held_keys import DeadLetter, HoldsChanged
from kafold.connectors.projection.mapping import Mapping, Row
from kafold.connectors.projection.snapshot_sweep import sweep
from kafold.connectors.projection.writer import REJECTED, ProjectionWriter
from kafold.errors import RetriableError


class Rewind(Exception):
    """A fold ahead could not be written as folded (an event the mapping refused, a row PostgreSQL rejected, a held
    key): nothing of it was (`events` of it dropped), and the caller goes back to the stored checkpoints and writes
    batch by batch."""

    def __init__(self, message: str, events: int) -> None:
        super().__init__(message)
        self.events = events


@dataclass
class _Ahead:
    """What was folded ahead and not written yet."""

    rows: dict[Key, Row | None] = field(default_factory=dict)  # key -> its row after the events folded ahead
    base: dict[Key, Row] = field(default_factory=dict)  # key -> its stored row before them
    buried: dict[Key, int] = field(default_factory=dict)  # tombstones made or raised
    dead: list[DeadLetter] = field(default_factory=list)
    offsets: dict[TopicPartition, int] = field(default_factory=dict)
    events: int = 0
    truncated: bool = False  # a truncate was folded: the stored rows are gone, those in `rows` written after them
    swept: int = 0  # a snapshot's sweep was folded: stored rows older than this are gone (snapshot_sweep.py)


class ShadowWriter(ProjectionWriter):
    """Writes a rebuild's shadow table: the live protocol (`write`) and folding ahead (`fold_ahead`, `flush`)."""

    def __init__(self, pgc: PostgresConfig, config: ProjectionConfig, mapping: Mapping, key: str, table: str,
                 cache_rows: int, track: bool) -> None:
        # The rebuild's key names its checkpoints and its tracking records; its rows are kept between batches (it
        # is the shadow's only writer), and its commits do not wait for the WAL flush (see the note above).
        super().__init__(pgc, config, mapping, key, key, table, cache_rows=cache_rows, track=track, durable=False)
        self._ahead = _Ahead()

    def fold_ahead(self, records: Sequence[SinkRecord], dead: Sequence[DeadLetter],
                   offsets: dict[TopicPartition, int], prepared: Prepared | None = None) -> None:
        """Fold `records` onto the rows folded so far (reading the rows and tombstones of keys not known yet);
        nothing is written until `flush`."""
        assert not self.track and self.table_rows.cache_rows, "folding ahead deduplicates by version, keeping rows"
        with self.turns:
            records = list(records)
            prep = prepared if prepared is not None else self.prepare(records)
            todo = candidates(records, prep, set())
            ahead, cache = self._ahead, self.table_rows.cache
            pending, base = ahead.rows, ahead.base
            # after a truncate folded ahead the stored rows (and their tombstones) are as good as gone: none is read
            new_keys = [k for k in todo.keys if k not in pending and k not in cache] if not ahead.truncated else []
            found: dict[Key, Row] = {}
            gone: dict[Key, int] = {}
            if new_keys:
                conn = self.connection()
                try:
                    with self.turns.waiting(conn.pipeline()):
                        read = self.table_rows.read_keys(conn, new_keys)
                    found = self.table_rows.rows(read[0])
                    gone = self.table_rows.tombstones_read(read)
                except psycopg.OperationalError as e:
                    self.close()
                    raise RetriableError(f"PostgreSQL: {e}") from e
            loaded: dict[Key, Row] = {}
            for k in todo.keys:
                row: Row | None = None
                if k in pending:
                    row = pending[k]
                    if k in ahead.buried:
                        gone[k] = ahead.buried[k]
                elif not ahead.truncated:
                    got = cache[k] if k in cache else found.get(k)
                    if type(got) is int:  # a cached tombstone
                        gone[k] = got
                    elif got is not None and (got.get(VERSION_COLUMN) or 0) < ahead.swept:  # type: ignore[union-attr]
                        gone[k] = max(ahead.swept - 1, gone.get(k, 0))  # swept by a snapshot folded ahead
                    elif got is not None:
                        row = base[k] = got  # type: ignore[assignment]
                if row is not None:
                    loaded[k] = row
            folded = fold(self.mapping, list(todo.first.values()), loaded, todo.record_keys, todo.key_errors, gone)
            if folded.bad:
                raise Rewind(f"{len(folded.bad)} event(s) the mapping refused", self.drop_ahead() + len(records))
            if folded.truncated:
                pending.clear()
                ahead.base.clear()
                ahead.buried.clear()
                ahead.truncated = True
            if folded.swept:  # the rows folded ahead of it are swept too, not only this batch's
                sweep(pending, folded.swept, {}, ahead.buried)
                ahead.swept = max(ahead.swept, folded.swept)
            pending.update(folded.state)
            ahead.buried.update(folded.buried)
            ahead.dead += dead
            for tp, off in self.advance_to(records, offsets).items():
                ahead.offsets[tp] = max(off, ahead.offsets.get(tp, 0))
            ahead.events += len(records)

    def flush(self) -> BatchResult:
        """Write what was folded ahead in one transaction (Rewind: nothing was, and nothing is kept)."""
        ahead = self._ahead
        if not ahead.rows and not ahead.dead and not ahead.offsets:
            return BatchResult()
        folded = Folded(ahead.rows, ahead.base, 0, 0, [], ahead.buried, truncated=ahead.truncated,
                        swept=ahead.swept)
        result = BatchResult(events=ahead.events, transactions=1, dead_lettered=len(ahead.dead))
        try:
            conn = self.connection()
            turns = self.turns
            try:
                with turns, turns.waiting(conn.pipeline()) as pipe:
                    db.begin(conn)
                    holds = self.holds.read(conn)
                    turns.sync(pipe)
                    try:
                        self.holds.check(holds)
                    except HoldsChanged:
                        raise Rewind("held keys", ahead.events) from None
                    stored = self.store(conn, pipe, folded, ahead.dead, ahead.offsets, {}, None,
                                         result)  # hold no key
            except BaseException:
                db.roll_back(conn)
                raise
            result.upserted, result.deleted = stored.counts()
        except REJECTED as e:
            raise Rewind(f"PostgreSQL rejected a row: {str(e).splitlines()[0]}", self.drop_ahead()) from e
        except psycopg.OperationalError as e:
            self.drop_ahead()
            self.close()
            raise RetriableError(f"PostgreSQL: {e}") from e
        except BaseException:
            self.drop_ahead()
            raise
        finally:
            self.idle.set()
        result.checkpoints = dict(ahead.offsets)
        if ahead.truncated or ahead.swept:
            self.table_rows.cache.clear()
        self.table_rows.remember(ahead.rows, ahead.buried)
        self._ahead = _Ahead()
        return result

    def drop_ahead(self) -> int:
        """Forget what was folded ahead, and the rows kept (they may be what it folded onto); the events dropped."""
        dropped = self._ahead.events
        self._ahead = _Ahead()
        self.table_rows.cache.clear()
        return dropped

    @property
    def can_fold_ahead(self) -> bool:
        """Deduplicating by version, keeping rows, and folding onto rows as PostgreSQL would give them back: a
        mapper (the user's code) sees each value as read back, so with one every column must read back as written."""
        if self.track or not self.table_rows.cache_rows:
            return False
        self.connection()  # the table's column types
        plain = self.table_rows.plain
        return self.mapping.copies_rows or all(plain.get(c) for c in (*self.config.columns, VERSION_COLUMN))

    @property
    def ahead_rows(self) -> int:
        """Keys folded ahead, not written yet."""
        return len(self._ahead.rows)

    @property
    def ahead_events(self) -> int:
        """Events folded ahead, not written yet."""
        return self._ahead.events
