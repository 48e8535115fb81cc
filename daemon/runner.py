"""SinkRunner: drives one sink task with a confluent-kafka consumer: decode, dead-letter, put, commit.

Guarantee (at-least-once into the task)
---------------------------------------
For each batch: decode every record; records that are not valid envelopes are reported to the dead-letter
topic and never reach `put`; `put` gets the rest (retried on RetriableError with the partitions paused, so the
group membership stays alive); then the dead-letter writer is flushed (every dead letter acknowledged,
acks=all); only then are the offsets after the batch offered to `pre_commit`, and what it returns is committed.
So a committed offset never passes a record that was neither put successfully nor durably dead-lettered. These
commits are sent asynchronously, as Kafka Connect's sink tasks do (daemon/commits.py): the loop keeps polling while one
is answered, so a slow or lost answer stalls neither fetching nor the group's rebalance callbacks. A task that
stores its own offsets (`SinkTask.stores_offsets`, the projection) is offered them on a timer instead
(`offset_flush_interval_ms`; see commits.py): its store decides where it resumes, Kafka's commit follows. After a
crash, a FatalError or a rebalance, the records after the last commit are delivered again: `put` must be
idempotent. On revoke, the offsets of everything already put are offered to `pre_commit`
and committed synchronously before `close`. On stop, fetching stops, the in-flight batch finishes (within
`shutdown_grace_s`), offsets are committed, the partitions are closed and the task stopped.

Pause/resume from outside (the REST API) are requests applied by the loop between polls: the consumer's
partitions are paused but it keeps polling, so the group membership stays and no rebalance happens. A pause never
outlives the assignment (librdkafka would keep it for a later assignment: see `_unpause`). Per-partition
progress (position, end offsets seen at assignment, caught-up, lag) is published by `daemon.progress`.

The poll loop (the consumer, the poll, the subscription, fatal consumer errors, the back-off polls, the shutdown
call) is `kafold.consumer_loop`'s; this runner is its batch handler, and every commit above is still made here:
after a batch's put and dead-letter flush, on revoke and at shutdown (`loop_stopped`), never by the loop.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

from confluent_kafka import KafkaException
from confluent_kafka import TopicPartition as KafkaTP

from kafold import kafka_clients, logs, tracing, upcast
from kafold.config import DaemonConfig, KafkaConfig
from kafold.connectors.api import (
    Connector,
    ErrantRecordReporter,
    SinkRecord,
    SinkTask,
    SinkTaskContext,
    TaskConfig,
    TopicPartition,
)
from kafold.connectors.convert import converter_for
from kafold.connectors.dlq import DeadLetterWriter
from kafold.connectors.intake import Intake
from kafold.consumer_loop import ConsumerLoop, LoopHandler
from kafold.daemon import batch_decode
from kafold.daemon.accounting import Account, Tally, accounts
from kafold.daemon.commits import CAUGHT_UP_POLL_S, Commits, Offered
from kafold.daemon.liveness import STATS_INTERVAL_MS, GroupWatch
from kafold.daemon.progress import BatchStats, PartitionProgress, ProgressTracker, last_event_times
from kafold.errors import FatalError, KafoldError, RecordError, RetriableError
from kafold.kafka_message import Message

log = logs.get("kafold.daemon.runner")

MAX_BACKOFF_S = 10.0
# librdkafka's prefetch queue per consumer (queued.max.messages.kbytes; its default is 64 MB) and how long the
# fetcher waits before it looks again when that queue is full (fetch.queue.backoff.ms; its default is 1 s). 2 MB is
# ~6,600 300-byte events, a few batches ahead of the loop; checked again every 10 ms, it refills long before the loop
# drains it. Each queued message costs librdkafka about as much again as its payload, so the queue's real footprint
# is about twice its setting. Measured with two projection task processes (docs/benchmarks.md): 16 MB with the 1 s
# backoff held ~40 MB per task; 2 MB with 10 ms gives the same rate with ~20 MB less per task (16 MB, 8 MB and 4 MB
# with the 1 s backoff: 4 MB and 8 MB starved the loop, as the queue emptied within the backoff).
PREFETCH_KBYTES = 2048
FETCH_QUEUE_BACKOFF_MS = 10
# While a commit is awaited the loop polls in slices this short: its answer is served inside the poll, which does
# not return for it, and a task waiting on the commit (at-most-once effects) is offered the next one right away.
COMMIT_AWAIT_POLL_S = 0.005


class _Abandoned(KafoldError):
    """The grace period ran out while a batch was still failing: stop without committing it."""


class _Context(SinkTaskContext):
    """The runner's side of SinkTaskContext; call it only from the task's own thread (put/open/close)."""

    def __init__(self, runner: SinkRunner, task_id: int) -> None:
        self.runner = runner
        self.connector_name = runner.connector.name
        self.task_id = task_id
        self.commit_requested = False
        self.seeks: dict[TopicPartition, int] = {}

    def assignment(self) -> frozenset[TopicPartition]:
        return frozenset(self.runner.assigned)

    def pause(self, *partitions: TopicPartition) -> None:
        self.runner.user_paused.update(partitions)
        self.runner.consumer.pause([KafkaTP(tp.topic, tp.partition) for tp in partitions])

    def resume(self, *partitions: TopicPartition) -> None:
        self.runner.user_paused.difference_update(partitions)
        if not self.runner.backing_off and not self.runner.api_paused:
            self.runner.consumer.resume([KafkaTP(tp.topic, tp.partition) for tp in partitions])

    def offset(self, tp: TopicPartition, offset: int) -> None:
        self.seeks[tp] = offset

    def request_commit(self) -> None:
        self.commit_requested = True

    def errant_record_reporter(self) -> ErrantRecordReporter | None:
        return self.runner.reporter

    def committed_offsets(self) -> Mapping[TopicPartition, int]:
        return dict(self.runner.commits.committed)  # updated only once the broker answered a commit without error


class ProgressView(Protocol):
    """Per-partition progress as published (immutable values, replaced whole: read without locks)."""

    @property
    def snapshot(self) -> Mapping[TopicPartition, PartitionProgress]: ...


class RunnerView(Protocol):
    """What the daemon (its task slots, HTTP views, /metrics and `kafold status`) reads of and asks of a sink task's
    runner: `SinkRunner` in the daemon's process, or `task_process.RemoteRunner` following one in a child."""

    connector: Connector[Any]
    group_id: str
    counts: dict[str, int]
    error: BaseException | None
    failed: bool
    started: bool
    stopped: bool
    api_paused: bool
    last_poll: float  # CLOCK_MONOTONIC of the loop's last poll
    on_batch: Callable[[BatchStats], None] | None

    @property
    def task_id(self) -> int: ...

    @property
    def progress(self) -> ProgressView: ...

    @property
    def state(self) -> str: ...

    @property
    def task_status(self) -> dict[str, Any]: ...

    @property
    def accounts(self) -> Mapping[TopicPartition, Account]: ...

    def run(self) -> None: ...

    def stop(self) -> None: ...

    def request_pause(self, paused: bool) -> None: ...


