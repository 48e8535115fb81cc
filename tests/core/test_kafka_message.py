"""kafold.kafka_message.Message names only methods confluent-kafka's records have, with the values kafold reads."""

from __future__ import annotations

import inspect

from confluent_kafka import Message as KafkaMessage

from kafold.kafka_message import Message


def protocol_methods() -> list[str]:
    return [n for n, v in vars(Message).items() if inspect.isfunction(v) and not n.startswith("_")]


def test_the_protocol_names_the_accessors_kafold_uses() -> None:
    assert sorted(protocol_methods()) == sorted(
        ["key", "value", "headers", "topic", "partition", "offset", "timestamp", "error"])


def test_a_confluent_kafka_message_has_every_method_of_the_protocol() -> None:
    m = KafkaMessage(topic="t", partition=2, offset=7, key=b"k", value=b"v", headers=[("h", b"1")],
                     timestamp=(1, 1000))
    got = {name: getattr(m, name)() for name in protocol_methods()}
    assert got == {"key": b"k", "value": b"v", "headers": [("h", b"1")], "topic": "t", "partition": 2, "offset": 7,
                   "timestamp": (1, 1000), "error": None}
