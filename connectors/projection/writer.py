"""ProjectionWriter: applies a batch of events to PostgreSQL in ONE transaction, set-based, exactly once.

The fold of a batch onto the rows read (version guard, tombstones, outcomes) is fold.py's, pure; this module reads
and writes around it. A rebuild's shadow table has its own writer on top of this one (shadow_writer.py: folding
ahead).

Note on offsets and commits
---------------------------
Per batch, one transaction: (1) the batch's tracking keys go into the tracking table with ON CONFLICT DO NOTHING,
RETURNING the new ones — the rest are duplicates and are dropped (a tracking key is the 16-byte BLAKE2b of the
namespace and the event id, 16 bytes: one small primary key instead of two text columns); (2) the current
rows of the affected keys are read in one SELECT; (3) the new events are folded in order in Python, skipping any
event whose aggregate version is <= the row's `_kafold_version`; (4) changed rows are upserted by one INSERT …
SELECT FROM unnest(one array per column) ON CONFLICT DO UPDATE (guarded by version again; no staging table),
removed rows go with one DELETE …
USING; (5) the next offset of every partition the batch covers is upserted into the checkpoints table,
monotonically (`WHERE next_offset < EXCLUDED.next_offset`), so a zombie writer after a rebalance cannot move it
back; (6) commit. The checkpoint therefore always describes exactly the rows: PostgreSQL is the source of truth for
offsets.

A source table's truncate (an event of type TRUNCATE, Debezium op `t`, when its converter is told to apply it):
the fold empties its rows there, and step (4) starts with one DELETE of every row, then writes the rows the batch
made after it, all in the transaction that moves the checkpoint past it. So it happens once and in its place among
the changes: a crash before the commit redoes the whole batch; its tracking key makes a redelivery a duplicate.

Round trips: the transaction is one pipeline, its BEGIN and COMMIT statements queued with the rest (`db.begin`):
BEGIN and the reads of (1)-(2) are the first round trip; (4)-(6) are queued after the fold and sent with the
COMMIT, the second, whatever the number of changed rows (the upsert's arrays go as parameters of its one statement:
no COPY, which would leave the pipeline). Any error rolls back
(`db.roll_back`), and the batch is done again or isolated as below.

A concurrent writer of the same events (a zombie task after a rebalance) blocks on the tracking rows' primary
key until the first commits, then sees them as duplicates: no event is applied twice; its row reads come after
that wait (READ COMMITTED) and the merge's version guard covers any other overlap.

The optimistic order (the usual case: the last batch had no duplicates). Steps (1)-(3) then run as: read the rows
(the first round trip), send a PLAIN insert of the tracking keys, and fold the batch in Python while the server
runs that insert, the batch's largest statement (~7 µs a key here; a plain insert costs about a third less in the
server than ON CONFLICT … RETURNING). If any key is already there, the insert fails with a unique violation on the
tracking table (seen at the next sync, the statements after it not run): the transaction rolls back and is done
again in the order above, and batches keep that order until one comes without duplicates (so a replay pays this
once). A clean plain insert proves every event of the batch new, and the rows read just before it are the rows
to fold onto: another writer's commit in between would have to hold some of this batch's events (it starts from
the same stored offsets: its tracking rows would fail the insert) or only later events of the same aggregates
(newer versions: the merge's version guard keeps its rows).

Rows the database rejects (constraint violations, bad values) do not poison the batch: the transaction is rolled
back and the batch bisected, in order, until the bad events are isolated; each is written to the dead-letter
table (after the DLQ topic acknowledged it) in the same transaction as the checkpoint that passes it, and the
rest is applied. Connection failures are RetriableError: the caller retries the same batch, and steps (1) and
(5) make the retry harmless.

Held keys (`hold_on_dead_letter`, on by default). A dead-lettered event the projection handles (schema-invalid,
db-rejected) whose row key is known becomes the *head* of that key (`hold_key` in the dead-letter table): the key's
later events — in this batch after it, and in every later batch — are not applied but recorded as dead letters with
status `held`, in the same transaction as the checkpoint that passes them, and are not tracked (so applying them
later is their first application); other keys keep flowing. Every transaction that may hold starts by taking the
connector's holds lock (an advisory lock, shared) and reading the connector's held keys in the same round trip as
its first statements; a set different from the one the batch was prepared with (another task's head, a release by
`kafold dlq replay|discard`, which takes that lock exclusively, or a swap) rolls the transaction back and redoes it
with the set read. See holds.py for the release.

Deduplicating by version (`track=False`: a rebuild's writer when the projection has its version guard, and the live
writer with `dedup = "version"`, below). Tracking
records cost a key per event in the server; a writer that is its table's only writer can drop them and let the
version guard alone skip what was already applied: a row at version V has seen every event of its aggregate up to V,
a duplicate carries its original's version, so it is stale. What a row forgets when it is deleted is kept as a
tombstone (namespace, row key, the highest version the row had reached; `tombstones` table, written in the same
transaction as the delete): an event of a key with no row is stale when its version is at most the tombstone's.
This equals tracking wherever an aggregate's versions rise along its partition (what kafold's aggregates write and
what the version guard already assumes); where they go back, the version guard decides as it does live.

The live writer deduplicating by version (`dedup = "version"`, `fence=True`): the checkpoint is the fence. A live
table has other writers at times — the zombie of a task that lost its partitions, still finishing a batch, and the
new owner, both starting from the same stored offsets — so "its table's only writer" is made true per partition by
the checkpoint row instead of by tracking rows. The writer keeps the offsets it last knew stored (`_stored`: read
at `open`, updated by each commit). Each transaction moves the checkpoints of the partitions it
covers from exactly those offsets to the batch's next ones (`UPDATE … WHERE next_offset = <last known>`, an insert
where none was stored), sent with BEGIN and the reads in the first round trip, after them (the table's lock first,
as a rebuild's swap takes them). Its row locks serialize the writers of a
partition: a second writer waits for the first's commit, then (READ COMMITTED rechecks the WHERE against the
committed row) moves nothing; a count short of the partitions is `_Moved`: that transaction rolls back having
written nothing, the writer reads the stored checkpoints and redoes the batch, skipping every record below them
(the transaction that moved them applied those records) — a zombie thus writes nothing, and a new owner that lost
the race applies just what follows. So the committed transactions of a partition form one chain, each starting at
the offset the previous left: a record is applied by at most one committed transaction, which also moves the
checkpoint past it (exactly once for the offsets). A record *produced* twice (same event id, at a later offset)
carries its original's aggregate and version: the version guard finds it stale, a deleted row's tombstone too. A
different event at a version its row already has (a producer's bug) is stale as well, as it is with tracking, where
the version guard skips it after the tracking insert; both count it under `stale`. Kafka's own committed offsets
follow the checkpoints as before (task.py): only what is stored here is trusted at `open`.

Whole rows (whole_rows.py): with the fence, a batch whose events each set their whole row is not read nor folded
here; one statement upserts its last row of each key, BEGIN to COMMIT in one round trip, and fails (sql.redo) when
the fence, the held keys or any event's outcome is not what the writer assumed: the batch is then done as above.
Such a plan may come with the batch, made ahead (`WholeRows.ahead`, on the runner's thread while the previous batch
is in PostgreSQL): used only by the batch's first transaction, when it skips no record and the path is still on.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import psycopg
from psycopg.types.json import Jsonb

from kafold import db, logs
from kafold.config import PostgresConfig
from kafold.connectors.api import RawRecord, SinkRecord, TopicPartition
from kafold.connectors.dlq import DeadLetterStatus, headers_json, pg_text
from kafold.connectors.projection import sql as q
from kafold.connectors.projection.config import ProjectionConfig
from kafold.connectors.projection.fold import (
    APPLIED,
    DEAD,
    DUPLICATE,
    STALE,
    BatchResult,
    Candidates,
    Folded,
    Prepared,
    candidates,
    empty,
    fold,
    next_offsets,
    prepare,
    tally,
)
from kafold.connectors.projection.held_keys import DeadLetter, HeldKeys, HoldsChanged, hold_text
from kafold.connectors.projection.mapping import Mapping, Row
from kafold.connectors.projection.table_rows import TableRows
from kafold.connectors.projection.whole_batch import WholeBatch
from kafold.connectors.projection.whole_rows import WholePlan, WholeRows, redone
from kafold.errors import ConfigError, FatalError, RecordError, RetriableError, redact_quoted

log = logs.get(__name__)

Report = Callable[[Sequence[tuple[Any, BaseException]]], None]  # to the DLQ topic, acknowledged on return
REJECTED = (psycopg.errors.IntegrityError, psycopg.errors.DataError)
T = TypeVar("T")


class _Moved(Exception):
    """A checkpoint this batch moves is not where this writer last stored it: another writer of the partition (the
    new owner after a rebalance, or this writer's zombie) committed since; redo from the stored checkpoints."""


@dataclass
class _Stored:
    """The merge's and the delete's cursors, read once the pipeline they were queued in has synced."""

    merged: psycopg.Cursor[Any] | None
    removed: psycopg.Cursor[Any] | None

    def counts(self) -> tuple[int, int]:
        """The rows upserted and deleted."""
        return (self.merged.rowcount if self.merged is not None else 0,
                self.removed.rowcount if self.removed is not None else 0)


class _Bad(Exception):
    """Events the mapping refused during a fold; the transaction is redone without them."""

    def __init__(self, bad: list[tuple[SinkRecord, RecordError]]) -> None:
        super().__init__(f"{len(bad)} event(s) do not fit the mapping")
        self.bad = bad


# A literal PostgreSQL quotes in an error message: `invalid input syntax for type uuid: "<the value>"`.
def _rejection(e: BaseException) -> str:
    """Why PostgreSQL refused a row, in one line; a NUL character (which its text and jsonb cannot store) named.
    Every quoted literal but the names the error's diagnostics give (schema, table, column, type, constraint) is
    redacted: the text is kept with the dead letter (its table and topic) and may quote a value of the row, which
    may be a protected field the intake opened. Always, not only for protected rows: a mapper can put a protected
    value into any column, and the record itself keeps the value."""
    full = str(e)
    diag = getattr(e, "diag", None)
    names = {n for n in (getattr(diag, a, None) for a in ("schema_name", "table_name", "column_name",
                                                          "datatype_name", "constraint_name")) if n}
    first = redact_quoted(full.splitlines()[0] if full else "", names)
    text = f"{type(e).__name__}: {first}"
    nul = "0x00" in full or "\\u0000" in full  # the server's words (text, jsonb) and psycopg's (a text parameter)
    return f"a value holds a NUL character, which PostgreSQL text and jsonb cannot store ({text})" if nul else text


Then = Callable[[psycopg.Connection[Any], "BatchResult"], None]


@dataclass
class _Call:
    """One `write`'s settings and the dead letters' hold keys it decides, handed down its steps (never kept on the
    writer: a write's state ends with it)."""

    advance: bool = True  # move the checkpoints to cover the records
    prepared: Prepared | None = None  # `prepare` of the records, computed on the runner's thread
    hold: bool = False  # this write holds (holding, and not a release)
    then: Then | None = None  # runs in each committed transaction, last
    ahead: WholePlan | None = None  # the whole batch's plan made ahead (WholeRows.ahead): its first transaction's
    hold_of: dict[int, tuple[DeadLetterStatus, str]] = field(default_factory=dict)  # id(error) -> (status, hold_key)


def tracking_prefix(namespace: str) -> bytes:
    """What precedes the event id in the hashed tracking key (length-prefixed, so no two pairs collide)."""
    raw = namespace.encode()
    return b"%d:" % len(raw) + raw + b"/"


def tracking_key(prefix: bytes, event_id: str) -> bytes:
    """The tracking key of an event in a namespace: BLAKE2b-128 of the pair (collision-resistant, unlike md5)."""
    return hashlib.blake2b(prefix + event_id.encode(), digest_size=16).digest()


class _Turns:
    """The GIL hand-off of one writer: inside `with`, the writer runs Python (`idle` clear); `waiting` and `sync`
    hand the interpreter over while it waits for PostgreSQL; leaving hands it over for the rest of the transaction
    (the merge, the checkpoint, the commit). `idle` is the task's yield point (task.py)."""

    def __init__(self, idle: threading.Event) -> None:
        self.idle = idle

    def __enter__(self) -> _Turns:
        self.idle.clear()
        return self

    def __exit__(self, *exc: object) -> None:
        self.idle.set()

    @contextlib.contextmanager
    def waiting(self, step: contextlib.AbstractContextManager[T]) -> Iterator[T]:
        """`step` (a pipeline) whose exit waits for PostgreSQL: the interpreter is handed over for that wait."""
        with step as value:
            yield value
            self.idle.set()
        self.idle.clear()

    def sync(self, pipe: psycopg.Pipeline) -> None:
        self.idle.set()
        pipe.sync()
        self.idle.clear()

    def handing_over(self, report: Report) -> Report:
        """`report`, handing the interpreter over while it runs (it waits for the runner's thread)."""
        idle = self.idle

        def reporting(bad: Sequence[tuple[Any, BaseException]]) -> None:
            idle.set()
            try:
                report(bad)
            finally:
                idle.clear()

        return reporting


class ProjectionWriter:
    """Owns one PostgreSQL session for one projection task; `write` is the whole per-batch protocol.

    Its parts: `table_rows` (table_rows.py: the table's shape, rows read by key, rows kept between batches) and
    `holds` (held_keys.py). What a writer built on it (ShadowWriter, shadow_writer.py: folding ahead) may use
    besides `write`: those parts, `turns` (the session's one-at-a-time use), `advance_to` (the next offsets a
    batch leaves) and `store` (a batch's writes into an open transaction); the rest is private to this module."""

    def __init__(self, pgc: PostgresConfig, config: ProjectionConfig, mapping: Mapping, connector: str,
                 namespace: str | None = None, table: str | None = None, cache_rows: int = 0, track: bool = True,
                 durable: bool = True, fence: bool = False) -> None:
        self.pgc, self.config, self.mapping = pgc, config, mapping
        self.connector = connector  # key of checkpoints and dead letters
        self.namespace = namespace or connector  # key of tracking records (a rebuild uses its own)
        self.table = table or config.table
        self.conn: psycopg.Connection[Any] | None = None
        self._tracking = db.table(pgc, "tracking")
        # Deduplicating by version instead (see the module note): only with the guard, for its table's only writer.
        if not track and not mapping.guard:
            raise ConfigError([f"projection {connector}: deduplicating by version needs the version guard"])
        self.track = track
        # fence=True (a live writer deduplicating by version): each transaction moves its checkpoints from the
        # offsets last stored (`_stored`, read by `checkpoints` and kept by each commit), or fails (see the note).
        if fence and track:
            raise ConfigError([f"projection {connector}: the checkpoint fence is for a writer without tracking"])
        self.fence = fence
        self._stored: dict[TopicPartition, int] = {}
        # durable=False: commits do not wait for the WAL flush (synchronous_commit off). For a writer whose
        # transactions may be lost together with their checkpoints on a PostgreSQL crash (it then resumes from
        # the checkpoints left): a rebuild's shadow, which nothing reads before the swap, whose own transaction
        # flushes the WAL up to it.
        self.durable = durable
        self._checkpoints = db.table(pgc, "checkpoints")
        self._dead = db.table(pgc, "dead_letters")
        self._optimistic = True  # fold while the tracking insert runs (see _apply); off after duplicates
        self._prefix = tracking_prefix(self.namespace)
        self.holding = config.hold_on_dead_letter
        self.holds = HeldKeys(connector, self._dead, mapping)
        # Set while this writer is not running Python (waiting for PostgreSQL, or between writes): the task's
        # yield point lets the runner's decoding wait for it, so the batch being written — the slower stage —
        # gets the interpreter first (see task.py). `turns` is the one place that moves it.
        self.idle = threading.Event()
        self.idle.set()
        self.turns = _Turns(self.idle)
        self.table_rows = TableRows(pgc, config, mapping, self.namespace, self.table, cache_rows)
        self.whole_rows = WholeRows(mapping, self.table_rows, self.namespace)  # used with the fence (whole_rows.py)

    # ---- session ----------------------------------------------------------------------------------------
    def connection(self) -> psycopg.Connection[Any]:
        if self.conn is None or self.conn.closed or self.conn.broken:
            self.close()
            conn = db.connect(self.pgc)
            try:
                if not self.durable:
                    conn.execute("SET synchronous_commit = off")
                with db.transaction(conn):
                    self.table_rows.check(conn)
            except BaseException:
                conn.close()
                raise
            self.conn = conn
        return self.conn

    def close(self) -> None:
        if self.conn is not None:
            try:
                self.conn.close()
            finally:
                self.conn = None


    # ---- offsets ----------------------------------------------------------------------------------------
    def checkpoints(self) -> dict[TopicPartition, int]:
        """The stored next offset of every partition this connector has written."""
        conn = self.connection()
        try:
            rows = conn.execute(q.load_checkpoints(self._checkpoints), (self.connector,)).fetchall()
        except psycopg.OperationalError as e:
            self.close()
            raise RetriableError(f"PostgreSQL: {e}") from e
        stored = {TopicPartition(t, p): o for t, p, o in rows}
        self._stored = dict(stored)
        return stored

    # ---- the batch --------------------------------------------------------------------------------------
    def write(self, records: Sequence[SinkRecord], dead: Sequence[DeadLetter] = (),
              offsets: dict[TopicPartition, int] | None = None, report: Report | None = None,
              advance: bool = True, prepared: Prepared | None = None, hold: bool = True,
              then: Then | None = None, ahead: WholePlan | None = None) -> BatchResult:
        """Apply `records`, record `dead` letters and advance checkpoints to cover `records` and `offsets`
        (`advance=False`: leave checkpoints alone, e.g. when re-applying dead letters). `prepared`: what
        `prepare` gave for (at least) these records, else it is computed here. `hold=False`: neither hold events
        nor make heads (a release, which holds the holds lock itself); `then(conn, result)` runs in each
        committed transaction, last. `ahead`: `whole_rows.ahead` of exactly these records."""
        call = _Call(advance, prepared, self.holding and hold, then, ahead)
        if report is not None:  # reporting waits for the runner's thread: never make it wait for us meanwhile
            report = self.turns.handing_over(report)
        try:
            try:
                return self._isolating(call, listed(records), list(dead), dict(offsets or {}), report)
            except BaseException:
                self.table_rows.cache.clear()  # rows kept may be what a rolled-back transaction wrote
                raise
        except RetriableError:
            self.close()
            raise
        except psycopg.OperationalError as e:
            self.close()
            raise RetriableError(f"PostgreSQL: {e}") from e
        finally:
            self.idle.set()

    def _isolating(self, call: _Call, records: Sequence[SinkRecord], dead: list[DeadLetter],
                   offsets: dict[TopicPartition, int], report: Report | None) -> BatchResult:
        """One transaction; on a rejected row, bisect in order so each committed part covers a prefix."""
        try:
            return self._transaction(call, records, dead, offsets, report)
        except REJECTED as e:
            if len(records) <= 1:
                if not records:
                    raise FatalError(f"PostgreSQL rejected kafold's own bookkeeping: {e}") from e
                bad = records[0]
                error = RecordError(f"{self.config.schema}.{self.table} rejected the row of event "
                                    f"{bad.event.event_id}: {_rejection(e)}", raw=bad, reason="db-rejected")
                if report is not None:
                    report([(bad, error)])
                head = self.holds.head_text(call.hold, bad)
                if head is not None:
                    call.hold_of[id(error)] = (DeadLetterStatus.NEW, head)
                done = self._transaction(call, [], [*dead, (RawRecord.of(bad), error)],
                                         {**offsets, bad.tp: bad.offset + 1}, None)
                if head is not None:
                    self.holds.known.add(head)  # committed: the key's later events are held from now on
                done.dead_lettered += 1
                tally(done.by_partition, [bad], DEAD)
                return done
            half = len(records) // 2
            result = self._isolating(call, records[:half], dead, {}, report)
            result.add(self._isolating(call, records[half:], [], offsets, report))
            return result

    def _transaction(self, call: _Call, records: Sequence[SinkRecord], dead: list[DeadLetter],
                     offsets: dict[TopicPartition, int], report: Report | None) -> BatchResult:
        excluded: list[SinkRecord] = []
        heads: dict[str, int] = {}  # row keys this batch's dead letters hold back -> index of the head in records
        while True:
            try:
                conn = self.connection()
                try:
                    result, folded = self._apply(conn, call, records, excluded, dead, offsets, heads)
                except BaseException:
                    db.roll_back(conn)
                    raise
                self.holds.known.update(heads)  # committed with their heads
                if self.fence:
                    self._stored.update(result.checkpoints)
                    self.whole_rows.on = not result.stale and self.whole_rows.usable
                if self.table_rows.cache_rows and (folded.state or folded.truncated or folded.swept):  # rows committed
                    if folded.truncated or folded.swept:  # the rows kept are gone with the rest (or may be)
                        self.table_rows.cache.clear()
                    self.table_rows.remember(folded.state, folded.buried)
                return result
            except REJECTED as e:
                if isinstance(e, psycopg.errors.UniqueViolation) and self._tracked_already(e):
                    self._optimistic = False  # rolled back: do it again expecting duplicates, until a batch has none
                elif self.whole_rows.tried:  # the careful way decides: a stale event's row is not written at all
                    self.whole_rows.on = False
                else:  # a row the table refused: the caller isolates it
                    raise
            except HoldsChanged:  # rolled back: do it again with the keys read
                continue
            except psycopg.errors.UndefinedObject as e:
                if not redone(e):
                    raise
                self.whole_rows.on = False  # rolled back: the one-statement path's checks failed; the careful way
            except _Moved:  # rolled back: another writer moved a checkpoint; redo from the stored ones
                was = dict(self._stored)
                now = self.checkpoints()
                log.info("projection.checkpoint_moved", connector=self.connector,
                         moved={str(tp): [was.get(tp), off] for tp, off in now.items() if was.get(tp) != off})
            except _Bad as e:  # rolled back: do it again without them, dead-lettered
                bad = self.holds.heads(call.hold, call.hold_of, records, e.bad, heads)
                if report is not None and bad:
                    report(bad)
                excluded += [r for r, _ in bad]
                dead = [*dead, *((RawRecord.of(r), err) for r, err in bad)]

    def prepare(self, records: Sequence[SinkRecord]) -> Prepared:
        """Per record (by id): its tracking key and its row key (or the MappingError). Pure, thread-safe: the
        task computes it on the runner's thread while the previous batch is being written."""
        return prepare(self.mapping, records, self._prefix if self.track else None)

    def _apply(self, conn: psycopg.Connection[Any], call: _Call, records: Sequence[SinkRecord],
               excluded: list[SinkRecord], dead: list[DeadLetter], offsets: dict[TopicPartition, int],
               heads: dict[str, int]) -> tuple[BatchResult, Folded]:
        """One transaction of the protocol in the module note: hold → track → read → fold in Python's turn,
        then upsert → checkpoint in PostgreSQL's (the caller commits); what it did, and the batch folded."""
        result = BatchResult(events=len(records), transactions=1, dead_lettered=len(dead))
        skip = {id(r) for r in excluded}
        turns = self.turns
        advance = self.advance_to(records, offsets, call.advance)
        behind: list[SinkRecord] = []
        if self.fence:  # what the stored checkpoints passed was applied by the transaction that moved them
            stored_at = self._stored
            behind = below(records, stored_at, skip)
            skip.update(id(r) for r in behind)
            advance = {tp: o for tp, o in advance.items() if o > stored_at.get(tp, -1)}
        with turns, turns.waiting(conn.pipeline()) as pipe:
            db.begin(conn)  # with the first reads: no round trip of its own
            fence = advance if self.fence and advance else None
            prep = call.prepared
            if call.hold and (self.holds.known or heads):
                prep = prep if prep is not None else self.prepare(records)
                held = self.holds.held_records(call.hold_of, records, prep, skip, heads)
                result.held = len(held)
                tally(result.by_partition, (raw for raw, _ in held), DEAD)
                dead = [*dead, *held]
            plan, todo = planned(self.whole_rows, records, call, skip, fence,
                                 lambda: prep if prep is not None else self.prepare(records))
            self.whole_rows.tried = plan is not None
            if plan is not None and fence:  # one round trip, no row read (whole_rows.py)
                fresh, folded = list(todo.first.values()) if todo is not None else [], plan.folded  # (see below)
                if call.hold:
                    self.holds.check_in_server(conn)
                self.whole_rows.lock(conn)
                self._fence_checkpoints(conn, fence, strict=True)
                self.whole_rows.upsert(conn, plan)
            elif todo is not None and todo.first:
                fresh, folded = (self._track_read_fold(conn, pipe, call.hold, todo) if self.track
                                 else self._read_fold(conn, pipe, call.hold, todo, fence))
            else:
                holding = call.hold and result.held  # nothing to apply, events to hold: under the lock, keys read
                holds = self.holds.read(conn) if holding else None
                fenced = self._fence_checkpoints(conn, fence) if fence else None
                if holds is not None or fenced is not None:
                    turns.sync(pipe)
                if holds is not None:
                    self.holds.check(holds)
                if fenced is not None and fence:
                    check_fence(fenced, fence)
                fresh, folded = [], empty()
            fresh_count = len(fresh) if todo is not None else len(records)  # a WholeBatch's own plan: all fresh
            result.duplicates = len(records) - len(skip) - fresh_count + len(behind)
            result.stale, result.unchanged = folded.stale, folded.unchanged
            if result.duplicates:
                handled = skip | {id(r) for r in fresh}
                tally(result.by_partition, (r for r in records if id(r) not in handled), DUPLICATE)
                tally(result.by_partition, behind, DUPLICATE)
            tally(result.by_partition, folded.stale_records, STALE)
            tally(result.by_partition, excluded, DEAD)
            for k, n in folded.applied.items():
                result.by_partition.setdefault(k, [0, 0, 0, 0])[APPLIED] += n
            if folded.bad:
                raise _Bad(folded.bad)
            if plan is not None:
                queue_dead_letters(conn, self._dead, self.connector, dead, call.hold_of)
                db.commit(conn)
                stored = _Stored(None, None)
            else:
                stored = self.store(conn, pipe, folded, dead, {} if self.fence else advance, call.hold_of, call.then,
                                     result)
        result.upserted, result.deleted = stored.counts() if plan is None else (len(plan.rows), 0)
        self.whole_rows.batches += plan is not None  # committed: the pipeline's exit raised nothing
        result.checkpoints = advance
        return result, folded

    def _fence_checkpoints(self, conn: psycopg.Connection[Any], advance: dict[TopicPartition, int],
                           strict: bool = False) -> psycopg.Cursor[Any]:
        """Move the checkpoints of `advance` from the offsets this writer last knew to be stored (pipelined, in the
        transaction's first round trip: it takes their row locks); the cursor gives how many moved (`strict`: the
        statement fails unless all did, sql.redo)."""
        tps, stored_at = list(advance), self._stored
        return conn.execute(q.fence_checkpoints(self._checkpoints, strict),
                            ([tp.topic for tp in tps], [tp.partition for tp in tps],
                             [stored_at.get(tp, -1) for tp in tps], [advance[tp] for tp in tps],
                             self.connector, self.connector, *((len(tps),) if strict else ())))

    def _track_read_fold(self, conn: psycopg.Connection[Any], pipe: psycopg.Pipeline, hold: bool, todo: Candidates
                         ) -> tuple[list[SinkRecord], Folded]:
        """Steps (1)-(3) of the note, in the optimistic order or the safe one: the new events, folded."""
        if self._optimistic and todo.keys:
            return list(todo.first.values()), self._read_track_fold(conn, pipe, hold, todo)
        first = todo.first
        count, new_keys, found = self._track_read(conn, pipe, hold, todo)
        if count == len(first):
            fresh = list(first.values())
        else:
            inserted = set(new_keys or ())
            fresh = [r for tk, r in first.items() if tk in inserted]
        self._optimistic = count == len(first)
        rows = self.table_rows.loaded(todo.keys, found)
        return fresh, fold(self.mapping, fresh, rows, todo.record_keys, todo.key_errors)

    def _read_track_fold(self, conn: psycopg.Connection[Any], pipe: psycopg.Pipeline, hold: bool, todo: Candidates
                         ) -> Folded:
        """The optimistic order: the rows first (and the held keys); then the plain tracking insert runs in the
        server while the batch is folded here, assuming every candidate is new (see the module note). A key
        already tracked fails the insert: a UniqueViolation at the transaction's last sync (`_tracked_already`)."""
        held_keys = None
        if hold:
            held_keys = self.holds.read(conn)
        found = self.table_rows.select_uncached(conn, todo.keys)
        self.turns.sync(pipe)
        if held_keys is not None:
            self.holds.check(held_keys)
        conn.execute(q.track_new(self._tracking), (list(todo.first), self.namespace))
        return fold(self.mapping, list(todo.first.values()), self.table_rows.loaded(todo.keys, found), todo.record_keys,
                    todo.key_errors)

    def _tracked_already(self, e: psycopg.errors.UniqueViolation) -> bool:
        """Whether `e` is the optimistic tracking insert's (an event already applied), not a row the table refused."""
        return (e.diag.schema_name, e.diag.table_name) == (self.pgc.schema, "tracking")

    def _read_fold(self, conn: psycopg.Connection[Any], pipe: psycopg.Pipeline, hold: bool, todo: Candidates,
                   fence: dict[TopicPartition, int] | None = None) -> tuple[list[SinkRecord], Folded]:
        """Deduplicating by version: the rows and tombstones of the keys not cached (and the held keys) in one
        round trip, with the checkpoints' fence (`fence`: the offsets to move them to) last in it, then every
        candidate folded (the version guard skips what was applied)."""
        held_keys = None
        if hold:
            held_keys = self.holds.read(conn)
        uncached = self.table_rows.uncached(todo.keys)
        read = self.table_rows.read_keys(conn, uncached) if uncached else None
        # After the reads: the table's lock before the checkpoints' rows, the order of a rebuild's swap (which
        # locks the table, then the live checkpoints), so the two never wait for each other in a circle.
        fenced = self._fence_checkpoints(conn, fence) if fence else None
        self.turns.sync(pipe)
        if held_keys is not None:
            self.holds.check(held_keys)
        if fenced is not None and fence:
            check_fence(fenced, fence)
        rows = self.table_rows.loaded(todo.keys, read[0] if read else None)
        gone = self.table_rows.tombstones_read(read) if read else {}
        self.table_rows.cached_tombstones(todo.keys, gone)
        fresh = list(todo.first.values())
        return fresh, fold(self.mapping, fresh, rows, todo.record_keys, todo.key_errors, gone)

    def _track_read(self, conn: psycopg.Connection[Any], pipe: psycopg.Pipeline, hold: bool, todo: Candidates
                    ) -> tuple[int, list[bytes] | None, psycopg.Cursor[Any] | None]:
        """The safe order in ONE round trip: the tracking insert (ON CONFLICT DO NOTHING, RETURNING the new keys),
        and after it (same session, in order) the rows; the number of new keys, the keys, the rows' cursor."""
        held_keys = None
        first = todo.first
        if hold:
            held_keys = self.holds.read(conn)
        tracked = conn.execute(q.track(self._tracking), (list(first), self.namespace, len(first)))
        found = self.table_rows.select_uncached(conn, todo.keys)
        self.turns.sync(pipe)
        if held_keys is not None:
            self.holds.check(held_keys)
        count, new_keys = tracked.fetchone() or (0, None)
        return count, new_keys, found

    def advance_to(self, records: Sequence[SinkRecord], offsets: dict[TopicPartition, int],
                   advance_records: bool = True) -> dict[TopicPartition, int]:
        """The next offset of every partition the batch covers (unless not advancing) and of `offsets`."""
        advance = covered(records) if advance_records else {}
        for tp, off in offsets.items():
            advance[tp] = max(off, advance.get(tp, -1))
        return {tp: off for tp, off in advance.items() if off >= 0}

    def store(self, conn: psycopg.Connection[Any], pipe: psycopg.Pipeline, folded: Folded,
               dead: list[DeadLetter], advance: dict[TopicPartition, int],
               hold_of: dict[int, tuple[DeadLetterStatus, str]], then: Then | None, result: BatchResult) -> _Stored:
        """Steps (4)-(6), queued in the transaction's open pipeline (the batch's last round trip): upsert the
        changed rows in one statement (version-guarded), delete the removed ones (and record their tombstones),
        record the dead letters, move the checkpoints forward only, run `then`, COMMIT."""
        assert self.table_rows.shape is not None
        shape = self.table_rows.shape
        upserts, deletes = folded.changes()
        if folded.truncated:  # before the upsert: the rows the batch made after the truncate are written after it
            conn.execute(q.delete_all(shape))
        if folded.swept and shape.version_column:  # a completed snapshot's sweep (snapshot_sweep.py)
            conn.execute(q.delete_older(shape), (folded.swept,))
        merged = None
        if upserts:
            merged = conn.execute(q.upsert_rows(shape, self.mapping.guard), self.table_rows.text_columns(conn, upserts))
        stored = _Stored(merged,
                         conn.execute(q.delete_rows(shape), [list(c) for c in zip(*deletes, strict=True)],
                                      prepare=db.BY_KEYS) if deletes else None)
        buried = folded.buried
        if buried:
            conn.execute(q.save_tombstones(self.table_rows.tombstones),
                         (self.namespace, [hold_text(k) for k in buried], list(buried.values())))
        queue_dead_letters(conn, self._dead, self.connector, dead, hold_of)
        if advance:
            tps = list(advance)
            conn.execute(q.save_checkpoints(self._checkpoints),
                         (self.connector, [tp.topic for tp in tps], [tp.partition for tp in tps],
                          [advance[tp] for tp in tps]))
        if then is not None:  # it sees what the batch did: one round trip more
            self.turns.sync(pipe)
            result.upserted, result.deleted = stored.counts()
            then(conn, result)
        db.commit(conn)
        return stored

    def row_of(self, key: tuple[Any, ...]) -> Row | None:
        """The current row of `key` (None if there is none)."""
        return self.table_rows.rows(self.table_rows.select(self.connection(), [key])).get(tuple(key))


def listed(records: Sequence[SinkRecord]) -> Sequence[SinkRecord]:
    """`records` as a list, but a WholeBatch as it is: its records are made only if the careful way reads them."""
    return records if isinstance(records, WholeBatch) else list(records)


def covered(records: Sequence[SinkRecord]) -> dict[TopicPartition, int]:
    """The next offset of every partition `records` cover (a WholeBatch's own: its records not read one by one)."""
    return records.next_offsets() if isinstance(records, WholeBatch) else next_offsets(records)


def below(records: Sequence[SinkRecord], stored_at: dict[TopicPartition, int], skip: set[int]) -> list[SinkRecord]:
    """The records (but those in `skip`) below their partition's stored checkpoint in `stored_at`: applied by the
    transaction that moved it (a WholeBatch's records read one by one only when it has such records)."""
    floor = {(tp.topic, tp.partition): off for tp, off in stored_at.items()}  # no TopicPartition a record
    if isinstance(records, WholeBatch) and not records.below(floor):
        return []
    return [r for r in records if r.offset < floor.get((r.topic, r.partition), -1) and id(r) not in skip]


def planned(whole_rows: WholeRows, records: Sequence[SinkRecord], call: _Call, skip: set[int],
            fence: dict[TopicPartition, int] | None, prepared: Callable[[], Prepared]
            ) -> tuple[WholePlan | None, Candidates | None]:
    """A transaction's one-statement plan (None: the careful way) and the batch's candidates, None only beside a
    WholeBatch's own plan, whose records are then not read one by one."""
    ahead, call.ahead = (None if skip else call.ahead), None  # made for the whole batch: its first try only
    one = fence is not None and call.then is None  # the one-statement path may take the batch
    if ahead is None and not skip and isinstance(records, WholeBatch):
        ahead = records.plan  # the batch's own plan: what planning its records gives (whole_batch.py)
    todo = ahead.todo if ahead is not None else None
    plan = whole_rows.plan(None, ahead) if one and ahead is not None and todo is None else None
    if plan is not None:
        return plan, None
    if todo is None:
        todo = candidates(records, prepared(), skip)  # the careful way reads the records one by one
    return (whole_rows.plan(todo, ahead) if one else None), todo


def queue_dead_letters(conn: psycopg.Connection[Any], table: Any, connector: str, dead: list[DeadLetter],
                       hold_of: dict[int, tuple[DeadLetterStatus, str]]) -> None:
    """Record `dead` letters of `connector` into the dead-letter `table` (pipelined)."""
    if dead:
        with conn.cursor() as cur:
            cur.executemany(q.insert_dead_letters(table), [dead_row(connector, raw, err, hold_of) for raw, err in dead])


def dead_row(connector: str, raw: RawRecord, error: BaseException, hold_of: dict[int, tuple[DeadLetterStatus, str]]
             ) -> tuple[Any, ...]:
    cls = type(error)
    status, hold_key = hold_of.get(id(error), (DeadLetterStatus.NEW, None))
    return (connector, raw.topic, raw.partition, raw.offset, raw.key, raw.value,
            Jsonb(headers_json(raw.headers)), pg_text(f"{cls.__module__}.{cls.__qualname__}"),
            pg_text(str(error)[:2000]), pg_text(str(getattr(error, "reason", "task-error"))), status.value,
            hold_key)


def check_fence(cur: psycopg.Cursor[Any], advance: dict[TopicPartition, int]) -> None:
    """_Moved unless the fence moved every checkpoint of `advance`."""
    row = cur.fetchone()
    if row is None or row[0] != len(advance):
        raise _Moved()


def elapsed_ms(started: float) -> float:
    return round((time.perf_counter() - started) * 1000, 1)

