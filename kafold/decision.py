"""One command decided on one state, as the runtime does it and as kafold.testing replays it: the command read from
its JSON, `decide`, and each event written as the envelope stores it and read back from those bytes. Pure."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kafold.domain import AggregateDomain, InvalidCommand, InvalidEvent, UnreadableEvent
from kafold.envelope import Headers, derive_event_id, encode_new
from kafold.errors import FatalError, RecordError
from kafold.fold import domain_event, fields
from kafold.frozen import quick_init
from kafold.stages import Stage, deciding_reason

Encoded = tuple[bytes, bytes, Headers]


@quick_init
@dataclass(frozen=True, slots=True)
class Decided:
    """What deciding one command gave. Accepted: `events` as written (key, value, headers) and `state`/`version`
    after them. Rejected: `reason`, and `error` when the rejection is a defect of the client or the domain (an
    invalid command, a bug in decide or evolve, an event that cannot be stored), not a business rule: such a
    command is also dead-lettered."""

    events: tuple[Encoded, ...]
    state: Any
    version: int
    event_ids: tuple[str, ...] = ()
    reason: str | None = None
    error: RecordError | None = None

    @property
    def accepted(self) -> bool:
        return self.reason is None


def event_ids(command_id: str, version_before: int, n: int) -> tuple[str, ...]:
    """The ids of the `n` events a command decided at `version_before` writes: `derive_event_id(command_id, v)`
    with v = each event's version - 1. Deterministic for a re-decision after a crash (same state, same version),
    and distinct for a retry decided again after the window (a later version), so no id is ever written twice."""
    if n == 1:  # the common case, without a generator
        return (derive_event_id(command_id, version_before),)
    return tuple([derive_event_id(command_id, version_before + i) for i in range(n)])


def _rejected(state: Any, version: int, reason: str, error: RecordError | None = None) -> Decided:
    # module-level, not a closure in `decide`: made once, not per command
    return Decided((), state, version, (), reason, error)


def decide(domain: AggregateDomain, command_type: str, data: dict[str, Any], aggregate_id: str, state: Any,
           version: int, *, command_id: str, correlation_id: str, at: str) -> Decided:
    """Decide the command `command_type`/`data` (its JSON) on `state` at `version`; never raises on bad input."""
    try:
        command = domain.command(command_type, data)
    except InvalidCommand as e:
        return _rejected(state, version, str(e), RecordError(str(e), reason=e.reason))
    try:
        decided = domain.decide(command, state)
    except domain.rejections as e:
        return _rejected(state, version, str(e) or type(e).__name__)
    except Exception as e:  # a bug in decide must not stop the runtime: dead-letter the command
        msg = f"decide raised {type(e).__name__}: {e}"
        return _rejected(state, version, msg, RecordError(msg, reason=deciding_reason(Stage.DECIDE)))
    if not isinstance(decided, list | tuple):
        msg = f"decide returned {type(decided).__name__}, expected a list of events"
        return _rejected(state, version, msg, RecordError(msg, reason=deciding_reason(Stage.DECIDE)))
    ids = event_ids(command_id, version, len(decided))
    codec = domain.codec
    newest = codec.upcaster.version_of  # decide writes every type at its newest schema version
    events: list[Encoded] = []
    after = state
    protector = domain.protector
    correlation = correlation_id or command_id
    try:
        for i, ev in enumerate(decided):
            type_name, payload, as_is = codec.written(ev)
            if protector is not None:  # personal data leaves only encrypted (kafold.protect)
                payload = protector.seal(domain.name, type_name, aggregate_id, payload)
            # the bytes of encode(Event(...)), without the Event (envelope.encode_new); a flat payload (as_is)
            # sealed may nest (the protector's envelope), so it is walked then
            written = encode_new(ids[i], type_name, domain.name, aggregate_id, version + i + 1, at, correlation,
                                 payload, newest(type_name), command_id, flat=as_is and protector is None)
            # Live = replay: evolve the event as every reader will read it back from these bytes, not the object
            # decide returned (a tuple would stay a tuple here and come back a list from JSON), unless the codec
            # proves them equal (flat scalar fields of exactly their types: the common case, without a decode).
            read_back = ev if as_is else domain_event(domain, fields(written[1]))
            after = domain.evolve(after, read_back)
            events.append(written)
    except (InvalidEvent, UnreadableEvent, FatalError, ValueError) as e:
        msg = f"cannot store the decided events: {e}"
        return _rejected(state, version, msg, RecordError(msg, reason=deciding_reason(Stage.ENCODE)))
    except Exception as e:
        msg = f"evolve raised {type(e).__name__}: {e}"
        return _rejected(state, version, msg, RecordError(msg, reason=deciding_reason(Stage.FOLD)))
    return Decided(tuple(events), after, version + len(events), ids)
