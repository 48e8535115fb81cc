"""Offsets read from Kafka for reports: a group's committed offsets and the partitions' end offsets.

Note: these are read-only views (OffsetFetch and ListOffsets); nothing here commits. The end offset is
ListOffsets(latest), which some brokers under-report (the embedded one returns the base offset of the last
batch + 1), so a lag computed from it can read low there; the running daemon's own figures use fetch watermarks.
On Apache Kafka ListOffsets(latest) is the high watermark (the last stable offset under read_committed): exact.
"""

from __future__ import annotations

from collections.abc import Iterable

from confluent_kafka import Consumer
from confluent_kafka import TopicPartition as KafkaTP

from kafold import kafka_clients
from kafold.config import KafkaConfig
from kafold.connectors.api import TopicPartition

TIMEOUT_S = 10.0


def partitions(kafka: KafkaConfig, topics: Iterable[str]) -> list[TopicPartition]:
    """Every partition of `topics` (missing topics have none)."""
    admin = kafka_clients.admin(kafka)
    meta = admin.list_topics(timeout=TIMEOUT_S)
    out: list[TopicPartition] = []
    for topic in topics:
        t = meta.topics.get(topic)
        if t is not None and t.error is None:
            out += [TopicPartition(topic, p) for p in sorted(t.partitions)]
    return out


def group_offsets(kafka: KafkaConfig, group: str, tps: Iterable[TopicPartition]) -> dict[TopicPartition, int]:
    """The group's committed offset (next to read) of each partition that has one."""
    reader = kafka_clients.consumer(kafka, group)
    try:
        return {TopicPartition(*tp): off for tp, off in committed(reader, tps).items()}
    finally:
        reader.close()


def committed(reader: Consumer, tps: Iterable[TopicPartition | KafkaTP], timeout: float = TIMEOUT_S
              ) -> dict[tuple[str, int], int]:
    """The committed offsets of `reader`'s group (a consumer of that group that never subscribes, so never joins
    it) for `tps`, those that have one. Not AdminClient.list_consumer_group_offsets: librdkafka's admin path
    dereferences the group handle an admin client does not have when the coordinator answers NOT_COORDINATOR
    (librdkafka issue 5040), and the process dies of a segmentation fault; a consumer's OffsetFetch retries."""
    wanted = [KafkaTP(tp.topic, tp.partition) for tp in tps]
    if not wanted:
        return {}
    return {(k.topic, k.partition): k.offset for k in reader.committed(wanted, timeout=timeout)
            if k.offset >= 0 and k.error is None}


def end_offsets(kafka: KafkaConfig, tps: Iterable[TopicPartition]) -> dict[TopicPartition, int]:
    """ListOffsets(latest) of each partition (read_committed: the last stable offset)."""
    consumer = kafka_clients.consumer(kafka, "kafold.status", **{"isolation.level": "read_committed"})
    try:
        return {tp: consumer.get_watermark_offsets(KafkaTP(tp.topic, tp.partition), timeout=TIMEOUT_S,
                                                   cached=False)[1] for tp in tps}
    finally:
        consumer.close()
