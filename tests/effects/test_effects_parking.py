"""A permanently failing key is parked with its successors while other keys flow; retry / skip release it."""

from __future__ import annotations

from typing import Any

import orjson
from confluent_kafka import Consumer

from kafold import kafka_clients
from kafold.config import KafkaConfig, PostgresConfig
from kafold.connectors.effects import ops
from kafold.envelope import encode
from tests.effects.effects_support import start_effects
from tests.support import committed, create_topic, make_event, produce, wait_for
from tests.support.receiver import Receiver, Req


def test_failing_keys_park_in_order_others_complete_then_retry_and_skip_release_them(
        kafka_config: KafkaConfig, effects_pg: PostgresConfig, receiver: Receiver, unique: str) -> None:
    topic, dlq = f"{unique}.events", f"kafold.dlq.{unique}"
    create_topic(kafka_config, topic, 2)
    create_topic(kafka_config, dlq, 1)
    keys = ["good1", "bad", "good2", "worse"]
    events = {k: [make_event(k, v) for v in range(1, 6)] for k in keys}
    items = [(i % 2, *encode(events[k][v])) for v in range(5) for i, k in enumerate(keys)]
    coords = produce(kafka_config, topic, items)
    ends = {p: max(o for pp, o in coords if pp == p) + 1 for p in (0, 1)}
    broken = {("bad", 2), ("worse", 3)}

    async def rejecting(req: Req) -> tuple[int, dict[str, str]] | None:
        return (422, {}) if (req.key, req.version) in broken else None

    receiver.behaviour = rejecting
    run = start_effects(kafka_config, effects_pg, unique, topic, "webhook", {
        "url": receiver.url, "allow_http": True, "request_poll_s": 0.2})  # type: ignore[attr-defined]
    try:
        # the partitions' offsets reach the end although two keys are stuck
        wait_for(lambda: committed(kafka_config, run.runner.group_id, topic, 2) == ends, "commit past parked")
        ok = receiver.per_key()
        assert ok["good1"] == ok["good2"] == [1, 2, 3, 4, 5]
        assert ok["bad"] == [1] and ok["worse"] == [1, 2]
        parked = {r["key"]: r for r in ops.parked(effects_pg, unique)}
        assert set(parked) == {"bad", "worse"}
        assert parked["bad"]["events"] == 4 and parked["worse"]["events"] == 3
        assert parked["bad"]["head_event_id"] == events["bad"][1].event_id and "422" in parked["bad"]["error"]
        head = ops.show(effects_pg, events["bad"][1].event_id)[0]
        assert head["status"] == "parked" and head["attempts"] == 1  # a 422 is permanent: no retries
        assert ops.show(effects_pg, events["bad"][3].event_id)[0]["status"] == "parked"

        broken.clear()  # the target is fixed
        assert ops.request(effects_pg, "bad", "retry") == unique
        assert ops.wait(effects_pg, unique, "bad", 30) is ops.WaitOutcome.RELEASED
        broken.add(("worse", 4))  # skipping the head; the next one fails again and becomes the head
        ops.request(effects_pg, "worse", "skip", connector=unique)
        assert ops.wait(effects_pg, unique, "worse", 30) is ops.WaitOutcome.PARKED
        broken.clear()
        ops.request(effects_pg, "worse", "retry")
        assert ops.wait(effects_pg, unique, "worse", 30) is ops.WaitOutcome.RELEASED
        more = [(1, *encode(make_event("bad", 6)))]  # the released key flows normally again
        produce(kafka_config, topic, more)
        wait_for(lambda: receiver.per_key().get("bad", [])[-1:] == [6], "a later event of the released key")
    finally:
        run.finish()
    ok = receiver.per_key()
    assert ok["bad"] == [1, 2, 3, 4, 5, 6]
    assert ok["worse"] == [1, 2, 4, 5]  # 3 was skipped, in order otherwise
    assert ops.show(effects_pg, events["worse"][2].event_id)[0]["status"] == "skipped"
    assert ops.parked(effects_pg, unique) == []
    letters = _dead_letters(kafka_config, dlq, 2)  # the two heads whose retries ran out, with the raw event
    assert sorted(orjson.loads(value)["event_id"] for _, value in letters) == sorted(
        [events["bad"][1].event_id, events["worse"][2].event_id])
    assert all(h["kafold-dlq-connector"] == unique.encode() and h["kafold-dlq-topic"] == topic.encode()
               for h, _ in letters)


def _dead_letters(kafka: KafkaConfig, topic: str, n: int) -> list[tuple[dict[str, Any], bytes]]:
    consumer = Consumer(kafka_clients.librdkafka(kafka, **{"group.id": f"{topic}.reader",
                                                           "auto.offset.reset": "earliest"}))
    consumer.subscribe([topic])
    got: list[Any] = []
    try:
        wait_for(lambda: bool(got.extend(m for m in consumer.consume(10, 0.5) if not m.error())) or len(got) >= n,
                 "dead letters")
    finally:
        consumer.close()
    return [(dict(m.headers()), m.value()) for m in got]
