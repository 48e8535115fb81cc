"""The connector contract, Kafka Connect-style: a Connector splits work into tasks; tasks move records.

Note on offsets and commits
---------------------------
* A committed offset is the *next* offset to read: after handling the record at offset 41 of a partition, the
  runner offers ``{tp: 42}``.
* The runner calls ``put`` with a batch, and only after ``put`` returned (and every dead-lettered record
  of the batch was acknowledged by the DLQ topic) calls ``pre_commit(offsets)`` with the offsets after it.
  What ``pre_commit`` returns is exactly what gets committed to the consumer group; the default flushes and
  returns its argument. A task that stores its offsets elsewhere (the projection connector keeps them in
  PostgreSQL, in the same transaction as its rows) returns ``{}`` — nothing is committed to Kafka — and in
  ``open`` seeks to its own offsets with ``context.offset(tp, offset)``. Such a task sets ``stores_offsets``: its
  Kafka commit is then only a follower of its store, and the runner calls ``pre_commit`` on a timer
  (``[daemon] offset_flush_interval_ms``, as Kafka Connect's ``offset.flush.interval.ms``; and on revoke and stop)
  instead of after every batch. Other tasks are asked after every batch.
* Hence delivery into a task is at-least-once: after a crash or rebalance a task sees again every record after
  the last committed offset, so ``put`` must be idempotent (e.g. keyed on ``event.event_id``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Literal, TypeVar

from kafold.envelope import Event, encode

if TYPE_CHECKING:
    from kafold.config import ConnectorConfig, KafkaConfig, PostgresConfig
    from kafold.connectors.intake import Intake
    from kafold.protect import Protector

C = TypeVar("C")
Offsets = Mapping["TopicPartition", int]


@dataclass(frozen=True, order=True, slots=True)
class TopicPartition:
    """A partition of a topic."""

    topic: str
    partition: int

    def __str__(self) -> str:
        return f"{self.topic}[{self.partition}]"


@dataclass(frozen=True, slots=True)
class SinkRecord:
    """A decoded event as a sink task receives it, with its Kafka coordinates. Immutable."""

    topic: str
    partition: int
    offset: int
    key: str
    event: Event
    timestamp_ms: int | None = None
    # The record as it came from Kafka (a confluent-kafka Message or a RawRecord), when the intake made this one:
    # the event may hold protected fields the intake opened, so a copy kept of it (a dead letter) is made from
    # these bytes, sealed as they came, never from the opened event (see RawRecord.of).
    source: Any = field(default=None, compare=False, repr=False)

    @property
    def tp(self) -> TopicPartition:
        return TopicPartition(self.topic, self.partition)


_new = object.__new__
_SINK_SET = tuple(SinkRecord.__dict__[name].__set__
                  for name in ("topic", "partition", "offset", "key", "event", "timestamp_ms", "source"))


def sink_record(topic: str, partition: int, offset: int, key: str, event: Event,
                timestamp_ms: int | None, source: Any = None) -> SinkRecord:
    """SinkRecord(...) for the runner's per-record loop: fills the slots directly (the frozen dataclass's
    __init__ calls object.__setattr__ per field, ~0.6 µs a record more); the result is the same immutable record."""
    r = _new(SinkRecord)
    s = _SINK_SET
    s[0](r, topic)
    s[1](r, partition)
    s[2](r, offset)
    s[3](r, key)
    s[4](r, event)
    s[5](r, timestamp_ms)
    s[6](r, source)
    return r


@dataclass(frozen=True, slots=True)
class RawRecord:
    """A Kafka record as bytes (what the dead-letter queue stores)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, str | bytes | None], ...] = ()
    timestamp_ms: int | None = None

    @classmethod
    def of(cls, record: Any, protector: Protector | None = None) -> RawRecord:
        """A RawRecord from a confluent-kafka Message, a SinkRecord or a RawRecord. A SinkRecord gives the record
        it was decoded from (its `source`: protected fields sealed as they came); one made without a source is
        re-encoded, its protected fields sealed again by `protector` (kafold.protect; the task's, TaskConfig's):
        never a clear protected value."""
        if isinstance(record, RawRecord):
            return record
        if isinstance(record, SinkRecord):
            if record.source is not None:
                return cls.of(record.source)
            key, value, headers = encode(record.event if protector is None else protector.resealed(record.event))
            return cls(record.topic, record.partition, record.offset, key, value, tuple(headers),
                       record.timestamp_ms)
        kind, ts = record.timestamp()
        return cls(record.topic(), record.partition(), record.offset(), record.key(), record.value(),
                   tuple(record.headers() or ()), ts if kind else None)


