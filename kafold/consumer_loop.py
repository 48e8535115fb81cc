"""ConsumerLoop: the one poll loop of kafold's consumers; the sink runner (daemon/runner.py), the aggregate runtime
(daemon/aggregates/runtime.py) and the projection rebuild's catch-up (connectors/projection/rebuild.py) plug their
batch handlers into it.

The loop owns the consumer, the stop event, `last_poll` (the host warns when a loop stops polling), the poll itself
(natural batching, `take`: what the fetch brought, at once, up to `batch_max_records`; a wait only while nothing is
there, of up to `batch_max_wait_ms`, and a handler may ask for a shorter one), the group subscription
and its rebalance callbacks (counted: `assignments`), a new consumer joining again (`resubscribe`), fatal consumer
errors (`raise_fatal`: FatalError), the polls count, a back-off that keeps serving the consumer, retries through
`kafold.retry`, and the shutdown hook, called exactly once a run.

It is in the core so that every layer reading Kafka shares it. A handler without a group (the rebuild: manual
assignment, recomputed before each poll from its own state) never subscribes and assigns in `before_poll`; it may
skip a poll when it already holds its next batch (`SKIP_POLL`: e.g. records read ahead), and it ends a run itself
once done (`finish`) rather than only through the stop event. A loop may `run` more than once over the same
consumer (the rebuild catches up again after a swap attempt rolled back): `loop_stopped` ends each run, and such a
handler closes the consumer itself after its last one.

Offsets and commits
-------------------
The loop commits nothing, stores no offset and seeks nowhere except in `back_off`: what a back-off poll fetched is
sought back to, so it is fetched again once the back-off ends (nothing skipped, nothing handled twice in a row).
Every commit is the handler's, inside its batch handler or its rebalance callbacks: the sink runner's after `put`
and the dead-letter flush (at-least-once, runner.py), the aggregate runtime's in the batch's transaction
(exactly-once, runtime.py); the rebuild commits nothing to Kafka (its progress is the shadow's checkpoints, written
with its rows, rebuild.py). A fatal consumer error is raised from inside the handler's batch, before its commit,
so nothing of that batch is committed; what the handler does on a revoke, a lost partition or at shutdown (commit
or not) is its own contract.

Natural batching
----------------
librdkafka's `consume(n, timeout)` returns only once it holds `n` records or the timeout expired, so a lone record
waited the whole `batch_max_wait_ms` for a batch that never filled. `take` hands over what is already fetched
(a zero-wait `consume`) and waits only while nothing is: a `poll` returns the first record as soon as it arrives,
and what came with it is drained at once. Under load the batches grow by themselves (everything fetched while the
previous batch was handled), up to `batch_max_records`; at a few records a second each one goes alone.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from confluent_kafka import TopicPartition as KafkaTP

from kafold.errors import FatalError, RetriableError
from kafold.kafka_message import Message
from kafold.retry import retrying

T = TypeVar("T")
Rebalance = Callable[[Any, list[Any]], None]  # librdkafka's on_assign / on_revoke / on_lost: (consumer, partitions)

BACK_OFF_POLL_S = 0.2  # a back-off polls at least this often: heartbeats, rebalances and `last_poll` stay current
# An idle wait is served in slices of at most this long: a stop is seen (and `last_poll` kept current) within it,
# however long `batch_max_wait_ms` is.
IDLE_SLICE_S = 0.5


class SkipPoll:
    """The type of `SKIP_POLL`."""

    def __repr__(self) -> str:
        return "SKIP_POLL"


# Returned by `before_poll`: nothing is consumed this round, the handler's batch is what it already holds
# (`handle_batch([])`, then `after_poll`); not counted in `polls`.
SKIP_POLL = SkipPoll()


def raise_fatal(err: Any, message: Callable[[Any], str]) -> None:
    """FatalError(message(err)) when `err` (a record's KafkaError) is fatal: the consumer cannot go on (e.g. fenced
    or unauthorized), so the batch ends before anything of it is committed. A transient error returns: the caller
    skips that record (it carries no data) as it always did. Called only for a record that has an error, so the
    batches' per-record loops pay nothing for it."""
    if err.fatal():
        raise FatalError(message(err))


