"""The converters' shared interface: a value format (bytes to a Python value) and a converter (record to Event)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from kafold.config import UNAVAILABLE_PLACEHOLDER
from kafold.envelope import Event
from kafold.errors import RecordError

Headers = Sequence[tuple[str, bytes | None]] | None
# The event type of a source table's truncate (Debezium op `t`): a projection empties its table (see fold.py).
TRUNCATE = "debezium.truncate"
# A value the source did not send (Debezium's placeholder for an unchanged TOASTed column, whatever its configured
# text): a projection keeps the column's stored value (see mapping.py).
UNAVAILABLE = UNAVAILABLE_PLACEHOLDER
# The payload field (true) of the last record of a completed Debezium snapshot, when the connector sweeps: the
# projection deletes its rows older than that record, the ones the snapshot did not read (see snapshot_sweep.py).
SNAPSHOT_END = "__debezium.snapshot_end"


class ConvertError(RecordError):
    """A record that its converter cannot turn into an event (reason `convert-failed`); the message names the
    path, field or schema id, and the topic/offset."""

    def __init__(self, message: str, *, raw: Any = None, reason: str = "convert-failed") -> None:
        super().__init__(message, raw=raw, reason=reason)


class ValueFormat(Protocol):
    def load(self, topic: str, data: bytes, *, is_key: bool) -> Any:
        """`data` as a Python value (dict/list/scalars); ConvertError for bad data, RetriableError for transient
        trouble (a registry down)."""
        ...


class Converter(Protocol):
    def event(self, key: bytes | None, value: bytes | None, headers: Headers, *, topic: str, partition: int,
              offset: int, timestamp_ms: int | None, raw: Any) -> Event | None:
        """The record's Event; None when the record carries no event (a Debezium tombstone)."""
        ...


def where(topic: str, partition: int, offset: int) -> str:
    """The record's coordinates as error messages name them."""
    return f"{topic}[{partition}]@{offset}"