@dataclass(frozen=True, slots=True)
class SourceRecord:
    """A record a source task wants produced."""

    topic: str
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...] = ()
    partition: int | None = None


@dataclass(frozen=True, slots=True)
class TaskConfig(Generic[C]):
    """What one task runs with: its id, the connector's validated settings (its `config_class`), its dead-letter
    topic and the services the host resolved: `kafka` always (the runner fills it in), `postgres` for a connector
    with `uses_postgres` run by the daemon (a task driven outside it may read `[postgres]` from the environment,
    `kafold.db.from_environment`), and `protector`, the host's (kafold.protect) when its configuration has protected
    fields: what opens them as the records come in and seals them again in what the task keeps (None: nothing is
    protected). Connector.task_configs makes them; the host adds the services."""

    task_id: int
    config: C
    dlq_topic: str | None = None
    kafka: KafkaConfig | None = None
    postgres: PostgresConfig | None = None
    protector: Protector | None = None
    # Told (from whichever of the task's threads committed) the next offsets its store has just committed, e.g. a
    # projection's checkpoints: the daemon wakes the waits on them (daemon.visibility). None: nobody listens.
    on_stored: Callable[[Mapping[TopicPartition, int]], None] | None = None

    def with_services(self, kafka: KafkaConfig | None = None, postgres: PostgresConfig | None = None,
                      protector: Protector | None = None) -> TaskConfig[C]:
        """This config with the host's services (None keeps what it has)."""
        return replace(self, kafka=kafka or self.kafka, postgres=postgres or self.postgres,
                       protector=protector or self.protector)


@dataclass(frozen=True, slots=True)
class Outcomes:
    """What became of the records a sink task was handed by `put` on one partition, counted since `start`: the
    task's half of the offset accounting (see `SinkTask.outcomes`)."""

    applied: int = 0  # taken into the task's store (a row written, left unchanged, an effect done)
    duplicates: int = 0  # already handled before (same event id)
    stale: int = 0  # older than what the store already holds (version guard)
    dead_lettered: int = 0  # refused by the task itself and kept as a dead letter (or held behind one)

    def __add__(self, other: Outcomes) -> Outcomes:
        return Outcomes(self.applied + other.applied, self.duplicates + other.duplicates,
                        self.stale + other.stale, self.dead_lettered + other.dead_lettered)


class ErrantRecordReporter(ABC):
    """Sends records that cannot be processed to the connector's dead-letter topic."""

    @abstractmethod
    def report(self, record: Any, error: BaseException) -> None:
        """Queue `record` (a Message, RawRecord or SinkRecord) for the dead-letter topic; returns at once."""

    @abstractmethod
    def flush(self, timeout: float) -> None:
        """Block until every reported record is acknowledged; raise RetriableError if some are not yet."""


class SinkTaskContext(ABC):
    """What a sink task may ask of the runner that drives it."""

    connector_name: str
    task_id: int

    @abstractmethod
    def assignment(self) -> frozenset[TopicPartition]:
        """The partitions currently assigned to this task."""

    @abstractmethod
    def pause(self, *partitions: TopicPartition) -> None:
        """Stop fetching from these partitions (the consumer keeps its group membership)."""

    @abstractmethod
    def resume(self, *partitions: TopicPartition) -> None:
        """Fetch again from partitions paused with `pause`."""

    @abstractmethod
    def offset(self, tp: TopicPartition, offset: int) -> None:
        """Continue `tp` from `offset` (the next offset to read): applied before the next fetch; from `open`,
        the partition starts there instead of the committed offset."""

    @abstractmethod
    def request_commit(self) -> None:
        """Ask for a pre_commit/commit cycle as soon as possible."""

    @abstractmethod
    def errant_record_reporter(self) -> ErrantRecordReporter | None:
        """The dead-letter reporter of this connector."""

    def committed_offsets(self) -> Mapping[TopicPartition, int]:
        """The offsets the runner has committed to Kafka (next offset to read, per partition), as far as it
        knows: a task that must act only after a commit (at-most-once) checks here that the commit happened."""
        return {}


