"""ProjectionSinkTask: seeks to the offsets stored in PostgreSQL and applies each batch in one transaction.

Note on offsets and commits
---------------------------
PostgreSQL is the source of truth: every write stores the partitions' next offsets in the same transaction as
the rows (see writer.py). `open` seeks each newly assigned partition to its stored offset (the beginning when
there is none), so whatever Kafka's consumer group says, no event is skipped and none is applied twice.

Pipelining (see pipeline.py): `put` waits for the previous batch's write, then hands its batch to the writer
thread and returns, so the runner decodes batch N+1 while batch N's transaction runs. A small batch (at most
INLINE_WRITE_RECORDS) is written by `put` itself, in the runner's thread, and its errors raised from there (a
RetriableError: the runner offers the same batch again).

Kafka's commit only follows PostgreSQL (`stores_offsets`): the runner calls `pre_commit` on a timer
(`[daemon] offset_flush_interval_ms`, as Kafka Connect's `offset.flush.interval.ms`) and on revoke and stop, not
after every batch. `pre_commit` returns only offsets already stored in PostgreSQL (the runner commits those to
Kafka), never those of the write in flight; they go with the next timed commit. So the group's offset never passes
PostgreSQL's, and may lag it by about one interval, which costs nothing: `open` seeks to the stored checkpoints
whatever the group says. Offsets of records that never reached `put` (dead-lettered or skipped by the runner) are
stored with the next write (`hint`: what `pre_commit` was offered while a write was in flight, which covers only
records already handed over) or, when no write is in flight, by a small write in `pre_commit` itself.

Errors of a write in the worker surface at the next `put` (or `pre_commit`). RetriableError: the failed batch is
kept and `put` redoes it synchronously, before the new batch; while that fails `put` raises RetriableError, the
runner backs off and offers its (new) batch again, and `put` again first redoes the failed one — so batches are
applied in order and none is skipped; tracking makes any redo harmless. FatalError (or any other error) fails the
task at the next call. On revocation `close` waits for the write in flight and drops the revoked partitions from
a failed batch (the new owner starts from the offsets in PostgreSQL); `stop` waits up to STOP_WAIT_S, then
cancels the statement: the transaction rolls back and those records are delivered again.
"""
from __future__ import annotations

import time
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from kafold import db, logs
from kafold.connectors.api import (
    BatchReader,
    Offsets,
    Outcomes,
    RawRecord,
    SinkRecord,
    SinkTask,
    SinkTaskContext,
    TaskConfig,
    TopicPartition,
)
from kafold.connectors.intake import Intake
from kafold.connectors.projection.config import Dedup, ProjectionConfig
from kafold.connectors.projection.fold import BatchResult
from kafold.connectors.projection.mapping import Mapping as EventMapping
from kafold.connectors.projection.mapping import load_mapper
from kafold.connectors.projection.pipeline import Job, WriteAhead
from kafold.connectors.projection.whole_batch import WholeBatch, WholeReader
from kafold.connectors.projection.writer import DeadLetter, ProjectionWriter, Report, elapsed_ms
from kafold.errors import FatalError, RetriableError
from kafold.interpreter import tune_interpreter
from kafold.retry import retrying

log = logs.get("kafold.connectors.projection")

OFFSET_BEGINNING = -2  # librdkafka's logical offset: the first record still on the partition
START_RETRY_S = 30.0
DLQ_FLUSH_S = 10.0
STOP_WAIT_S = 8.0  # the daemon exits within 10 s of SIGTERM
# The runner's decoding waits at its yield points (every 256 records) while the writer runs Python, at most this
# long each time: the batch being written is on the critical path, the next one is not. The GIL otherwise
# alternates between the two threads and stretches the writer's Python (kafold bench projection: +6-13 %,
# docs/benchmarks.md).
YIELD_WAIT_S = 0.004
# A batch of at most this many records is written in the runner's thread before `put` returns, instead of by the
# writer thread while the runner decodes the next: handing a few records over costs more than it saves (the thread
# switch, the yield wait, the two threads taking turns at the GIL through the write's round trips), and the next
# batch is at most a few records the fetch brings meanwhile. This is the light-traffic case, where latency is
# what matters: events -> row p50 at 1,000/s (docs/benchmarks.md). Larger batches, under load, are pipelined.
INLINE_WRITE_RECORDS = 64


