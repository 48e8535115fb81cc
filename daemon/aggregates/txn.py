"""One Kafka transaction per batch of commands: events + results + dead letters + the consumed command offsets.

Guarantee: `commit` makes the batch's events, results, dead-letter records and the commands consumer's offsets
visible together (read_committed) or not at all. The offsets go through `send_offsets_to_transaction` with the
consumer's group metadata (KIP-447): a member fenced by a newer generation cannot commit them, and a second
producer with the same `transactional.id` fences this one (`init_transactions` aborts our open transaction).
`commit` returns False when the transaction was aborted (the caller rewinds to the last committed offsets and
rebuilds the state the batch touched); it raises FatalError when this producer is fenced or hung, and ProducerBroken
when librdkafka reports a fatal error that is not a fence (the caller replaces the producer, see ProducerBroken).

Result tokens (kafold.tokens): a result carries the offset of its command's last event, which Kafka assigns only
when the event is written. So results are held back (`produce_result`) and produced at `commit`, after a flush
has delivered the batch's events (their delivery reports give the offsets), still inside the open transaction:
the results become visible with the events or not at all, as before. The offsets of records of an open
transaction are final: an abort leaves them unused (never reassigned), and the results naming them are aborted
with them. A duplicate carries its first decision's token when this writer committed that decision (a bounded
memory, checked against the duplicate's event ids), else the token of the newest event known committed on its
events partition (`ends`: the replay's end at assignment, `known_end`, then each committed batch's last event): its
first decision, made before this writer's memory, lies at or before it, so a wait on it covers that decision
(waiting perhaps a little longer than needed, never too short).

One delivery report and one token per partition and transaction: the last event of each partition is held back
until commit (produced before any later event of its partition, so the order is Kafka's as before), and every result
of that partition's commands carries the offset of the batch's last event there. A reader waiting on it waits for
the same thing as on its own last event: the transaction makes the batch's events visible together.

Predicted offsets: waiting for the events' delivery before producing the results makes the commit two chains of
round trips (register the events' partitions, produce, then the results' partitions, produce, then EndTxn). Once a
transaction of this producer has committed events to a partition, the next record it writes there lands, unless
another producer wrote in between, at the offset after that transaction's last event and its commit marker
(`_next`: last + 2). A batch's events to such a partition are then given the offsets they will have (`Landing.base`
+ their count), each result is encoded with its own command's last event at once and produced while the batch is
decided, and the commit flushes events and results in one go. Before EndTxn every predicted partition's last event
must have landed where predicted (its delivery report): else the transaction is aborted and the batch decided again
with the flush between (predictions are dropped at any abort; a partition mispredicted once, where another producer
writes, e.g. a service's `kafold.aio.EventProducer`, is never predicted again by this writer). Why a check of the
last event is enough: a partition's offsets only grow, so with the last where predicted no record of the batch there
landed above its prediction, and a token is never below its event (at most it names a later event of the same
transaction, as the batch's last does).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from itertools import islice
from typing import Any

from confluent_kafka import KafkaError, KafkaException, TopicPartition

from kafold import kafka_clients, logs
from kafold.config import KafkaConfig
from kafold.envelope import Headers
from kafold.errors import FatalError, RetriableError
from kafold.messages import Result
from kafold.tokens import encode_one as encode_token

log = logs.get(__name__)
TIMEOUT_S = 30.0
# librdkafka's send_offsets_to_transaction can block past its timeout, for good, when the group coordinator's
# broker went away (confluentinc/librdkafka#5456, #5511; seen when a broker of three was killed): the call is
# waited for this long beyond its timeout, then the producer counts as broken and this instance stops (its
# supervisor starts a new one; the broker aborts the open transaction or the new producer fences it).
HANG_GRACE_S = 30.0
CLOSE_FLUSH_S = 5.0  # what a close waits for queued records, and again for the close itself
TXN_TIMEOUT_MS = 60000  # the producer's transaction.timeout.ms: past it the coordinator aborts an open transaction
# A commit or abort that timed out has an outcome not known yet: librdkafka asks for the call again ("retry call to
# resume"), which is safe. It is asked again until past the transaction timeout, by when the coordinator has decided
# (committed, or aborted by itself: the retry then answers abort-required and the batch is decided again), rather
# than stopping the instance on a slow cluster (seen in the chaos soak on three-node Apache Kafka under load 30).
DECIDED_S = TXN_TIMEOUT_MS / 1000 + 15.0
# A transaction's first requests to its coordinator wait while the coordinator still writes the previous
# transaction's markers (EndTxn is answered before they are written, ~5 ms at 1,000 commands/s): the broker answers
# CONCURRENT_TRANSACTIONS. librdkafka asks again after retry.backoff.ms for AddOffsetsToTxn (the offsets, sent first:
# `send_offsets`), but after a fixed 20 ms for AddPartitionsToTxn (rdkafka_txnmgr.c), which one transaction in five
# paid when its events were queued before the markers were out (docs/benchmarks.md, 2026-12-06). So the offsets call
# is the probe: asked again every RETRY_BACKOFF_MS, and the batch's records are held until it has returned (see
# `produce`). Other retries back off exponentially from it up to retry.backoff.max.ms (1 s) as before.
RETRY_BACKOFF_MS = 1
REMEMBERED_TOKENS = 20_000  # committed decisions whose token a duplicate can repeat (~0.4 KB each)
Encoded = tuple[bytes, bytes, Headers]


class Landing:
    """Where the open transaction's last event of one partition landed: its offset, set by its delivery report;
    `token`, encoded once for every result that names it."""

    __slots__ = ("base", "count", "offset", "partition", "token", "topic")

    def __init__(self, topic: str, partition: int, base: int | None = None) -> None:
        self.topic, self.partition = topic, partition
        self.offset: int | None = None
        self.token: str | None = None
        self.base = base  # the offset predicted for the transaction's first event here (module note), None: unknown
        self.count = 0  # the transaction's events queued here so far

    def __call__(self, err: Any, msg: Any) -> None:  # librdkafka's delivery report (served by flush/poll)
        if err is None:
            self.offset = msg.offset()


class ProducerBroken(FatalError):
    """A fatal transactional error that is not a fence, e.g. INVALID_TXN_STATE when an abort reached a coordinator
    that had just taken over after a broker kill. This producer cannot go on; librdkafka's remedy is a new producer
    instance, and one with the same transactional.id fences this one (init_transactions bumps the epoch; the
    coordinator aborts what this one left open, or completes a commit it had started). What the last transaction
    became is then known only from the topics: the caller recovers its partitions again, as a restart would."""


class TransactionalWriter:
    """A transactional producer; `begin`, `produce`..., then `commit(offsets, group_metadata)` or `abort`."""

    _sending: _Bounded | None = None  # the offsets being sent into the open transaction (send_offsets)
    # Set by __init__ (these empty defaults serve a writer made without it, as the close/timeout unit tests make
    # one, which never commits an event): (events topic, partition) -> the offset this producer's next record there
    # lands at, known from its last committed transaction there (module note: predicted offsets); (results topic,
    # partition) -> the last result produced at once, held back until commit for its delivery report (result_ends)
    _next: dict[tuple[str, int], int] = {}
    _held_results: dict[tuple[str, int], tuple[bytes | None, bytes | None, Headers, int]] = {}
    _unpredictable: set[tuple[str, int]] = set()  # events partitions mispredicted once (another producer writes)

    def __init__(self, kafka: KafkaConfig, transactional_id: str, **extra: Any) -> None:
        self.transactional_id = transactional_id
        # linger.ms above a batch's processing time: records leave at commit (flush) in few large requests, and
        # the span in which a crash leaves flushed-but-uncommitted records stays short.
        self.producer = kafka_clients.producer(kafka, **{
            "transactional.id": transactional_id, "enable.idempotence": True, "acks": "all", "linger.ms": 100,
            "batch.num.messages": 10000, "queue.buffering.max.messages": 500000,
            "transaction.timeout.ms": TXN_TIMEOUT_MS, "retry.backoff.ms": RETRY_BACKOFF_MS, **extra})
        self._produce = self.producer.produce
        # held back until commit
        self._results: list[tuple[str, int, Result, Landing | None, int, Sequence[tuple[str, bytes]] | None,
                                  tuple[str, int] | None]] = []
        # (topic, partition) -> its Landing and the last event queued there, held back until commit (module note)
        self._last: dict[tuple[str, int], tuple[Landing, tuple[bytes | None, bytes | None, Headers, int] | None]] = {}
        # (aggregate id, command id) -> (event ids, token): of committed decisions (oldest first), of the batch
        self._tokens: dict[tuple[str, str], tuple[tuple[str, ...], str]] = {}
        self._committing: dict[tuple[str, str], tuple[tuple[str, ...], str]] = {}
        # (events topic, partition) -> offset of the newest event known committed there (module note)
        self.ends: dict[tuple[str, int], int] = {}
        # (results topic, partition) -> the offset after the newest result known committed there: what the local
        # state store records with the outcomes it holds (local.py); set from the last result of each partition of
        # a committed transaction whose delivery report was served (none served: it stays, the store only lags)
        self.result_ends: dict[tuple[str, int], int] = {}
        self._results_landed: list[Landing] = []
        # the open transaction's records queued before its offsets were in it (`produce`), in produce order
        self._waiting: list[tuple[str, int, bytes | None, bytes | None, Headers, int, Landing | None]] = []
        self._landed: list[Landing] = []  # the open transaction's last events, known committed at `_remember`
        self._next = {}
        self._held_results = {}
        self._unpredictable = set()
        self.open = False
        self.held = False  # a librdkafka call blocked for good holds the producer: close must not touch it
        self._init()

    def _init(self) -> None:
        try:
            self.producer.init_transactions(TIMEOUT_S)
        except KafkaException as e:
            raise _convert(e, "init_transactions") from e

    def begin(self) -> None:
        try:
            self.producer.begin_transaction()
        except KafkaException as e:
            raise _convert(e, "begin_transaction") from e
        self._results.clear()
        self._last.clear()
        self._held_results = {}
        self._committing = {}
        self._waiting = []
        self._sending = None
        self.open = True

    def produce(self, topic: str, partition: int, key: bytes | None, value: bytes | None,
                headers: Headers, timestamp: int = 0, landing: Landing | None = None) -> None:
        """Queue one record of the open transaction; `timestamp` (ms) 0 = the producer's clock; `landing`: told
        where it landed (its delivery report).

        While the batch's offsets are still being sent into the transaction (`send_offsets`), the record waits here,
        not in librdkafka: a record queued there registers its partition with the coordinator at once, and a
        registration refused because the previous transaction's markers are still being written costs a fixed
        20 ms (RETRY_BACKOFF_MS's note). Once the offsets call returned, the coordinator takes the registration:
        the waiting records go first, in their order."""
        sending = self._sending
        if sending is not None:
            if not sending.done.is_set():
                self._waiting.append((topic, partition, key, value, headers, timestamp, landing))
                return
            if self._waiting:
                self._produce_waiting()
        try:
            if landing is None:
                self._produce(topic, value, key, partition, headers=headers, timestamp=timestamp)
            else:
                self._produce(topic, value, key, partition, headers=headers, timestamp=timestamp,
                              on_delivery=landing)
        except BufferError:  # the local queue is full: serve delivery reports until there is room
            kafka_clients.produce(self.producer, topic, value, key, headers, partition=partition, timestamp=timestamp,
                                  on_delivery=landing)
        except KafkaException as e:
            raise self._produce_failed(e) from e

    def _produce_failed(self, e: KafkaException) -> Exception:
        """What a refused produce raises. librdkafka refuses with _FATAL ("the producer is in a fatal state"),
        which names no cause, when the offsets call running beside it (send_offsets) met that cause first, e.g. a
        newer instance's fence: that call is waited for, so its error, naming the cause, is the one raised."""
        if e.args[0].code() == KafkaError._FATAL and self._sending is not None:
            self._offsets_sent()  # raises the fence (or the fatal error) the offsets call met
        return _convert(e, "produce")

    def produce_events(self, topic: str, partition: int, events: list[Encoded], timestamp: int = 0
                       ) -> Landing | None:
        """Queue one command's events (the partition's last one held back, see the module note); the Landing of
        the partition's last event at commit (None when there are none)."""
        if not events:
            return None
        at = (topic, partition)
        landing, held = self._last.get(at) or (Landing(topic, partition, self._next.get(at)), None)
        if held is not None:
            self.produce(topic, partition, *held)
        for key, value, headers in events[:-1]:
            self.produce(topic, partition, key, value, headers, timestamp)
        key, value, headers = events[-1]
        self._last[at] = (landing, (key, value, headers, timestamp))
        landing.count += len(events)
        return landing

    def _produce_waiting(self) -> None:
        """Produce the records that waited for the offsets (`produce`), in their order."""
        waiting, self._waiting = self._waiting, []
        for record in waiting:
            self.produce(*record)

    def _produce_last(self) -> list[Landing]:
        """Produce each partition's held-back last event with its delivery report; their Landings."""
        landings = []
        for (topic, partition), (landing, held) in self._last.items():
            assert held is not None
            key, value, headers, timestamp = held
            try:
                self._produce(topic, value, key, partition, headers=headers, timestamp=timestamp,
                              on_delivery=landing)
            except BufferError:
                kafka_clients.produce(self.producer, topic, value, key, headers, partition=partition,
                                      timestamp=timestamp, on_delivery=landing)
            except KafkaException as e:
                raise self._produce_failed(e) from e
            landings.append(landing)
        self._last.clear()
        return landings

    def produce_result(self, topic: str, partition: int, result: Result, events: Landing | None,
                       timestamp: int = 0, trace: Sequence[tuple[str, bytes]] | None = None,
                       events_at: tuple[str, int] | None = None) -> None:
        """Queue `result`, produced at commit with the token of `events` (its command's last event); `trace`:
        trace-context headers to add (kafold.tracing); `events_at`: a duplicate's events partition (its token when
        the first decision's is not remembered, see the module note).

        Produced at once when its token is known now (its events' offsets predicted, or none needed) and no result
        of the batch waits for the events' delivery before it (the module note); else held until commit."""
        if not self._results:
            ident = (result.aggregate_id, result.command_id)
            token: str | None = None
            if events is not None:
                if events.base is None:  # not predicted: the token is known once the events are delivered
                    self._results.append((topic, partition, result, events, timestamp, trace, events_at))
                    return
                token = encode_token(events.topic, events.partition, events.base + events.count - 1)
                self._committing[ident] = (result.event_ids, token)
            elif result.duplicate and result.event_ids:
                token = self._duplicate_token(ident, result.event_ids, events_at)
            key, value, headers = result.encode(token)
            if trace:
                headers = [*headers, *trace]
            at = (topic, partition)
            held = self._held_results.get(at)
            if held is not None:
                self.produce(topic, partition, *held)
            self._held_results[at] = (key, value, headers, timestamp)
            return
        self._results.append((topic, partition, result, events, timestamp, trace, events_at))

    def _duplicate_token(self, ident: tuple[str, str], event_ids: tuple[str, ...],
                         events_at: tuple[str, int] | None) -> str | None:
        """A duplicate's token: its first decision's, when this writer made it (in this batch or committed), else
        the newest event known committed on its events partition (the module note)."""
        known = self._committing.get(ident) or self._tokens.get(ident)
        if known is not None and known[0] == event_ids:
            return known[1]
        if events_at is not None and events_at in self.ends:
            return encode_token(*events_at, self.ends[events_at])
        return None

    def released(self, topic: str, partition: int) -> None:
        """This instance no longer owns the events partition: another may write there before it comes back, so its
        next offset is not predicted from this writer's last transaction (nor is a misprediction held against it)."""
        self._next.pop((topic, partition), None)
        self._unpredictable.discard((topic, partition))

    def known_end(self, topic: str, partition: int, offset: int) -> None:
        """Events up to `offset` of the partition are committed (a replay reached them)."""
        if offset >= 0 and offset > self.ends.get((topic, partition), -1):
            self.ends[(topic, partition)] = offset

    def _produce_results(self) -> str | None:
        """Produce the held-back events and results (the waiting ones with their tokens); why the transaction cannot
        commit (the caller aborts it), or None: an event not delivered, or not where it was predicted."""
        results, self._results = self._results, []
        landings = self._produce_last()
        reported = []
        for (topic, partition), held in self._held_results.items():  # the results produced at once: the last ones
            x = Landing(topic, partition)
            self.produce(topic, partition, *held, x)
            reported.append(x)
        self._held_results = {}
        if landings:  # one round trip for the batch's events (and the results already produced)
            try:
                left = self.producer.flush(TXN_TIMEOUT_MS / 1000)
            except Exception as e:  # seen when fenced: confluent-kafka raises SystemError out of a delivery report
                log.warning("aggregate.txn_flush_failed", transactional_id=self.transactional_id, error=str(e))
                return "events of the batch not delivered"
            if left or any(x.offset is None for x in landings):
                return "events of the batch not delivered"
            # The results produced at once name offsets predicted before the events landed: checked here, before
            # EndTxn, by each predicted partition's last event (the module note)
            wrong = {f"{x.topic}/{x.partition}": (x.base + x.count - 1, x.offset) for x in landings
                     if x.base is not None and x.offset != x.base + x.count - 1}
            if wrong:
                self._unpredictable.update((x.topic, x.partition) for x in landings if x.base is not None
                                           and x.offset != x.base + x.count - 1)
                log.warning("aggregate.txn_offsets_mispredicted", transactional_id=self.transactional_id,
                            predicted_landed=wrong)
                return "events not at their predicted offsets (another producer wrote to their partitions)"
            for x in landings:
                assert x.offset is not None
                x.token = encode_token(x.topic, x.partition, x.offset)
        batch = self._committing
        self._landed = landings
        last_result: dict[tuple[str, int], int] = {}  # (topic, partition) -> index of its last result
        for i, (topic, partition, *_) in enumerate(results):
            last_result[(topic, partition)] = i
        waiting = {i: Landing(topic, partition) for (topic, partition), i in last_result.items()}
        self._results_landed = [*reported, *waiting.values()]
        for i, (topic, partition, result, landing, timestamp, trace, events_at) in enumerate(results):
            ident = (result.aggregate_id, result.command_id)
            token = None
            if landing is not None:
                token = landing.token
                assert token is not None
                batch[ident] = (result.event_ids, token)
            elif result.duplicate and result.event_ids:
                token = self._duplicate_token(ident, result.event_ids, events_at)
            key, value, headers = result.encode(token)
            if trace:
                headers = [*headers, *trace]
            self.produce(topic, partition, key, value, headers, timestamp, waiting.get(i))
        return None

    def _remember(self) -> None:
        """The committed batch's tokens, for duplicates of its commands (the first remembered forgotten first)."""
        committing, self._committing, tokens = self._committing, {}, self._tokens
        tokens.update(committing)
        landed, self._landed = self._landed, []
        for x in landed:
            assert x.offset is not None
            self.known_end(x.topic, x.partition, x.offset)
            if (x.topic, x.partition) not in self._unpredictable:
                self._next[(x.topic, x.partition)] = x.offset + 2  # after the commit marker (module note)
        reported, self._results_landed = self._results_landed, []
        if reported:
            self.producer.poll(0)  # serve the results' delivery reports the commit's flush queued
        for x in reported:  # committed: the transaction holding the result is; an unserved one leaves it behind
            if x.offset is not None and x.offset + 1 > self.result_ends.get((x.topic, x.partition), 0):
                self.result_ends[(x.topic, x.partition)] = x.offset + 1
        if len(tokens) > REMEMBERED_TOKENS:
            for ident in list(islice(tokens, len(tokens) - REMEMBERED_TOKENS)):
                del tokens[ident]

    def send_offsets(self, offsets: list[TopicPartition], group_metadata: Any) -> None:
        """Start sending the batch's consumed `offsets` into the open transaction, in a helper thread: `commit`
        waits for them (and sends them itself when this was not called). Called right after `begin`, before the
        batch is decided: the transaction's first request to the coordinator (AddOffsetsToTxn) is the one that
        waits while the previous transaction's markers are written (CONCURRENT_TRANSACTIONS, see RETRY_BACKOFF_MS),
        and TxnOffsetCommit follows it: both round trips then run while the commands are decided, and the batch's
        records are produced once they are done (`produce`). Offsets and commits: they belong to the
        transaction whatever the order, committed with its events and results or aborted with them."""
        if offsets:
            self._sending = _Bounded("send_offsets_to_transaction", TIMEOUT_S, lambda: self._retrying(
                lambda t: self.producer.send_offsets_to_transaction(offsets, group_metadata, t)))

    def commit(self, offsets: list[TopicPartition], group_metadata: Any) -> bool:
        """Commit the open transaction with `offsets` (unless `send_offsets` sent them already); False when it had
        to be aborted (nothing visible)."""
        self._landed, self._results_landed = [], []
        if self._sending is None:
            self.send_offsets(offsets, group_metadata)
        # The offsets first: then the coordinator takes the registration of the partitions produced to below (the
        # records held in `produce`, the last events, the results) at once (RETRY_BACKOFF_MS's note). Offsets
        # and commits: they are in the transaction, committed with its records or aborted with them.
        held = self._sending is not None  # records may wait for it (`produce`)
        if not self._offsets_sent():  # a fence or a hang there is raised
            return False  # aborted there
        if held:
            self._produce_waiting()
        failed = self._produce_results() if self._results or self._last or self._held_results else None
        if failed is not None:
            log.warning("aggregate.txn_aborting", transactional_id=self.transactional_id, error=failed)
            self.abort()
            return False
        try:
            self._retrying(self.producer.commit_transaction, DECIDED_S)
            self._remember()
            return True
        except KafkaException as e:
            err = e.args[0]
            if err.fatal() or err.code() in FENCED or not err.txn_requires_abort():
                raise _convert(e, "commit") from e
            log.warning("aggregate.txn_aborting", transactional_id=self.transactional_id, error=str(err))
            self.abort()
            return False
        finally:
            self.open = False

    def _offsets_sent(self) -> bool:
        """Wait for the offsets being sent into the transaction (if any); False when it was aborted."""
        try:
            self._join_sending()
        except KafkaException as e:
            err = e.args[0]
            if err.fatal() or err.code() in FENCED:
                self.open = False
                raise _convert(e, "commit") from e
            # The transaction coordinator's broker died or stayed out of reach: nothing of the transaction was
            # committed yet (the commit never started), so aborting it is safe and the batch is decided again.
            log.warning("aggregate.txn_aborting", transactional_id=self.transactional_id, error=str(err))
            self.abort()
            return False
        return True

    def _join_sending(self) -> None:
        """Wait for the offsets being sent (if any): raises what that call raised; a hang (FatalError) leaves the
        producer held, so close does not touch it (the broker aborts the transaction)."""
        sending, self._sending = self._sending, None
        if sending is None:
            return
        try:
            sending.join()
        except FatalError:
            self.open = False
            self.held = True
            raise

    def abort(self) -> None:
        self._results.clear()
        self._last.clear()
        self._held_results, self._committing = {}, {}
        # The aborted records took offsets (and an abort marker) wherever they landed: nothing predicted until a
        # committed transaction tells again
        self._next = {}
        self._waiting = []
        try:  # librdkafka refuses an abort while another transactional call is in progress
            self._join_sending()
        except KafkaException as e:  # the transaction is aborted below whatever this was
            log.info("aggregate.txn_offsets_not_sent", transactional_id=self.transactional_id, error=str(e))
        try:
            self._retrying(self.producer.abort_transaction, DECIDED_S)
        except KafkaException as e:
            raise _convert(e, "abort") from e
        finally:
            self.open = False

    def _retrying(self, op: Any, within_s: float | None = None) -> None:
        """`op(timeout)` again on a retriable error until `within_s` (default TIMEOUT_S) has passed.

        Not kafold.retry.retrying: each try is given what is left of the budget as its own timeout (the call blocks
        inside librdkafka that long, waiting for the coordinator itself), and a retriable answer is asked again at
        once — librdkafka documents retriable errors of these calls as "call again", with no backoff of ours."""
        deadline = time.monotonic() + (TIMEOUT_S if within_s is None else within_s)
        while True:
            try:
                op(max(0.1, min(TIMEOUT_S, deadline - time.monotonic())))
                return
            except KafkaException as e:
                err = e.args[0]
                if err.retriable() and not err.fatal() and time.monotonic() < deadline:
                    continue
                raise

    def close(self) -> None:
        """Abort an open transaction and close the producer, never blocking the stop for good: a producer held by a
        blocked call is left to the process's exit (closing it would wait behind that call), and the close itself
        runs bounded, as any call on a producer that met such a hang may block too."""
        if self.held:
            log.warning("aggregate.txn_producer_left_open", transactional_id=self.transactional_id,
                        reason="a blocked librdkafka call holds it; the broker aborts its transaction")
            return
        if self.open:
            try:
                self.abort()
            except Exception as e:
                log.warning("aggregate.txn_abort_on_close_failed", error=str(e))
        try:
            _bounded("close", CLOSE_FLUSH_S, lambda: kafka_clients.close_producer(self.producer, CLOSE_FLUSH_S),
                     grace_s=CLOSE_FLUSH_S)
        except Exception as e:
            log.warning("aggregate.txn_close_failed", transactional_id=self.transactional_id, error=str(e))


# A newer producer with our transactional.id exists: we are the zombie. Whatever flag the broker's error carries,
# nothing this instance does can succeed any more, so it stops rather than trying to abort.
FENCED = frozenset({KafkaError._FENCED, KafkaError.PRODUCER_FENCED, KafkaError.INVALID_PRODUCER_EPOCH})


class _Bounded:
    """`call()` started in a helper thread; `join` waits for it `timeout_s` + `grace_s` (default HANG_GRACE_S) from
    the start and raises FatalError if it has not returned (the thread is left behind: a blocked librdkafka call
    cannot be cancelled), or what the call raised."""

    def __init__(self, doing: str, timeout_s: float, call: Any, grace_s: float | None = None) -> None:
        self.doing, self.done, self.failure = doing, threading.Event(), list[BaseException]()
        self.bound_s = timeout_s + (HANG_GRACE_S if grace_s is None else grace_s)
        self.until, self.call = time.monotonic() + self.bound_s, call
        threading.Thread(target=self._run, daemon=True, name=f"kafold-txn-{doing}").start()

    def _run(self) -> None:
        try:
            self.call()
        except BaseException as e:
            self.failure.append(e)
        finally:
            self.done.set()

    def join(self) -> None:
        if not self.done.wait(max(0.0, self.until - time.monotonic())):
            raise FatalError(f"transactional producer {self.doing} did not return within {self.bound_s:.0f}s "
                             "(a librdkafka hang after the group coordinator's broker went away); this instance must "
                             "restart")
        if self.failure:
            raise self.failure[0]


def _bounded(doing: str, timeout_s: float, call: Any, grace_s: float | None = None) -> None:
    """`call()` in a helper thread, waited for as `_Bounded.join` does."""
    _Bounded(doing, timeout_s, call, grace_s).join()


def _convert(e: KafkaException, doing: str) -> Exception:
    err = e.args[0]
    if err.code() in FENCED:
        return FatalError(f"transactional producer {doing} failed (fenced: this instance must stop): {err.str()}")
    if err.fatal():
        return ProducerBroken(f"transactional producer {doing} failed (fatal: the producer is replaced): "
                              f"{err.str()}")
    if err.retriable():
        return RetriableError(f"transactional producer {doing} failed: {err.str()}")
    return FatalError(f"transactional producer {doing} failed: {err.str()}")
