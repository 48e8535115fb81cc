"""AggregateRuntime: the catch-up gate, then exactly-once command processing for one aggregate type.

Offsets and commits
-------------------
The commands topic is consumed in the group `<group_prefix>.aggregate.<name>` with auto-commit off and
read_committed. Each assigned commands partition is paused and gets a `PartitionGate`: its events partition
(same number; the topics are co-partitioned) is restored (a `recovery.Restorer`: the latest usable snapshot when
the aggregate has a snapshot topic, restorer.py, else a full replay) and its tail replayed to the end (see gate.py)
before the partition resumes. A command fetched from a
partition that is not LIVE is never decided: the partition is sought back to it.

A batch (the commands fetched, handed over at once: natural batching, up to `batch_max_records`; see
kafold.consumer_loop) is one transaction (txn.py): the events
(written to the command's partition number of the events topic, versions consecutive per aggregate, ids
`derive_event_id(command_id, i)`), one result per command (same partition of the results topic), dead letters,
and the offsets after the batch. A crash before the commit aborts all of it: the commands are read again and
decided on the state rebuilt from committed events only, so no event is written twice. If the commit is
aborted, the consumer is sought back to the batch's first offsets and the touched states are restored from an
undo log.

The idempotency window (window.py) answers a command id decided within `idempotency_window_s` (by command time)
with its first outcome and no new events, accepted or rejected. It is rebuilt wherever states are: from the
snapshot that seeds a partition (snapshots carry it), from the replayed events' causation ids, and from the
results partition of the same number (rejections, acceptances without events) before a partition opens; an
evicted aggregate gets it back with its state; a rebalance rebuilds it on the instance taking the partition over.

With a local state store (`daemon.state_dir`, local.py) the LRU is its hot cache: an evicted aggregate and an id
whose outcome left memory are read back from it, never by scanning Kafka. It is written after each committed
transaction (so it can only lag the committed events) and trusted on assignment up to the events offset it records;
the tail past it is replayed as after a snapshot (local.py's note).

The parts: this class owns the consumer, the transactional producer and each batch's transaction; `CatchUp`
(catchup.py) runs the gates from assignment to LIVE; `Decider` (decide.py) decides a batch's commands into the
open transaction; `Forgetting` (forgetting.py) evicts the states of forgotten subjects between batches. They share
the runtime's dicts (gates, positions, counts) handed down at construction, and the producer per call.

The poll loop (the consumer, the poll, the subscription, fatal consumer errors, the shutdown call) is
`kafold.consumer_loop`'s; this runtime is its batch handler. The loop commits nothing: the offsets are committed
only in a batch's transaction, as above; a revoked or lost partition is dropped without a commit.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import lmdb
from confluent_kafka import TopicPartition as KTP

from kafold import kafka_clients, logs, protect, topics
from kafold.config import AggregateConfig, DaemonConfig, KafkaConfig, TopicSpec
from kafold.consumer_loop import ConsumerLoop, LoopHandler
from kafold.daemon.aggregates import recovery, routing
from kafold.daemon.aggregates.catchup import CatchUp, restore_base
from kafold.daemon.aggregates.decide import Decider, Undo, decode
from kafold.daemon.aggregates.forgetting import Forgetting
from kafold.daemon.aggregates.gate import PartitionGate
from kafold.daemon.aggregates.heap import HeapTrim
from kafold.daemon.aggregates.local import LocalStates, local_states
from kafold.daemon.aggregates.startup import StartUp
from kafold.daemon.aggregates.store import StateStore
from kafold.daemon.aggregates.txn import ProducerBroken, TransactionalWriter
from kafold.daemon.aggregates.window import Window
from kafold.domain import AggregateDomain
from kafold.errors import FatalError, RetriableError
from kafold.interpreter import freeze_startup
from kafold.kafka_message import Message
from kafold.messages import Command
from kafold.partitioning import partition_for

log = logs.get(__name__)
T = TypeVar("T")

ASSIGN_RETRY_S = 120.0  # well under the default rebalance timeout (max.poll.interval.ms, 300 s)
START_RETRY_S = 120.0  # a broker's restart or a controller election, several times over
HOLD_POLL_S = 0.05  # while deciding is held (startup.py's HOLDING), between two polls
# librdkafka's prefetch queue of commands: ~12k commands, 6 batches of 2,000 ahead (its default, 64 MB, held a backlog
# in each worker's memory; 16 MB kept ~50k, for no throughput measured: docs/benchmarks.md, issue 56)
COMMAND_PREFETCH_KBYTES = 4096
COMMAND_FETCH_KBYTES = 1024  # per partition per fetch (max.partition.fetch.bytes): a fetch response is held whole
# until the last of its messages is freed, so it counts on top of the queue


def dlq_topic(agg: AggregateConfig) -> str:
    return agg.dlq_topic


class AggregateRuntime(LoopHandler):
    """Runs one aggregate type in the calling thread until `stop()`; raises FatalError if it must stop."""

    def __init__(self, kafka: KafkaConfig, daemon: DaemonConfig, agg: AggregateConfig, domain: AggregateDomain,
                 *, instance_id: str, restorer: recovery.Restorer | None = None,
                 stop: threading.Event | None = None, consumer_extra: dict[str, Any] | None = None,
                 startup: StartUp | None = None, after_batch: Callable[[], None] | None = None) -> None:
        self.kafka, self.daemon, self.agg, self.domain = kafka, daemon, agg, domain
        # Its start beside the sibling worker processes of its daemon (startup.py): built, it waits to join the
        # group with them; joined, every batch fetched is sought back (as a recovering partition's is) until it may
        # decide. A runtime that is no worker decides from the start.
        self.startup = startup or StartUp.without_siblings(agg.name)
        self.after_batch = after_batch  # called after each committed batch (a worker process reports its counts)
        self.restorer = restorer or recovery.FullReplay()
        self.stop_event = stop or threading.Event()
        self.group_id = f"{daemon.group_prefix}.aggregate.{agg.name}"
        self.transactional_id = f"{self.group_id}.{instance_id}"
        self.topics = {k: agg.topic(k) for k in ("commands", "events", "results")}
        self.dlq = dlq_topic(agg)
        self.consumer_extra = dict(consumer_extra or {})
        self.window_ms = int(agg.idempotency_window_s * 1000)
        self.local: LocalStates | None = local_states(daemon, agg, domain, self.window_ms)  # None: no state_dir
        window = Window(self.window_ms, agg.window_max_ids(self.local is not None))
        self.store = StateStore(agg.cache_max_aggregates, window, self.local)
        self.store.window.on_disk = self.local is not None
        self.store.window.keep = self.local.keep if self.local is not None else None
        self.heap = HeapTrim()  # freed native memory back to the OS between batches (heap.py)
        self.gates: dict[int, PartitionGate] = {}  # read by the daemon (status, metrics, reads) and the tests
        # Per partition, the commands offset below which everything is decided and committed (the group's
        # committed offset when the gate opened, then each committed transaction's): a record below it fetched
        # again is skipped (handle_batch).
        self.positions: dict[int, int] = {}
        # The open transaction's undo log: the committed (state, version) of every aggregate it changed. State reads
        # (another thread) answer from it, so they never show a decision that may yet abort; replaced by an empty
        # one once the transaction committed or its changes were reverted.
        self.uncommitted: Undo = {}
        self.counts = dict.fromkeys(("batches", "commands", "accepted", "rejected", "dead_lettered", "duplicates",
                                     "events", "aborts", "assignments", "reloads", "producers_renewed",
                                     "fold_errors", "events_parked", "refetched",
                                     "recovery_results_read"), 0)
        self.renewed = False  # a producer was renewed and no batch has committed since: a second break stops
        self.loop = ConsumerLoop(self, stop=self.stop_event, max_records=daemon.batch_max_records,
                                 wait_s=daemon.batch_max_wait_ms / 1000, counts=self.counts,
                                 fatal=lambda err: f"commands consumer: {err.str()}")
        self.reader: Any = None
        self.writer: TransactionalWriter | None = None
        self.catch_up: CatchUp | None = None  # made once the consumer exists (loop_started)
        self.joined = False
        self.error: BaseException | None = None
        self.log = log.bind(aggregate=agg.name)
        self.decider = Decider(agg, domain, self.store, self.gates, self.window_ms, self.log)
        self.forgetting = Forgetting(agg.name, domain, self.store, self.log)

    # ---- queries (any thread) ---------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        """Joined the group and every assigned partition is LIVE."""
        return self.joined and all(g.live for g in list(self.gates.values()))

    def partitions(self) -> list[dict[str, object]]:
        return [g.describe() for g in sorted(list(self.gates.values()), key=lambda g: g.partition)]

    def get(self, aggregate_id: str) -> tuple[Any, int, str] | None:
        """(state, version, where it was read from) of an aggregate of a LIVE partition: "memory" (the cache),
        "store" (not cached: the local state store) or "events" (evicted, no local store: rebuilt from its events
        partition). None = unknown here (not assigned to this
        instance, still recovering, or no events yet)."""
        entry, partition = self.store.locate(aggregate_id)
        if entry is not None:
            gate = self.gates.get(entry.partition)
            # The entry first: the runtime notes an aggregate's committed values in `uncommitted` before it changes
            # the entry, so a changed entry read here always has its committed values there.
            state, version = entry.state, entry.version
            pending = self.uncommitted.get(aggregate_id)
            if pending is not None:
                if pending[0] is None:  # first decided in the open transaction: no committed state yet
                    return None
                state, version = pending[0]
            live = gate is not None and gate.live and version > 0
            return (state, version, "memory") if live else None
        if self.local is not None:
            return self._get_local(aggregate_id)
        if partition is None:
            return None
        private = StateStore(1)
        reader = recovery.reader(self.kafka, self.agg.name)
        try:
            recovery.reload(reader, self.topics["events"], self.domain, private, partition, {aggregate_id})
        finally:
            reader.close()
        found, _ = private.locate(aggregate_id)
        return (found.state, found.version, "events") if found is not None and found.version else None

    def _get_local(self, aggregate_id: str) -> tuple[Any, int, str] | None:
        """An aggregate not cached, read from the local store of its LIVE partition (committed states only)."""
        assert self.local is not None
        n = partition_for(aggregate_id.encode(), self.agg.partitions)
        gate = self.gates.get(n)
        if gate is None or not gate.live:
            return None
        try:
            found = self.local.load(n, aggregate_id)
        except lmdb.Error:  # the partition was released meanwhile (its store closed)
            return None
        return (found.state, found.version, "store") if found is not None else None

    def idempotency(self) -> dict[str, int]:
        """The idempotency window's figures: ids held, expired, dropped early (beyond idempotency_max_ids)."""
        return {**self.store.window_figures(), "window_s": self.window_ms // 1000}

    def figures(self) -> dict[str, float]:
        """What /metrics shows of this runtime besides its counts: the idempotency window's ids held in memory,
        expired and dropped early; with a local store, its bytes on disk and its reads."""
        w = self.store.window
        out = {"window_ids": float(len(w.times)), "window_expired": float(w.expired),
               "window_dropped_early": float(w.dropped_early)}
        if self.local is not None:
            out.update(local_store_bytes=float(self.local.disk_bytes()), local_store_reads=float(self.local.reads))
        return out

    def get_state(self, aggregate_id: str) -> Any:
        """The domain state of one aggregate, or None (thread-safe; served at GET /aggregates/{name}/{id})."""
        got = self.get(aggregate_id)
        return None if got is None else got[0]

    def stop(self) -> None:
        self.stop_event.set()

    # ---- the loop (kafold.consumer_loop: this runtime is its batch handler) ------------------------------
    def run(self) -> None:
        """Start, then recover and decide until stopped; an error is logged, kept in `error` and raised."""
        self.loop.run()

    def loop_started(self) -> None:
        self._start()
        # The domain, the store and the clients made by `_start` frozen out of the cyclic collector with the rest
        # (in the daemon's process that froze its own start, or in an aggregate worker process).
        freeze_startup()
        self.catch_up = CatchUp(self.kafka, self.agg, self.domain, self.store, self.local, consumer=self.consumer,
                                reader=self.reader, gates=self.gates, positions=self.positions, counts=self.counts,
                                restore=self._restore, retrying=self._retrying,
                                auto_offset_reset=self.consumer_extra.get("auto.offset.reset", "earliest"),
                                log=self.log)

    def forget(self, aggregate_id: str) -> None:
        """A forgotten subject (kafold.protect) that is this aggregate's id: its cached state (folded while the key
        existed) is evicted between two batches, on this runtime's thread, so it is reloaded with placeholders."""
        self.forgetting.forget(aggregate_id)

    def before_poll(self) -> float | None:
        """Evict forgotten states; stop on a local store found damaged; fold one fetch of events while a partition
        recovers; the poll then does not wait (the gates)."""
        self.forgetting.between_batches()
        if self.local is not None and self.local.damaged:  # found by a read on any thread (local.py's note)
            raise FatalError(next(iter(self.local.damaged.values())))
        if self.catch_up is not None and self.catch_up.recovering:
            assert self.writer is not None
            self.catch_up.step(self.writer)
            return 0.0
        return None

    def on_failure(self, error: Exception) -> bool:
        self.error = error
        self.log.error("aggregate.failed", error_class=type(error).__name__, error=str(error),
                       exc_info=not isinstance(error, FatalError))
        return False  # raised from run: the daemon decides (the aggregate's slot fails)

    def _start(self) -> None:
        rf = self.kafka.replication_factor
        specs = [TopicSpec(t, self.agg.partitions, rf, self.agg.topic_configs(k)) for k, t in self.topics.items()]
        snapshots = TopicSpec(self.agg.topic("snapshot"), self.agg.partitions, rf, self.agg.topic_configs("snapshot"))
        wanted = [*specs, snapshots, TopicSpec(self.dlq, 1, rf, self.agg.topic_configs("dlq"), purpose="dead-letter")]

        # A broker restarting or a controller failing over while the daemon starts (a rolling restart of the
        # cluster) is waited out rather than ending the daemon.
        self._retrying("aggregate.start_retrying", lambda: topics.ensure(self.kafka, wanted), START_RETRY_S)
        self.writer = self._retrying("aggregate.start_retrying",
                                     lambda: TransactionalWriter(self.kafka, self.transactional_id), START_RETRY_S)
        self.reader = recovery.reader(self.kafka, self.agg.name)
        extra = {"isolation.level": "read_committed", "enable.auto.offset.store": False,
                 "fetch.wait.max.ms": 50, "max.partition.fetch.bytes": COMMAND_FETCH_KBYTES * 1024,
                 # librdkafka's prefetch queue (its default, 64 MB, held a backlog of queued commands in each
                 # worker's memory): a few batches ahead of the loop, refilled every 10 ms (as daemon/runner.py's)
                 "queued.max.messages.kbytes": COMMAND_PREFETCH_KBYTES, "fetch.queue.backoff.ms": 10,
                 # the group's description then tells every instance where this one serves state (routing.py)
                 # (signed with the instance secret: the others send reads only to an address that verifies)
                 "client.id": routing.member_client_id(self.kafka.client_id, routing.advertised_url(self.daemon),
                                                       self.group_id, routing.InstanceKey.of(self.daemon)),
                 **self.consumer_extra}
        self.consumer = kafka_clients.consumer(self.kafka, self.group_id, **extra)
        self.startup.built(self.stop_event)  # a worker: waits here to join the group with its siblings
        # A lost partition is released as a revoked one: its transaction's offsets were committed with it or not.
        self.loop.subscribe([self.topics["commands"]], self._on_assign, self._on_revoke, self._on_revoke)
        protector = self.domain.protector
        if protector is not None and protector.for_aggregate(self.agg.name) is not None:
            self.forgetting.watch = self._retrying("aggregate.start_retrying",
                                           lambda: protect.ErasureWatch(protector.ring.store), START_RETRY_S)
        self.log.info("aggregate.started", group=self.group_id, transactional_id=self.transactional_id,
                      fingerprint=self.domain.fingerprint)

    # ---- recovery (catchup.py) -------------------------------------------------------------------------
    def _on_assign(self, consumer: Any, partitions: list[Any]) -> None:
        kafka_clients.rebalance_assign(self.kafka, consumer, partitions)  # incremental with KIP-848
        self._recover(partitions)

    def _recover(self, partitions: list[Any]) -> None:
        assert self.catch_up is not None
        self.catch_up.assign(partitions)
        self.joined = True  # after the gates exist: `ready` must not see a joined runtime without them

    def _restore(self, events: str, n: int) -> tuple[int, int, Any]:
        """(first offset, the gate's end, the restored base) of partition `n` (catchup.restore_base)."""
        return restore_base(self.kafka, self.agg, self.reader, self.local, self.restorer, events, n)

    def _retrying(self, event: str, step: Callable[[], T], within_s: float = ASSIGN_RETRY_S, **fields: Any) -> T:
        """`step`, its RetriableErrors (the broker paused or unreachable) logged as `event` and retried with backoff
        for up to `within_s` (while assigning, the group keeps the membership: heartbeats run in the background),
        then raised; raised at once when the runtime is stopping."""
        def warn(e: RetriableError, delay: float) -> None:
            self.log.warning(event, **fields, error=str(e), retry_in_s=delay)

        return self.loop.retrying(step, warn, within_s=within_s, first_delay=0.5)

    def _on_revoke(self, consumer: Any, partitions: list[Any], *, renewing: bool = False) -> None:
        """Release `partitions` (the consumer's revoke callback); see CatchUp.release."""
        if self.writer is not None:  # another instance may write their events before they come back (txn.py)
            for p in partitions:
                self.writer.released(self.topics["events"], p.partition)
        if self.catch_up is not None:
            self.catch_up.release(partitions, renewing=renewing)

    # ---- commands ---------------------------------------------------------------------------------------
    def handle_batch(self, msgs: list[Message]) -> None:
        """One batch of commands as one transaction."""
        started = time.monotonic()
        live: list[Any] = []
        rewind: dict[int, int] = {}
        refetched: dict[int, list[int]] = {}
        held = not self.startup.may_decide()
        for m in msgs:
            if m.error() is not None:
                self.loop.consumer_error(m.error())  # a fatal one ends the run before anything is decided
                continue
            n = m.partition()
            gate = self.gates.get(n)
            if held or gate is None or not gate.may_decide():
                rewind.setdefault(n, m.offset())  # fetched before the pause (or while held): read it again later
            elif m.offset() < self.positions.get(n, 0):
                refetched.setdefault(n, []).append(m.offset())
            else:
                live.append(m)
        for n, off in rewind.items():
            if n in self.gates:
                self.consumer.seek(KTP(self.topics["commands"], n, off))
        for n, skipped in refetched.items():
            # Decided and committed (their results are out): deciding them again would only answer them twice.
            # Not expected of a consumer; counted and logged so that it shows.
            self.counts["refetched"] += len(skipped)
            self.log.warning("aggregate.refetched_skipped", partition=n, first=skipped[0], last=skipped[-1],
                             records=len(skipped), position=self.positions[n])
        if held:
            self.startup.may_decide(HOLD_POLL_S)  # not a busy loop of fetches sought back
        if not live:
            return
        decoded = [decode(m) for m in live]
        if self.local is not None:  # not cached: read back from the local store, never by a partition scan
            self.local.read_back(self.store, [(m.partition(), c.aggregate_id, c.command_id)
                                              for m, c in zip(live, decoded, strict=True) if isinstance(c, Command)])
        else:
            self._reload_missing(live)
        if self.domain.protector is not None:  # the batch's data keys at once, not a round trip per new subject
            ids = {k.decode("utf-8", "replace") for m in live if (k := m.key())}
            self.domain.protector.prepare_writing(self.agg.name, ids, [i for i in ids if self.store.get(i) is None])
        assert self.writer is not None
        undo: Undo = {}
        self.uncommitted = undo
        try:
            self.writer.begin()
            # Offsets and commits: the commands' next offsets are committed in the batch's own transaction; sent
            # before the batch is decided, so that their round trips to the coordinators overlap the deciding (txn.py)
            offsets = [KTP(self.topics["commands"], n, off) for n, off in
                       {m.partition(): m.offset() + 1 for m in live}.items()]
            group_metadata = self.consumer.consumer_group_metadata()
            self.writer.send_offsets(offsets, group_metadata)
            first, last, tally = self.decider.decide(self.writer, live, decoded, undo)
            decided = time.monotonic()
            committed = self.writer.commit(offsets, group_metadata)
        except ProducerBroken as e:
            self._renew_writer(e)
            self.uncommitted = {}
            return
        if not committed:
            self._rewind(first, undo)
            self.uncommitted = {}
            return
        self.uncommitted = {}
        self.renewed = False
        self.positions.update(last)
        if self.local is not None:  # after the commit, never before: the store can only lag (local.py's note)
            self.local.write_batch(self.store, {aid: cids for aid, (_, cids) in undo.items()}, self.writer.ends,
                                   self.topics["events"], self.writer.result_ends, self.topics["results"])
        self.store.trim()
        self.heap.after_batch()
        self.counts["batches"] += 1
        self.counts["commands"] += len(live)
        for k, v in tally.items():
            self.counts[k] += v
        self.log.info("aggregate.batch", commands=len(live), **tally, partitions=sorted(last),
                      duration_ms=round((time.monotonic() - started) * 1000, 1),
                      commit_ms=round((time.monotonic() - decided) * 1000, 1))
        if self.after_batch is not None:
            self.after_batch()

    def _reload_missing(self, msgs: list[Message]) -> None:
        """Rebuild evicted aggregates of this batch from Kafka before deciding on them."""
        if not self.store.has_evicted():  # the cache holds every aggregate met: no record to look at
            return
        wanted: dict[int, set[str]] = {}
        for m in msgs:
            key = m.key()
            if key is None:
                continue
            aid = key.decode("utf-8", "replace")
            if self.store.missing(m.partition(), aid):
                wanted.setdefault(m.partition(), set()).add(aid)
        if not wanted:
            return
        reader = recovery.reader(self.kafka, self.agg.name)
        try:
            for n, ids in wanted.items():
                recovery.reload(reader, self.topics["events"], self.domain, self.store, n, ids,
                                results=self.topics["results"])
                self.counts["reloads"] += len(ids)
        finally:
            reader.close()

    def _rewind(self, first: dict[int, int], undo: Undo) -> None:
        """After an aborted transaction: restore the touched states (and take their outcomes back out of the
        window) and read the batch's commands again."""
        self.counts["aborts"] += 1
        self.store.revert(undo)
        for n, off in first.items():
            if n in self.gates:
                self.consumer.seek(KTP(self.topics["commands"], n, off))
        self.log.warning("aggregate.batch_aborted", partitions=sorted(first), rewound_to=first)

    def _renew_writer(self, error: ProducerBroken) -> None:
        """Replace a producer librdkafka reported broken (see txn.ProducerBroken) and recover every assigned
        partition again, as a restart of this instance would, without stopping the daemon's other tasks. A second
        break before any batch commits stops the runtime (the daemon fails fast; its supervisor restarts it)."""
        assert self.writer is not None and self.consumer is not None
        if self.renewed:
            raise error
        self.renewed = True
        self.counts["producers_renewed"] += 1
        partitions = [KTP(self.topics["commands"], n) for n in sorted(self.gates)]
        self.log.warning("aggregate.producer_renewing", error=str(error), partitions=[p.partition for p in partitions])
        self._on_revoke(self.consumer, partitions, renewing=True)
        broken, self.writer = self.writer, None
        broken.open = False  # nothing to abort on a broken producer: the new one's init_transactions ends it
        broken.close()
        self.writer = self._retrying("aggregate.start_retrying",
                                     lambda: TransactionalWriter(self.kafka, self.transactional_id), START_RETRY_S)
        self._recover(partitions)

    def loop_stopped(self) -> None:
        for what, close in (("writer", self.writer.close if self.writer else None),
                            ("consumer", self.consumer.close if self.consumer else None),
                            ("reader", self.reader.close if self.reader else None),
                            ("local state store", self.local.close_all if self.local else None)):
            if close is None:
                continue
            try:
                close()
            except Exception as e:
                self.log.error("aggregate.close_failed", what=what, error=str(e))
        self.log.info("aggregate.stopped", failed=self.error is not None, **self.counts)