class BatchReader(ABC):
    """A task's reading of one batch straight from its Kafka records, without a SinkRecord (nor an Event) per record:
    the runner offers it each record in order (`take`, after the record's error check and offset accounting) and
    hands `records()` to `put`. Where `take` says False the reader is dropped and the whole batch is decoded again
    record by record (`Intake.record`), which decides each record as always (dead letters, skips): so a reader takes
    only records that path would turn into SinkRecords without a doubt, and its `records()` must give those very
    SinkRecords when read one by one."""

    @abstractmethod
    def take(self, m: Any, topic: str, partition: int, offset: int) -> bool:
        """Take the record `m` (a confluent-kafka Message) at these coordinates; False when it cannot."""

    @abstractmethod
    def records(self) -> Sequence[SinkRecord]:
        """The batch taken, as `put` receives it."""

    @abstractmethod
    def event_times(self) -> dict[TopicPartition, int]:
        """The event time (epoch ms) of the batch's last record per partition (what the runner's progress shows)."""


class SinkTask(ABC):
    """Receives batches of decoded events from Kafka. Required: start, put, stop."""

    # The task keeps its offsets in its own store and seeks to them in `open` (see the module note): the runner
    # then commits to Kafka on a timer (`[daemon] offset_flush_interval_ms`), not after every batch.
    stores_offsets: ClassVar[bool] = False
    # Otherwise: the least time between two commits after batches and `request_commit`s (0: after every batch). A
    # task may set its own in `start`; revoke and stop always commit.
    commit_interval_s: float = 0.0
    # The task continues its records' traces in spans of its own (kafold.tracing.recall): with tracing on, the
    # runner keeps each batch's trace headers for it.
    continues_traces: ClassVar[bool] = False

    @abstractmethod
    def start(self, task_config: TaskConfig[Any], context: SinkTaskContext) -> None:
        """Prepare the task (open connections); `task_config` is one of Connector.task_configs(), with the
        host's services."""

    @abstractmethod
    def put(self, records: Sequence[SinkRecord]) -> None:
        """Handle a batch, in offset order per partition.

        Raise RetriableError to be offered the same batch again after a back-off, FatalError to stop the
        task, RecordError(raw=record) to dead-letter that one record (the rest of the batch is offered again).
        """

    def handles(self, event_type: str) -> bool:
        """Whether this task wants `event_type`; other events follow the connector's `on_unknown_type`."""
        return True

    def batch_reader(self, intake: Intake, size: int) -> BatchReader | None:
        """A reader of the next batch (`size` records) straight from its records (BatchReader), or None (the
        default): every record decoded by `intake`, one SinkRecord each."""
        return None

    def on_dead_letter(self, record: Any, error: BaseException) -> None:
        """Told of each record the runner dead-lettered before `put` (undecodable, unknown type), after it was
        handed to the reporter; a task that keeps its own dead-letter store records it here. Default: nothing."""
        return None

    def yield_point(self) -> None:
        """Called by the runner every few hundred records while it decodes a batch: a task whose own thread needs
        the interpreter right now (the projection's writer between PostgreSQL round trips) may wait here briefly,
        so the GIL goes to the slower stage first. Must return within a few milliseconds. Default: nothing."""
        return None

    def flush(self, offsets: Offsets) -> None:
        """Make everything handed to `put` up to `offsets` durable."""
        return None

    def pre_commit(self, offsets: Offsets) -> Offsets:
        """The offsets to commit to Kafka (next offset to read); default: flush, then commit all of them."""
        self.flush(offsets)
        return offsets

    def status(self) -> dict[str, Any]:
        """Task-specific state for /metrics and `kafold status` (plain JSON values; called from other threads,
        so it only reads). Default: nothing."""
        return {}

    def outcomes(self) -> Mapping[TopicPartition, Outcomes] | None:
        """Per partition, what became of the records handed to `put` since `start`, once decided (a write still in
        flight counts when it is done): the offset accounting, where the runner counts the records it saw and
        those it dead-lettered or skipped itself (RecordError from `put` included), so that per partition
        seen = applied + duplicates + stale + dead_lettered + skipped, and a record dropped silently shows as a
        gap. Called from other threads: return a snapshot that is never changed afterwards. None (the default):
        the task does not tell, and every record put counts as applied."""
        return None

    def open(self, partitions: Collection[TopicPartition]) -> None:
        """Partitions newly assigned to this task (seek with context.offset if offsets live elsewhere)."""
        return None

    def close(self, partitions: Collection[TopicPartition]) -> None:
        """Partitions taken away (rebalance, shutdown); drop per-partition state."""
        return None

    @abstractmethod
    def stop(self) -> None:
        """Release everything `start` acquired."""


