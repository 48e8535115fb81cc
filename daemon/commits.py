"""Commits: a sink runner's commits of its consumer group offsets, one asynchronous commit in flight at a time.

Commit note: one asynchronous commit is in flight at a time. While it is, a flush is put off (the task is asked
again once the answer is in), unless it went unanswered for COMMIT_TIMEOUT_S: then it is given up and the next one
is sent (a commit is idempotent; the broker applies them in order). `committed`, and so the task's
`committed_offsets`, holds only what the broker confirmed; a failed commit leaves it as it was and the runner marks
itself dirty, so the same offsets are offered again at the next flush.

For a task that stores its own offsets (`SinkTask.stores_offsets`: a projection, whose checkpoints are written in
the same PostgreSQL transaction as its rows): a commit is made after a batch only once `offset_flush_interval_ms`
has passed since the last one sent, and always on revoke and stop, and on an idle poll (the task has caught up:
the group's offsets then follow its store at once instead of up to an interval later; the runner polls briefly
until the last write's offsets are committed, see CAUGHT_UP_POLL_S). What it commits is what
`pre_commit` returned — offsets already stored in the task's store, never those of a write still in flight — so the
group's offset never passes the store; and the store, not the group, decides where a restart resumes (the task's
`open` seeks every assigned partition to its stored offset). A group offset behind the store (up to one interval)
only means a new owner's first fetch starts a little earlier, before that seek.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Set
from dataclasses import dataclass
from typing import Any

from confluent_kafka import KafkaException
from confluent_kafka import TopicPartition as KafkaTP

from kafold import kafka_clients
from kafold.connectors.api import SinkTask, TopicPartition

# An asynchronous commit not answered within this long is given up (logged) and the next one is sent: Kafka
# Connect's offset.flush.timeout.ms (5 s by default) plays this part. A commit's request times out in librdkafka
# only after socket.timeout.ms (60 s), and a sync commit can wait forever (confluent-kafka-python#1801; seen here
# once a paused broker came back: the runner sat in `commit` until the process ended).
COMMIT_TIMEOUT_S = 10.0
# A task that stores its own offsets and has caught up (an idle poll) has its group's offsets committed right away;
# its last write may still be in flight then, so until everything handled is committed the runner polls in slices
# this short instead of batch_max_wait_ms: the group shows the end within tens of milliseconds of the store, as lag
# monitors and a caught-up check read it. Only for CAUGHT_UP_WINDOW_S after it caught up: a store that keeps
# failing (PostgreSQL down) is then asked on the timer again, not every few milliseconds.
CAUGHT_UP_POLL_S = 0.02
CAUGHT_UP_WINDOW_S = 1.0


@dataclass(frozen=True)
class InFlight:
    """An asynchronous commit sent and not yet answered: its offsets and when it was sent (CLOCK_MONOTONIC)."""

    offsets: dict[TopicPartition, int]
    sent_at: float


@dataclass(frozen=True)
class Offered:
    """What one commit was asked to cover, handed down by the runner: the next offsets after the handled records
    (`positions`), the partitions assigned, whether positions moved since the last commit (`dirty`) and whether the
    task asked for a commit (`requested`)."""

    positions: Mapping[TopicPartition, int]
    assigned: Set[TopicPartition]
    dirty: bool
    requested: bool


class Commits:
    """When the runner's next commit is due, the commit in flight, and what the broker confirmed (`committed`)."""

    def __init__(self, flush_interval_s: float, log: Any) -> None:
        self.flush_interval_s = flush_interval_s  # for a task that stores its own offsets (see the note)
        self.log = log
        self.next_flush = 0.0  # CLOCK_MONOTONIC of the next timed commit
        self.committed: dict[TopicPartition, int] = {}  # what the broker confirmed
        self.in_flight: InFlight | None = None  # the asynchronous commit awaiting its answer
        self.caught_up_at: float | None = None  # CLOCK_MONOTONIC of the first idle poll since the runner's last batch

    def due(self) -> bool:
        """Whether to commit after a batch or on an idle poll: once the task's `commit_interval_s` (0: always) has
        passed since the last commit, or for a task that stores its own offsets, `offset_flush_interval_ms`."""
        return time.monotonic() >= self.next_flush

    def idle_due(self, task: SinkTask, dirty: bool, requested: bool) -> bool:
        """Whether to commit on an idle poll (noted as caught up): a commit waiting for the timer, a task that asked
        and stores its own offsets, or one that stores its own offsets and has just caught up (see the note)."""
        if self.caught_up_at is None:
            self.caught_up_at = time.monotonic()
        return (((requested or dirty) and (self.due() or self.just_caught_up(task)))
                or (requested and task.stores_offsets))

    def just_caught_up(self, task: SinkTask) -> bool:
        """A task that stores its own offsets, idle for less than CAUGHT_UP_WINDOW_S."""
        return (task.stores_offsets and self.caught_up_at is not None
                and time.monotonic() - self.caught_up_at < CAUGHT_UP_WINDOW_S)

    def put_off(self, wait: bool) -> bool:
        """True while an asynchronous commit awaits its answer (a flush waits for it), unless `wait` or it went
        unanswered for COMMIT_TIMEOUT_S (then it is given up)."""
        if wait or self.in_flight is None:
            return False
        waited = time.monotonic() - self.in_flight.sent_at
        if waited < COMMIT_TIMEOUT_S:
            return True
        self.log.warning("runner.commit_timed_out", waited_s=round(waited, 1),
                         hint="given up; the next commit carries the same offsets or later ones")
        self.in_flight = None
        return False

    def commit(self, consumer: Any, task: SinkTask, offer: Offered, partitions: Iterable[TopicPartition], *,
               wait: bool = False) -> tuple[dict[TopicPartition, int], bool]:
        """Offer the positions of `partitions` to the task's pre_commit and commit what it returns: asynchronously
        (the answer comes to `answered` inside a later poll), or with `wait` synchronously (on revoke and stop,
        where the partitions are handed over next; asked after `put_off`). The offsets sent, and whether every
        position was taken as offered (the runner is then clean; else it stays dirty and the task is asked again)."""
        offered = {tp: offer.positions[tp] for tp in partitions if tp in offer.positions}
        if not offered or not (offer.dirty or offer.requested):  # a task that completes work later asks explicitly
            return {}, False
        asked_at = time.monotonic()
        chosen = dict(task.pre_commit(offered))
        chosen = {tp: off for tp, off in chosen.items() if tp in offer.assigned and self.committed.get(tp) != off}
        # The interval runs from a commit sent. A task that stores its own offsets and had nothing new stored yet
        # (its first write still in flight) is asked again at the next batch, not an interval later: the group
        # shows its first progress at once.
        if chosen or not task.stores_offsets:
            self.next_flush = asked_at + (self.flush_interval_s if task.stores_offsets else task.commit_interval_s)
        if chosen:
            offsets = [KafkaTP(tp.topic, tp.partition, off) for tp, off in chosen.items()]
            try:
                if wait:
                    kafka_clients.commit(consumer, offsets)  # a moving member epoch is sent again
                    self.committed.update(chosen)
                else:
                    consumer.commit(offsets=offsets, asynchronous=True)
                    self.in_flight = InFlight(chosen, time.monotonic())
            except KafkaException as e:  # e.g. a rebalance: the new owner re-reads from the last commit
                self.log.warning("runner.commit_failed", error=str(e),
                                 hint="records after the last commit will be delivered again")
                return {}, False
        # Clean only when every position was taken as offered; a task that held some back (work still in
        # flight) gets asked again on the next batch or request.
        clean = set(offered) >= set(offer.positions) and all(chosen.get(tp, self.committed.get(tp)) == off
                                                             for tp, off in offered.items())
        return chosen, clean

    def answered(self, err: Any, partitions: list[Any]) -> bool:
        """An asynchronous commit's answer (served inside consume(), in the runner's thread): what succeeded is
        `committed`; a failure is logged, and True says its offsets are to be offered again. The answer to a
        commit given up (COMMIT_TIMEOUT_S) or whose partitions were released meanwhile is not this runner's."""
        answered = {TopicPartition(p.topic, p.partition): p.offset for p in partitions or ()}
        if self.in_flight is None or (answered and answered != self.in_flight.offsets):
            return False  # an error answered without its partitions can only be the one in flight's
        self.in_flight = None
        error = err if err is not None else kafka_clients.refusal(partitions)
        if error is not None or not answered:
            reason = "no partitions answered" if error is None else str(error)
            self.log.warning("runner.commit_failed", error=reason,
                             hint="offered again at the next flush; a crash meanwhile delivers them again")
            return True
        self.committed.update(answered)  # a flush put off meanwhile is still due: it goes at the next poll
        return False

    def release(self, tps: list[TopicPartition]) -> None:
        """Forget partitions leaving the assignment; a commit in flight for any of them no longer concerns us."""
        for tp in tps:
            self.committed.pop(tp, None)
        if self.in_flight is not None and not self.in_flight.offsets.keys().isdisjoint(tps):
            self.in_flight = None
