"""The effect sink task and the `webhook`, `kafka` and `python` connectors built on it.

Note on offsets and commits
---------------------------
* at-least-once (default): `put` adds each record to the OffsetTracker and hands it to the executor, returning
  at once; `pre_commit` returns, per partition, the end of the contiguous prefix of completed events (succeeded,
  already in the ledger, or durably parked). A crash re-delivers everything after that prefix; effects the ledger
  shows as finished are not run again, the rest run again with the same idempotency key.
* at-most-once: `put` only holds the records; `pre_commit` returns everything handed over, and the held records are
  released to the executor the next time the runner calls in (put, pre_commit or close) once the broker has
  confirmed their commit (`committed_offsets`); those whose commit is not confirmed yet, or failed, go back to be
  held and offered again. A crash loses the released-but-unfinished effects; none runs twice.
* Idle progress: each completion calls `context.request_commit()`, so the runner commits on an idle poll.
* at-least-once commits at most every COMMIT_INTERVAL_S (`commit_interval_s`): a commit per batch (synchronous
  then) took the runner's thread ~5 ms each, 60 % of it at 1,000 events/s, while records waited to be handed over;
  sent asynchronously now, each is still a request to the group coordinator. A crash
  re-delivers up to that much more, which the ledger shows finished (not run again). at-most-once commits after
  every batch: its effects wait for that commit.
* Flow control: while more than `max_in_flight` events are unfinished, `put` waits up to a second, then pauses the
  task's partitions (group membership stays alive) until half of them completed.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

from kafold import db, logs
from kafold.config import KafkaConfig
from kafold.connectors.api import (
    Connector,
    Metric,
    Offsets,
    Outcomes,
    Sample,
    SinkRecord,
    SinkTask,
    SinkTaskContext,
    TaskConfig,
    TaskView,
    TopicPartition,
)
from kafold.connectors.dlq import DeadLetterWriter, pg_text
from kafold.connectors.effects.circuit import Circuit
from kafold.connectors.effects.drivers import Effect, KafkaEffect, PythonEffect, Webhook
from kafold.connectors.effects.executor import Executor
from kafold.connectors.effects.ledger import Ledger
from kafold.connectors.effects.policy import RetryPolicy
from kafold.connectors.effects.settings import (
    AT_MOST_ONCE,
    EffectConfig,
    KafkaEffectConfig,
    PythonEffectConfig,
    WebhookConfig,
)
from kafold.connectors.effects.tracker import OffsetTracker
from kafold.errors import FatalError, RetriableError
from kafold.protect import Protector
from kafold.retry import retrying

log = logs.get("kafold.connectors.effects")

PUT_BLOCK_S = 1.0
COMMIT_INTERVAL_S = 0.1
OPEN_RETRY_S = 60.0  # how long `open` waits for PostgreSQL (parked keys) before failing the task


class EffectSinkTask(SinkTask):
    """Hands events to the ordered-per-key executor; commits per the connector's delivery mode."""

    continues_traces = True  # a delivery's span continues its record's trace (tracing.recall)

    def start(self, task_config: TaskConfig[EffectConfig], context: SinkTaskContext) -> None:
        self.context = context
        self.config = task_config.config
        kafka = task_config.kafka
        pg = task_config.postgres or db.from_environment()  # same rule as the projection's
        if kafka is None:
            raise FatalError(f"effect connector {context.connector_name!r}: no [kafka] section reached the task "
                             "(TaskConfig.kafka; the runner fills it in)")
        self.name = context.connector_name
        if pg.migrate_on_start:
            # The ledger's tables exist before `open` reads parked keys: a task never relies on another connector
            # having migrated first, which a fast group join (real Kafka: no initial rebalance delay) outruns.
            # Under the daemon the flag is cleared: the daemon migrated before starting any task.
            def warn(e: RetriableError, delay: float) -> None:
                log.warning("effects.postgres_retrying", step="migrate", connector=self.name,
                            error=str(e), retry_in_s=delay)

            retrying(lambda: db.upgrade(pg), within_s=OPEN_RETRY_S, on_retry=warn)
        self.at_most_once = self.config.delivery == AT_MOST_ONCE
        self.commit_interval_s = 0.0 if self.at_most_once else COMMIT_INTERVAL_S
        self.tracker = OffsetTracker()
        protector = task_config.protector  # the host's (kafold.protect): opened events sealed again where kept
        self.dlq = DeadLetterWriter(kafka, task_config.dlq_topic or f"kafold.dlq.{self.name}", self.name,
                                    protector=protector)
        self.ledger = Ledger(pg, self.name, self.dlq, self.config.ledger_flush_ms / 1000, protector)
        c = self.config
        policy = RetryPolicy(c.max_attempts, c.max_age_s, c.backoff_initial_s, c.backoff_max_s)
        effect = build_effect(c, kafka, self.name, protector)
        circuit = Circuit(self.name, effect.endpoint, ratio=c.circuit_failure_ratio, window=c.circuit_window,
                          probe_initial_s=c.backoff_initial_s, probe_max_s=c.probe_max_s)
        self.executor = Executor(self.name, effect, policy, self.ledger, self.tracker, c.concurrency,
                                 c.request_poll_s, self._progress, self._tick, circuit, c.parked_retry_every_s)
        self.executor.start()
        self.held: list[SinkRecord] = []       # at-most-once: waiting for the commit that covers them
        self.committing: list[SinkRecord] = []  # at-most-once: their commit was offered to the runner
        self.paused: set[TopicPartition] = set()
        self._counter = itertools.count(1)
        self.completions = self.acknowledged = 0  # completions counted / seen by the latest pre_commit
        self.log = log.bind(connector=self.name, task=context.task_id, delivery=c.delivery)
        self.log.info("effects.task_started", effect=type(self.config).__name__)

    def _progress(self) -> None:
        """Any thread: ask the runner for a pre_commit/commit cycle (it runs on an idle poll)."""
        self.completions = next(self._counter)  # atomic, unlike += across threads
        self._request()

    def _tick(self) -> None:
        """Executor thread, every 100 ms: ask again while completions are not yet seen by a pre_commit (a
        request can be consumed by a commit that started just before the completion)."""
        if self.completions != self.acknowledged or self.committing:
            self._request()

    def _request(self) -> None:
        self.context.request_commit()

    def put(self, records: Sequence[SinkRecord]) -> None:
        self._release_committed()
        if not records:
            return
        records = [_storable_key(r) for r in records]
        for r in records:
            self.tracker.add(r.tp, r.offset)
        if self.at_most_once:
            self.held.extend(records)
            self._request()
        else:
            self.executor.submit(records)
        self._bound()

    def _bound(self) -> None:
        limit = self.config.max_in_flight
        deadline = time.monotonic() + PUT_BLOCK_S
        while self.tracker.in_flight >= limit and time.monotonic() < deadline:
            time.sleep(0.02)
        if self.tracker.in_flight >= limit:
            todo = self.context.assignment() - self.paused
            if todo:
                self.context.pause(*todo)
                self.paused |= todo
                self.log.info("effects.fetch_paused", in_flight=self.tracker.in_flight,
                              reason="too many effects in flight")

    def _release_committed(self) -> None:
        """at-most-once: records whose commit the runner has performed since the last call may now run; those
        whose commit failed (e.g. during a rebalance) go back to be held and offered again — running them
        uncommitted could run them twice after a crash."""
        if self.committing:
            done = self.context.committed_offsets()
            ready = [r for r in self.committing if r.offset < done.get(r.tp, -1)]
            if len(ready) < len(self.committing):
                self.held = [r for r in self.committing if r.offset >= done.get(r.tp, -1)] + self.held
                self._request()
            self.committing = []
            if ready:
                self.executor.submit(ready)

    def pre_commit(self, offsets: Offsets) -> Offsets:
        self.acknowledged = self.completions
        self._release_committed()
        if self.paused and self.tracker.in_flight < self.config.max_in_flight // 2:
            self.context.resume(*self.paused)
            self.log.info("effects.fetch_resumed", in_flight=self.tracker.in_flight)
            self.paused.clear()
        if self.at_most_once:
            covered = {tp: off for tp, off in offsets.items()}
            ready = [r for r in self.held if r.offset < covered.get(r.tp, -1)]
            if ready:
                self.held = [r for r in self.held if r.offset >= covered.get(r.tp, -1)]
                self.committing = ready  # released on the next call in; _tick asks for one
            return covered
        return self.tracker.committable(dict(offsets))

    def outcomes(self) -> Mapping[TopicPartition, Outcomes] | None:
        """Counted as the executor completes records: effects done applied, those the ledger had finished
        duplicates, those parked (head or behind it) dead-lettered; a record still in flight not yet."""
        executor = getattr(self, "executor", None)
        return None if executor is None else executor.outcomes()

    def status(self) -> dict[str, Any]:
        executor = getattr(self, "executor", None)
        if executor is None:
            return {}
        return {**executor.status(), "in_flight": self.tracker.in_flight,
                "max_in_flight": self.config.max_in_flight, "fetch_paused": bool(self.paused)}

    def open(self, partitions: Collection[TopicPartition]) -> None:
        # Parked keys first (their later events must queue behind them); PostgreSQL may be restarting.
        def warn(e: RetriableError, delay: float) -> None:
            self.log.warning("effects.parked_keys_retrying", error=str(e), retry_in_s=delay)

        parked = retrying(self.ledger.parked_keys, within_s=OPEN_RETRY_S, on_retry=warn)
        self.executor.open(list(partitions), parked)

    def close(self, partitions: Collection[TopicPartition]) -> None:
        gone = set(partitions)
        self._release_committed()
        self.held = [r for r in self.held if r.tp not in gone]
        self.paused -= gone
        self.executor.close(list(partitions))

    def stop(self) -> None:
        # start() may have failed part way (PostgreSQL still starting): close what it got to.
        executor = getattr(self, "executor", None)
        if executor is not None:
            executor.stop()
        for name in ("ledger", "dlq"):
            part = getattr(self, name, None)
            if part is not None:
                part.close()
        if executor is not None:
            self.log.info("effects.task_stopped", **executor.counts)


