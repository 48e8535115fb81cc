"""Kafka's default key partitioner (murmur2, as the Java client and librdkafka's murmur2_random compute it)."""

from __future__ import annotations

_M = 0x5BD1E995
_MASK = 0xFFFFFFFF


def murmur2(data: bytes) -> int:
    """The 32-bit murmur2 hash Kafka uses (seed 0x9747b28c), as an unsigned int."""
    length = len(data)
    h = (0x9747B28C ^ length) & _MASK
    for i in range(0, length - length % 4, 4):
        k = int.from_bytes(data[i:i + 4], "little")
        k = (k * _M) & _MASK
        k ^= k >> 24
        k = (k * _M) & _MASK
        h = ((h * _M) & _MASK) ^ k
    tail = length % 4
    if tail:
        rest = data[length - tail:]
        if tail >= 3:
            h ^= rest[2] << 16
        if tail >= 2:
            h ^= rest[1] << 8
        h ^= rest[0]
        h = (h * _M) & _MASK
    h ^= h >> 13
    h = (h * _M) & _MASK
    h ^= h >> 15
    return h


def partition_for(key: bytes, partitions: int) -> int:
    """The partition Kafka's default partitioner picks for a non-empty key."""
    return (murmur2(key) & 0x7FFFFFFF) % partitions
