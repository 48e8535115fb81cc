"""Deciding one command against its aggregate's entry: the events to write, the result, and the new state. Pure."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kafold.daemon.aggregates.messages import ACCEPTED, REJECTED, Command, Result
from kafold.daemon.aggregates.store import Entry
from kafold.domain import AggregateDomain, InvalidCommand, InvalidEvent
from kafold.envelope import Event, Headers, derive_event_id, encode, utc_now
from kafold.errors import FatalError, RecordError

Encoded = tuple[bytes, bytes, Headers]


@dataclass
class Outcome:
    """What handling a command produced. `error` set = the command is also dead-lettered (a client or domain
    defect, not a business rejection). `state`/`version` are the entry's values after the command."""

    result: Result
    events: list[Encoded] = field(default_factory=list)
    state: Any = None
    version: int = 0
    error: RecordError | None = None


def _reject(cmd: Command, entry: Entry, reason: str, error: RecordError | None = None) -> Outcome:
    return Outcome(Result(cmd.command_id, cmd.aggregate_id, REJECTED, entry.version, (), reason,
                          cmd.correlation_id), [], entry.state, entry.version, error)


def handle(domain: AggregateDomain, cmd: Command, entry: Entry, now: str | None = None) -> Outcome:
    """Decide `cmd` on `entry` (not modified). Never raises on bad input: it becomes a rejected Outcome."""
    seen = entry.recent.get(cmd.command_id)
    if seen is not None:  # idempotency guard: the same command id again repeats the first outcome
        version_after, n = seen
        again = tuple(derive_event_id(cmd.command_id, i) for i in range(n))
        return Outcome(Result(cmd.command_id, cmd.aggregate_id, ACCEPTED, version_after, again, None,
                              cmd.correlation_id, duplicate=True), [], entry.state, entry.version)
    if cmd.expected_version is not None and cmd.expected_version != entry.version:
        return _reject(cmd, entry, f"expected version {cmd.expected_version}, aggregate is at {entry.version}")
    try:
        command = domain.command(cmd.type, cmd.data)
    except InvalidCommand as e:
        return _reject(cmd, entry, str(e), RecordError(str(e), reason=e.reason))
    try:
        decided = domain.decide(command, entry.state)
    except domain.rejections as e:
        return _reject(cmd, entry, str(e) or type(e).__name__)
    except Exception as e:  # a bug in decide must not stop the runtime: dead-letter the command
        msg = f"decide raised {type(e).__name__}: {e}"
        return _reject(cmd, entry, msg, RecordError(msg, reason="decide-error"))
    if not isinstance(decided, list | tuple):
        msg = f"decide returned {type(decided).__name__}, expected a list of events"
        return _reject(cmd, entry, msg, RecordError(msg, reason="decide-error"))
    state, version, at = entry.state, entry.version, now or utc_now()
    events: list[Encoded] = []
    ids: list[str] = []
    try:
        for i, ev in enumerate(decided):
            type_name, payload = domain.event_payload(ev)
            state = domain.evolve(state, ev)
            eid = derive_event_id(cmd.command_id, i)
            events.append(encode(Event(eid, type_name, domain.name, cmd.aggregate_id, version + i + 1, at,
                                       cmd.correlation_id or cmd.command_id, payload, 1, cmd.command_id)))
            ids.append(eid)
    except (InvalidEvent, FatalError, ValueError) as e:
        msg = f"cannot store the decided events: {e}"
        return _reject(cmd, entry, msg, RecordError(msg, reason="bad-event"))
    except Exception as e:
        msg = f"evolve raised {type(e).__name__}: {e}"
        return _reject(cmd, entry, msg, RecordError(msg, reason="evolve-error"))
    new_version = version + len(events)
    return Outcome(Result(cmd.command_id, cmd.aggregate_id, ACCEPTED, new_version, tuple(ids), None,
                          cmd.correlation_id), events, state, new_version)