class ProjectionSinkTask(SinkTask):
    """Projects events into one PostgreSQL table with exactly-once checkpoints."""

    stores_offsets = True  # its checkpoints in PostgreSQL; Kafka's commit follows on a timer (see the note above)

    def start(self, task_config: TaskConfig[ProjectionConfig], context: SinkTaskContext) -> None:
        self.context = context
        self.config = task_config.config
        self.on_stored = task_config.on_stored
        # A task driven outside the daemon may have no [postgres]: KAFOLD_POSTGRES__* then say where (else a
        # ConfigError naming postgres.url).
        pgc = task_config.postgres or db.from_environment()
        self.name = context.connector_name
        mapper = load_mapper(self.config.mapper) if self.config.mapper else None
        self.mapping = EventMapping(self.config, mapper)
        # By version only when the connector decided so (task_configs); a task driven outside it keeps tracking.
        self.dedup = self.config.dedup if self.config.dedup is Dedup.VERSION else Dedup.TRACKING
        versioned = self.dedup is Dedup.VERSION
        self.writer = ProjectionWriter(pgc, self.config, self.mapping, self.name, track=not versioned,
                                       fence=versioned)
        self.stored: dict[TopicPartition, int] = {}
        self.totals = BatchResult()
        # Per partition, what became of the events put (SinkTask.outcomes): replaced whole, read from other threads.
        self._outcomes: dict[TopicPartition, Outcomes] = {}
        self.log = log.bind(connector=self.name, task=context.task_id, table=self.writer.table)
        self.topic_reporter = context.errant_record_reporter()
        # The runner's dead letters (undecodable records, unknown types), kept for the dead-letter table: the next
        # transaction writes them with the checkpoint that passes them.
        self.pending_dead: list[DeadLetter] = []
        self.hint: dict[TopicPartition, int] = {}  # offsets offered while a write was in flight (see above)
        self.failed: Job | None = None  # a write that failed retriably, redone before anything newer
        self.fatal: BaseException | None = None
        self.pipe = WriteAhead(self.name, self._write, self._report)
        tune_interpreter()  # the daemon does it at start too; a task driven outside it (a test, a tool) needs it here
        self._retrying("start", lambda: (pgc.migrate_on_start and db.upgrade(pgc), self.writer.connection()))
        self.log.info("projection.task_started", namespace=self.writer.namespace, dedup=self.dedup.value)

    def _retrying(self, what: str, fn: Any) -> Any:
        def warn(e: RetriableError, delay: float) -> None:
            self.log.warning("projection.postgres_retrying", step=what, error=str(e), retry_in_s=delay)

        try:
            return retrying(fn, within_s=START_RETRY_S, on_retry=warn)
        except RetriableError as e:
            raise FatalError(f"projection {self.name!r}: {what}: {e}") from e

    def handles(self, event_type: str) -> bool:
        return self.mapping.handles(event_type)

    def batch_reader(self, intake: Intake, size: int) -> BatchReader | None:
        """A WholeReader (whole_batch.py) for a batch the writer's one-statement path may take: deduplicating by
        version, the path on, a batch handed to the writer thread (not one written inline), kafold's envelopes."""
        writer = self.writer
        if not writer.fence or not writer.whole_rows.on or size <= INLINE_WRITE_RECORDS or not intake.plain:
            return None
        return WholeReader(self.mapping, intake)

    def yield_point(self) -> None:
        if not self.pipe.done():  # a write in flight that is running Python now: let it go first
            self.writer.idle.wait(YIELD_WAIT_S)

    def open(self, partitions: Collection[TopicPartition]) -> None:
        self._settle()  # the writer is free, and an earlier write's checkpoints are visible
        stored = self._retrying("read checkpoints", self.writer.checkpoints)
        for tp in partitions:
            offset = stored.get(tp)
            self.stored[tp] = offset if offset is not None else -1
            self.context.offset(tp, offset if offset is not None else OFFSET_BEGINNING)
        self.log.info("projection.partitions_opened",
                      offsets={str(tp): stored.get(tp, "beginning") for tp in sorted(partitions)})

    def close(self, partitions: Collection[TopicPartition]) -> None:
        self._settle()
        gone = set(partitions)
        if self.failed is not None:
            self.failed = self.failed.without(gone)
        for tp in gone:
            self.stored.pop(tp, None)
            self.hint.pop(tp, None)

    def put(self, records: Sequence[SinkRecord]) -> None:
        # Tracking and row keys now, while the previous batch's write is still running (it is pure work), and for a
        # batch handed to the worker its whole-row plan too (pipeline.py): its transaction then goes right away.
        # A WholeBatch (whole_batch.py) comes planned: only its statement's parameters are made here.
        writer, whole = self.writer, isinstance(records, WholeBatch)
        prepared = writer.prepare(records) if records and not whole else None
        ahead = None
        if writer.fence and len(records) > INLINE_WRITE_RECORDS:
            if isinstance(records, WholeBatch):
                ahead = writer.whole_rows.arranged(writer.conn, records.plan)
            elif prepared is not None:
                ahead = writer.whole_rows.ahead(writer.conn, records, prepared)
        self._settle()
        self._raise_fatal()
        if self.failed is not None:  # redo it first, here; RetriableError -> the runner backs off, offers again
            job, started = self.failed, time.perf_counter()
            self._done(self.pipe.run_here(job), started)
            self.failed = None
        dead, self.pending_dead = self.pending_dead, []
        hint, self.hint = self.hint, {}
        if not records and not dead and not hint:
            return
        job = Job(records if whole else list(records), dead, hint, prepared, ahead)
        if len(records) > INLINE_WRITE_RECORDS:
            self.pipe.submit(job)
            return
        try:  # a small batch: written here, now (see INLINE_WRITE_RECORDS)
            self._done(self.pipe.run_here(job), job.started)
        except RetriableError:  # the runner offers the same records again; these go with them
            self.pending_dead[:0] = dead
            self.hint = {**hint, **self.hint}
            raise

    def flush(self, offsets: Offsets) -> None:
        """Wait until every batch handed to `put` is in PostgreSQL (redoing a failed one)."""
        self.put([])
        self._settle()
        self._raise_fatal()

    def pre_commit(self, offsets: Offsets) -> Offsets:
        offered = {tp: off for tp, off in offsets.items() if off >= 0}
        if not self.pipe.done():
            self.pipe.serve()
            self.hint = {**self.hint, **offered}  # stored with the next write; committed at a later flush
            return self._stored_of(offered)
        self._settle()
        self._raise_fatal()
        if self.failed is not None:  # put redoes it; these offsets wait for it
            self.hint = {**self.hint, **offered}
            return self._stored_of(offered)
        behind = {tp: off for tp, off in offered.items() if off > self.stored.get(tp, -1)}
        dead = list(self.pending_dead)
        if behind or dead:
            started = time.perf_counter()
            try:
                result = self.pipe.run_here(Job([], dead, {**self.hint, **behind}))
            except RetriableError as e:  # returned offsets must be in PostgreSQL: return only those
                self.log.warning("projection.offsets_store_failed", error=str(e),
                                 hint="committing what PostgreSQL holds")
                return self._stored_of(offered)
            del self.pending_dead[:len(dead)]
            self.hint = {}
            self._done(result, started)
        return self._stored_of(offered)

    def _write(self, job: Job, report: Report) -> BatchResult:
        result = self.writer.write(job.records, job.dead, job.offsets, report=report, prepared=job.prepared,
                                   ahead=job.ahead)
        # Committed by now (the writer returns after its transaction's commit): these checkpoints are visible to
        # any reader, so a wait on them can be answered without reading them back.
        if self.on_stored is not None and result.checkpoints:
            self.on_stored(result.checkpoints)
        return result

    def outcomes(self) -> Mapping[TopicPartition, Outcomes] | None:
        """Counted from the writes that committed: duplicates by tracking, stale by the version guard, dead-lettered
        the events the mapping or PostgreSQL refused and those held behind them; the others applied."""
        return self._outcomes

    def _settle(self, timeout: float | None = None) -> None:
        """Wait for the write in flight and take its outcome (runner's thread)."""
        job = self.pipe.settle(timeout)
        if job is None or job.future is None:
            return
        error = job.future.exception()
        if error is None:
            self._done(job.future.result(), job.started)
        elif isinstance(error, RetriableError):
            self.log.warning("projection.batch_write_failed", error=str(error), hint="redoing it before the next batch")
            self.failed = job
        else:
            self.fatal = self.fatal or error

    def _raise_fatal(self) -> None:
        if self.fatal is not None:
            error, self.fatal = self.fatal, None
            raise error

    def _stored_of(self, offered: dict[TopicPartition, int]) -> dict[TopicPartition, int]:
        return {tp: min(off, self.stored[tp]) for tp, off in offered.items() if self.stored.get(tp, -1) >= 0}

    def on_dead_letter(self, record: Any, error: BaseException) -> None:
        self.pending_dead.append((RawRecord.of(record), error))

    def _report(self, bad: Sequence[tuple[Any, BaseException]]) -> None:
        """Send events the mapping or the database refused to the DLQ topic and wait for the acknowledgement."""
        if self.topic_reporter is None:
            return
        for record, error in bad:
            self.topic_reporter.report(record, error)
        self.topic_reporter.flush(DLQ_FLUSH_S)

    def _done(self, result: BatchResult, started: float) -> None:
        for tp, off in result.checkpoints.items():
            self.stored[tp] = max(off, self.stored.get(tp, -1))
        self.totals.add(result)
        if result.by_partition:
            merged = dict(self._outcomes)
            for tp, o in result.outcomes().items():
                merged[tp] = merged.get(tp, Outcomes()) + o
            self._outcomes = merged
        self.log.info("projection.batch", events=result.events, duplicates=result.duplicates, stale=result.stale,
                      upserted=result.upserted, deleted=result.deleted, unchanged=result.unchanged,
                      dead_lettered=result.dead_lettered, held=result.held, transactions=result.transactions,
                      duration_ms=elapsed_ms(started))

    def stop(self) -> None:
        try:
            self._settle(STOP_WAIT_S)
            if not self.pipe.done():
                self.log.warning("projection.write_cancelled", waited_s=STOP_WAIT_S,
                                 reason="write still running at stop", hint="it rolls back and is delivered again")
                conn = self.writer.conn
                if conn is not None:
                    conn.cancel()
                self._settle(2.0)
        finally:
            self.pipe.close()
            if self.pipe.done():
                self.writer.close()
        if self.fatal is not None:
            self.log.error("projection.last_batch_failed", error=str(self.fatal))
        self.log.info("projection.task_stopped", events=self.totals.events, duplicates=self.totals.duplicates,
                      upserted=self.totals.upserted, deleted=self.totals.deleted,
                      dead_lettered=self.totals.dead_lettered)
