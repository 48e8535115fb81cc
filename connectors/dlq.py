"""Dead-letter writer: the raw record plus `kafold-dlq-*` headers, produced idempotently to the DLQ topic.

Note on commits: `report` only queues; the runner commits a batch's offsets only after `flush` returned, i.e.
after the DLQ topic acknowledged (acks=all) every dead-lettered record. A record whose delivery failed is sent
again by the next `flush`, so a dead letter may be written twice but is never lost.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Sequence
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from kafold import kafka_clients, logs
from kafold.config import KafkaConfig
from kafold.connectors.api import ErrantRecordReporter, RawRecord
from kafold.envelope import Headers
from kafold.errors import RecordError, RetriableError

if TYPE_CHECKING:
    from kafold.protect import Protector

H_TOPIC = "kafold-dlq-topic"
H_PARTITION = "kafold-dlq-partition"
H_OFFSET = "kafold-dlq-offset"
H_ERROR_CLASS = "kafold-dlq-error-class"
H_ERROR_MESSAGE = "kafold-dlq-error-message"
H_REASON = "kafold-dlq-reason"
H_CONNECTOR = "kafold-dlq-connector"
H_TIMESTAMP = "kafold-dlq-timestamp"
H_VALUE_DROPPED = "kafold-dlq-value-dropped"
MAX_MESSAGE_CHARS = 2000
# A dead letter must fit the DLQ topic's message limit (librdkafka's and Kafka's default is about 1 MB); a bigger
# hostile record keeps its coordinates and error, its value stays in the source topic (and kafold.dead_letters).
MAX_VALUE_BYTES = 900_000

log = logs.get("kafold.connectors.dlq")


class DeadLetterStatus(StrEnum):
    """A dead letter's state in `<schema>.dead_letters` (the values are stored there; migrations/tables.py)."""

    NEW = "new"  # as it was dead-lettered (a projection's row key it carries is held behind it)
    HELD = "held"  # a projection's event held behind an earlier dead letter of its row key, never applied yet
    REPLAYED = "replayed"
    DISCARDED = "discarded"


# Not yet replayed or discarded: a row key such a dead letter carries is held back.
OPEN_STATUSES = (DeadLetterStatus.NEW, DeadLetterStatus.HELD)


# ---- what PostgreSQL can hold --------------------------------------------------------------------------------
# PostgreSQL's text and jsonb hold neither NUL nor a lone surrogate (psycopg cannot even encode one), and a record's
# producer chooses every byte of it: a dead letter must be writable whatever they are, or one record stops the task
# for good. Bytes are kept as they were (bytea, base64 in JSON); text derived from them is escaped.

def pg_text(text: str) -> str:
    """`text` as PostgreSQL text can store it: NUL as `\\x00`, a lone surrogate as `\\udXXX` (the rest unchanged)."""
    if "\x00" in text:
        text = text.replace("\x00", "\\x00")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def _storable(raw: bytes) -> str | None:
    """`raw` as JSON text PostgreSQL's jsonb keeps exactly, or None (not UTF-8, or holding NUL)."""
    if b"\x00" in raw:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def headers_json(headers: Sequence[tuple[str, Any]]) -> list[list[Any]]:
    """Headers as jsonb can hold them, every byte kept: [name, text] when UTF-8 without NUL, [name, {"base64": …}]
    otherwise, [name, null] for none; a name that is not storable text is {"base64": …} too."""
    out: list[list[Any]] = []
    for name, value in headers:
        n: Any = name
        if not isinstance(name, str) or pg_text(name) != name:
            raw_name = name.encode("utf-8", "surrogateescape") if isinstance(name, str) else bytes(name)
            n = {"base64": base64.b64encode(raw_name).decode()}
        if value is None:
            out.append([n, None])
            continue
        raw = value.encode("utf-8", "surrogateescape") if isinstance(value, str) else bytes(value)
        text = _storable(raw)
        out.append([n, text if text is not None else {"base64": base64.b64encode(raw).decode()}])
    return out


def stored_headers(stored: list[list[Any]]) -> list[tuple[str, bytes | None]]:
    """The original headers of a dead letter as `headers_json` stored them, without kafold's `kafold-dlq-*` ones."""
    out: list[tuple[str, bytes | None]] = []
    for name, value in stored:
        if isinstance(name, dict):
            name = base64.b64decode(name["base64"]).decode("utf-8", "surrogateescape")
        if name.startswith("kafold-dlq-"):
            continue
        if isinstance(value, dict):
            out.append((name, base64.b64decode(value["base64"])))
        else:
            out.append((name, None if value is None else str(value).encode()))
    return out