def take(consumer: Any, max_records: int, wait_s: float, stop: threading.Event | None = None,
         waiting: Callable[[], bool] | None = None) -> list[Message]:
    """A natural batch: the records (or record errors) already fetched, up to `max_records`, returned at once; only
    when there are none, a wait of up to `wait_s` for the first one, which is returned as soon as it arrives with
    whatever came with it. The wait is served in slices of IDLE_SLICE_S; it ends early on `stop`, or when
    `waiting` (called before each slice) returns False. [] when nothing arrived."""
    msgs = consumer.consume(max_records, 0)
    if msgs:
        return list(msgs)
    until = time.monotonic() + wait_s
    while (left := until - time.monotonic()) > 0 and not (stop is not None and stop.is_set()):
        if waiting is not None and not waiting():
            break
        first = consumer.poll(min(left, IDLE_SLICE_S))  # returns with the first record (callbacks served too)
        if first is not None:
            return [first, *consumer.consume(max_records - 1, 0)] if max_records > 1 else [first]
    return []


class BatchHandler(Protocol):
    """What a consumer plugs into the loop; every hook runs in the loop's thread."""

    def loop_started(self) -> None:
        """Start the handler and subscribe through the loop (errors end the run like a batch's)."""

    def before_poll(self) -> float | SkipPoll | None:
        """Work between polls (requests, seeks, assignment, recovery); the next poll's wait in seconds, None for
        the default, SKIP_POLL for no poll this round. It may end the run (`ConsumerLoop.finish`): no poll then."""

    def handle_batch(self, msgs: list[Message]) -> None:
        """One batch (empty after SKIP_POLL); a record's error goes to `ConsumerLoop.consumer_error` (a fatal one
        ends the run)."""

    def on_idle(self) -> None:
        """A poll that returned nothing."""

    def after_poll(self) -> None:
        """After each poll (counted in `polls`) or skipped poll, and its handling."""

    def on_failure(self, error: Exception) -> bool:
        """The run's error; True when handled (the run returns), False to raise it from `run`."""

    def loop_stopped(self) -> None:
        """Release everything, whatever happened (called once a run, last)."""


class LoopHandler:
    """A base for batch handlers: the consumer and `last_poll` are the loop's (read and replaced through the
    handler, as its callers and tests know them), and the optional hooks do nothing."""

    loop: ConsumerLoop

    @property
    def consumer(self) -> Any:
        return self.loop.consumer

    @consumer.setter
    def consumer(self, consumer: Any) -> None:
        self.loop.consumer = consumer

    @property
    def last_poll(self) -> float:
        """When the loop last served the consumer (CLOCK_MONOTONIC; the host warns when it stops)."""
        return self.loop.last_poll

    @last_poll.setter
    def last_poll(self, at: float) -> None:
        self.loop.last_poll = at

    def before_poll(self) -> float | SkipPoll | None:
        return None

    def on_idle(self) -> None:
        pass

    def after_poll(self) -> None:
        pass


