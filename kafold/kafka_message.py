"""`Message`: the shape of a Kafka record as confluent-kafka's consumer and delivery reports hand it to kafold.

confluent-kafka ships no type stubs, so its records were `Any` in every signature that takes one; this Protocol
names the methods kafold calls on them (a test's fake record need only have these).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol


class Message(Protocol):
    """A consumed (or delivered) Kafka record: confluent_kafka.Message's accessors that kafold uses."""

    def key(self) -> bytes | None: ...

    def value(self) -> bytes | None: ...

    def headers(self) -> Sequence[tuple[str, bytes | None]] | None: ...

    # Not Optional, unlike confluent-kafka's stubs: a consumed record that carries no error always has them (those
    # with an error are filtered out before these are read), and the hot loops read them as ints.
    def topic(self) -> str: ...

    def partition(self) -> int: ...

    def offset(self) -> int: ...

    def timestamp(self) -> tuple[int, int]: ...

    def error(self) -> Any: ...  # a confluent_kafka.KafkaError, or None for a record
