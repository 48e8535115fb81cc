"""Offset accounting of an effect connector (webhook to a real local receiver, the real SinkRunner, Apache Kafka):
per partition, records seen = effects done (applied) + those the ledger had already finished (duplicates) +
poison records and parked events (dead-lettered), nothing unaccounted once every record completed."""

from __future__ import annotations

from collections import Counter

from kafold.config import KafkaConfig, PostgresConfig
from kafold.envelope import encode
from tests.effects.effects_support import start_effects
from tests.support import committed, create_topic, make_event, produce, wait_for
from tests.support.receiver import Receiver, Req

PARTITIONS = 2


def test_effects_count_done_duplicate_and_parked_records_per_partition(
        kafka_config: KafkaConfig, effects_pg: PostgresConfig, receiver: Receiver, unique: str) -> None:
    topic = f"{unique}.events"
    create_topic(kafka_config, topic, PARTITIONS)
    create_topic(kafka_config, f"kafold.dlq.{unique}", 1)
    # keys of this test only: the session's ledger is shared, and a parked key's name must be unique to it
    bad = f"bad-{unique[-8:]}"
    keys = ["k0", "k1", "k2", "k3", bad]
    partition = {k: i % PARTITIONS for i, k in enumerate(keys)}  # the bad key in partition 0
    events = [make_event(k, v) for v in (1, 2, 3) for k in keys]

    async def rejecting(req: Req) -> tuple[int, dict[str, str]] | None:
        return (422, {}) if (req.key, req.version) == (bad, 2) else None  # 422: parked at once, no retries

    receiver.behaviour = rejecting
    poison = [(0, b"k0", b"not an envelope", None), (1, b"k1", b"\xff\xfe", None)]
    first = produce(kafka_config, topic, [*((partition[e.aggregate_id], *encode(e)) for e in events[:8]), *poison,
                                          *((partition[e.aggregate_id], *encode(e)) for e in events[8:])])
    run = start_effects(kafka_config, effects_pg, unique, topic, "webhook", {
        "url": receiver.url, "allow_http": True})  # type: ignore[attr-defined]
    try:
        def settled(sent: list[tuple[int, int]]) -> bool:
            ends = {p: max(o for pp, o in sent if pp == p) + 1 for p in range(PARTITIONS)}
            if committed(kafka_config, run.runner.group_id, topic, PARTITIONS) != ends:
                return False
            acc = run.runner.accounts
            return sum(a.seen for a in acc.values()) == len(sent) and all(a.unaccounted == 0 for a in acc.values())

        wait_for(lambda: settled(first), "the first records completed and accounted for")
        # The same events again (a producer's retry, a replay): the ledger has them finished.
        again = [e for e in events if e.aggregate_id != bad]
        second = produce(kafka_config, topic, [(partition[e.aggregate_id], *encode(e)) for e in again])
        wait_for(lambda: settled(first + second), "the duplicates completed and accounted for")

        per = Counter(partition[e.aggregate_id] for e in events)
        parked = Counter({0: 2})  # bad v2 (the head) and v3 (behind it)
        expected = {p: {"seen": per[p] + 1 + Counter(p2 for p2, _ in second)[p],
                        "applied": per[p] - parked[p],
                        "duplicates": Counter(partition[e.aggregate_id] for e in again)[p],
                        "stale": 0, "dead_lettered": 1 + parked[p], "skipped": 0, "unaccounted": 0}
                    for p in range(PARTITIONS)}
        got = {tp.partition: {k: v for k, v in a.as_dict().items() if k in expected[0]}
               for tp, a in run.runner.accounts.items()}
        assert got == expected
        done = receiver.per_key()
        assert done[bad] == [1] and all(done[k] == [1, 2, 3] for k in keys if k != bad)  # each effect once
    finally:
        run.finish()
