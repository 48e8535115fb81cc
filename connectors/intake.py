"""The one decode-and-intake of a sink connector's events: envelope decode, upcasting, the unknown-type policy.

The live sink runner, the projection rebuild and the replay of held dead letters all turn a Kafka record into the
SinkRecord a task sees through `Intake.record`, so a task gets the same event (today's shape, after the
connector's upcasters) on every path. A record it cannot take raises a RecordError that carries the record, for
the caller to dead-letter: `DecodeError` (not an envelope), `UnknownTypeError` (`on_unknown_type = "dead-letter"`),
or reason `upcast-failed` (an upcaster step raised; the message names type, version and connector).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kafold.connectors.api import SinkRecord, sink_record
from kafold.connectors.convert.api import Converter
from kafold.envelope import Event, decode, record_body, reshaped
from kafold.errors import DecodeError, FatalError, RecordError, UnknownTypeError
from kafold.kafka_message import Message
from kafold.upcast import NONE, Upcaster, UpcastError

if TYPE_CHECKING:
    from kafold.protect import Protector


class Intake:
    """Decides what one connector does with each record (see the module docstring)."""

    def __init__(self, name: str, handles: Callable[[str], bool], on_unknown: str,
                 upcaster: Upcaster = NONE, decrypt: Callable[[Event, Any], Event] | None = None,
                 converter: Converter | None = None, protector: Protector | None = None) -> None:
        self.name, self.handles, self.on_unknown = name, handles, on_unknown
        # A record kafold did not write (kafold.connectors.convert); None: kafold's envelope, the fast decode.
        self.converter = converter
        # Protected fields opened before upcasters (kafold.protect; RecordError `decrypt-failed`) by `decrypt`, by
        # default `protector`'s: the host's, handed down with the task's config (TaskConfig.protector).
        self.decrypt = decrypt if decrypt is not None else protector.event if protector is not None else None
        self.protector = protector if decrypt is None and converter is None else None
        self.steps = upcaster.steps if not upcaster.empty else None
        self.upcaster = upcaster

    def event(self, key: bytes | None, value: bytes | None, headers: Sequence[tuple[str, bytes | None]] | None,
              raw: Any = None, *, topic: str = "", partition: int = -1, offset: int = -1,
              timestamp_ms: int | None = None) -> Event | None:
        """The record's event in today's shape; None when the connector skips its type (or the converter finds
        no event in the record: a Debezium tombstone). The coordinates feed a converter's defaults."""
        if self.converter is None:
            event = decode(key, value, headers, raw=raw)
        else:
            converted = self.converter.event(key, value, headers, topic=topic, partition=partition, offset=offset,
                                             timestamp_ms=timestamp_ms, raw=raw)
            if converted is None:
                return None
            event = converted
        upcasts = self.steps is not None and (event.type, event.schema_version) in self.steps
        if not upcasts and not self.handles(event.type):  # decided before opening: never decrypted for nothing
            self.unknown(event, raw)
            return None
        if self.decrypt is not None:
            event = self.decrypt(event, raw)
        if upcasts:
            event = self.upcast(event, raw)
            if not self.handles(event.type):
                self.unknown(event, raw)
                return None
        return event

    def unknown(self, event: Event, raw: Any) -> None:
        """A type the connector does not handle, as `on_unknown` says: skipped (returns), dead-lettered (raises
        UnknownTypeError) or fatal."""
        if self.on_unknown == "fail":
            raise FatalError(f"connector {self.name!r}: unknown event type {event.type!r}")
        if self.on_unknown != "skip":
            raise UnknownTypeError(f"unknown event type {event.type!r}", raw=raw, reason="unknown-type")

    def upcast(self, event: Event, raw: Any) -> Event:
        try:
            type_name, version, payload = self.upcaster.apply(event.type, event.schema_version, event.payload)
        except UpcastError as e:
            raise RecordError(f"connector {self.name!r}: {e}", raw=raw, reason=e.reason) from e
        return reshaped(event, type_name, version, payload)

    def prefetch(self, msgs: Sequence[Message]) -> None:
        """Before a batch's records are opened one by one: their subjects' keys in one round trip, when protected
        fields are read (kafold.protect); nothing otherwise."""
        if self.protector is not None:
            self.protector.prefetch(m.key() for m in msgs)

    @property
    def plain(self) -> bool:
        """Whether `peek` can take records: kafold's envelope, no protected fields to open."""
        return self.converter is None and self.decrypt is None

    def peek(self, m: Message) -> Any | None:
        """The record's envelope body (envelope.record_body: the fields its Event would hold, validated by the same
        checks) when `record` would make its event straight from it: a `plain` intake, a valid envelope of a type the
        connector handles, no upcaster step for it. None otherwise: `record` then decides (and names any defect)."""
        if self.converter is not None or self.decrypt is not None:
            return None
        try:
            body = record_body(m.key(), m.value(), m.headers(), raw=m)
        except DecodeError:
            return None
        if body is None or not self.handles(body.type) or (self.steps is not None
                                                           and (body.type, body.schema_version) in self.steps):
            return None
        return body

    def record(self, m: Message, topic: str, partition: int, offset: int) -> SinkRecord | None:
        """A consumed message as the SinkRecord its task sees; None when skipped."""
        ts_kind, ts = m.timestamp()
        event = (self.event(m.key(), m.value(), m.headers(), raw=m) if self.converter is None else
                 self.event(m.key(), m.value(), m.headers(), raw=m, topic=topic, partition=partition, offset=offset,
                            timestamp_ms=ts if ts_kind else None))
        if event is None:
            return None
        # `m` kept as the record's source: a copy of it kafold keeps (a dead letter, a held event) is made from the
        # bytes as they came, protected fields sealed, not from the event opened here (SinkRecord.source)
        return sink_record(topic, partition, offset, event.aggregate_id, event, ts if ts_kind else None, m)
