"""Blue-green rebuilds of a projection: replay the source topics into a shadow table, then swap it in atomically.

Note on offsets and commits
---------------------------
The rebuild reads with a plain consumer and manual assignment (no consumer group, nothing committed to Kafka), so
it never disturbs the live connector nor triggers any effect connector. Its progress is the shadow writer's own
checkpoints (`<name>:rebuild`) written in the same transaction as the shadow rows (and, for a projection without
the version guard, their tracking records; with it the shadow's writer deduplicates by version, deleted rows' versions
kept as tombstones, namespace `<name>:rebuild`), as the live writer does (see writer.py): a killed rebuild resumes
from them. Those transactions do not wait for the WAL flush (`durable=False`): a PostgreSQL crash may lose the last
of them, each with its checkpoints, so the rebuild resumes from what is left; the swap's own transaction is durable
and flushes the WAL up to it.
Its reading is a run of kafold's consumer loop (kafold/consumer_loop.py, which commits and seeks nothing here): the
batch handler (`_CatchUp`) recomputes the assignment before each poll from the checkpoints in PostgreSQL (the
shadow's and the live connector's), skips the poll when its read-ahead already reaches the targets, and finishes
the run once caught up (below); the copy workers run the same. The loop runs again over the same consumer for each
swap attempt, and the tail under the swap's lock is applied by the same step (`_step`) outside the loop, with its
own deadline and short polls, while the live writer waits.

While the shadow is far behind (more than `max_tail` records on a partition), the history is copied by worker
processes (`workers`), each its own partitions, with its own consumer and writer on the same checkpoint key and
tracking namespace: the checkpoints are rows per partition, so each worker moves only its own, in the transactions
of its own rows, and a key's events are all in one partition. Each worker stops once it has reached the targets it
read before its last batch and is within `max_tail` of them on its partitions; the coordinating process then
resumes from the checkpoints in PostgreSQL and runs the tail phase and the swap itself. A worker outliving a killed
coordinator is harmless: a second writer of the same partitions is a zombie writer (see writer.py).

The shadow never goes past the live connector: partition by partition it applies only offsets below the live
checkpoint (the target), re-read as the live connector advances. Under steady traffic the live connector commits a
batch on some partition several times a second, so the shadow is never *equal* to it for long; the rebuild converges
instead: once the shadow has reached the targets read before its last batch and is within `max_tail` records of the
current ones on every partition (and one more such lap would not leave a tail shorter by a quarter: the tail goes
under the lock, so laps outside it shorten the lock), the swap transaction locks the live table (ACCESS EXCLUSIVE:
it waits for the live writer's in-flight batch and blocks the next one) and the live checkpoint rows (FOR UPDATE),
re-reads the targets, applies the remaining tail into the shadow while holding the lock (so the lock lasts as long
as that tail takes), renames live -> old and shadow -> live, drops old (unless kept), deletes the rebuild
checkpoints and marks the rebuild swapped; then commits. If the tail grew past `max_tail` while the lock was awaited
(or the lock was not granted in time), the transaction rolls back having changed nothing, and the rebuild catches up
and tries again after a backoff (a log line and `swap_retries` count each). At the commit the new table holds
exactly the events below the live checkpoints, which is what the live writer's tracking namespace has recorded, so
the live connector continues from its own checkpoints with its own tracking, untouched. Its statements name the
table, so its next batch (even one blocked on the lock) resolves the name again and writes into the new table.

The tail phase (`catching-up`) starts once the shadow is within `max_tail` of the live connector on every partition.
In it the rebuild keeps every partition assigned and keeps what it fetched at or past its target (up to
`max_tail` messages a partition, in order): the tail under the lock is then applied from memory, without waiting
for a fetch while the live writer waits. Read-ahead messages are applied only once the live checkpoint passes
them, so the shadow still never goes past the live connector.

The machinery (fold into a scratch table, converge under traffic, act under the lock) is `Rebuild`; `finish` is the
only step that swaps (its SQL in rebuild_tables.py), so a job that acts otherwise under the lock overrides it. The
jobs that fold into scratch tables of their own (verify.py, subject_refresh.py) share their lifecycle in scratch.py
(`Scratch`: their Plan names their tables and bookkeeping key, and no rebuild_state is written). The copy workers
(rebuild_workers.py) run `Rebuild`'s own copy loop into `plan.shadow` under `plan.key`: a Plan subclass travels to
the workers as itself. The writes into the shadow, one in flight while the next batch is read, are
shadow_writes.py's. The log events are named for the kind of job (`kind`: `rebuild.started`, `refresh.done`).
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

import psycopg
from confluent_kafka import TopicPartition as KafkaTP
from psycopg import sql

from kafold import db, kafka_clients, logs, protect, upcast
from kafold.config import ConnectorConfig, KafkaConfig, KafoldConfig, PostgresConfig, RegistryConfig, python_path
from kafold.connectors.api import RawRecord, SinkRecord, TopicPartition
from kafold.connectors.convert import converter_for
from kafold.connectors.intake import Intake
from kafold.connectors.projection import rebuild_workers
from kafold.connectors.projection import sql as q
from kafold.connectors.projection.config import ProjectionConfig
from kafold.connectors.projection.connector import ProjectionConnector
from kafold.connectors.projection.held_keys import DeadLetter, holds_lock
from kafold.connectors.projection.mapping import Mapping, load_mapper
from kafold.connectors.projection.rebuild_state import offsets
from kafold.connectors.projection.rebuild_tables import RebuildTables
from kafold.connectors.projection.shadow_writer import Rewind, ShadowWriter
from kafold.connectors.projection.shadow_writes import SHADOW_CACHE_ROWS, ShadowWrites
from kafold.connectors.registry import instantiate
from kafold.consumer_loop import SKIP_POLL, ConsumerLoop, LoopHandler, SkipPoll
from kafold.errors import ConfigError, FatalError, RecordError, RetriableError
from kafold.interpreter import tune_interpreter
from kafold.kafka_message import Message
from kafold.retry import retrying
from kafold.upcast import UpcasterConfig

log = logs.get(__name__)

OFFSET_BEGINNING = -2  # librdkafka's logical offset
# How long the swap waits for the live table's lock: the live writer's batch in flight finishes well within it.
# Queries of the live table queue behind a pending ACCESS EXCLUSIVE request, so the wait is kept short; a lock not
# granted in time is retried after a backoff.
LOCK_WAIT_S = 2.0
COPY_POLL_S, TAIL_POLL_S = 0.5, 0.05  # how long a batch waits for records while copying / in the tail phase
TAIL_WAIT_S = 30.0  # the tail under the lock must arrive from Kafka within this (else roll back, retry)
RETRY_FIRST_S, RETRY_MAX_S = 0.1, 2.0
# A tail this small goes under the swap's lock without another lap first (see _CatchUp._last_lap).
LAST_LAP_TAIL = 100
# Copy workers: one interpreter each (the copy is GIL-bound, see task.py); a few more than the cores pays off as
# each waits for PostgreSQL part of the time, but every worker is one more session and one more consumer.
MAX_DEFAULT_WORKERS = 4


def _fatal(err: Any) -> str:
    return f"rebuild consumer: {err}"


def _unassign(consumer: Any, partitions: Collection[TopicPartition]) -> None:
    consumer.incremental_unassign([KafkaTP(tp.topic, tp.partition) for tp in partitions])


def default_workers() -> int:
    """Copy workers when `--workers` is not given: the cores, at most MAX_DEFAULT_WORKERS."""
    return max(1, min(os.cpu_count() or 1, MAX_DEFAULT_WORKERS))


@dataclass(frozen=True)
class Plan:
    """What a rebuild of one `postgres-projection` connector works on."""

    name: str
    kafka: KafkaConfig
    pgc: PostgresConfig
    config: ProjectionConfig
    mapping: Mapping
    topics: tuple[str, ...]
    on_unknown: str
    python_path: tuple[str, ...] = ()  # the config's `daemon.python_path`, resolved: a copy worker imports the mapper
    upcasters: tuple[UpcasterConfig, ...] = ()  # the connector's, as configured (built where they are used)
    settings: ConnectorConfig | None = None  # the connector's settings: its converter (connectors.convert)
    registry: RegistryConfig | None = None  # the config's [registry], for the Schema Registry converters
    # the caller's (kafold.protect.build of its configuration) when it has protected fields; a copy worker is sent
    # its Setup and builds its own (_copier)
    protector: protect.Protector | None = field(default=None, compare=False, repr=False)

    @functools.cached_property
    def intake(self) -> Intake:
        """The connector's one decode-and-intake (connectors.intake): the rebuild sees what the live runner sees."""
        return Intake(self.name, self.mapping.handles, self.on_unknown,
                      upcast.build(self.upcasters, f"connector {self.name!r}"),
                      converter=converter_for(self.settings, self.registry) if self.settings is not None else None,
                      protector=self.protector)

    @property
    def shadow(self) -> str:
        return f"{self.config.table[:48]}_kafold_rebuild"

    @property
    def key(self) -> str:
        """Checkpoint key and tracking namespace of the rebuild."""
        return f"{self.name}:rebuild"

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled for a copy worker without the mapping (it may hold closures): built again there."""
        return (_unpickle_plan, (type(self), self.name, self.kafka, self.pgc, self.config, self.topics,
                                 self.on_unknown, self.python_path, self.upcasters))


def _unpickle_plan(cls: type[Plan], name: str, kafka: KafkaConfig, pgc: PostgresConfig, config: ProjectionConfig,
                   topics: tuple[str, ...], on_unknown: str, paths: tuple[str, ...],
                   upcasters: tuple[UpcasterConfig, ...]) -> Plan:
    for path in reversed(paths):
        if path not in sys.path:
            sys.path.insert(0, path)
    mapping = Mapping(config, load_mapper(config.mapper) if config.mapper else None)
    return cls(name, kafka, pgc, config, mapping, topics, on_unknown, paths, upcasters)


@dataclass
class Progress:
    """Where a rebuild stands: offsets covered by the shadow out of the live connector's (the target), and the
    records it is behind the live connector, summed over partitions (0 once swapped)."""

    phase: str
    done: int
    total: int
    events: int = 0
    batch: int = 0
    behind: int = 0


def plan(cfg: KafoldConfig, base: Path, name: str, protector: protect.Protector | None = None) -> Plan:
    """The rebuild of connector `name`, reading protected fields with `protector` (kafold.protect.build of `cfg`);
    ConfigError naming the problem when there is no such projection."""
    by_name = {c.name: (i, c) for i, c in enumerate(cfg.connectors)}
    if name not in by_name:
        known = ", ".join(sorted(by_name)) or "none"
        raise ConfigError([f"connectors: no connector named {name!r} (configured: {known})"])
    i, settings = by_name[name]
    paths = python_path(cfg, base)
    with paths:
        connector = instantiate(settings, base, f"connectors[{i}]")
        if not isinstance(connector, ProjectionConnector):
            raise ConfigError([f"connectors[{i}].class: {name!r} is a {settings.connector_class!r} connector; "
                               "only postgres-projection connectors can be rebuilt"])
        pc: ProjectionConfig = connector.config
        mapping = Mapping(pc, load_mapper(pc.mapper) if pc.mapper else None)
    return Plan(name, cfg.kafka, cfg.postgres, pc, mapping, tuple(settings.topics), settings.on_unknown_type,
                tuple(paths.paths), tuple(settings.upcasters), settings, cfg.registry, protector)


class _NotYet(RetriableError):
    """The tail under the lock was too long or did not arrive, or the lock was not granted in time: roll back,
    catch up and try again after a backoff."""


@dataclass
class _Batch:
    """One step's batch: the records below their targets, dead letters, the checkpoints it moves, and the
    partitions read ahead past the bound (re-fetched from their target later)."""

    targets: dict[TopicPartition, int]
    records: list[SinkRecord] = field(default_factory=list)
    dead: list[DeadLetter] = field(default_factory=list)
    advance: dict[TopicPartition, int] = field(default_factory=dict)
    overrun: set[TopicPartition] = field(default_factory=set)
    count: int = 0  # messages taken, read ahead before included

    def short(self, positions: dict[TopicPartition, int]) -> bool:
        """Not at the targets yet on some partition: a poll is needed (else the read-ahead covers the step)."""
        return not all(self.advance.get(tp, positions.get(tp, 0)) >= off for tp, off in self.targets.items())


class _CatchUp(LoopHandler):
    """The rebuild's catch-up (copy and tail phase, also a copy worker's) as the consumer loop's batch handler:
    before each poll the live checkpoints are read and the partitions behind them assigned (no group); a step whose
    read-ahead already reaches the targets skips its poll; the run finishes once the shadow has reached the targets
    read before its last batch and is near the current ones. The loop runs again over the same consumer on each
    swap attempt; the consumer is closed by `Rebuild` (its `close_consumer`), after the swap's tail."""

    def __init__(self, rebuild: Rebuild) -> None:
        self.rebuild = rebuild
        self.loop = ConsumerLoop(self, stop=rebuild.stop, max_records=rebuild.batch, wait_s=COPY_POLL_S,
                                 counts={}, fatal=_fatal)
        self.batch: _Batch | None = None
        self.reached = False
        self.lap_tail: int | None = None  # records behind when the last lap reached its targets

    def loop_started(self) -> None:
        self.batch, self.reached, self.lap_tail = None, False, None

    def _last_lap(self) -> bool:
        """Whether the lap that just reached its targets is the last before the swap's lock. A copy worker stops
        as soon as it is near. Otherwise the laps go on while each leaves a tail at most 3/4 of the one before:
        what is left when the lock is taken is applied while the live writer waits, so a lap more outside the
        lock is a shorter lock (under steady traffic the tail shrinks to what the live connector commits during
        one lap); a tail that stops shrinking, or is already small, ends them."""
        r = self.rebuild
        if r.share is not None or r.behind <= LAST_LAP_TAIL:
            return True
        last, self.lap_tail = self.lap_tail, r.behind
        return last is not None and r.behind > last * 3 // 4

    def before_poll(self) -> float | SkipPoll | None:
        r = self.rebuild
        targets = r._targets()
        if self.reached and r._near(targets) and self._last_lap():
            if r._settle(self.consumer):
                self.loop.finish()
                return SKIP_POLL
            self.reached, targets = False, r._targets()  # rewound: not there any more
        self.batch = r._prepare(self.consumer, targets)
        if not self.batch.short(r.positions):
            return SKIP_POLL
        # In the tail phase a short poll: what is left is small, and every wait lets the tail grow.
        return TAIL_POLL_S if r.phase != "copying" else None

    def handle_batch(self, msgs: list[Message]) -> None:
        assert self.batch is not None
        self.rebuild._add(self.batch, msgs)

    def after_poll(self) -> None:
        assert self.batch is not None
        self.rebuild._past_markers(self.consumer, self.batch)
        self.rebuild._apply(self.consumer, self.batch, save=True)
        self.reached = self.rebuild.caught_up(self.batch.targets)

    def on_failure(self, error: Exception) -> bool:
        return False  # the attempt's error: retried (RetriableError) or ending the rebuild, resumable

    def loop_stopped(self) -> None:
        pass  # the consumer serves the next attempt and the swap's tail: closed by `Rebuild.close_consumer`