class SourceTask(ABC):
    """Produces records into Kafka."""

    @abstractmethod
    def start(self, task_config: TaskConfig[Any]) -> None:
        """Prepare the task."""

    @abstractmethod
    def poll(self) -> list[SourceRecord]:
        """The next records to produce (may be empty); should return within about a second."""

    def commit(self) -> None:
        """Every record returned by poll so far has been acknowledged by Kafka."""
        return None

    @abstractmethod
    def stop(self) -> None:
        """Release everything `start` acquired."""


@dataclass(frozen=True, slots=True)
class Metric:
    """A metric a connector exports on the daemon's `/metrics` (Prometheus): declared once on the connector class,
    sampled at scrape time by `Connector.sample_metrics`."""

    name: str
    help: str
    labels: tuple[str, ...] = ("connector",)
    kind: Literal["gauge", "counter"] = "gauge"


@dataclass(frozen=True, slots=True)
class TaskView:
    """What the daemon shows a connector of one of its running tasks when it samples metrics: the task's id, its
    `SinkTask.status()` (read from its thread or its process) and its task config (with the services it got)."""

    task_id: int
    status: Mapping[str, Any]
    config: TaskConfig[Any]


Sample = tuple[str, Sequence[str], float]  # metric name, label values (in the metric's label order), value


class Connector(ABC, Generic[C]):
    """A configured plugin: its settings are validated through `config_class`; it splits work into tasks.

    `config_class` is a frozen dataclass declared with `kafold.schema.setting` (shown in `kafold config
    reference`); `task_class` is the SinkTask or SourceTask subclass the runner instantiates per task.
    """

    config_class: ClassVar[type[Any]]
    task_class: ClassVar[type[SinkTask] | type[SourceTask]]
    version: ClassVar[str] = "0.1.0"
    # Whether its tasks need the [postgres] section (the host then resolves it and passes it as "postgres").
    uses_postgres: ClassVar[bool] = False
    # Its own metrics on the daemon's /metrics (families shared by every connector of the class).
    metrics: ClassVar[tuple[Metric, ...]] = ()

    def __init__(self, settings: ConnectorConfig, config: C) -> None:
        self.settings = settings
        self.config = config

    @property
    def name(self) -> str:
        return self.settings.name

    @classmethod
    def is_sink(cls) -> bool:
        return issubclass(cls.task_class, SinkTask)

    def task_configs(self, max_tasks: int) -> list[TaskConfig[C]]:
        """One config per task to run (at most `max_tasks`); default: a single task sharing the settings."""
        return [TaskConfig(0, self.config, self.settings.dlq_topic)]

    def sample_metrics(self, tasks: Sequence[TaskView]) -> Iterable[Sample]:
        """The current values of `metrics` for this connector, from its running tasks; called at every scrape of
        `/metrics` from the daemon's HTTP thread (read only, quick: cache anything that costs a round trip).
        A sample's labels follow its metric's `labels`. Default: none."""
        return ()

    def stop(self) -> None:
        """Called once every task of the connector stopped."""
        return None
