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

The poll loop (the consumer, the poll, the subscription, fatal consumer errors, the shutdown call) is
`kafold.consumer_loop`'s; this runtime is its batch handler. The loop commits nothing: the offsets are committed
only in a batch's transaction, as above; a revoked or lost partition is dropped without a commit.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

import lmdb
from confluent_kafka import OFFSET_BEGINNING, TIMESTAMP_NOT_AVAILABLE, KafkaError, KafkaException
from confluent_kafka import TopicPartition as KTP

from kafold import kafka_clients, logs, protect, topics, tracing
from kafold.config import AggregateConfig, DaemonConfig, KafkaConfig, TopicSpec
from kafold.connectors.api import RawRecord
from kafold.connectors.dlq import dlq_headers, fitted
from kafold.consumer_loop import ConsumerLoop, LoopHandler
from kafold.daemon.aggregates import recovery, routing
from kafold.daemon.aggregates.gate import PartitionGate
from kafold.daemon.aggregates.local import LocalStates, local_states
from kafold.daemon.aggregates.processor import handle
from kafold.daemon.aggregates.store import Entry, StateStore
from kafold.daemon.aggregates.txn import ProducerBroken, TransactionalWriter
from kafold.daemon.aggregates.window import Window
from kafold.domain import AggregateDomain
from kafold.envelope import format_epoch_ms
from kafold.errors import DecodeError, FatalError, RecordError, RetriableError
from kafold.fold import Folder, FoldError, Parked
from kafold.kafka_message import Message
from kafold.messages import REJECTED, Command, Result, decode_command, header
from kafold.partitioning import partition_for
from kafold.stages import folding_reason

log = logs.get(__name__)
T = TypeVar("T")

RECOVERY_BATCH = 20000
COMMITTED_TIMEOUT_S = 10.0
ASSIGN_RETRY_S = 120.0  # well under the default rebalance timeout (max.poll.interval.ms, 300 s)
START_RETRY_S = 120.0  # a broker's restart or a controller election, several times over
ERASURES_CHECK_S = 2.0  # how often a runtime with protected fields looks for forgets made by other processes
CLOCK_SKEW_MS = 60_000  # a command time further ahead of this host's clock is taken as this host's clock


def command_time(m: Any, now_ms: int) -> int:
    """A command's time (ms): its record's timestamp, or `now_ms` when it has none or one from the future (a
    client clock far ahead must not push every other id out of the window)."""
    kind, ts = m.timestamp()
    return ts if kind != TIMESTAMP_NOT_AVAILABLE and 0 < ts <= now_ms + CLOCK_SKEW_MS else now_ms


# Per aggregate touched in a batch: (state, version) as committed (None: new in this batch), command ids decided
Undo = dict[str, tuple[tuple[Any, int] | None, list[str]]]


def dlq_topic(agg: AggregateConfig) -> str:
    return agg.dlq_topic


