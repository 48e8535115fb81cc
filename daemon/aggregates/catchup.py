"""CatchUp: the recovery side of an aggregate runtime, from a partition's assignment to its gate opening.

On assignment each commands partition is paused and gets a `PartitionGate` (gate.py): its events partition (same
number) is restored (the local store up to the offset it is trusted to, else the restorer: the latest usable
snapshot, or a full replay) and its tail replayed to the end, one fetch per `step`; then the results partition
seeds the idempotency window, the local store is sealed at the replayed position, and the commands partition
resumes. The runtime (runtime.py) decides commands only on LIVE partitions; this class never decides.

Offsets and commits: nothing is committed here. The events are read with a reader of its own (read_committed,
never in the commands group); a partition resumes at the group's committed commands offset, or further where this
assignment's last committed transaction left it (`positions`, shared with the runtime, which moves it on every
commit). See gate.py's offset note for when a gate may open.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, KafkaError, KafkaException
from confluent_kafka import TopicPartition as KTP

from kafold import kafka_clients
from kafold.config import AggregateConfig, KafkaConfig
from kafold.connectors.api import RawRecord
from kafold.connectors.dlq import dlq_headers, fitted
from kafold.daemon.aggregates import recovery
from kafold.daemon.aggregates.gate import PartitionGate
from kafold.daemon.aggregates.local import LocalStates
from kafold.daemon.aggregates.store import StateStore
from kafold.daemon.aggregates.txn import TransactionalWriter
from kafold.domain import AggregateDomain
from kafold.errors import RecordError
from kafold.fold import Folder, FoldError, Parked
from kafold.kafka_message import Message
from kafold.stages import folding_reason

RECOVERY_BATCH = 20000
COMMITTED_TIMEOUT_S = 10.0

# `retrying(event, step, **fields)`: the runtime's retry of a step through RetriableErrors (its loop's backoff)
Retrying = Callable[..., Any]
# `restore(events_topic, n)`: (first offset, the gate's end, the restored base) of one partition
Restore = Callable[[str, int], tuple[int, int, recovery.Base]]


def restore_base(kafka: KafkaConfig, agg: AggregateConfig, reader: Any, local: LocalStates | None,
                 restorer: recovery.Restorer, events: str, n: int) -> tuple[int, int, recovery.Base]:
    """(first offset, the gate's end: the high watermark, the restored base); see gate.py's offset note."""
    low, stable = recovery.bounds(reader, events, n)
    with recovery.probing(kafka, agg.name) as probe:
        _, high = recovery.bounds(probe, events, n)
    if local is not None:  # a store trusted up to its offsets: no snapshot read, the tails from there
        _, results_stable = recovery.bounds(reader, agg.topic("results"), n)
        trusted = local.open(n, low, stable, results_stable)
        if trusted is not None:
            return low, max(stable, high), recovery.Base(start=trusted.offset, results_start=trusted.results)
    return low, max(stable, high), restorer.restore(n, low, stable)


class CatchUp:
    """The gates of one runtime's assigned partitions: `assign`, `step` until each is LIVE, `release`.

    `gates`, `positions` and `counts` are the runtime's own dicts, handed down: the runtime reads the gates to
    decide, moves the positions on every commit, and the daemon reads both (status, metrics)."""

    def __init__(self, kafka: KafkaConfig, agg: AggregateConfig, domain: AggregateDomain, store: StateStore,
                 local: LocalStates | None, *, consumer: Any, reader: Any, gates: dict[int, PartitionGate],
                 positions: dict[int, int], counts: dict[str, int], restore: Restore, retrying: Retrying,
                 auto_offset_reset: str, log: Any) -> None:
        self.kafka, self.agg, self.domain, self.store, self.local = kafka, agg, domain, store, local
        self.consumer, self.reader = consumer, reader
        self.gates, self.positions, self.counts = gates, positions, counts
        self.restore, self.retrying = restore, retrying
        self.auto_offset_reset = auto_offset_reset
        self.log = log
        self.commands, self.events, self.results = (agg.topic(k) for k in ("commands", "events", "results"))
        self.folders: dict[int, Folder[recovery.Recovering]] = {}
        self.results_from: dict[int, int] = {}  # partition -> its trusted store's results offset (local.py)
        self.parker: Any = None  # a plain producer for parked events (on_fold_error = "dead-letter"), made on use

    @property
    def recovering(self) -> bool:
        return any(not g.live for g in self.gates.values())

    def assign(self, partitions: list[Any]) -> None:
        """Start the gates of `partitions` (of the commands topic): restore each one's base, then replay its events."""
        self.consumer.pause(partitions)  # the gate: nothing is decided until the events are replayed
        for p in partitions:
            n = p.partition
            low, end, base = self.retrying("aggregate.restore_retrying", partial(self.restore, self.events, n),
                                           partition=n)
            self.gates[n] = PartitionGate(n, end, start=base.start, snapshot_version=base.snapshot_version)
            self.folders[n] = recovery.folder(self.domain, self.store, n)
            recovery.seed(self.store, n, base)
            if base.results_start is not None:
                self.results_from[n] = base.results_start
            if base.partial:
                self._note_events(n, set(base.partial), base.start)
            self.reader.incremental_assign([KTP(self.events, n, base.start)])
            self.log.info("aggregate.recovering", partition=n, low=low, captured_end=end, start=base.start)

    def release(self, partitions: list[Any], *, renewing: bool = False) -> None:
        """Release `partitions` (revoked or lost). `renewing`: the assignment stays (a producer's renewal), so each
        partition keeps its position: it resumes at least there."""
        mine = [p.partition for p in partitions if p.partition in self.gates]
        for n in mine:
            gate = self.gates.pop(n)
            self.folders.pop(n, None)
            self.results_from.pop(n, None)
            if not renewing:
                self.positions.pop(n, None)
            self.store.drop_partition(n)
            if self.local is not None:
                self.local.close(n)
            if not gate.live and not gate.stopped:  # a stopped gate's events were unassigned when it stopped
                self.reader.incremental_unassign([KTP(self.events, n)])
        if mine:
            self.log.info("aggregate.partitions_released", partitions=sorted(mine))

    def step(self, writer: TransactionalWriter) -> None:
        """Fold one fetch of events into the recovering partitions; open the gates that reached the end (`writer`:
        the runtime's current transactional producer, told where each opened partition's events end)."""
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
                self._open(gate, writer)
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
            self.reader.incremental_unassign([KTP(self.events, n)])
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
            self.parker.produce(self.agg.dlq_topic, value=value, key=raw.key, headers=headers, partition=0)
            self.counts["events_parked"] += 1
            self.log.warning("aggregate.event_parked", **p.error.fields(), dlq_topic=self.agg.dlq_topic)
        self.parker.flush(30)

    def _open(self, gate: PartitionGate, writer: TransactionalWriter) -> None:
        n = gate.partition
        # Every event of the partition decided before this assignment is at or before the last one replayed (a
        # duplicate's token, txn.py); with none replayed since a snapshot, the snapshot's last event.
        writer.known_end(self.events, n, max(gate.last_event, gate.start - 1))
        self.reader.incremental_unassign([KTP(self.events, n)])
        folder = self.folders.pop(n)

        since = self.results_from.pop(n, None)
        ended = [-1]

        def note_results(reader: Any) -> int:
            # a trusted store holds the outcomes of the results below `since`: only the results tail is read
            with recovery.probing(self.kafka, self.agg.name) as probe:
                read, ended[0] = recovery.note_results(reader, self.results, self.domain, self.store, n,
                                                       probe=probe, since=since)
                return read

        results = self._read_back("aggregate.results_retrying", n, note_results)
        self.counts["recovery_results_read"] += results
        if self.local is not None:  # what the restore, the replay and the results read built, trusted from now on
            with self.store.lock:
                held = [(aid, e) for aid, e in self.store.entries.items() if e.partition == n]
            # Offset note: the results offset is recorded with every outcome the read found: those still held are
            # in `held`, those dropped from memory early meanwhile (idempotency_max_ids) were written when dropped
            # (Window.keep -> LocalStates.keep), as were the replayed acceptances dropped early.
            self.local.seal(n, held, gate.position, ended[0] if ended[0] >= 0 else None)
        self._resume_commands(n)
        gate.open()  # LIVE once its commands resume, not before (gate.py)
        self.log.info("aggregate.caught_up", **gate.describe(), folded=folder.folded, duplicates=folder.skipped,
                      events_parked=folder.bad or None, results_read=results)

    def _read_back(self, event: str, n: int, read: Callable[[Any], int]) -> int:
        """`read(reader)` on a reader of its own (the recovery reader is busy replaying), retried like a restore."""
        def step() -> int:
            reader = recovery.reader(self.kafka, self.agg.name)
            try:
                return read(reader)
            finally:
                reader.close()

        return int(self.retrying(event, step, partition=n))

    def _note_events(self, n: int, ids: set[str], until: int) -> None:
        """The window's older ids of aggregates whose snapshots carried only their newest (recovery.note_events)."""
        read = self._read_back("aggregate.window_events_retrying", n, lambda reader: recovery.note_events(
            reader, self.events, self.store, n, ids, until))
        self.log.info("aggregate.window_read_back", partition=n, aggregates=len(ids), events_read=read)

    def _resume_commands(self, n: int) -> None:
        """Let partition `n`'s commands be fetched again, from the first one not decided: the group's committed
        offset, or where this assignment's last committed transaction left it when that is further (kept across
        a producer's renewal; also what a failed lookup falls back to). It becomes the partition's position
        (the runtime skips anything below it fetched again).

        An explicit seek makes librdkafka fetch at once (a plain resume waits for its next ~1 s tick); it only saves
        that tick: when the lookup fails (a paused or overloaded broker) with nothing known, the resumed partition
        still starts at the committed offset, which librdkafka fetches itself (retrying) before its first fetch."""
        tp = KTP(self.commands, n)
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
        elif self.auto_offset_reset != "earliest":
            return
        try:
            self.consumer.seek(KTP(tp.topic, n, start if start >= 0 else OFFSET_BEGINNING))
        except KafkaException as e:  # _STATE: not fetching yet (seen with the consumer group protocol)
            self.log.info("aggregate.seek_skipped", partition=n, error=str(e),
                          fallback="the consumer starts at the committed offset itself")