def _storable_key(record: SinkRecord) -> SinkRecord:
    """`record` with its key as the ledger stores it (`pg_text`: a NUL escaped): the executor orders, parks and
    releases keys by the same text PostgreSQL holds. The effect itself gets the event unchanged."""
    key = pg_text(record.key)
    return record if key == record.key else dataclasses.replace(record, key=key)


def build_effect(config: EffectConfig, kafka: KafkaConfig, name: str, protector: Protector | None = None) -> Effect:
    if isinstance(config, WebhookConfig):
        return Webhook(config)  # connections: as many as effects run at once (the executor's `concurrency`)
    if isinstance(config, KafkaEffectConfig):
        return KafkaEffect(config, kafka, name, protector)
    if isinstance(config, PythonEffectConfig):
        return PythonEffect(config)
    raise FatalError(f"no effect for {type(config).__name__}")


_BY_ENDPOINT = ("connector", "task", "endpoint")
EFFECT_OUTCOMES = ("succeeded", "parked", "deduplicated", "released")  # the executor's counts, failed attempts apart


class _EffectConnector(Connector[Any]):
    task_class = EffectSinkTask
    uses_postgres = True  # the delivery ledger and parked keys
    metrics = (
        Metric("kafold_effect_circuit_open", "1 while an effect endpoint's circuit is open (attempts wait; one probe "
               "at a time), else 0.", _BY_ENDPOINT),
        Metric("kafold_effect_circuit_changes", "Times the endpoint's circuit opened or closed.", _BY_ENDPOINT,
               "counter"),
        Metric("kafold_effect_in_flight", "Events handed to an effect task and not yet completed (running, waiting "
               "to retry, or queued behind their key).", _BY_ENDPOINT),
        Metric("kafold_effect_fetch_paused", "1 while the task stopped fetching because max_in_flight events are "
               "held (the lag grows meanwhile).", _BY_ENDPOINT),
        Metric("kafold_effect_parked_keys", "Keys parked in this task.", _BY_ENDPOINT),
        Metric("kafold_effect_events", "Events an effect task completed, by outcome: succeeded, parked, deduplicated "
               "(the ledger had it done already), released (run again from a parked key, and done).",
               (*_BY_ENDPOINT, "outcome"), "counter"),
        Metric("kafold_effect_failed_attempts", "Delivery attempts that failed: each is retried after a back-off, or "
               "parks its key when permanent or past max_age_s.", _BY_ENDPOINT, "counter"),
    )

    def task_configs(self, max_tasks: int) -> list[TaskConfig[Any]]:
        return [TaskConfig(i, self.config, self.settings.dlq_topic) for i in range(max_tasks)]

    def sample_metrics(self, tasks: Sequence[TaskView]) -> Iterable[Sample]:
        for task in tasks:
            st = task.status
            if "circuit" not in st:  # the task has not started its executor yet
                continue
            labels = (self.name, str(task.task_id), str(st["endpoint"]))
            yield "kafold_effect_circuit_open", labels, 0.0 if st["circuit"] == "closed" else 1.0
            yield "kafold_effect_circuit_changes", labels, float(st["circuit_changes"])
            yield "kafold_effect_in_flight", labels, float(st["in_flight"])
            yield "kafold_effect_fetch_paused", labels, 1.0 if st["fetch_paused"] else 0.0
            yield "kafold_effect_parked_keys", labels, float(st["parked_keys"])
            counts = st.get("counts", {})  # since the task's executor started (a counter reset to Prometheus)
            for outcome in EFFECT_OUTCOMES:
                yield "kafold_effect_events", (*labels, outcome), float(counts.get(outcome, 0))
            yield "kafold_effect_failed_attempts", labels, float(counts.get("failed_attempts", 0))


class WebhookConnector(_EffectConnector):
    """POSTs each event to a URL, signed the Standard Webhooks way; `webhook-id` = event id."""

    config_class = WebhookConfig


class KafkaEffectConnector(_EffectConnector):
    """Produces a derived event or command (deterministic uuid5 id) to another topic."""

    config_class = KafkaEffectConfig


class PythonEffectConnector(_EffectConnector):
    """Calls a user function `module:function(event)` (sync or async) per event."""

    config_class = PythonEffectConfig