class Rebuild:
    """Runs one rebuild to its swap; `stop` (a threading.Event) ends it early, resumable.

    Its extension surface, what a job built on it (Scratch, scratch.py, and its Verify and Refresh) may use or
    override: `begin` and `save` (the run's start and phase), `tables` (rebuild_tables.py: its bookkeeping),
    `record_of` (a message as a record), `new_consumer`, `catch_up` and `close_consumer` (reading up to the live
    checkpoints), `ours`, `caught_up` and `count_behind` (where the reading stands against its targets),
    `report_progress`, and `finish` (the swap). The rest is private to this module."""

    # The kind of job, naming its log events (`rebuild.started`, `verify.done`): a scratch job runs this machinery
    # too (scratch.py). `done_event` is logged once the swap transaction committed (`rebuild.swapped`).
    kind: ClassVar[str] = "rebuild"
    done_event: ClassVar[str] = "swapped"

    def __init__(self, plan: Plan, *, keep_old: bool = False, batch: int = 5000, max_tail: int = 20000,
                 workers: int | None = None, on_progress: Callable[[Progress], None] | None = None,
                 stop: threading.Event | None = None, share: Collection[TopicPartition] | None = None) -> None:
        self.plan, self.keep_old, self.batch, self.max_tail = plan, keep_old, batch, max_tail
        # Rows that fold several aggregates (no version guard) are read-modify-write across partitions: one writer.
        self.workers = 1 if not plan.config.version_guard else max(1, workers or default_workers())
        self.share = frozenset(share) if share is not None else None  # a copy worker's partitions (see _copier)
        self.on_progress = on_progress
        self.stop = stop or threading.Event()
        # The rebuild is the shadow's only writer (its copy workers each their own partitions' keys, one after the
        # other with this process): rows it wrote are not read back (see ProjectionWriter's cache).
        # With the version guard it deduplicates by version (tombstones for deleted rows), not by tracking records,
        # and its commits do not wait for the WAL flush: see ProjectionWriter's `track` and shadow_writer.py.
        self.writer = ShadowWriter(plan.pgc, plan.config, plan.mapping, plan.key, plan.shadow,
                                   cache_rows=SHADOW_CACHE_ROWS, track=not plan.config.version_guard)
        self.positions: dict[TopicPartition, int] = {}
        self.assigned: set[TopicPartition] = set()
        self.ahead: dict[TopicPartition, list[Any]] = {}  # messages at or past the target, in order (tail phase)
        # While copying, a batch's shadow write runs in a thread as the next batch is consumed and decoded; at
        # most one in flight, and `positions` already count it (see _settle and shadow_writes.py).
        self.writes = ShadowWrites(self.writer, plan.name)
        self.rewinds = 0  # times folding ahead gave way to batch-by-batch writes (see _rewind)
        self.tables = RebuildTables(plan.pgc, plan.config, plan.name, plan.key, plan.shadow, keep_old)
        self.phase = "copying"
        self.events = 0
        self.copied_by_workers = 0  # events the copy workers applied (in this run)
        self.tail = 0  # offsets applied while the live writer waited, in the last swap attempt
        self.behind = 0  # records behind the live connector at the last look, summed over partitions
        self.swap_retries = 0  # swap attempts rolled back (tail too long, lock not granted)
        self.locked_ms = 0.0  # how long the live table was locked by the swap (lock granted -> commit)
        self.lock_ms_max = 0.0  # the longest the live table was locked by any swap attempt (also rolled back)
        self.tail_ms = self.finish_ms = 0.0  # of the swap's lock: applying the tail, then `finish` (commit apart)
        self.log = log.bind(projection=plan.name, shadow=plan.shadow)
        self.catching_up = _CatchUp(self)

    # ---- state ------------------------------------------------------------------------------------------
    def begin(self) -> bool:
        """Resume the run in progress, or start afresh; True when resuming (a job with tables of its own, such as
        subject_refresh.py's, overrides it)."""
        phase = self.tables.begin()
        if phase is not None:
            self.phase = phase
        return phase is not None

    def save(self, phase: str, conn: psycopg.Connection[Any] | None = None) -> None:
        self.phase = phase
        self.tables.save(phase, sum(self.positions.values()), conn)

    # ---- the run ----------------------------------------------------------------------------------------
    def run(self) -> Progress:
        """Replay, converge with the live connector and swap; returns the final progress (phase 'swapped', or
        the phase reached when stopped)."""

        tune_interpreter()
        resumed = self.begin()
        self.positions = {tp: off for tp, off in self.writer.checkpoints().items()}
        self.log.info(f"{self.kind}.resumed" if resumed else f"{self.kind}.started", phase=self.phase,
                      covered=sum(self.positions.values()), workers=self.workers)
        consumer = self.new_consumer()

        def attempt() -> None:
            self.catch_up(consumer)
            if not self.stop.is_set():
                self._converge(consumer)

        def again(e: RetriableError, delay: float) -> None:
            self.swap_retries += 1
            # The swap transaction rolled back (see _converge): catching up, then trying again.
            self.log.info(f"{self.kind}.retrying", reason=str(e), retry_in_s=round(delay, 2),
                          swap_retries=self.swap_retries, max_tail=self.max_tail)

        try:
            for tp in source_partitions(consumer, self.plan):
                self.positions.setdefault(tp, 0)
            if self.phase == "copying" and self.workers > 1:
                self._copy_in_workers()
            retrying(attempt, within_s=float("inf"), on_retry=again, first_delay=RETRY_FIRST_S,
                     max_delay=RETRY_MAX_S, stop=self.stop)
        except _NotYet:
            pass  # stopped while waiting to try again: resumable
        finally:
            self.close_consumer(consumer)
        done = sum(self.positions.values())
        return Progress(self.phase, done, done, self.events, 0, self.behind)

    def new_consumer(self) -> Any:
        # Large fetches for the history; a short broker wait so that, in the tail phase, records reach the
        # read-ahead as soon as they are written rather than a long-poll later (see kafka_clients).
        return kafka_clients.consumer(self.plan.kafka, f"kafold-rebuild.{self.plan.name}", **{
            "enable.partition.eof": False, "fetch.wait.max.ms": kafka_clients.RANGE_FETCH_WAIT_MS,
            "fetch.max.bytes": 64 * 1024 * 1024, "max.partition.fetch.bytes": 16 * 1024 * 1024,
            "queued.min.messages": 200000})

    def close_consumer(self, consumer: Any) -> None:
        try:
            self._settle(flush=False)  # what was folded ahead and not written is redone on resuming
        finally:
            self.writes.close()
            consumer.close()
            self.writer.close()
            self.tables.close()

    # ---- copy workers -----------------------------------------------------------------------------------
    def _copy_in_workers(self) -> None:
        """Copy the history in worker processes, each its own partitions (those more than `max_tail` behind),
        until each is near the live connector on its partitions (see the module note); meanwhile report the
        progress read from the shadow's checkpoints and save it. A worker that fails ends the run (resumable)."""
        p = self.plan
        targets = self.ours(offsets(p.pgc, p.name, self.tables.session()))
        split = rebuild_workers.shares(targets, self.positions, self.workers, self.max_tail)
        if not split:
            return  # nothing to split: the copy runs in this process
        self.log.info(f"{self.kind}.workers_started", workers=len(split),
                      partitions={i: [str(tp) for tp in share] for i, share in enumerate(split)})
        before, reported = self.events, self.events

        def watch(copied: int) -> None:
            nonlocal reported
            conn = self.tables.session()
            self.positions.update(self.ours(offsets(p.pgc, p.key, conn)))
            targets = self.ours(offsets(p.pgc, p.name, conn))
            self.copied_by_workers = copied
            self.events = before + copied
            self.behind = self.count_behind(targets)
            self.report_progress(self.events - reported, sum(targets.values()))
            reported = self.events
            self.save(self.phase)

        # the plan goes to each worker without its Protector: the worker builds its own from the Setup
        sent = (replace(p, protector=None), protect.sent(p.protector))
        rebuild_workers.run(p.name, split, _copier, (*sent, self.batch, self.max_tail, logs.current()), self.stop,
                            watch)

    def catch_up(self, consumer: Any) -> None:
        """Apply batches until the shadow has reached the live checkpoints read before its last batch (so what is
        left is what the live connector committed meanwhile) and is within `max_tail` of them on every partition:
        a run of the consumer loop (see _CatchUp); `stop` ends it early."""
        self.catching_up.loop.consumer = consumer
        self.catching_up.loop.run()

    def _targets(self) -> dict[TopicPartition, int]:
        """The live checkpoints now, and where the shadow stands against them; entering the tail phase when near."""
        targets = self.ours(offsets(self.plan.pgc, self.plan.name, self.tables.session()))
        self.behind = self.count_behind(targets)
        if self.phase == "copying" and self.share is None and self._near(targets):  # reads ahead from here on
            self.save("catching-up")
            self.report_progress(0, sum(targets.values()))
            self.log.info(f"{self.kind}.tail_phase_started", behind=self.behind)
        return targets

    def ours(self, targets: dict[TopicPartition, int]) -> dict[TopicPartition, int]:
        """The live checkpoints of the configured source topics (a topic dropped from the config is ignored)."""
        return {tp: off for tp, off in targets.items()
                if tp.topic in self.plan.topics and (self.share is None or tp in self.share)}

    def _past_markers(self, consumer: Any, batch: _Batch) -> None:
        """Offset note: a transaction's commit marker takes an offset no record has, and the live connector's
        checkpoint steps past it (daemon/runner.py `_past_markers`). A partition whose records end in a marker is
        therefore never reached by the records' offsets: where nothing was read ahead, the consumer's position (past
        the markers) moves the batch's advance up to it, at most to the target."""
        tps = [tp for tp in batch.targets if tp in self.assigned and tp not in self.ahead and tp not in batch.overrun]
        for kafka_tp in consumer.position([KafkaTP(tp.topic, tp.partition) for tp in tps]) if tps else ():
            tp = TopicPartition(kafka_tp.topic, kafka_tp.partition)
            reach = min(kafka_tp.offset, batch.targets[tp])
            if reach > batch.advance.get(tp, self.positions.get(tp, 0)):
                batch.advance[tp] = reach

    def caught_up(self, targets: dict[TopicPartition, int]) -> bool:
        return all(self.positions.get(tp, 0) >= off for tp, off in targets.items())

    def _near(self, targets: dict[TopicPartition, int]) -> bool:
        """Within `max_tail` records of the target on every partition: small enough to apply under the lock."""
        return all(off - self.positions.get(tp, 0) <= self.max_tail for tp, off in targets.items())

    def count_behind(self, targets: dict[TopicPartition, int]) -> int:
        return sum(max(0, off - self.positions.get(tp, 0)) for tp, off in targets.items())

    def _assign(self, consumer: Any, targets: dict[TopicPartition, int]) -> None:
        """Fetch the partitions that are behind their target (in the tail phase: every partition, reading ahead),
        from the shadow's checkpoint."""
        ahead = self.phase != "copying"
        want = {tp for tp, off in targets.items() if ahead or self.positions.get(tp, 0) < off}
        gone, new = self.assigned - want, want - self.assigned
        if gone:
            _unassign(consumer, gone)
            for tp in gone:
                self.ahead.pop(tp, None)
        if new:
            consumer.incremental_assign([KafkaTP(tp.topic, tp.partition, self.positions.get(tp) or OFFSET_BEGINNING)
                                         for tp in new])
        self.assigned = want

    def _step(self, consumer: Any, targets: dict[TopicPartition, int], wait_s: float = 0.5,
              save: bool = True) -> None:
        """One batch applied to the shadow (offsets below the targets only): first the messages read ahead in an
        earlier step, then, unless they reach the targets, consumed ones. The swap's tail under the lock runs it
        directly (its own deadline and short polls); the catch-up runs the same parts through the loop (_CatchUp)."""
        batch = self._prepare(consumer, targets)
        if batch.short(self.positions):
            self._add(batch, consumer.consume(self.batch, wait_s))
        self._apply(consumer, batch, save)

    def _prepare(self, consumer: Any, targets: dict[TopicPartition, int]) -> _Batch:
        """A step's assignment, and its batch started with the messages read ahead in an earlier step."""
        self._assign(consumer, targets)
        batch = _Batch(targets)
        buffered, self.ahead = self.ahead, {}
        for msgs in buffered.values():
            self._add(batch, msgs)
        return batch

    def _add(self, batch: _Batch, msgs: list[Message]) -> None:
        batch.count += len(msgs)
        self._take(msgs, batch.targets, batch.records, batch.dead, batch.advance, batch.overrun)

    def _apply(self, consumer: Any, batch: _Batch, save: bool) -> None:
        """Write a step's batch into the shadow, and re-fetch what was read ahead past the bound from the target."""
        targets, records, dead, advance, overrun, count = (batch.targets, batch.records, batch.dead, batch.advance,
                                                           batch.overrun, batch.count)
        if overrun:
            _unassign(consumer, overrun)
            self.assigned -= overrun
            for tp in overrun:
                self.ahead.pop(tp, None)
        if not advance:
            return
        prepared = self.writer.prepare(records) if records else None  # while the write in flight runs
        copying = save and self.phase == "copying"
        ahead = copying and self.writes.folds_ahead()
        if not self._settle(consumer, flush=not ahead):
            return  # rewound: this batch is read again from the stored checkpoints
        # copying: folded or written while the next batch is fetched and decoded
        self.writes.hand_over(records, dead, advance, prepared, ahead=ahead, background=copying)
        for tp, off in advance.items():  # a write in flight counts: it is settled before anything relies on it
            self.positions[tp] = max(off, self.positions.get(tp, 0))
        self.events += len(records)
        self.behind = self.count_behind(targets)
        self.report_progress(count, sum(targets.values()))
        if save and self.share is None:  # a copy worker's progress is saved by the coordinator
            self.save(self.phase)

    def _settle(self, consumer: Any = None, flush: bool = True) -> bool:
        """Wait for the shadow write in flight, and write what was folded ahead unless `flush` is False (an error
        ends the run: it resumes from the checkpoints in PostgreSQL, which that write did not move); False when
        folding ahead gave way (see _rewind)."""
        why = self.writes.settle(flush)
        if why is not None:
            self._rewind(consumer, why)
        return why is None

    def _rewind(self, consumer: Any, why: Rewind) -> None:
        """What was folded ahead cannot be written as folded (see ShadowWriter.fold_ahead): nothing of it was.
        Read again from the stored checkpoints and write batch by batch from now on, which isolates the events
        at fault as a live writer does."""
        self.rewinds += 1
        self.events -= why.events
        stored = self.writer.checkpoints()
        self.positions = {tp: stored.get(tp, 0) for tp in {*self.positions, *self.ours(stored)}}
        if consumer is not None and self.assigned:
            _unassign(consumer, self.assigned)
        self.assigned, self.ahead = set(), {}
        self.log.warning(f"{self.kind}.rewound", reason=str(why), events_again=why.events)

    def _take(self, msgs: list[Message], targets: dict[TopicPartition, int], records: list[SinkRecord],
              dead: list[DeadLetter], advance: dict[TopicPartition, int], overrun: set[TopicPartition]) -> None:
        """Each message into the batch when below its target; else kept to read ahead (in the tail phase, up to
        `max_tail` a partition), so that the tail under the lock is mostly in memory already. The copy's
        per-record loop, written tight as the runner's (records come in runs per partition)."""
        assigned, positions, ahead, reading_ahead = self.assigned, self.positions, self.ahead, self.phase != "copying"
        # Per run of one partition's records: whether the partition is taken, the next offset it needs (`floor`)
        # and its target are looked up once, and its advance is stored when the run ends (`pending`): a
        # TopicPartition's hash and equality are Python calls, several a record when looked up per record.
        tp: TopicPartition | None = None
        last_topic, last_part = None, -1
        skip, floor, target, pending = True, 0, 0, -1
        for m in msgs:
            err = m.error()
            if err is not None:
                self.catching_up.loop.consumer_error(err)  # before the batch is written: checkpoints do not move
                continue
            topic, part, off = m.topic(), m.partition(), m.offset()
            if part != last_part or topic != last_topic:
                if pending >= 0:
                    advance[tp] = pending  # type: ignore[index]
                    pending = -1
                tp, last_topic, last_part = TopicPartition(topic, part), topic, part
                skip = tp not in assigned or tp in overrun
                floor, target = advance.get(tp, positions.get(tp, 0)), targets.get(tp, 0)
            if skip or off < floor:
                continue  # fetched before an unassign, dropped with its read-ahead, or already covered
            assert tp is not None
            if off >= target:  # messages arrive in order: nothing in between exists, the shadow is at the target
                floor = advance[tp] = max(pending, advance.get(tp, 0), target)
                pending = -1
                kept = ahead.setdefault(tp, [])
                if reading_ahead and len(kept) < self.max_tail:
                    kept.append(m)
                else:
                    overrun.add(tp)
                    skip = True
                continue
            pending = floor = off + 1
            record = self.record_of(m, dead, topic, part, off)
            if record is not None:
                records.append(record)
        if pending >= 0:
            advance[tp] = pending  # type: ignore[index]

    def report_progress(self, batch: int, total: int) -> None:
        if self.on_progress is not None:
            self.on_progress(Progress(self.phase, sum(self.positions.values()), total, self.events, batch,
                                      self.behind))

    def record_of(self, m: Any, dead: list[DeadLetter], topic: str, part: int, off: int) -> SinkRecord | None:
        """The message as a SinkRecord; None when skipped or dead-lettered (as the live runner does)."""
        try:
            return self.plan.intake.record(m, topic, part, off)
        except RecordError as e:
            dead.append((RawRecord.of(m), e))
            return None

    # ---- the swap ---------------------------------------------------------------------------------------
    def _converge(self, consumer: Any) -> None:
        """The swap transaction: lock, apply the tail, `finish`; _NotYet (rolled back, nothing changed) when the
        tail under the lock is longer than `max_tail` or the lock was not granted in time."""
        if not self._settle(consumer):
            raise _NotYet("rewound to the stored checkpoints")
        p, c = self.plan, self.plan.config
        live = q.qualified(c.schema, c.table)
        started = time.perf_counter()
        locked: float | None = None
        try:
            with db.connect(p.pgc) as conn, conn.transaction():
                conn.execute(sql.SQL("SET LOCAL lock_timeout = {}").format(sql.Literal(f"{int(LOCK_WAIT_S * 1000)}ms")))
                exists = conn.execute("SELECT to_regclass(%s) IS NOT NULL",
                                      (q.regclass_text(c.schema, c.table),)).fetchone()
                live_exists = bool(exists and exists[0])
                # The live writer reads its held keys under this lock (shared): it sees the holds as swapped.
                conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (holds_lock(p.name),))
                if live_exists:  # waits for the live writer's batch in flight, blocks the next one
                    conn.execute(sql.SQL("LOCK TABLE {} IN ACCESS EXCLUSIVE MODE").format(live))
                locked = time.perf_counter()
                targets = self.ours(offsets(p.pgc, p.name, conn, lock=True))
                self.tail = tail = self.count_behind(targets)
                if not self._near(targets):
                    raise _NotYet(f"{tail} records behind under the lock (more than --max-tail {self.max_tail} on "
                                  "a partition)")
                self.phase = "swapping"
                tail_started = time.perf_counter()
                deadline = time.monotonic() + TAIL_WAIT_S
                while not self.caught_up(targets):  # the tail, into the shadow, while the live writer waits
                    if time.monotonic() > deadline or self.stop.is_set():
                        raise _NotYet("the tail did not arrive")
                    self._step(consumer, targets, 0.02, save=False)  # short polls: the live writer is waiting
                finish_started = time.perf_counter()
                self.tail_ms = round((finish_started - tail_started) * 1000, 1)
                self.finish(conn, live_exists)
                self.finish_ms = round((time.perf_counter() - finish_started) * 1000, 1)
                self.phase = "swapped"
        except psycopg.errors.LockNotAvailable as e:
            self.phase = "catching-up"
            raise _NotYet(f"the live table was not locked within {LOCK_WAIT_S:g} s") from e
        except _NotYet:
            self.phase = "catching-up"
            raise
        finally:
            if locked is not None:  # from the lock granted to the commit or the rollback
                self.locked_ms = round((time.perf_counter() - locked) * 1000, 1)
                self.lock_ms_max = max(self.lock_ms_max, self.locked_ms)
        assert locked is not None
        with db.connect(p.pgc) as conn, conn.transaction():
            self.tables.forget(conn)
        self.behind = 0
        self.report_progress(0, sum(self.positions.values()))
        self.log.info(f"{self.kind}.{self.done_event}", table=f"{c.schema}.{c.table}", events=self.events,
                      covered=sum(self.positions.values()), locked_ms=self.locked_ms,
                      lock_wait_ms=round((locked - started) * 1000, 1), tail_under_lock=self.tail,
                      tail_ms=self.tail_ms, finish_ms=self.finish_ms,
                      swap_retries=self.swap_retries, kept_old=self.keep_old)

    def finish(self, conn: psycopg.Connection[Any], live_exists: bool) -> None:
        """Under the lock, with the shadow equal to the live connector's checkpoints: swap the shadow in."""
        self.writer.close()
        self.tables.swap(conn, live_exists)
        self.save("swapped", conn)


