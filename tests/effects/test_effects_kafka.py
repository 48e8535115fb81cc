"""The kafka effect produces derived events with deterministic ids (the python effect: test_effects_crash)."""

from __future__ import annotations

from confluent_kafka import Consumer

from kafold import kafka_clients
from kafold.config import KafkaConfig, PostgresConfig
from kafold.connectors.effects.drivers import derived_id
from kafold.envelope import Event, decode, encode
from tests.effects.effects_support import start_effects
from tests.support import committed, create_topic, make_event, produce, wait_for


def test_kafka_effect_derives_events_with_replay_detectable_ids(kafka_config: KafkaConfig,
                                                                effects_pg: PostgresConfig, unique: str) -> None:
    topic, out = f"{unique}.events", f"{unique}.notifications"
    create_topic(kafka_config, topic, 2)
    create_topic(kafka_config, out, 2)
    sources = [make_event(f"a{i % 3}", i // 3 + 1) for i in range(9)]
    produce(kafka_config, topic, [(i % 2, *encode(e)) for i, e in enumerate(sources)])
    run = start_effects(kafka_config, effects_pg, unique, topic, "kafka", {
        "topic": out, "type": "NotificationRequested", "aggregate_type": "notification"})
    try:
        wait_for(lambda: sum(committed(kafka_config, run.runner.group_id, topic, 2).values()) == 9, "commit")
    finally:
        run.finish()
    consumer = Consumer(kafka_clients.librdkafka(kafka_config, **{"group.id": f"{unique}.r",
                                                                  "auto.offset.reset": "earliest"}))
    consumer.subscribe([out])
    got: list[Event] = []
    try:
        wait_for(lambda: bool(got.extend(decode(m.key(), m.value(), m.headers()) for m in consumer.consume(10, 0.5)
                                         if not m.error())) or len(got) >= 9, "derived events")
    finally:
        consumer.close()
    by_cause = {e.causation_id: e for e in got}
    assert set(by_cause) == {s.event_id for s in sources} and len(got) == 9
    for s in sources:
        d = by_cause[s.event_id]
        assert d.event_id == derived_id(unique, s.event_id, 0)  # a replay yields the same id: detectable
        assert (d.type, d.aggregate_type, d.aggregate_id) == ("NotificationRequested", "notification", s.aggregate_id)
        assert d.correlation_id == s.correlation_id and d.payload == s.payload