class AggregateRuntime(LoopHandler):
    """Runs one aggregate type in the calling thread until `stop()`; raises FatalError if it must stop."""

    def __init__(self, kafka: KafkaConfig, daemon: DaemonConfig, agg: AggregateConfig, domain: AggregateDomain,
                 *, instance_id: str, restorer: recovery.Restorer | None = None,
                 stop: threading.Event | None = None, consumer_extra: dict[str, Any] | None = None) -> None:
        self.kafka, self.daemon, self.agg, self.domain = kafka, daemon, agg, domain
        self.restorer = restorer or recovery.FullReplay()
        self.stop_event = stop or threading.Event()
        self.group_id = f"{daemon.group_prefix}.aggregate.{agg.name}"
        self.transactional_id = f"{self.group_id}.{instance_id}"
        self.topics = {k: agg.topic(k) for k in ("commands", "events", "results")}
        self.dlq = dlq_topic(agg)
        self.consumer_extra = dict(consumer_extra or {})
        self.window_ms = int(agg.idempotency_window_s * 1000)
        self.local: LocalStates | None = local_states(daemon, agg, domain, self.window_ms)  # None: no state_dir
        self.store = StateStore(agg.cache_max_aggregates, Window(self.window_ms, agg.idempotency_max_ids), self.local)
        self.store.window.on_disk = self.local is not None
        self.gates: dict[int, PartitionGate] = {}
        self.folders: dict[int, Folder[recovery.Recovering]] = {}
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
                                     "fold_errors", "events_parked", "refetched"), 0)
        self.renewed = False  # a producer was renewed and no batch has committed since: a second break stops
        self.loop = ConsumerLoop(self, stop=self.stop_event, max_records=daemon.batch_max_records,
                                 wait_s=daemon.batch_max_wait_ms / 1000, counts=self.counts,
                                 fatal=lambda err: f"commands consumer: {err.str()}")
        self.reader: Any = None
        self.writer: TransactionalWriter | None = None
        self.parker: Any = None  # a plain producer for parked events (on_fold_error = "dead-letter"), made on use
        self.joined = False
        self.forgotten: list[str] = []  # aggregate ids whose subject was forgotten, evicted before the next poll
        self.erasures: protect.ErasureWatch | None = None  # forgets by other processes (the CLI), with protect rules
        self.erasures_at = 0.0
        self.error: BaseException | None = None
        self.log = log.bind(aggregate=agg.name)

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

    def forget(self, aggregate_id: str) -> None:
        """A forgotten subject (kafold.protect) that is this aggregate's id: its cached state (folded while the key
        existed) is evicted between two batches, on this runtime's thread, so it is reloaded with placeholders."""
        self.forgotten.append(aggregate_id)

    def _evict_forgotten(self) -> None:
        while self.forgotten:
            aid = self.forgotten.pop()
            with self.store.lock:  # as StateStore.trim: evicted ids are reloaded from Kafka before any use
                entry = self.store.entries.pop(aid, None)
                if entry is not None:
                    self.store.evicted.setdefault(entry.partition, set()).add(aid)

    def _forget_erased(self) -> None:
        """Evict the states of subjects another process forgot (`kafold subjects forget`): they were folded while
        the key existed and are reloaded with placeholders. A state folded under a payload-path subject may hold
        any subject's data, so with such rules every state is reloaded after an erasure."""
        assert self.erasures is not None and self.domain.protector is not None
        protector = self.domain.protector
        try:
            hashes = self.erasures.new()
        except FatalError as e:  # PostgreSQL down for longer than the key store's retries: look again later
            self.log.warning("aggregate.erasures_unreadable", error=str(e))
            return
        if not hashes:
            return
        with self.store.lock:
            held = list(self.store.entries)
        if protector.subjects_in_payloads(self.agg.name):
            matched = held
        else:
            matched = [aid for aid in held if protector.ring.cipher.subject_hash(aid) in hashes]
        protector.ring.drop(matched)
        self.forgotten.extend(matched)
        self.log.info("aggregate.erasures_seen", erasures=len(hashes), states_reloaded=len(matched))

    def before_poll(self) -> float | None:
        """Fold one fetch of events while a partition recovers; the poll then does not wait (the gates)."""
        if self.erasures is not None and time.monotonic() >= self.erasures_at:
            self.erasures_at = time.monotonic() + ERASURES_CHECK_S
            self._forget_erased()
        if self.forgotten:
            self._evict_forgotten()
        if any(not g.live for g in self.gates.values()):
            self._recover_step()
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
                 "fetch.wait.max.ms": 50, "max.partition.fetch.bytes": 8 * 1024 * 1024,
                 # the group's description then tells every instance where this one serves state (routing.py)
                 # (signed with the instance secret: the others send reads only to an address that verifies)
                 "client.id": routing.member_client_id(self.kafka.client_id, routing.advertised_url(self.daemon),
                                                       self.group_id, routing.InstanceKey.of(self.daemon)),
                 **self.consumer_extra}
        self.consumer = kafka_clients.consumer(self.kafka, self.group_id, **extra)
        # A lost partition is released as a revoked one: its transaction's offsets were committed with it or not.
        self.loop.subscribe([self.topics["commands"]], self._on_assign, self._on_revoke, self._on_revoke)
        protector = self.domain.protector
        if protector is not None and protector.for_aggregate(self.agg.name) is not None:
            self.erasures = self._retrying("aggregate.start_retrying",
                                           lambda: protect.ErasureWatch(protector.ring.store), START_RETRY_S)
        self.log.info("aggregate.started", group=self.group_id, transactional_id=self.transactional_id,
                      fingerprint=self.domain.fingerprint)

    # ---- recovery ---------------------------------------------------------------------------------------
    def _on_assign(self, consumer: Any, partitions: list[Any]) -> None:
        kafka_clients.rebalance_assign(self.kafka, consumer, partitions)  # incremental with KIP-848
        self._recover(partitions)

    def _recover(self, partitions: list[Any]) -> None:
        """Start the gates of `partitions` (of the commands topic): restore each one's base, then replay its events."""
        assert self.consumer is not None
        self.consumer.pause(partitions)  # the gate: nothing is decided until the events are replayed
        events = self.topics["events"]
        for p in partitions:
            n = p.partition
            low, end, base = self._retrying("aggregate.restore_retrying", partial(self._restore, events, n),
                                            partition=n)
            self.gates[n] = PartitionGate(n, end, start=base.start, snapshot_version=base.snapshot_version)
            self.folders[n] = recovery.folder(self.domain, self.store, n)
            recovery.seed(self.store, n, base)
            if base.partial:
                self._note_events(n, set(base.partial), base.start)
            self.reader.incremental_assign([KTP(events, n, base.start)])
            self.log.info("aggregate.recovering", partition=n, low=low, captured_end=end, start=base.start)
        self.joined = True  # after the gates exist: `ready` must not see a joined runtime without them

    def _restore(self, events: str, n: int) -> tuple[int, int, Any]:
        """(first offset, the gate's end: the high watermark, the restored base); see gate.py's offset note."""
        low, stable = recovery.bounds(self.reader, events, n)
        with recovery.probing(self.kafka, self.agg.name) as probe:
            _, high = recovery.bounds(probe, events, n)
        if self.local is not None:  # a store trusted up to an offset: no snapshot read, the tail from there
            trusted = self.local.open(n, low, stable)
            if trusted is not None:
                return low, max(stable, high), recovery.Base(start=trusted)
        return low, max(stable, high), self.restorer.restore(n, low, stable)

    def _retrying(self, event: str, step: Callable[[], T], within_s: float = ASSIGN_RETRY_S, **fields: Any) -> T:
        """`step`, its RetriableErrors (the broker paused or unreachable) logged as `event` and retried with backoff
        for up to `within_s` (while assigning, the group keeps the membership: heartbeats run in the background),
        then raised; raised at once when the runtime is stopping."""
        def warn(e: RetriableError, delay: float) -> None:
            self.log.warning(event, **fields, error=str(e), retry_in_s=delay)

        return self.loop.retrying(step, warn, within_s=within_s, first_delay=0.5)

    def _read_back(self, event: str, n: int, read: Callable[[Any], int]) -> int:
        """`read(reader)` on a reader of its own (the recovery reader is busy replaying), retried like a restore."""
        def step() -> int:
            reader = recovery.reader(self.kafka, self.agg.name)
            try:
                return read(reader)
            finally:
                reader.close()

        return self._retrying(event, step, partition=n)

    def _on_revoke(self, consumer: Any, partitions: list[Any], *, renewing: bool = False) -> None:
        """Release `partitions` (the consumer's revoke callback). `renewing`: the assignment stays (a producer's
        renewal), so each partition keeps its position: it resumes at least there."""
        mine = [p.partition for p in partitions if p.partition in self.gates]
        for n in mine:
            gate = self.gates.pop(n)
            self.folders.pop(n, None)
            if not renewing:
                self.positions.pop(n, None)
            self.store.drop_partition(n)
            if self.local is not None:
                self.local.close(n)
            if not gate.live and not gate.stopped:  # a stopped gate's events were unassigned when it stopped
                self.reader.incremental_unassign([KTP(self.topics["events"], n)])
        if mine:
            self.log.info("aggregate.partitions_released", partitions=sorted(mine))

    def _recover_step(self) -> None:
        """Fold one fetch of events into the recovering partitions; open the gates that reached the end."""
        msgs = self.reader.consume(RECOVERY_BATCH, 0.05)
        data: dict[int, list[Any]] = {}
        for m in msgs:
            n = m.partition()
            gate = self.gates.get(n)
            if gate is None or gate.live or gate.stopped:
                continue
            err = m.error()
            if err is None:
                data.setdefault(n, []).append(m)
                continue
            if err.code() != KafkaError._PARTITION_EOF:
                self.log.warning("aggregate.reader_error", partition=n, error=err.str())
                continue
            self._fold(n, data.pop(n, []))
            if not gate.stopped and gate.end_of_partition(m.offset()):
                self._open(gate)
        for n, batch in data.items():
            if not self.gates[n].stopped:
                self._fold(n, batch)
        self.store.trim()

    def _fold(self, n: int, batch: list[Message]) -> None:
        if not batch:
            return
        folder, gate = self.folders[n], self.gates[n]
        try:
            folder.fold_records(batch)
        except FoldError as e:  # on_fold_error = "stop": the gate never opens on a state that misses the event
            gate.stop(e.describe())
            self.reader.incremental_unassign([KTP(self.topics["events"], n)])
            self.counts["fold_errors"] += 1
            self.log.error("aggregate.fold_failed", **e.fields(), policy=str(folder.on_error),
                           action="partition not ready: fix evolve or add an upcaster, then restart; or set "
                                  "on_fold_error = \"dead-letter\"")
            return
        if folder.parked:
            self._park(batch, folder.parked)
            folder.parked.clear()
        gate.replayed(batch[-1].offset() + 1, len(batch))

    def _park(self, batch: list[Message], parked: list[Parked]) -> None:
        """on_fold_error = "dead-letter": the events the fold left out, to the aggregate's dead-letter topic (not
        in a transaction: the replay writes nothing else; a later replay parks them again)."""
        by_offset = {m.offset(): m for m in batch}
        if self.parker is None:
            self.parker = kafka_clients.producer(self.kafka, **{"enable.idempotence": True, "acks": "all"})
        for p in parked:
            raw = RawRecord.of(by_offset[p.offset])
            headers = dlq_headers(raw, RecordError(p.error.describe(), reason=folding_reason(p.error.stage)),
                                  f"aggregate.{self.agg.name}", int(time.time() * 1000))
            value, headers = fitted(raw.value, headers)
            self.parker.produce(self.dlq, value=value, key=raw.key, headers=headers, partition=0)
            self.counts["events_parked"] += 1
            self.log.warning("aggregate.event_parked", **p.error.fields(), dlq_topic=self.dlq)
        self.parker.flush(30)

    def _open(self, gate: PartitionGate) -> None:
        n = gate.partition
        assert self.writer is not None
        # Every event of the partition decided before this assignment is at or before the last one replayed (a
        # duplicate's token, txn.py); with none replayed since a snapshot, the snapshot's last event.
        self.writer.known_end(self.topics["events"], n, max(gate.last_event, gate.start - 1))
        self.reader.incremental_unassign([KTP(self.topics["events"], n)])
        folder = self.folders.pop(n)
        def note_results(reader: Any) -> int:
            with recovery.probing(self.kafka, self.agg.name) as probe:
                return recovery.note_results(reader, self.topics["results"], self.domain, self.store, n, probe=probe)

        results = self._read_back("aggregate.results_retrying", n, note_results)
        if self.local is not None:  # what the restore and the replay built, trusted from now on up to here
            with self.store.lock:
                held = [(aid, e) for aid, e in self.store.entries.items() if e.partition == n]
            self.local.seal(n, held, gate.position)
        self._resume_commands(n)
        self.log.info("aggregate.caught_up", **gate.describe(), folded=folder.folded, duplicates=folder.skipped,
                      events_parked=folder.bad or None, results_read=results)

    def _resume_commands(self, n: int) -> None:
        """Let partition `n`'s commands be fetched again, from the first one not decided: the group's committed
        offset, or where this assignment's last committed transaction left it when that is further (kept across
        a producer's renewal; also what a failed lookup falls back to). It becomes the partition's position
        (handle_batch skips anything below it fetched again).

        An explicit seek makes librdkafka fetch at once (a plain resume waits for its next ~1 s tick); it only saves
        that tick: when the lookup fails (a paused or overloaded broker) with nothing known, the resumed partition
        still starts at the committed offset, which librdkafka fetches itself (retrying) before its first fetch."""
        tp = KTP(self.topics["commands"], n)
        self.consumer.resume([tp])
        known = self.positions.get(n, -1)
        try:
            found = self.consumer.committed([tp], timeout=COMMITTED_TIMEOUT_S)[0]
            if found.error is not None:  # a partition's own error comes back in its entry, not raised
                raise KafkaException(found.error)
            start = max(found.offset, known)
        except KafkaException as e:
            if known < 0:
                self.log.warning("aggregate.committed_offset_unavailable", partition=n, error=str(e),
                                 fallback="the consumer looks the committed offset up itself")
                return
            start = known
        if start >= 0:
            self.positions[n] = start
        elif self.consumer_extra.get("auto.offset.reset", "earliest") != "earliest":
            return
        try:
            self.consumer.seek(KTP(tp.topic, n, start if start >= 0 else OFFSET_BEGINNING))
        except KafkaException as e:  # _STATE: not fetching yet (seen with the consumer group protocol)
            self.log.info("aggregate.seek_skipped", partition=n, error=str(e),
                          fallback="the consumer starts at the committed offset itself")

    def _note_events(self, n: int, ids: set[str], until: int) -> None:
        """The window's older ids of aggregates whose snapshots carried only their newest (recovery.note_events)."""
        read = self._read_back("aggregate.window_events_retrying", n, lambda reader: recovery.note_events(
            reader, self.topics["events"], self.store, n, ids, until))
        self.log.info("aggregate.window_read_back", partition=n, aggregates=len(ids), events_read=read)

    # ---- commands ---------------------------------------------------------------------------------------
    def handle_batch(self, msgs: list[Message]) -> None:
        """One batch of commands as one transaction."""
        started = time.monotonic()
        live: list[Any] = []
        rewind: dict[int, int] = {}
        refetched: dict[int, list[int]] = {}
        for m in msgs:
            if m.error() is not None:
                self.loop.consumer_error(m.error())  # a fatal one ends the run before anything is decided
                continue
            n = m.partition()
            gate = self.gates.get(n)
            if gate is None or not gate.may_decide():
                rewind.setdefault(n, m.offset())  # fetched before the pause: read it again later
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
        if not live:
            return
        decoded = [self._decode(m) for m in live]
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
        tally = dict.fromkeys(("accepted", "rejected", "dead_lettered", "duplicates", "events"), 0)
        first: dict[int, int] = {}
        last: dict[int, int] = {}
        now_ms = int(time.time() * 1000)
        tracer = tracing.tracer()  # once per batch: off, no header is read and nothing traced
        try:
            self.writer.begin()
            for m, cmd in zip(live, decoded, strict=True):
                n = m.partition()
                first.setdefault(n, m.offset())
                last[n] = m.offset() + 1
                if tracer is None:
                    self._one(m, cmd, n, command_time(m, now_ms), undo, tally)
                else:
                    self._one_traced(tracer, m, cmd, n, command_time(m, now_ms), undo, tally)
            offsets = [KTP(self.topics["commands"], n, off) for n, off in last.items()]
            decided = time.monotonic()
            committed = self.writer.commit(offsets, self.consumer.consumer_group_metadata())
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
                                   self.topics["events"])
        self.store.trim()
        self.counts["batches"] += 1
        self.counts["commands"] += len(live)
        for k, v in tally.items():
            self.counts[k] += v
        self.log.info("aggregate.batch", commands=len(live), **tally, partitions=sorted(last),
                      duration_ms=round((time.monotonic() - started) * 1000, 1),
                      commit_ms=round((time.monotonic() - decided) * 1000, 1))

    def _decode(self, m: Any) -> Command | DecodeError:
        try:
            return decode_command(m.key(), m.value(), raw=m)
        except DecodeError as e:
            return e

    def _one_traced(self, tracer: Any, m: Any, cmd: Command | DecodeError, n: int, t: int, undo: Undo,
                    tally: dict[str, int]) -> None:
        """`_one` in a span, child of the command record's trace context; its events and result carry the span's."""
        # opentelemetry: kafold[tracing], imported only when [tracing] is on
        from opentelemetry import trace

        name = f"handle {self.agg.name} {cmd.type}" if isinstance(cmd, Command) else f"handle {self.agg.name}"
        with tracer.start_as_current_span(name, context=tracing.extract(m.headers()), kind=trace.SpanKind.CONSUMER,
                                          attributes={"kafold.aggregate": self.agg.name, "kafold.partition": n,
                                                      "kafold.offset": m.offset()}) as span:
            self._one(m, cmd, n, t, undo, tally, tracing.inject(trace.set_span_in_context(span)))

    def _one(self, m: Any, cmd: Command | DecodeError, n: int, t: int, undo: Undo, tally: dict[str, int],
             trace: list[tuple[str, bytes]] | None = None) -> None:
        assert self.writer is not None
        at = format_epoch_ms(t)
        landing = None  # where the command's last event lands: its result's token (txn.py)
        if isinstance(cmd, DecodeError):
            key = m.key() or b""
            cid = header(m.headers(), "kafold-command-id") or f"{m.topic()}/{n}/{m.offset()}"
            result = Result(cid, key.decode("utf-8", "replace"), REJECTED, 0, (), str(cmd), cid, at=at)
            self._dead_letter(m, cmd)
            tally["rejected"] += 1
            tally["dead_lettered"] += 1
        else:
            entry = self.store.get(cmd.aggregate_id)
            fresh = entry is None
            if entry is None:
                entry = Entry(self.domain.initial(), 0, n)
            gate = self.gates[n]
            if not gate.may_decide():  # unreachable by construction; counted so a test can prove it
                gate.decided_while_recovering += 1
            if gate.first_decided_at is None:
                gate.first_decided_at = time.monotonic()
            out = handle(self.domain, cmd, entry, at, t, self.window_ms)
            result = out.result
            if trace:  # tracing on: the events carry the aggregate span's context (kafold.tracing)
                out.events = [(k, v, [*h, *trace]) for k, v, h in out.events]
            if out.remember is not None:  # decided (not a repeat): its outcome joins the window
                aid = cmd.aggregate_id
                if aid not in undo:  # first change in this batch: keep what was committed
                    undo[aid] = (None if fresh else (entry.state, entry.version), [])
                undo[aid][1].append(cmd.command_id)
                landing = self.writer.produce_events(self.topics["events"], n, out.events, t)
                entry.state, entry.version = out.state, out.version
                self.store.window.remember(entry, aid, cmd.command_id, out.remember, result.event_ids)
                if fresh:
                    self.store.put(aid, entry)
                tally["events"] += len(out.events)
            if out.refused:
                self.log.error("aggregate.event_id_refused", command_id=cmd.command_id,
                               aggregate_id=cmd.aggregate_id, partition=n, offset=m.offset(), reason=out.refused)
            if out.error is not None:
                out.error.raw = m
                self._dead_letter(m, out.error)
                tally["dead_lettered"] += 1
            tally["duplicates" if result.duplicate else "accepted" if result.accepted else "rejected"] += 1
        self.writer.produce_result(self.topics["results"], n, result, landing, t, trace,
                                   (self.topics["events"], n) if result.duplicate else None)

    def _dead_letter(self, m: Any, error: RecordError) -> None:
        assert self.writer is not None
        raw = RawRecord.of(m)
        headers = dlq_headers(raw, error, f"aggregate.{self.agg.name}", int(time.time() * 1000))
        self.writer.produce(self.dlq, 0, raw.key, *fitted(raw.value, headers))  # an oversized value is dropped
        self.log.warning("aggregate.dead_lettered", partition=raw.partition, offset=raw.offset,
                         reason=error.reason, error=str(error)[:200])

    def _reload_missing(self, msgs: list[Message]) -> None:
        """Rebuild evicted aggregates of this batch from Kafka before deciding on them."""
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
