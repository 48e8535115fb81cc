"""The sink connector contract (kafold.testing.SinkTaskContract) against the effect connectors shipped: webhook (to a
real local HTTP receiver), kafka (to a real topic) and python, each with its ledger in PostgreSQL."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from confluent_kafka import OFFSET_BEGINNING
from confluent_kafka import TopicPartition as KafkaTP

from kafold import kafka_clients
from kafold.config import KafkaConfig, PostgresConfig
from kafold.connectors.api import TopicPartition
from kafold.envelope import Event, decode
from tests.support import SinkTaskContract, create_topic, wait_for
from tests.support.receiver import Receiver

CALLED: list[str] = []  # event ids the python effect was called with (any thread)
CALLED_LOCK = threading.Lock()


def noted(event: Event) -> None:
    """The python connector's effect under test: notes the event's id."""
    with CALLED_LOCK:
        CALLED.append(event.event_id)


class EffectContract(SinkTaskContract):
    """An effect task needs Kafka (its dead-letter producer, the kafka effect) and PostgreSQL (its ledger) to start:
    the contract hands them over as the host does."""

    @pytest.fixture(autouse=True)
    def _services(self, kafka_config: KafkaConfig, effects_pg: PostgresConfig) -> None:
        self.kafka, self.pg = kafka_config, effects_pg

    def services(self) -> dict[str, Any]:
        return {"kafka": self.kafka, "postgres": self.pg}

    def delivered(self) -> set[str]:
        """Event ids the effect has reached so far."""
        raise NotImplementedError

    def test_put_records_reach_the_effect(self) -> None:
        task, ctx = self.started_task()
        tp = TopicPartition("contract.topic", 0)
        ctx.assigned.add(tp)
        task.open([tp])
        records = self.records(tp, 0, 5)
        task.put(records)
        wanted = {r.event.event_id for r in records}
        try:
            wait_for(lambda: wanted <= self.delivered(), "every put record's effect", 30)
            wait_for(lambda: task.pre_commit({tp: 5}).get(tp) == 5, "the offsets committable to the end", 30)
        finally:
            task.close([tp])
            task.stop()


class TestWebhookContract(EffectContract):
    connector_ref = "webhook"

    @pytest.fixture(autouse=True)
    def _receiver(self, receiver: Receiver) -> None:
        self.receiver = receiver
        self.config = {"url": receiver.url, "allow_http": True}  # type: ignore[attr-defined]  # set by the fixture

    def delivered(self) -> set[str]:
        with self.receiver.lock:
            return {r.event_id for r in self.receiver.requests}


class TestKafkaEffectContract(EffectContract):
    connector_ref = "kafka"

    @pytest.fixture(autouse=True)
    def _target(self, kafka_config: KafkaConfig, unique: str) -> Iterator[None]:
        self.target = f"{unique}.derived"
        create_topic(kafka_config, self.target)
        self.config = {"topic": self.target}
        yield

    def delivered(self) -> set[str]:
        """The source event ids of the derived events in the target topic (their causation)."""
        reader = kafka_clients.consumer(self.kafka, f"{self.target}.reader")
        try:
            reader.assign([KafkaTP(self.target, 0, OFFSET_BEGINNING)])
            msgs = [m for m in reader.consume(100, 2) if m.error() is None]
        finally:
            reader.close()
        return {decode(m.key(), m.value(), m.headers()).causation_id or "" for m in msgs}


class TestPythonEffectContract(EffectContract):
    connector_ref = "python"
    config = {"function": f"{__name__}:noted"}

    def delivered(self) -> set[str]:
        with CALLED_LOCK:
            return set(CALLED)
