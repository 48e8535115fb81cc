"""The one aggregate fold: `Folder` applies a partition's events to states, read through the envelope's fast decoder.

The runtime's recovery, `state get`, restore, `snapshot verify` and the snapshot runs (local and Spark) all fold
with it, so they agree on every event. Where the states live is the `States` the Folder is given: the runtime's
StateStore (bounded, with evicted ids and the idempotency window) or a snapshot run's states on top of base
snapshots (kafold.snapshot.fold).

Offset note: `Folder.fold` takes a partition's events in offset order. An event below its aggregate's `covered`
offset (already in a base snapshot's state) is skipped unread; an event whose version is not above its aggregate's
current version (covered by a snapshot, or a duplicate write) is skipped too, so a replay never folds an event twice.

A fold error is never skipped silently: an event that cannot be read or folded (its bytes, its type or payload
under the current code, `evolve` raising) raises FoldError naming the offset, aggregate, event type and exception,
after the events before it in the batch were applied; the caller stops there (the runtime keeps the partition's
gate closed, a snapshot run or `state get` fails). Under `on_fold_error = "dead-letter"` the Folder parks it
instead (`parked`: offset, key, value, error), leaves it out of every state and goes on; the caller dead-letters it.

Reading: the envelope's fast path (`envelope.peek_body`, msgspec in C) reads every event kafold wrote, faster than
parsing to a dict. When it declines, the body is read leniently (`envelope.lenient_body`, from the same schema) and
the fold's own checks decide (version an integer, key equal to the aggregate id, the domain building the event): the
envelope's decoder is stricter (unknown fields, version bounds, id lengths) than what a fold has always accepted,
and an event once folded must stay foldable, or a replay would come to a different state than the one the runtime
decided commands on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Generic, Protocol, TypeVar

from kafold.config import FoldErrorPolicy
from kafold.envelope import lenient_body, peek_body
from kafold.errors import KafoldError, redact_quoted
from kafold.kafka_message import Message
from kafold.stages import Stage
from kafold.upcast import UpcastError

UNSET: Any = object()  # an entry's state not built yet (a snapshot run builds it from its base on first use)


def fields(value: bytes | None) -> Any:
    """An event body's fields as attributes (aggregate_id, version, type, payload, causation_id, occurred_at,
    event_id, schema_version): the envelope's fast path, else its lenient reading; raises (msgspec.MsgspecError,
    TypeError) when it is no event a fold can read."""
    body = peek_body(value)
    return body if body is not None else lenient_body(value)


class FoldError(KafoldError):
    """An event a fold cannot apply: where it is, in which `stage` and why (`partition` is filled by callers that
    know it)."""

    def __init__(self, offset: int, aggregate_id: str | None, event_type: str | None, error: BaseException,
                 partition: int | None = None, *, protected: bool = False, stage: Stage = Stage.DECODE) -> None:
        self.offset, self.aggregate_id, self.event_type, self.error = offset, aggregate_id, event_type, error
        self.partition, self.protected, self.stage = partition, protected, stage
        super().__init__(self.describe())

    @property
    def message(self) -> str:
        """The error's own text; for an aggregate with protected fields its quoted literals are redacted (evolve
        and the upcasters saw the opened values, and this text goes to logs, /status and dead-letter headers)."""
        return redact_quoted(str(self.error)) if self.protected else str(self.error)

    def describe(self) -> str:
        where = f"partition {self.partition} " if self.partition is not None else ""
        return (f"cannot fold the event at {where}offset {self.offset} (aggregate {self.aggregate_id!r}, "
                f"type {self.event_type!r}): {type(self.error).__name__}: {self.message}")

    def fields(self) -> dict[str, Any]:
        """For a log line."""
        return {"partition": self.partition, "offset": self.offset, "aggregate_id": self.aggregate_id,
                "event_type": self.event_type, "stage": str(self.stage), "error_class": type(self.error).__name__,
                "error": self.message}


def domain_event(kernel: Kernel, body: Any) -> Any:
    """The domain event of a read event body (`fields`), as every path reads it: the live path, replays, snapshot
    runs and `state get` all call this. Protected fields are opened first (kafold.protect), before upcasters."""
    unseal = getattr(kernel, "unseal", None)
    payload = body.payload if unseal is None else unseal(body.type, body.aggregate_id, body.payload)
    return kernel.event(body.type, payload, body.schema_version)


class Parked:
    """An event left out under `on_fold_error = "dead-letter"`: its coordinates, bytes and why."""

    __slots__ = ("error", "key", "offset", "value")

    def __init__(self, offset: int, key: bytes | None, value: bytes | None, error: FoldError) -> None:
        self.offset, self.key, self.value, self.error = offset, key, value, error


class Kernel(Protocol):
    """What a fold needs of an aggregate's domain (kafold.domain.AggregateDomain, kafold.snapshot.fold.Domain)."""

    @property
    def evolve(self) -> Callable[[Any, Any], Any]: ...

    @property
    def event(self) -> Callable[[str, dict[str, Any], int], Any]: ...

    @property
    def on_fold_error(self) -> FoldErrorPolicy: ...


