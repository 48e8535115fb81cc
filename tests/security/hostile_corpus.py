"""Hostile records: bad event records for the projection path and bad commands for the aggregate path.

Each case names the reason it must be dead-lettered with (docs/envelope.md, docs/projections.md) and a fragment
the error message must contain. Every hostile event concerns an aggregate no good event touches (`acc-9xx`), so a
record wrongly projected shows up as an extra row against the independent fold.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson
from confluent_kafka import Producer

from kafold import kafka_clients
from kafold.config import KafkaConfig
from kafold.envelope import Event, Headers, encode

# Written into hostile payloads; it must never appear in a log line (payloads are not logged).
CANARY = "CANARY-payload-7f3a"
BIG = {"message.max.bytes": 4_000_000}  # lets a producer send the over-limit records
# ... and the topics they go to accept them where the broker enforces a limit (Apache Kafka: 1 MB by default;
# tansu has none): a topic may allow larger records than kafold decodes, and kafold must still refuse them.
BIG_TOPIC = {"max.message.bytes": "4000000"}


@dataclass(frozen=True)
class Hostile:
    name: str
    key: bytes | None
    value: bytes | None
    headers: Headers
    reason: str          # kafold-dlq-reason / dead_letters.reason
    message: str         # fragment of the error message naming the problem


def _opened(n: int, payload: dict[str, Any] | None = None, **fields: Any) -> Event:
    return Event.new("AccountOpened", "account", f"acc-{n}", 1, payload or {"owner": CANARY}, **fields)


def _body(event: Event, **changes: Any) -> tuple[bytes, bytes, Headers]:
    """The encoded event with some body fields replaced (headers and key as encoded before the change)."""
    key, value, headers = encode(event)
    body = orjson.loads(value)
    body.update(changes)
    return key, orjson.dumps(body), headers


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def events() -> list[Hostile]:
    """One record per kind of hostile event input."""
    out: list[Hostile] = []

    def add(name: str, kv: tuple[bytes | None, bytes | None, Headers], reason: str, message: str) -> None:
        out.append(Hostile(name, kv[0], kv[1], list(kv[2]), reason, message))

    key, value, headers = encode(_opened(901))
    add("truncated-json", (key, value[: len(value) // 2], headers), "bad-json", "not valid JSON")
    add("empty-value", (key, b"", headers), "bad-json", "not valid JSON")
    add("tombstone", (key, None, headers), "missing-field", "a tombstone is not an event")
    add("value-not-an-object", (key, b"[1, 2, 3]", headers), "wrong-type", "expected a JSON object")
    add("version-as-string", _body(_opened(902), version="1"), "wrong-type", "version: expected an integer")
    add("payload-as-array", _body(_opened(903), payload=[CANARY]), "wrong-type", "payload: expected a JSON object")
    add("event-id-as-number", _body(_opened(904), event_id=7), "wrong-type", "event_id: expected a string")
    add("unknown-envelope-field", _body(_opened(905), admin=True), "unknown-field", "admin: unknown field")
    add("missing-envelope-field", (key, orjson.dumps({k: v for k, v in orjson.loads(value).items()
                                                      if k != "aggregate_id"}), headers),
        "missing-field", "aggregate_id: missing")
    key, value, headers = encode(_opened(906))
    huge = value.replace(CANARY.encode(), CANARY.encode() + b"x" * 1_100_000)
    add("huge-payload", (key, huge, headers), "too-large", "exceeds the 1000000-byte limit")
    key, value, headers = encode(_opened(907))
    add("nested-64", (key, value.replace(b'"payload":{', b'"payload":{"d":' + _nested(64) + b",", 1), headers),
        "too-deep", "nests deeper than 32 levels")
    key, value, headers = encode(_opened(908))
    add("nested-5000", (key, value.replace(b'"payload":{', b'"payload":{"d":' + _nested(5000) + b",", 1), headers),
        "too-deep", "depth limit exceeded")
    key, value, headers = encode(_opened(909))
    add("invalid-utf8-value", (key, value.replace(CANARY.encode(), b"\xff\xfe" + CANARY.encode()), headers),
        "bad-utf8", "UTF-8")
    add("lone-surrogate", (key, value.replace(CANARY.encode(), b"\\ud800" + CANARY.encode()), headers),
        "bad-json", "surrogate")
    add("invalid-utf8-key", (b"acc-\xff", value, headers), "bad-utf8", "key: is not valid UTF-8")
    add("invalid-utf8-header", (key, value, [(n, b"\xc3\x28" if n == "kafold-type" else v) for n, v in headers]),
        "bad-utf8", "header kafold-type: is not valid UTF-8")
    add("no-headers", (key, value, []), "missing-header", "header kafold-type: missing")
    add("one-header-missing", (key, value, [(n, v) for n, v in headers if n != "kafold-id"]),
        "missing-header", "header kafold-id: missing")
    add("key-not-aggregate-id", (b"acc-1", value, headers), "header-mismatch", "key: does not match aggregate_id")
    add("forged-version-header", (key, value, [(n, b"2" if n == "kafold-version" else v) for n, v in headers]),
        "header-mismatch", "header kafold-version: does not match version")
    add("forged-version-zero", _body(_opened(910), version=0), "wrong-type", "version: must be >= 1")
    add("forged-version-huge", (key, value.replace(b'"version":1', b'"version":123456789012345678901234567890'),
                                headers), "wrong-type", "version: expected an integer")  # JSON rounds it beyond 64 bits
    add("forged-type-header", (key, value, [(n, b"AccountClosed" if n == "kafold-type" else v) for n, v in headers]),
        "header-mismatch", "header kafold-type: does not match type")
    add("unknown-event-type", encode(Event.new("AccountHijacked", "account", "acc-911", 1, {"owner": CANARY})),
        "unknown-type", "AccountHijacked")
    add("schema-invalid-payload", encode(Event.new("AccountOpened", "account", "acc-912", 1, {"name": CANARY})),
        "schema-invalid", "payload.owner is missing")
    add("nul-in-text", encode(_opened(913, {"owner": CANARY + "\u0000"})), "db-rejected", "NUL")
    key, value, headers = encode(_opened(914))
    add("integer-beyond-64-bits", (key, value.replace(b'"payload":{', b'"payload":{"n":18446744073709551616,', 1),
                                   headers), "int-range", "payload.n: integer beyond 64 bits")
    return out


def stale_forgery(account: str, version: int) -> Event:
    """A well-formed event re-using an applied version with a different id: the version guard must skip it."""
    return Event.new("MoneyDeposited", "account", account, version, {"amount": 1_000_000_000})


def commands() -> list[tuple[str, bytes | None, bytes | None, Headers, str]]:
    """(command id, key, value, headers, expected dead-letter reason) for the aggregate command path."""
    def body(cid: str, **fields: Any) -> bytes:
        return orjson.dumps({"command_id": cid, "type": "Deposit", "aggregate_id": "acc", "data": {"amount": 1},
                             **fields})

    deep = b'{"command_id": "c-deep", "type": "Deposit", "aggregate_id": "acc", "data": {"x": ' + _nested(5000) + b"}}"
    return [
        ("c-trunc", b"acc", body("c-trunc")[:30], [], "bad-json"),
        ("c-utf8", b"acc", body("c-utf8").replace(b'"Deposit"', b'"Dep\xffosit"'), [], "bad-json"),
        ("c-wrong-type", b"acc", body("c-wrong-type", data=[1]), [], "wrong-type"),
        ("c-id-number", b"acc", body("c-id-number").replace(b'"c-id-number"', b"17"), [], "wrong-type"),
        ("c-huge", b"acc", body("c-huge", data={"pad": "x" * 1_100_000}), [], "too-large"),
        ("c-deep", b"acc", deep, [], "bad-json"),
        ("c-forged-version", b"acc", body("c-forged-version", expected_version=-1), [], "wrong-type"),
        ("c-key-mismatch", b"other", body("c-key-mismatch"), [], "header-mismatch"),
        ("c-no-key", None, body("c-no-key"), [], "header-mismatch"),
        ("c-unknown-field", b"acc", body("c-unknown-field", sudo=True), [], "unknown-field"),
        ("c-unknown-type", b"acc", body("c-unknown-type", type="Teleport"), [], "unknown-type"),
    ]


def produce_raw(kafka: KafkaConfig, topic: str, items: list[tuple[int, bytes | None, bytes | None, Any]]
                ) -> list[tuple[int, int]]:
    """Produce (partition, key, value, headers) in order, one flush each (exact order); (partition, offset)s."""
    producer = Producer(kafka_clients.librdkafka(kafka, **{"enable.idempotence": True, **BIG}))
    out: list[tuple[int, int]] = []

    def delivered(err: Any, msg: Any) -> None:
        assert err is None, err
        out.append((msg.partition(), msg.offset()))

    for p, key, value, headers in items:
        producer.produce(topic, value=value, key=key, headers=headers, partition=p, on_delivery=delivered)
        assert producer.flush(30) == 0
    return out