class SinkRunner(LoopHandler):
    """Runs one task of a sink connector in the calling thread until `stop` is set or the task fails."""

    def __init__(self, connector: Connector[Any], task_config: TaskConfig[Any], *, kafka: KafkaConfig,
                 daemon: DaemonConfig, stop: threading.Event | None = None,
                 reporter: ErrantRecordReporter | None = None,
                 consumer_extra: Mapping[str, Any] | None = None, registry: Any = None) -> None:
        if not connector.is_sink():
            raise FatalError(f"connector {connector.name!r} is not a sink connector")
        self.connector = connector
        self.task_config = task_config.with_services(kafka=task_config.kafka or kafka)  # the task's [kafka]
        self.kafka = kafka
        self.daemon = daemon
        self.stop_event = stop or threading.Event()
        self.group_id = f"{daemon.group_prefix}.{connector.name}"
        self.reporter: ErrantRecordReporter = reporter or DeadLetterWriter(
            kafka, connector.settings.dlq_topic, connector.name, protector=task_config.protector)
        self._owns_reporter = reporter is None
        self.consumer_extra = dict(consumer_extra or {})
        self.task: SinkTask = connector.task_class()  # type: ignore[assignment]
        self.upcaster = upcast.build(connector.settings.upcasters, f"connector {connector.name!r}")
        # The connector's converter (kafold.connectors.convert; None = kafold envelopes); `registry` is the
        # config's [registry], needed by the Schema Registry formats.
        self.converter = converter_for(connector.settings, registry)
        self.context = _Context(self, task_config.task_id)
        self.log = log.bind(connector=connector.name, task=self.context.task_id)
        self.assigned: set[TopicPartition] = set()
        self.user_paused: set[TopicPartition] = set()
        self.positions: dict[TopicPartition, int] = {}  # next offset to read, after the handled records
        self.dirty = False
        # A task that stores its own offsets is committed to Kafka on a timer (see the note in commits.py).
        self.commits = Commits(daemon.offset_flush_interval_ms / 1000, self.log)
        self.backing_off = False
        self.failed = False
        self.error: BaseException | None = None
        self.counts = {"batches": 0, "records": 0, "dead_lettered": 0, "skipped": 0, "polls": 0, "assignments": 0,
                       "rejoins": 0}
        self.on_batch: Callable[[BatchStats], None] | None = None  # called in this thread after each batch
        self.progress = ProgressTracker(str(self.consumer_extra.get("auto.offset.reset", "earliest")))
        self.event_times: dict[TopicPartition, int] = {}  # event time (ms) of the last handled record
        self.tally = Tally()  # the runner's half of the offset accounting (daemon/accounting.py)
        self.api_paused = False  # paused through the REST API (applied between polls)
        self._pause_request: bool | None = None
        self.started = self.stopped = False
        self.loop = ConsumerLoop(self, stop=self.stop_event, max_records=daemon.batch_max_records,
                                 wait_s=daemon.batch_max_wait_ms / 1000, counts=self.counts,
                                 fatal=lambda err: f"consumer error: {err}")
        self.group_watch = GroupWatch.for_kafka(kafka)  # timeouts and group protocol

    @property
    def task_id(self) -> int:
        return self.context.task_id

    def stop(self) -> None:
        self.stop_event.set()

    def request_pause(self, paused: bool) -> None:
        """Pause (True) or resume (False) every assigned partition; applied by the loop before its next poll."""
        self._pause_request = paused

    @property
    def task_status(self) -> dict[str, Any]:
        """The task's own status (SinkTask.status); {} before it started or when it cannot tell."""
        if not self.started:
            return {}
        try:
            return self.task.status()
        except Exception:  # a view must never fail the scrape
            return {}

    @property
    def accounts(self) -> Mapping[TopicPartition, Account]:
        """The offset accounting per partition: the runner's counts with the task's `outcomes`."""
        try:
            outcomes = self.task.outcomes() if self.started else None
        except Exception:  # a view must never fail the scrape
            outcomes = None
        return accounts(self.tally.snapshot, outcomes)

    @property
    def state(self) -> str:
        """Kafka Connect's task state: UNASSIGNED, RUNNING, PAUSED, FAILED (or STOPPED after a clean stop)."""
        if self.failed and self.error is not None:
            return "FAILED"
        if self.stopped:
            return "STOPPED"
        if not self.started:
            return "UNASSIGNED"
        return "PAUSED" if self.api_paused else "RUNNING"

    # ---- the loop (kafold.consumer_loop: this runner is its batch handler) -------------------------------
    def run(self) -> None:
        """Consume until stopped; raises nothing — a fatal error is logged and kept in `self.error`."""
        self.consumer = self._new_consumer()  # outside the loop's run: a consumer never made has nothing to stop
        self.loop.run()

    def loop_started(self) -> None:
        self.task.start(self.task_config, self.context)
        self._subscribe()
        self.log.info("runner.started", group=self.group_id, topics=list(self.connector.settings.topics))
        self.last_poll = time.monotonic()  # before `started`: the start-up's own time is not a stall
        self.started = True

    def before_poll(self) -> float | None:
        if self.group_watch.look(self.log, self.group_id):  # wedged: leave the group and join again
            self._rejoin()
        self._apply_requests()
        self._apply_seeks()
        if self.commits.in_flight is not None:  # its answer is served inside the poll (see COMMIT_AWAIT_POLL_S)
            return COMMIT_AWAIT_POLL_S
        if self.dirty and self.commits.just_caught_up(self.task):  # see commits.CAUGHT_UP_POLL_S
            return CAUGHT_UP_POLL_S
        if self.context.commit_requested and not self.task.stores_offsets:  # a commit waiting for its interval:
            wait = self.commits.next_flush - time.monotonic()
            return max(0.0, min(wait, self.loop.wait_s))  # the idle poll ends then
        return None

    def on_idle(self) -> None:
        if self.commits.idle_due(self.task, self.dirty, self.context.commit_requested):
            self._commit(self.assigned)

    def after_poll(self) -> None:
        self._past_markers()
        self.progress.refresh(self.consumer, self.positions, self.user_paused if not self.api_paused
                              else self.assigned, self.commits.committed, self.event_times)

    def _past_markers(self) -> None:
        """Offset note: under read_committed a transaction's commit marker takes an offset that no record has. The
        consumer's position moves past it (librdkafka, like Kafka's Java consumer), but the next offset after the
        handled records stays one short, so a partition whose last record is a marker would look one behind for
        good: lag 1, never caught up, /ready 503 after a restart. After a poll every record consumed has been
        handed to the task, so a consumer position beyond ours can only be markers (or aborted records, which
        read_committed never delivers): it is taken, and committed with the next batch."""
        if self.backing_off or not self.positions:
            return
        tps = [KafkaTP(tp.topic, tp.partition) for tp in self.positions if tp in self.assigned]
        for kafka_tp in self.consumer.position(tps) if tps else ():
            tp = TopicPartition(kafka_tp.topic, kafka_tp.partition)
            if kafka_tp.offset > self.positions.get(tp, kafka_tp.offset):
                self.positions[tp] = kafka_tp.offset
                self.dirty = True

    def on_failure(self, error: Exception) -> bool:
        """Every error is handled here (the run raises nothing): the task fails, the process goes on."""
        self.failed = True
        if isinstance(error, _Abandoned):
            self.log.warning("runner.batch_abandoned", error=str(error), reason="in flight at shutdown",
                             hint="it will be delivered again")
            return True
        self.error = error  # a task bug is as fatal as a FatalError: stop this task, not the process
        self.log.error("runner.failed", hint="stopping the task (offsets stay at the last successful batch)",
                       error_class=type(error).__name__, error=str(error), exc_info=not isinstance(error, FatalError))
        return True

    def _new_consumer(self) -> Any:
        extra = {"isolation.level": "read_committed", "enable.auto.offset.store": False,
                 "queued.max.messages.kbytes": PREFETCH_KBYTES, "fetch.queue.backoff.ms": FETCH_QUEUE_BACKOFF_MS,
                 "statistics.interval.ms": STATS_INTERVAL_MS, "stats_cb": self._on_stats,
                 "on_commit": self._on_commit, **self.consumer_extra}
        return kafka_clients.consumer(self.kafka, self.group_id, **extra)

    def _subscribe(self) -> None:
        self.loop.subscribe(list(self.connector.settings.topics), self._on_assign, self._on_revoke, self._on_lost)
        self.group_watch.reset()

    def _on_stats(self, stats_json: str) -> None:  # librdkafka statistics, served by consume() in this thread
        self.group_watch.observe(stats_json, self.log, self.group_id)

    def _rejoin(self) -> None:
        """Release what this task holds (committed as in a rebalance), close the consumer, subscribe a new one."""
        if self.assigned:
            self._on_revoke(self.consumer, [KafkaTP(tp.topic, tp.partition) for tp in self.assigned])
        self.loop.resubscribe(self._new_consumer, lambda e: self.log.warning("runner.old_consumer_close_failed",
                                                                             error=str(e)))
        self.group_watch.reset()
        self.counts["rejoins"] += 1

    def handle_batch(self, msgs: list[Message]) -> None:
        """One batch: decode, dead-letter, put, commit."""
        started = time.monotonic()
        self.commits.caught_up_at = None  # busy again
        intake = Intake(self.connector.name, self.task.handles, self.connector.settings.on_unknown_type,
                        self.upcaster, converter=self.converter, protector=self.task_config.protector)
        try:
            got = batch_decode.decode(msgs, intake, self.task, self.reporter, self._consumer_error, self._retrying,
                                      self.assigned, self.log)
        except batch_decode.GaveUp as e:
            raise _Abandoned(f"decode still failing: {e}") from e
        records, dead, skipped, dead_at = got.records, got.dead, got.skipped, got.dead_at
        tracer = tracing.tracer()  # once per batch; off: no header is read (kafold.tracing)
        if tracer is None:
            dead += self._put(records, dead_at)
        else:
            with tracer.start_as_current_span(f"put {self.connector.name}", links=tracing.batch_links(
                    msgs, remember=self.task.continues_traces), attributes={"kafold.connector": self.connector.name,
                                                                           "kafold.records": len(records)}):
                dead += self._put(records, dead_at)
        self._flush_dead_letters()
        self.event_times.update(got.times if got.times is not None else last_event_times(records, msgs))
        for tp, nxt in got.seen.items():
            if tp in self.assigned:
                self.positions[tp] = nxt
                self.dirty = True
        committed = self._commit(self.assigned) if self.commits.due() else {}
        self.counts["batches"] += 1
        self.counts["records"] += len(msgs)
        self.counts["dead_lettered"] += dead
        self.counts["skipped"] += skipped
        self.tally.add(got.counted, dead_at, got.skipped_at)
        duration = time.monotonic() - started
        self.log.info("runner.batch", records=len(msgs), put=len(records), dead_lettered=dead, skipped=skipped,
                      duration_ms=round(duration * 1000, 1),
                      committed={str(tp): off for tp, off in sorted(committed.items())})
        if self.on_batch is not None:
            self.on_batch(BatchStats(len(msgs), len(records), dead, skipped, duration))

    def _consumer_error(self, err: Any) -> None:
        self.loop.consumer_error(err)  # a fatal one ends the run before this batch is committed
        self.log.warning("runner.consumer_error", error=str(err))

    def _apply_requests(self) -> None:
        request, self._pause_request = self._pause_request, None
        if request is None or request == self.api_paused:
            return
        self.api_paused = request
        tps = [KafkaTP(tp.topic, tp.partition) for tp in self.assigned
               if request or (tp not in self.user_paused and not self.backing_off)]
        (self.consumer.pause if request else self.consumer.resume)(tps)
        self.log.info("runner.paused_by_api" if request else "runner.resumed_by_api",
                      partitions=sorted(str(tp) for tp in self.assigned))

    def _put(self, records: Sequence[SinkRecord], dead_at: dict[TopicPartition, int]) -> int:
        """Put until it succeeds; returns how many records the task dead-lettered via RecordError (counted per
        partition into `dead_at`)."""
        pending, dead = records, 0  # a BatchReader's records are read one by one only where a put failed

        def put() -> None:
            nonlocal pending, dead
            while pending:
                try:
                    self.task.put(pending)
                    return
                except RecordError as e:
                    bad = e.raw
                    if not isinstance(bad, SinkRecord) or not any(r is bad for r in pending):
                        raise
                    self.reporter.report(bad, e)
                    dead += 1
                    dead_at[bad.tp] = dead_at.get(bad.tp, 0) + 1
                    pending = [r for r in pending if r is not bad]  # the others again: put is idempotent

        def warn(e: RetriableError, delay: float) -> None:
            self.log.warning("runner.put_retrying", error=str(e), retry_in_s=delay, hint="retrying the same batch")

        def back_off(delay: float) -> None:
            nonlocal pending
            self._back_off(delay)
            pending = [r for r in pending if r.tp in self.assigned]  # revoked ones go to the new owner

        try:
            self._retrying(put, warn, back_off)
        except RetriableError as e:
            raise _Abandoned(f"put still failing: {e}") from e
        return dead

    def _flush_dead_letters(self) -> None:
        def warn(e: RetriableError, delay: float) -> None:
            self.log.warning("runner.dlq_retrying", error=str(e), reason="dead-letter topic not acknowledging")

        try:
            self._retrying(lambda: self.reporter.flush(timeout=max(1.0, self.daemon.shutdown_grace_s)), warn,
                           self._back_off)
        except RetriableError as e:
            raise _Abandoned(str(e)) from e

    def _retrying(self, step: Callable[[], None], warn: Callable[[RetriableError, float], None],
                  back_off: Callable[[float], None] | None = None) -> None:
        """`step` until it succeeds, backing off (`_back_off` unless told) while serving the consumer; once the
        runner is stopping, for up to the shutdown grace period more, then its RetriableError is raised."""
        self.loop.retrying(step, warn, within_s=float("inf"), first_delay=0.1, max_delay=MAX_BACKOFF_S,
                           grace_s=self.daemon.shutdown_grace_s, wait=back_off or self._back_off)

    def _back_off(self, seconds: float) -> None:
        """Sleep while serving the consumer (heartbeats, rebalances) with every partition paused."""
        self.backing_off = True
        self.consumer.pause([KafkaTP(tp.topic, tp.partition) for tp in self.assigned])
        try:
            self.loop.back_off(seconds)  # what it fetches anyway (assigned meanwhile) is sought back to
        finally:
            self.backing_off = False
            active = [tp for tp in self.assigned if tp not in self.user_paused and not self.api_paused]
            self.consumer.resume([KafkaTP(tp.topic, tp.partition) for tp in active])

    # ---- offsets ----------------------------------------------------------------------------------------
    def _commit(self, partitions: Iterable[TopicPartition], *, wait: bool = False) -> dict[TopicPartition, int]:
        """Offer the positions of `partitions` to pre_commit and commit what it returns (commits.py has the note):
        asynchronously, or with `wait` synchronously (on revoke and stop). Returns the offsets sent."""
        if self.commits.put_off(wait):
            return {}
        requested, self.context.commit_requested = self.context.commit_requested, False
        offer = Offered(self.positions, self.assigned, self.dirty, requested)
        chosen, clean = self.commits.commit(self.consumer, self.task, offer, partitions, wait=wait)
        if clean:
            self.dirty = False
        return chosen

    def _on_commit(self, err: Any, partitions: list[Any]) -> None:
        """An asynchronous commit's answer (served inside consume(), in this thread); a failed one is offered
        again at the next flush."""
        if self.commits.answered(err, partitions):
            self.dirty = True

    def _apply_seeks(self) -> None:
        seeks, self.context.seeks = self.context.seeks, {}
        for tp, off in seeks.items():
            if tp in self.assigned:
                self.consumer.seek(KafkaTP(tp.topic, tp.partition, off))
                self.positions[tp] = off

    # ---- rebalance callbacks (run inside consume(), in this thread) -------------------------------------
    def _on_assign(self, consumer: Any, partitions: list[Any]) -> None:
        tps = [TopicPartition(p.topic, p.partition) for p in partitions]
        self.assigned.update(tps)
        self.task.open(tps)
        seeks = {tp: self.context.seeks.pop(tp) for tp in tps if tp in self.context.seeks}
        for p, tp in zip(partitions, tps, strict=True):
            if tp in seeks:
                p.offset = seeks[tp]
                self.positions[tp] = seeks[tp]
        kafka_clients.rebalance_assign(self.kafka, consumer, partitions)  # incremental with KIP-848
        if self.backing_off or self.api_paused:
            consumer.pause(partitions)
        self.progress.assigned(tps)  # `assignments` is counted by the loop once this returns
        self.log.info("runner.partitions_assigned", partitions=sorted(str(tp) for tp in tps))

    def _on_revoke(self, consumer: Any, partitions: list[Any]) -> None:
        tps = [tp for tp in (TopicPartition(p.topic, p.partition) for p in partitions) if tp in self.assigned]
        if not tps:
            return
        if not self.failed:
            try:
                self._commit(tps, wait=True)
            except Exception as e:
                self.log.warning("runner.revoke_commit_failed", error=str(e))
        self._release(tps)

    def _on_lost(self, consumer: Any, partitions: list[Any]) -> None:
        tps = [tp for tp in (TopicPartition(p.topic, p.partition) for p in partitions) if tp in self.assigned]
        self.log.warning("runner.partitions_lost", partitions=sorted(str(tp) for tp in tps), hint="not committing")
        self._release(tps)

    def _release(self, tps: list[TopicPartition]) -> None:
        try:
            self.task.close(tps)
        finally:
            self._unpause(tps)
            self.assigned.difference_update(tps)
            self.user_paused.difference_update(tps)
            for tp in tps:
                self.positions.pop(tp, None)
                self.event_times.pop(tp, None)
            self.commits.release(tps)
            self.progress.released(tps)
            self.log.info("runner.partitions_released", partitions=sorted(str(tp) for tp in tps))

    def _unpause(self, tps: list[TopicPartition]) -> None:
        """Lift this consumer's pause of partitions leaving its assignment (called while they are still assigned).

        librdkafka keeps an application's pause of a partition after the partition left the assignment (revoked or
        lost) and applies it again when the partition is assigned again; it lifts only the pause it set itself for
        the rebalance. The reasons for a pause (the task's flow control, a back-off, an API pause) are dropped
        here together with the partition, so nobody would resume it: assigned again, it would never be fetched,
        silently. As in the Java consumer, a pause does not outlive the assignment; `_on_assign` pauses a new
        assignment again while a back-off or an API pause lasts.

        Offsets: nothing is committed or moved here; a partition assigned again starts at its committed offset."""
        try:
            self.consumer.resume([KafkaTP(tp.topic, tp.partition) for tp in tps])
        except KafkaException as e:  # the partitions go anyway; a later assignment would show the stall
            self.log.warning("runner.released_resume_failed", error=str(e),
                             partitions=sorted(str(tp) for tp in tps))

    def loop_stopped(self) -> None:
        """Commit what was put (as on a revoke), close the partitions, stop the task and close the consumer."""
        try:
            if self.assigned:
                self._on_revoke(self.consumer, [KafkaTP(tp.topic, tp.partition) for tp in self.assigned])
        except Exception as e:
            self.log.error("runner.partitions_close_failed", error=str(e))
        for what, close in (("task", self.task.stop), ("consumer", self.consumer.close)):
            try:
                close()
            except Exception as e:
                self.log.error(f"runner.{what}_stop_failed", error=str(e))
        if self._owns_reporter and isinstance(self.reporter, DeadLetterWriter):
            self.reporter.close()
        self.stopped = True
        self.log.info("runner.stopped", failed=self.failed, **self.counts)
