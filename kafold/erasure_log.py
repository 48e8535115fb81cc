"""The erasure log: every deleted subject key recorded on a compacted Kafka topic, outside the key store's backups.

A `forget` deletes a subject's data key from the key store (kafold.protect). A restore of that store from an older
backup would bring the key back, and with it the subject's protected values. So each deleted key is also recorded
on `[privacy] erasure_topic`, keyed by its key id (random, one per key: a subject forgotten, written again and
forgotten again has a record per key, and compaction keeps each), with the subject's keyed hash and who asked
(never the subject itself). The topic is read whole and re-applied on daemon start, `kafold db upgrade` and
`kafold keys reapply`: any key the store still holds whose id the log names is deleted again.

Ordering (see KeyRing.forget): the record is produced with acks=all and flushed, and its delivery report checked,
before the key is deleted; a forget whose record is not acknowledged fails and deletes nothing.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import orjson

from kafold import kafka_clients, logs
from kafold.errors import FatalError

if TYPE_CHECKING:
    from kafold.config import KafkaConfig

log = logs.get(__name__)
FLUSH_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Erasure:
    """One deleted data key: its id, the subject's keyed hash (kafold.protect.Cipher.subject_hash), who asked, when
    (epoch seconds)."""

    key_id: bytes
    subject_hash: str
    actor: str
    erased_at: float

    def encode(self) -> tuple[bytes, bytes]:
        """(record key, record value): keyed by the key id, so compaction keeps one record per deleted key."""
        return self.key_id.hex().encode(), orjson.dumps(
            {"key_id": self.key_id.hex(), "subject_hash": self.subject_hash, "actor": self.actor,
             "erased_at": self.erased_at})

    @staticmethod
    def decode(value: bytes) -> Erasure:
        """A record's value; ValueError when it is not one this module wrote."""
        try:
            doc = orjson.loads(value)
            return Erasure(bytes.fromhex(doc["key_id"]), str(doc["subject_hash"]), str(doc["actor"]),
                           float(doc["erased_at"]))
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not an erasure record: {e}") from None


class ErasureLog:
    """Writes and reads the erasure topic of one Kafka cluster (its producer made on the first `record`)."""

    def __init__(self, kafka: KafkaConfig, topic: str) -> None:
        self.kafka, self.topic = kafka, topic
        self.producer: Any = None
        self.lock = threading.Lock()

    def record(self, key_id: bytes, subject_hash: str, actor: str) -> None:
        """Write one erasure and wait for the brokers' acknowledgement (all in-sync replicas); FatalError when it
        is not acknowledged within FLUSH_TIMEOUT_S: the caller must not delete the key then."""
        key, value = Erasure(key_id, subject_hash, actor, time.time()).encode()
        failed: list[str] = []

        def delivered(err: Any, _msg: Any) -> None:
            if err is not None:
                failed.append(str(err))

        with self.lock:
            if self.producer is None:
                # idempotent, acks=all: an acknowledged record is on every in-sync replica; a record not delivered
                # within the timeout gets its delivery report (with librdkafka's reason) before the flush gives up
                self.producer = kafka_clients.producer(self.kafka, **{
                    "enable.idempotence": True, "acks": "all", "message.timeout.ms": int(FLUSH_TIMEOUT_S * 1000)})
            kafka_clients.produce(self.producer, self.topic, value, key, on_delivery=delivered)
            left = self.producer.flush(FLUSH_TIMEOUT_S + 5)
        if left or failed:
            reason = failed[0] if failed else f"not acknowledged within {FLUSH_TIMEOUT_S:.0f} s"
            raise FatalError(f"the erasure could not be recorded on topic {self.topic!r} ({reason}); the key was "
                             "not deleted: try again once Kafka is reachable and the topic exists (`kafold topics "
                             "ensure`)")
        log.info("protect.erasure_logged", topic=self.topic, subject_hash=subject_hash[:16])

    def read(self) -> list[Erasure]:
        """Every erasure on the topic (each partition read to its end); a record that is not one is skipped and
        logged. A topic that does not exist holds none: no forget completes without its record on the topic (a
        deployment upgraded to a kafold with the topic has not run `kafold topics ensure` yet), which a warning
        says. RetriableError when the topic cannot be read."""
        # kafka_io imports confluent_kafka at its top: only processes that re-apply pay for it (a task process
        # builds a ring with a log it never reads)
        from kafold.snapshot import kafka_io

        reader = kafka_clients.range_reader(self.kafka, f"kafold-erasures-{time.monotonic_ns()}")
        found: dict[bytes, Erasure] = {}
        try:
            if not kafka_io.exists(reader, self.topic):
                log.warning("protect.erasure_topic_missing", topic=self.topic, hint="run `kafold topics ensure`; "
                            "forgets fail until it exists")
                return []
            partitions = sorted(reader.list_topics(self.topic, timeout=10).topics[self.topic].partitions)
            for partition in partitions:
                for _offsets, _keys, values in kafka_io.read_range(reader, self.topic, partition, 0, None):
                    for value in values:
                        if value is None:  # a tombstone: nothing of ours, left alone
                            continue
                        try:
                            erasure = Erasure.decode(value)
                        except ValueError as e:
                            log.warning("protect.erasure_record_skipped", topic=self.topic, error=str(e))
                            continue
                        found[erasure.key_id] = erasure
        finally:
            reader.close()
        return list(found.values())

    def close(self) -> None:
        with self.lock:
            if self.producer is not None:
                kafka_clients.close_producer(self.producer, FLUSH_TIMEOUT_S)
                self.producer = None


class Reapplies(Protocol):
    """What `reapply` needs of a key ring (kafold.protect.KeyRing, which records erasures here: typed by this
    protocol, not imported, so that the two modules do not import each other)."""

    def reapply(self, erasures: list[tuple[bytes, str, str]]) -> list[str]: ...


def reapply(ring: Reapplies, erasure_log: ErasureLog) -> list[str]:
    """Re-apply the erasure log to `ring`'s store (a kafold.protect.KeyRing): the keys it still holds that the log
    names are deleted (and recorded as erasures again), and dropped from this process's caches; the subjects whose
    keys were deleted (a database behind the log: restored from a backup, or a crash between log and delete)."""
    started = time.monotonic()
    erasures = erasure_log.read()
    gone = ring.reapply([(e.key_id, e.subject_hash, f"reapply:{e.actor}") for e in erasures])
    if gone:
        log.warning("protect.erasures_reapplied", topic=erasure_log.topic, erasures=len(erasures),
                    keys_deleted=len(gone), seconds=round(time.monotonic() - started, 3),
                    # a restored database's projection rows still hold those subjects' values: the daemon and
                    # `kafold db upgrade` fold them again (connectors/projection/restored.py, docs/operations.md)
                    next_step="those subjects' rows are folded again in each projection of protected fields "
                    "(protect.restored_refreshed; on protect.restored_refresh_failed, its hint)")
    else:
        log.info("protect.erasures_checked", topic=erasure_log.topic, erasures=len(erasures),
                 seconds=round(time.monotonic() - started, 3))
    return gone