def dlq_headers(raw: RawRecord, error: BaseException, connector: str, now_ms: int) -> Headers:
    """The original headers followed by the `kafold-dlq-*` coordinates and error description."""
    reason = error.reason if isinstance(error, RecordError) else "task-error"
    cls = type(error)
    extra = [
        (H_TOPIC, raw.topic), (H_PARTITION, str(raw.partition)), (H_OFFSET, str(raw.offset)),
        (H_ERROR_CLASS, f"{cls.__module__}.{cls.__qualname__}"),
        (H_ERROR_MESSAGE, str(error)[:MAX_MESSAGE_CHARS]),
        (H_REASON, reason), (H_CONNECTOR, connector), (H_TIMESTAMP, str(now_ms)),
    ]
    original: Headers = [(k, v if v is not None else b"") for k, v in raw.headers if not k.startswith("kafold-dlq-")]
    return original + [(k, v.encode("utf-8", "replace")) for k, v in extra]


def fitted(value: bytes | None, headers: Headers) -> tuple[bytes | None, Headers]:
    """The value to dead-letter: None (and a `kafold-dlq-value-dropped: <size>` header) when it is too big."""
    if value is None or len(value) <= MAX_VALUE_BYTES:
        return value, headers
    return None, [*headers, (H_VALUE_DROPPED, str(len(value)).encode())]


class DeadLetterWriter(ErrantRecordReporter):
    """Writes dead letters of one connector to its DLQ topic with an idempotent producer."""

    def __init__(self, kafka: KafkaConfig, topic: str, connector: str, *, protector: Protector | None = None,
                 **extra: Any) -> None:
        self.topic = topic
        self.connector = connector
        self.protector = protector  # the task's (TaskConfig.protector): a record made without a source sealed again
        self._producer = kafka_clients.producer(
            kafka, **{"enable.idempotence": True, "acks": "all", "linger.ms": 5, **extra})
        self._pending = 0
        self._failed: list[tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]] = []
        self.written = 0

    def report(self, record: Any, error: BaseException) -> None:
        raw = RawRecord.of(record, self.protector)
        headers = dlq_headers(raw, error, self.connector, int(time.time() * 1000))
        log.warning("dlq.record_dead_lettered", connector=self.connector, topic=raw.topic,
                    partition=raw.partition, offset=raw.offset, error=type(error).__name__,
                    reason=getattr(error, "reason", None), dlq_topic=self.topic)
        self._send(raw.key, *fitted(raw.value, headers))

    def _send(self, key: bytes | None, value: bytes | None, headers: Any) -> None:
        def delivered(err: Any, _msg: Any) -> None:
            self._pending -= 1
            if err is None:
                self.written += 1
            else:
                log.warning("dlq.delivery_retrying", connector=self.connector, error=str(err))
                self._failed.append((key, value, headers))

        kafka_clients.produce(self._producer, self.topic, value, key, headers, on_delivery=delivered)
        self._pending += 1
        self._producer.poll(0)

    def flush(self, timeout: float) -> None:
        if not self._pending and not self._failed:
            return  # nothing reported since the last flush (the runner flushes after every batch)
        deadline = time.monotonic() + timeout
        while True:
            retry, self._failed = self._failed, []
            for key, value, headers in retry:
                self._send(key, value, headers)
            remaining = self._producer.flush(max(0.0, deadline - time.monotonic()))
            if not remaining and not self._failed and not self._pending:
                return
            if time.monotonic() >= deadline:
                raise RetriableError(f"dead-letter topic {self.topic!r}: {self._pending + len(self._failed)} "
                                     f"records not acknowledged within {timeout:.1f}s")

    @property
    def outstanding(self) -> int:
        """Reported records not yet acknowledged."""
        return self._pending + len(self._failed)

    def close(self, timeout: float = 5.0) -> None:
        try:
            self.flush(timeout)
        except RetriableError as e:
            log.error("dlq.unacknowledged_at_close", connector=self.connector, error=str(e),
                      hint="their offsets were not committed")
        kafka_clients.close_producer(self._producer, 0)