class States(Protocol):
    """Where a Folder keeps states: `entries` maps an aggregate id to an object with `state` (or UNSET), `version`
    and `covered` (the offset its base covers: events below it are in the state)."""

    @property
    def entries(self) -> Mapping[str, Any]: ...

    def new(self, aggregate_id: str) -> Any | None:
        """A fresh entry (version 0) for an id not in `entries`, not yet added; None: not folded here."""

    def add(self, aggregate_id: str, entry: Any) -> None:
        """Keep the entry `new` gave, once an event of it folded."""

    def thaw(self, entry: Any) -> Any:
        """The state of an entry whose state is UNSET."""

    def note(self, entry: Any, aggregate_id: str, cause: str, occurred_at: Any, version: int, event_id: Any) -> None:
        """A folded event's command id, for the idempotency window; raises (leaving nothing changed) on a bad time."""


H = TypeVar("H", bound=States)


class Folder(Generic[H]):
    """Folds the events of one partition into `held` (see the module docstring); counts and names bad events."""

    def __init__(self, domain: Kernel, held: H, partition: int | None = None) -> None:
        self.domain, self.held, self.on_error, self.partition = domain, held, domain.on_fold_error, partition
        self.read = 0        # events seen
        self.folded = 0      # events applied
        self.skipped = 0     # covered by a snapshot or duplicate versions
        self.parked: list[Parked] = []  # left out under on_fold_error = "dead-letter" (the caller takes them)
        self.bad = 0         # parked in total

    def fold(self, offsets: Sequence[int], keys: Sequence[bytes | None], values: Sequence[bytes | None]) -> None:
        """Apply one batch of events (parallel sequences, offset order). An event that cannot be folded changes
        nothing and raises FoldError (the events before it applied), or is parked (see the module docstring)."""
        held = self.held
        entries, new, add, note = held.entries, held.new, held.add, held.note
        read, make, evolve = fields, self.domain.event, self.domain.evolve
        unseal = getattr(self.domain, "unseal", None)  # protected fields (kafold.protect), opened before upcasters
        folded = skipped = 0
        for offset, key, value in zip(offsets, keys, values, strict=True):
            aid = body = None
            stage = Stage.DECODE  # where this event is, for a FoldError (one local store per stage: the hot loop)
            try:
                aid = key.decode()  # type: ignore[union-attr]  # no key: a bad event
                entry: Any = entries.get(aid)
                if entry is not None and offset < entry.covered:
                    skipped += 1
                    continue
                body = read(value)
                version = body.version
                if type(version) is not int:
                    raise TypeError("version is not an integer")
                fresh = entry is None
                if fresh:
                    entry = new(aid)
                    if entry is None:
                        continue
                if version <= entry.version:
                    skipped += 1
                    continue
                if body.aggregate_id != aid:
                    raise ValueError("key does not match aggregate_id")
                state = entry.state
                if state is UNSET:
                    state = held.thaw(entry)
                stage = Stage.READ  # or UPCAST, told apart by the exception below
                payload = body.payload if unseal is None else unseal(body.type, aid, body.payload)
                event = make(body.type, payload, body.schema_version)  # as domain_event
                stage = Stage.FOLD
                state = evolve(state, event)
                stage = Stage.DECODE  # the command id's time
                cause = body.causation_id
                if cause:
                    note(entry, aid, cause, body.occurred_at, version, body.event_id)
            except Exception as e:
                if stage is Stage.READ and isinstance(e, UpcastError):
                    stage = Stage.UPCAST
                error = FoldError(offset, aid, getattr(body, "type", None), e, self.partition,
                                  protected=unseal is not None, stage=stage)
                if self.on_error is not FoldErrorPolicy.DEAD_LETTER:
                    self._count(len(offsets), folded, skipped)
                    raise error from e
                self.parked.append(Parked(offset, key, value, error))
                self.bad += 1
                continue
            entry.state, entry.version = state, version
            if fresh:
                add(aid, entry)
            folded += 1
        self._count(len(offsets), folded, skipped)

    def _count(self, read: int, folded: int, skipped: int) -> None:
        self.read += read
        self.folded += folded
        self.skipped += skipped

    def fold_messages(self, batches: Iterable[tuple[list[int], list[bytes | None], list[bytes | None]]]) -> None:
        """Fold (offsets, keys, values) batches."""
        for offsets, keys, values in batches:
            self.fold(offsets, keys, values)

    def fold_records(self, msgs: Sequence[Message]) -> None:
        """Fold consumed records (errors and EOFs filtered out by the caller)."""
        self.fold([m.offset() for m in msgs], [m.key() for m in msgs], [m.value() for m in msgs])
