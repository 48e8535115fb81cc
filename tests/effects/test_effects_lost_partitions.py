"""A webhook effect whose group membership is lost (the broker stopped past the session timeout) while the task has
fetching paused (too many effects in flight) delivers everything once its partitions are assigned again.

Found by the chaos soak on Apache Kafka: after a session timeout the effect connector was assigned its partitions
again but never fetched. librdkafka keeps an application's pause of a partition across its removal from the
assignment and its assignment again (only the pause it set itself for the rebalance is lifted), while the task had
forgotten the pause together with the partition: nobody resumed it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from typing import Any

import pytest

from kafold.config import KafkaConfig, PostgresConfig
from kafold.envelope import encode
from tests.effects.effects_support import start_effects
from tests.support import create_topic, make_event, produce
from tests.support.receiver import Receiver, Req

pytestmark = [pytest.mark.integration, pytest.mark.apache_kafka]

PARTITIONS = 4
KEYS = 16


def publish(kafka: KafkaConfig, topic: str, versions: range) -> dict[str, str]:
    """KEYS keys x `versions`, interleaved (key k on partition k % PARTITIONS); returns event id -> key@version."""
    items, ids = [], {}
    for v in versions:
        for k in range(KEYS):
            event = make_event(f"k{k}", v)
            ids[event.event_id] = f"k{k}@{v}"
            items.append((k % PARTITIONS, *encode(event)))
    produce(kafka, topic, items)
    return ids


@pytest.mark.timeout(240)
def test_partitions_lost_while_fetching_is_paused_are_fetched_again_once_assigned(
        request: pytest.FixtureRequest, kafka_config: KafkaConfig, effects_pg: PostgresConfig, receiver: Receiver,
        unique: str) -> None:
    if os.environ.get("KAFOLD_TEST_BOOTSTRAP"):
        pytest.skip("stops the dev stack's broker; an external broker is not ours to stop")
    broker = request.getfixturevalue("dev_stack").broker
    topic = f"{unique}.events"
    create_topic(kafka_config, topic, PARTITIONS)
    published = publish(kafka_config, topic, range(1, 9))
    released = threading.Event()

    async def held(req: Req) -> tuple[int, dict[str, str]] | None:
        while not released.is_set():  # the effects in flight stay in flight: the task pauses fetching
            await asyncio.sleep(0.05)
        return None

    receiver.behaviour = held
    config: dict[str, Any] = {"url": receiver.url, "allow_http": True, "timeout_s": 120.0,  # type: ignore[attr-defined]
                              "max_in_flight": 20, "backoff_initial_s": 0.05, "backoff_max_s": 0.5}
    run = start_effects(kafka_config, effects_pg, unique, topic, "webhook", config, batch=40)
    runner = run.runner
    try:
        deadline = time.monotonic() + 60
        while not (runner.task_status.get("fetch_paused") and len(runner.assigned) == PARTITIONS):
            assert time.monotonic() < deadline, f"fetching never paused: {runner.task_status}"
            time.sleep(0.1)
        assignments = runner.counts["assignments"]
        # Past the session timeout without a heartbeat answered: the consumer gives its partitions up as lost.
        os.kill(broker.pid, signal.SIGSTOP)
        try:
            time.sleep(kafka_config.session_timeout_ms / 1000 + 4)
        finally:
            os.kill(broker.pid, signal.SIGCONT)
        deadline = time.monotonic() + 90
        while not (runner.counts["assignments"] > assignments and len(runner.assigned) == PARTITIONS):
            assert time.monotonic() < deadline, f"partitions not assigned again: {runner.counts}"
            time.sleep(0.1)
        released.set()
        published |= publish(kafka_config, topic, range(9, 13))  # and traffic goes on
        deadline = time.monotonic() + 90
        while set(published) - set(receiver.delivered_at()) and time.monotonic() < deadline:
            time.sleep(0.2)
        progress = {str(tp): f"position {p.position}, committed {p.committed}, lag {p.lag}, paused {p.paused}"
                    for tp, p in sorted(runner.progress.snapshot.items())}
    finally:
        released.set()
        run.finish()
    missing = sorted(published[e] for e in set(published) - set(receiver.delivered_at()))
    assert not missing, (f"{len(missing)} of {len(published)} events never delivered (e.g. {missing[:5]}); "
                         f"runner {runner.counts}, task {runner.task_status}, partitions {progress}")
    # At least once, and per key the first deliveries in topic order.
    for key, versions in receiver.per_key(only_success=True).items():
        firsts = list(dict.fromkeys(versions))
        assert firsts == sorted(firsts) == list(range(1, 13)), (key, versions)