def source_partitions(consumer: Any, plan: Plan) -> list[TopicPartition]:
    """Every partition of the plan's source topics (FatalError naming a topic that does not exist)."""
    out: list[TopicPartition] = []
    for topic in plan.topics:
        meta = consumer.list_topics(topic, timeout=15).topics.get(topic)
        if meta is None or meta.error is not None or not meta.partitions:
            raise FatalError(f"rebuild of {plan.name!r}: source topic {topic!r} does not exist")
        out += [TopicPartition(topic, p) for p in sorted(meta.partitions)]
    return out


def _copier(share: tuple[TopicPartition, ...], halt: Any, applied: Any, plan: Plan,
            protection: protect.Setup | None, batch: int, max_tail: int, log_config: tuple[str, str]) -> None:
    """A copy worker (a child process): copy `share` into the shadow until near the live connector on each of its
    partitions, protected fields opened by a Protector of its own (from `protection`, the parent's Setup). Stops
    early, its batch in flight written, when `halt` is set or its parent is gone (kill -9 included); Ctrl-C is left
    to the parent, which sets `halt`."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logs.configure(*log_config)
    if protection is not None:
        plan = replace(plan, protector=protect.build_setup(protection))
    parent = os.getppid()
    rebuild = Rebuild(plan, batch=batch, max_tail=max_tail, share=share,
                      on_progress=lambda p: setattr(applied, "value", p.events))

    def watch() -> None:
        while not rebuild.stop.wait(rebuild_workers.WATCH_S):
            if halt.is_set() or os.getppid() != parent:
                rebuild.stop.set()
    threading.Thread(target=watch, daemon=True, name="kafold-rebuild-watch").start()
    tune_interpreter()
    consumer = rebuild.new_consumer()
    try:
        rebuild.positions = {tp: off for tp, off in rebuild.writer.checkpoints().items() if tp in share}
        for tp in share:
            rebuild.positions.setdefault(tp, 0)
        rebuild.catch_up(consumer)
    finally:
        rebuild.stop.set()
        rebuild.close_consumer(consumer)
    rebuild.log.info(f"{rebuild.kind}.worker_done", partitions=[str(tp) for tp in share], events=rebuild.events,
                     covered=sum(rebuild.positions.values()), stopped=halt.is_set() or os.getppid() != parent)
