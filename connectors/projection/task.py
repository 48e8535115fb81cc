"""ProjectionSinkTask: seeks to the offsets stored in PostgreSQL and applies each batch in one transaction.

Note on offsets and commits
---------------------------
PostgreSQL is the source of truth: every `put` stores the partitions' next offsets in the same transaction as the
rows (see writer.py). `open` seeks each newly assigned partition to its stored offset (the beginning when there is
none), so whatever Kafka's consumer group says, no event is skipped and none is applied twice. `pre_commit` is
called after `put` committed; it also stores the offsets of records that never reached `put` (dead-lettered or
skipped by the runner), then returns them, so the runner commits them to Kafka only after the database commit and
Kafka tooling shows the true lag. If that small write fails it returns what PostgreSQL already holds.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from kafold import db, logs
from kafold.config import PostgresConfig
from kafold.connectors.api import (
    Offsets,
    RawRecord,
    SinkRecord,
    SinkTask,
    SinkTaskContext,
    TopicPartition,
)
from kafold.connectors.projection.config import ProjectionConfig
from kafold.connectors.projection.mapping import Mapping as EventMapping
from kafold.connectors.projection.mapping import load_mapper
from kafold.connectors.projection.writer import BatchResult, DeadLetter, ProjectionWriter, elapsed_ms
from kafold.errors import FatalError, RetriableError

log = logs.get("kafold.connectors.projection")

OFFSET_BEGINNING = -2  # librdkafka's logical offset: the first record still on the partition
START_RETRY_S = 30.0
DLQ_FLUSH_S = 10.0


class ProjectionSinkTask(SinkTask):
    """Projects events into one PostgreSQL table with exactly-once checkpoints."""

    def start(self, task_config: Mapping[str, Any], context: SinkTaskContext) -> None:
        self.context = context
        self.config: ProjectionConfig = task_config["config"]
        pgc = task_config.get("postgres")
        if not isinstance(pgc, PostgresConfig):
            # The host did not pass [postgres] (see docs/projections.md): take it from KAFOLD_POSTGRES__* or the
            # running dev stack.
            pgc = db.from_environment()
        self.name = context.connector_name
        mapper = load_mapper(self.config.mapper) if self.config.mapper else None
        self.mapping = EventMapping(self.config, mapper)
        self.writer = ProjectionWriter(pgc, self.config, self.mapping, task_config.get("checkpoint_key") or self.name,
                                       task_config.get("namespace"), task_config.get("table"))
        self.stored: dict[TopicPartition, int] = {}
        self.totals = BatchResult()
        self.log = log.bind(connector=self.name, task=context.task_id, table=self.writer.table)
        self.topic_reporter = context.errant_record_reporter()
        # The runner's dead letters (undecodable records, unknown types), kept for the dead-letter table: the next
        # transaction writes them with the checkpoint that passes them.
        self.pending_dead: list[DeadLetter] = []
        self._retrying("start", lambda: (pgc.migrate_on_start and db.upgrade(pgc), self.writer.connection()))
        self.log.info("projection task started", namespace=self.writer.namespace)

    def _retrying(self, what: str, fn: Any) -> Any:
        deadline, delay = time.monotonic() + START_RETRY_S, 0.2
        while True:
            try:
                return fn()
            except RetriableError as e:
                if time.monotonic() + delay > deadline:
                    raise FatalError(f"projection {self.name!r}: {what}: {e}") from e
                self.log.warning("PostgreSQL not available; retrying", step=what, error=str(e), retry_in_s=delay)
                time.sleep(delay)
                delay = min(delay * 2, 5.0)

    def handles(self, event_type: str) -> bool:
        return self.mapping.handles(event_type)

    def open(self, partitions: Collection[TopicPartition]) -> None:
        stored = self._retrying("read checkpoints", self.writer.checkpoints)
        for tp in partitions:
            offset = stored.get(tp)
            self.stored[tp] = offset if offset is not None else -1
            self.context.offset(tp, offset if offset is not None else OFFSET_BEGINNING)
        self.log.info("partitions opened at stored offsets",
                      offsets={str(tp): stored.get(tp, "beginning") for tp in sorted(partitions)})

    def close(self, partitions: Collection[TopicPartition]) -> None:
        for tp in partitions:
            self.stored.pop(tp, None)

    def put(self, records: Sequence[SinkRecord]) -> None:
        dead = self._pending_dead()
        if not records and not dead:
            return
        started = time.perf_counter()
        result = self.writer.write(records, dead, report=self._report)
        del self.pending_dead[:len(dead)]
        self._done(result, started)

    def pre_commit(self, offsets: Offsets) -> Offsets:
        offered = {tp: off for tp, off in offsets.items() if off >= 0}
        behind = {tp: off for tp, off in offered.items() if off > self.stored.get(tp, -1)}
        dead = self._pending_dead()
        if behind or dead:
            started = time.perf_counter()
            try:
                result = self.writer.write([], dead, behind)
            except RetriableError as e:  # returned offsets must be in PostgreSQL: return only those
                self.log.warning("could not store offsets; committing what PostgreSQL holds", error=str(e))
                return self._stored_of(offered)
            del self.pending_dead[:len(dead)]
            self._done(result, started)
        return self._stored_of(offered)

    def _stored_of(self, offered: dict[TopicPartition, int]) -> dict[TopicPartition, int]:
        return {tp: min(off, self.stored[tp]) for tp, off in offered.items() if self.stored.get(tp, -1) >= 0}

    def on_dead_letter(self, record: Any, error: BaseException) -> None:
        self.pending_dead.append((RawRecord.of(record), error))

    def _pending_dead(self) -> list[DeadLetter]:
        return list(self.pending_dead)

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
        self.log.info("projection batch", events=result.events, duplicates=result.duplicates, stale=result.stale,
                      upserted=result.upserted, deleted=result.deleted, unchanged=result.unchanged,
                      dead_lettered=result.dead_lettered, transactions=result.transactions,
                      duration_ms=elapsed_ms(started))

    def stop(self) -> None:
        self.writer.close()
        self.log.info("projection task stopped", events=self.totals.events, duplicates=self.totals.duplicates,
                      upserted=self.totals.upserted, deleted=self.totals.deleted,
                      dead_lettered=self.totals.dead_lettered)
