"""Deciding one command against its aggregate's entry: the events to write, the result, and the new state. Pure."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kafold import decision
from kafold.daemon.aggregates import window
from kafold.daemon.aggregates.store import Entry
from kafold.decision import Encoded
from kafold.domain import AggregateDomain
from kafold.errors import RecordError
from kafold.messages import ACCEPTED, REJECTED, Command, Result


@dataclass(slots=True)
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
    out = decision.decide(domain, cmd.type, cmd.data, cmd.aggregate_id, entry.state, entry.version,
                          command_id=cmd.command_id, correlation_id=cmd.correlation_id, at=at)
    if out.reason is not None:
        return _reject(cmd, entry, out.reason, t, at, out.error)
    return Handled(Result(cmd.command_id, cmd.aggregate_id, ACCEPTED, out.version, out.event_ids, None,
                          cmd.correlation_id, at=at), list(out.events), out.state, out.version, None,
                   window.accepted(t, out.version, len(out.event_ids)))