class ConsumerLoop:
    """Polls `consumer` for `handler` in the calling thread until `stop` is set, the handler calls `finish` or a
    hook raises."""

    def __init__(self, handler: BatchHandler, *, stop: threading.Event, max_records: int, wait_s: float,
                 counts: dict[str, int], fatal: Callable[[Any], str]) -> None:
        self.handler = handler
        self.stop = stop
        self.max_records, self.wait_s = max_records, wait_s
        self.counts = counts  # the handler's own counts: the loop adds `polls` and `assignments` to them
        self.counts.setdefault("polls", 0)
        self.counts.setdefault("assignments", 0)
        self.fatal = fatal  # a fatal consumer error (librdkafka's KafkaError) as the FatalError's message
        self.consumer: Any = None
        self.last_poll = time.monotonic()  # CLOCK_MONOTONIC of the last poll (the host warns when it stops)
        self._subscription: tuple[list[str], Rebalance, Rebalance, Rebalance] | None = None
        self._finished = False  # this run's end, asked for by the handler (`finish`); `stop` ends every run
        self._rebalances = 0  # callbacks run: an idle wait ends after one, so the handler's hooks see it at once

    def run(self) -> None:
        """Start the handler, poll until stopped or finished; the handler's `on_failure` decides whether an error
        is raised. Each run starts afresh (a run finished before does not end the next one)."""
        self._finished = False
        try:
            self.handler.loop_started()
            while not self.stop.is_set() and not self._finished:
                self.last_poll = time.monotonic()
                wait = self.handler.before_poll()
                if self._finished:
                    break
                if isinstance(wait, SkipPoll):
                    self.handler.handle_batch([])
                else:
                    self._poll(wait)
                self.handler.after_poll()
        except Exception as e:
            if not self.handler.on_failure(e):
                raise
        finally:
            self.handler.loop_stopped()

    def _poll(self, wait: float | None) -> None:
        rebalances = self._rebalances

        def waiting() -> bool:  # an idle wait serves the consumer (not a stall); a rebalance ends it
            self.last_poll = time.monotonic()
            return self._rebalances == rebalances

        msgs = take(self.consumer, self.max_records, self.wait_s if wait is None else wait, self.stop, waiting)
        if msgs:
            self.handler.handle_batch(msgs)
        else:
            self.handler.on_idle()
        self.counts["polls"] += 1

    def finish(self) -> None:
        """End this run once the hook calling it returns (from `before_poll`: before its poll); `stop` stays
        unset, so the loop may run again."""
        self._finished = True

    def consumer_error(self, err: Any) -> None:
        """A record's error met in a batch: FatalError when fatal (see `raise_fatal`), else it returns."""
        raise_fatal(err, self.fatal)

    # ---- the group --------------------------------------------------------------------------------------
    def subscribe(self, topics: list[str], on_assign: Rebalance, on_revoke: Rebalance,
                  on_lost: Rebalance) -> None:
        """Join the group on `topics`; the callbacks run inside the poll, in this thread."""
        self._subscription = (topics, on_assign, on_revoke, on_lost)

        def assigned(consumer: Any, partitions: list[Any]) -> None:
            self._rebalances += 1
            on_assign(consumer, partitions)
            self.counts["assignments"] += 1  # a completed assignment (a failing one ends the run)

        def revoked(consumer: Any, partitions: list[Any]) -> None:
            self._rebalances += 1
            on_revoke(consumer, partitions)

        def lost(consumer: Any, partitions: list[Any]) -> None:
            self._rebalances += 1
            on_lost(consumer, partitions)

        self.consumer.subscribe(topics, on_assign=assigned, on_revoke=revoked, on_lost=lost)

    def resubscribe(self, new_consumer: Callable[[], Any], on_close_error: Callable[[Exception], None]) -> None:
        """Close the consumer (leaving the group; a failure is reported, not raised) and join again with a new
        one on the same subscription. What the old one held must have been released (and committed) before."""
        assert self._subscription is not None
        try:
            self.consumer.close()
        except Exception as e:
            on_close_error(e)
        self.consumer = new_consumer()
        self.subscribe(*self._subscription)

    # ---- backoff ----------------------------------------------------------------------------------------
    def back_off(self, seconds: float) -> None:
        """Serve the consumer (heartbeats, rebalances) for `seconds` without handling anything. The caller pauses
        what should not be fetched; a record fetched anyway (a partition assigned meanwhile) is sought back to, so
        it is delivered again after the back-off and nothing is skipped."""
        until = time.monotonic() + seconds
        while (left := until - time.monotonic()) > 0:
            self.last_poll = time.monotonic()
            for m in self.consumer.consume(100, min(left, BACK_OFF_POLL_S)):
                if m.error() is None:
                    self.consumer.seek(KafkaTP(m.topic(), m.partition(), m.offset()))

    def retrying(self, step: Callable[[], T], on_retry: Callable[[RetriableError, float], None], *,
                 within_s: float, first_delay: float, max_delay: float = 5.0, grace_s: float = 0.0,
                 wait: Callable[[float], None] | None = None) -> T:
        """`step` retried on RetriableError through `kafold.retry`, ending with this loop's stop (after `grace_s`);
        `wait` replaces the sleep (e.g. a `back_off` that keeps the group membership)."""
        return retrying(step, within_s=within_s, on_retry=on_retry, first_delay=first_delay, max_delay=max_delay,
                        stop=self.stop, grace_s=grace_s, wait=wait)
