"""The one decode-and-intake of a sink connector's events: envelope decode, upcasting, the unknown-type policy.

The live sink runner, the projection rebuild and the replay of held dead letters all turn a Kafka record into the
SinkRecord a task sees through `Intake.record`, so a task gets the same event (today's shape, after the
connector's upcasters) on every path. A record it cannot take raises a RecordError that carries the record, for
the caller to dead-letter: `DecodeError` (not an envelope), `UnknownTypeError` (`on_unknown_type = "dead-letter"`),
or reason `upcast-failed` (an upcaster step raised; the message names type, version and connector).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kafold.connectors.api import SinkRecord, sink_record
from kafold.envelope import Event, decode, reshaped
from kafold.errors import FatalError, RecordError, UnknownTypeError
from kafold.upcast import NONE, Upcaster, UpcastError


class Intake:
    """Decides what one connector does with each record (see the module docstring)."""

    def __init__(self, name: str, handles: Callable[[str], bool], on_unknown: str,
                 upcaster: Upcaster = NONE) -> None:
        self.name, self.handles, self.on_unknown = name, handles, on_unknown
        self.steps = upcaster.steps if not upcaster.empty else None
        self.upcaster = upcaster

    def event(self, key: bytes | None, value: bytes | None, headers: Sequence[tuple[str, bytes | None]] | None,
              raw: Any = None) -> Event | None:
        """The record's event in today's shape; None when the connector skips its type."""
        event = decode(key, value, headers, raw=raw)
        if self.steps is not None and (event.type, event.schema_version) in self.steps:
            event = self.upcast(event, raw)
        if not self.handles(event.type):
            if self.on_unknown == "fail":
                raise FatalError(f"connector {self.name!r}: unknown event type {event.type!r}")
            if self.on_unknown == "skip":
                return None
            raise UnknownTypeError(f"unknown event type {event.type!r}", raw=raw, reason="unknown-type")
        return event

    def upcast(self, event: Event, raw: Any) -> Event:
        try:
            type_name, version, payload = self.upcaster.apply(event.type, event.schema_version, event.payload)
        except UpcastError as e:
            raise RecordError(f"connector {self.name!r}: {e}", raw=raw, reason=e.reason) from e
        return reshaped(event, type_name, version, payload)

    def record(self, m: Any, topic: str, partition: int, offset: int) -> SinkRecord | None:
        """A consumed message as the SinkRecord its task sees; None when skipped."""
        event = self.event(m.key(), m.value(), m.headers(), raw=m)
        if event is None:
            return None
        ts_kind, ts = m.timestamp()
        return sink_record(topic, partition, offset, event.aggregate_id, event, ts if ts_kind else None)
