"""kafold's murmur2 partitioner agrees with the real client's (librdkafka murmur2_random) on the broker."""

from __future__ import annotations

import pytest

from kafold import kafka_clients
from kafold.config import KafkaConfig, TopicSpec
from kafold.partitioning import partition_for
from kafold.topics import ensure


@pytest.mark.integration
def test_partition_for_matches_the_producer(kafka_config: KafkaConfig, unique: str) -> None:
    topic = f"{unique}.keys"
    ensure(kafka_config, [TopicSpec(topic, 7, 1, {})])
    producer = kafka_clients.producer(kafka_config, partitioner="murmur2_random")
    seen: dict[bytes, int] = {}

    def record(err: object, msg: object) -> None:
        assert err is None
        seen[msg.key()] = msg.partition()  # type: ignore[attr-defined]

    keys = [f"acc-{i}".encode() for i in range(60)] + [b"x", b"ab", b"abc", "ünï".encode()]
    for key in keys:
        producer.produce(topic, key=key, value=b"v", on_delivery=record)
    producer.flush(30)
    assert seen == {key: partition_for(key, 7) for key in keys}
