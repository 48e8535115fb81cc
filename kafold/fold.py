"""The one aggregate fold: `Folder` applies a partition's events to states, read through the envelope's fast decoder.

The runtime's recovery, `state get`, restore, `snapshot verify` and the snapshot runs (local and Spark) all fold
with it, so they agree on every event. Where the states live is the `States` the Folder is given: the runtime's
StateStore (bounded, with evicted ids and the idempotency window) or a snapshot run's states on top of base
snapshots (kafold.snapshot.fold).

Offset note: `Folder.fold` takes a partition's events in offset order. An event below its aggregate's `covered`
offset (already in a base snapshot's state) is skipped unread; an event whose version is not above its aggregate's
current version (covered by a snapshot, or a duplicate write) is skipped too, so a replay never folds an event twice.

Reading: the envelope's fast path (`envelope.peek_body`, msgspec in C) reads every event kafold wrote, faster than
parsing to a dict. When it declines, the body is read as plain JSON (`Loose`) and the fold's own checks decide
(version an integer, key equal to the aggregate id, the domain building the event): the envelope's decoder is
stricter (unknown fields, version bounds, id lengths) than what a fold has always accepted, and an event once folded
must stay foldable, or a replay would come to a different state than the one the runtime decided commands on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Generic, Protocol, TypeVar

import orjson

from kafold.envelope import peek_body

UNSET: Any = object()  # an entry's state not built yet (a snapshot run builds it from its base on first use)


class Loose:
    """The fields a fold reads from a JSON object the fast path declined (KeyError: a field the fold needs is
    missing; TypeError: not a JSON object). The optional ones are None when absent."""

    __slots__ = ("aggregate_id", "causation_id", "event_id", "occurred_at", "payload", "type", "version")

    def __init__(self, body: Any) -> None:
        self.aggregate_id, self.version = body["aggregate_id"], body["version"]
        self.type, self.payload = body["type"], body["payload"]
        self.causation_id, self.occurred_at = body.get("causation_id"), body.get("occurred_at")
        self.event_id = body.get("event_id")


def fields(value: bytes | None) -> Any:
    """An event body's fields as attributes (aggregate_id, version, type, payload, causation_id, occurred_at,
    event_id); raises (orjson.JSONDecodeError, KeyError, TypeError) when it is no event a fold can read.
    Integers beyond 64 bits in a payload read exactly on the fast path (the plain path rounds them to floats, as
    folds always did); kafold's own `encode` never writes them."""
    body = peek_body(value)
    return body if body is not None else Loose(orjson.loads(value))  # type: ignore[arg-type]


class Kernel(Protocol):
    """What a fold needs of an aggregate's domain (kafold.domain.AggregateDomain, kafold.snapshot.fold.Domain)."""

    @property
    def evolve(self) -> Callable[[Any, Any], Any]: ...

    @property
    def event(self) -> Callable[[str, dict[str, Any]], Any]: ...


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

    def __init__(self, domain: Kernel, held: H) -> None:
        self.domain, self.held = domain, held
        self.read = 0        # events seen
        self.folded = 0      # events applied
        self.skipped = 0     # covered by a snapshot or duplicate versions
        self.bad = 0         # could not be decoded or applied; left out of every state
        self.first_bad: list[tuple[int, str]] = []

    def fold(self, offsets: Sequence[int], keys: Sequence[bytes | None], values: Sequence[bytes | None]) -> None:
        """Apply one batch of events (parallel sequences, offset order). A bad event changes nothing."""
        held = self.held
        entries, new, add, note = held.entries, held.new, held.add, held.note
        read, make, evolve = fields, self.domain.event, self.domain.evolve
        folded = skipped = 0
        for offset, key, value in zip(offsets, keys, values, strict=True):
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
                state = evolve(state, make(body.type, body.payload))
                cause = body.causation_id
                if cause:
                    note(entry, aid, cause, body.occurred_at, version, body.event_id)
            except Exception as e:  # a bad event is left out of the state, counted and logged per batch
                self.bad += 1
                if len(self.first_bad) < 5:
                    self.first_bad.append((offset, type(e).__name__))
                continue
            entry.state, entry.version = state, version
            if fresh:
                add(aid, entry)
            folded += 1
        self.read += len(offsets)
        self.folded += folded
        self.skipped += skipped

    def fold_messages(self, batches: Iterable[tuple[list[int], list[bytes | None], list[bytes | None]]]) -> None:
        """Fold (offsets, keys, values) batches."""
        for offsets, keys, values in batches:
            self.fold(offsets, keys, values)

    def fold_records(self, msgs: Sequence[Any]) -> None:
        """Fold consumed records (errors and EOFs filtered out by the caller)."""
        self.fold([m.offset() for m in msgs], [m.key() for m in msgs], [m.value() for m in msgs])
