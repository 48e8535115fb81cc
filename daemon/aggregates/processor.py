"""Deciding one command against its aggregate's entry: the events to write, the result, and the new state. Pure."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kafold.daemon.aggregates import window
from kafold.daemon.aggregates.store import Entry
from kafold.domain import AggregateDomain, InvalidCommand, InvalidEvent, UnreadableEvent
from kafold.envelope import Event, Headers, encode
from kafold.errors import FatalError, RecordError
from kafold.fold import domain_event, fields
from kafold.messages import ACCEPTED, REJECTED, Command, Result

Encoded = tuple[bytes, bytes, Headers]


@dataclass
class Handled:
    """What handling a command produced. `error` set = the command is also dead-lettered (a client or domain
    defect, not a business rejection). `state`/`version` are the entry's values after the command. `remember`:
    the outcome to keep in the idempotency window (None for a repeat, which keeps the first)."""

    result: Result
    events: list[Encoded] = field(default_factory=list)
    state: Any = None
    version: int = 0
    error: RecordError | None = None
    remember: window.Remembered | None = None
    refused: str | None = None  # why the last line of defence answered instead of writing


def _reject(cmd: Command, entry: Entry, reason: str, t: int, at: str, error: RecordError | None = None
            ) -> Handled:
    return Handled(Result(cmd.command_id, cmd.aggregate_id, REJECTED, entry.version, (), reason,
                          cmd.correlation_id, at=at), [], entry.state, entry.version, error,
                   window.rejected(t, entry.version, reason))


event_ids = window.event_ids


def repeat(cmd: Command, entry: Entry, seen: window.Remembered, at: str) -> Handled:
    """The first outcome of `cmd.command_id` again, as a duplicate: nothing written, state unchanged."""
    _, version, n, reason = window.unpack(seen)
    ids = () if reason is not None else event_ids(cmd.command_id, version - n, n)
    return Handled(Result(cmd.command_id, cmd.aggregate_id, ACCEPTED if reason is None else REJECTED, version, ids,
                          reason, cmd.correlation_id, duplicate=True, at=at), [], entry.state, entry.version)


def handle(domain: AggregateDomain, cmd: Command, entry: Entry, at: str, t: int, window_ms: int) -> Handled:
    """Decide `cmd` (its command time: `at`, ISO; `t`, ms) on `entry` (not modified). Never raises on bad input:
    it becomes a rejected result. A command id decided within `window_ms` before repeats its first outcome."""
    seen = entry.recent.get(cmd.command_id)
    if seen is not None and t - window.time_of(seen) <= window_ms:
        return repeat(cmd, entry, seen, at)
    out = _decide(domain, cmd, entry, at, t)
    for eid in out.result.event_ids:
        owner = entry.events.get(hash(eid))
        if owner is not None:  # the last line of defence: an event id already in this aggregate's window
            first = entry.recent.get(owner)
            why = f"an event id it would write was already written by command {owner!r}"
            answer = repeat(cmd, entry, first, at) if first is not None else _reject(cmd, entry, why, t, at)
            answer.refused = why
            return answer
    return out


def _decide(domain: AggregateDomain, cmd: Command, entry: Entry, at: str, t: int) -> Handled:
    if cmd.expected_version is not None and cmd.expected_version != entry.version:
        return _reject(cmd, entry, f"expected version {cmd.expected_version}, aggregate is at {entry.version}",
                       t, at)
    try:
        command = domain.command(cmd.type, cmd.data)
    except InvalidCommand as e:
        return _reject(cmd, entry, str(e), t, at, RecordError(str(e), reason=e.reason))
    try:
        decided = domain.decide(command, entry.state)
    except domain.rejections as e:
        return _reject(cmd, entry, str(e) or type(e).__name__, t, at)
    except Exception as e:  # a bug in decide must not stop the runtime: dead-letter the command
        msg = f"decide raised {type(e).__name__}: {e}"
        return _reject(cmd, entry, msg, t, at, RecordError(msg, reason="decide-error"))
    if not isinstance(decided, list | tuple):
        msg = f"decide returned {type(decided).__name__}, expected a list of events"
        return _reject(cmd, entry, msg, t, at, RecordError(msg, reason="decide-error"))
    state, version = entry.state, entry.version
    events: list[Encoded] = []
    ids = event_ids(cmd.command_id, version, len(decided))
    codec = domain.codec
    newest = codec.upcaster.version_of  # decide writes every type at its newest schema version
    try:
        for i, ev in enumerate(decided):
            type_name, payload, as_is = codec.written(ev)
            if domain.protector is not None:  # personal data leaves only encrypted (kafold.protect)
                payload = domain.protector.seal(domain.name, type_name, cmd.aggregate_id, payload)
            written = encode(Event(ids[i], type_name, domain.name, cmd.aggregate_id, version + i + 1, at,
                                   cmd.correlation_id or cmd.command_id, payload, newest(type_name), cmd.command_id))
            # Live = replay: evolve the event as every reader will read it back from these bytes, not the object
            # decide returned (a tuple would stay a tuple here and come back a list from JSON), unless the codec
            # proves them equal (flat scalar fields of exactly their types: the common case, without a decode).
            read_back = ev if as_is else domain_event(domain, fields(written[1]))
            state = domain.evolve(state, read_back)
            events.append(written)
    except (InvalidEvent, UnreadableEvent, FatalError, ValueError) as e:
        msg = f"cannot store the decided events: {e}"
        return _reject(cmd, entry, msg, t, at, RecordError(msg, reason="bad-event"))
    except Exception as e:
        msg = f"evolve raised {type(e).__name__}: {e}"
        return _reject(cmd, entry, msg, t, at, RecordError(msg, reason="evolve-error"))
    new_version = version + len(events)
    return Handled(Result(cmd.command_id, cmd.aggregate_id, ACCEPTED, new_version, ids, None, cmd.correlation_id,
                          at=at), events, state, new_version, None, window.accepted(t, new_version, len(ids)))
