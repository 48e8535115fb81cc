"""Webhook effects on the real broker, PostgreSQL and a local HTTP server: order, retries, commits, timeouts."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from structlog.testing import capture_logs

from kafold.config import KafkaConfig, PostgresConfig
from kafold.connectors.effects import ops
from kafold.connectors.effects.signing import verify
from kafold.envelope import encode
from tests.effects.effects_support import start_effects
from tests.support import committed, create_topic, make_event, produce, wait_for
from tests.support.receiver import Receiver, Req


def publish(kafka: KafkaConfig, topic: str, keys: int, versions: int, partitions: int = 3
            ) -> tuple[dict[str, list[int]], dict[tuple[int, int], str], dict[int, int]]:
    """keys x versions events, interleaved; returns per-key versions in topic order, (partition, offset) -> id,
    and the end offset of each partition."""
    items, ids = [], []
    for v in range(1, versions + 1):
        for k in range(keys):
            event = make_event(f"k{k}", v)
            ids.append(event.event_id)
            items.append((k % partitions, *encode(event)))
    coords = produce(kafka, topic, items)
    where = {c: ids[i] for i, c in enumerate(coords)}
    ends = {p: max(o for pp, o in coords if pp == p) + 1 for p in range(partitions)}
    order = {f"k{k}": list(range(1, versions + 1)) for k in range(keys)}
    return order, where, ends


def webhook(url: str, **extra: Any) -> dict[str, Any]:
    return {"url": url, "allow_http": True, "backoff_initial_s": 0.05, "backoff_max_s": 0.5, "max_attempts": 100,
            "request_poll_s": 0.2, **extra}


def test_receiver_down_then_up_every_event_delivered_in_key_order_never_committed_early(
        kafka_config: KafkaConfig, effects_pg: PostgresConfig, receiver: Receiver, unique: str) -> None:
    topic = f"{unique}.events"
    create_topic(kafka_config, topic, 3)
    order, where, ends = publish(kafka_config, topic, keys=12, versions=15)
    down_until = time.monotonic() + 3.0

    async def flaky(req: Req) -> tuple[int, dict[str, str]] | None:
        if time.monotonic() < down_until:
            return (503, {}) if req.version % 2 else (500, {})
        if req.key == "k3" and sum(1 for r in receiver.requests if r.event_id == req.event_id) <= 3:
            return 502, {}  # one key keeps failing a few times per event after the outage
        return None

    receiver.behaviour = flaky
    run = start_effects(kafka_config, effects_pg, unique, topic, "webhook", webhook(receiver.url))  # type: ignore[attr-defined]
    samples: list[tuple[float, dict[int, int]]] = []
    stop_sampling = threading.Event()

    def sample() -> None:
        while not stop_sampling.is_set():
            offsets = committed(kafka_config, run.runner.group_id, topic, 3)
            samples.append((time.monotonic(), offsets))
            stop_sampling.wait(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        wait_for(lambda: committed(kafka_config, run.runner.group_id, topic, 3) == ends, "commit to the end", 90)
    finally:
        stop_sampling.set()
        sampler.join(10)
        run.finish()
    delivered = receiver.delivered_at()
    assert set(delivered) == set(where.values())  # every event delivered
    assert receiver.per_key(only_success=True) == order  # per key, receiver order == topic order, no repeats
    for key, versions in receiver.per_key(only_success=False).items():  # failed tries never run ahead either
        assert versions == sorted(versions), key
    for seen_at, offsets in samples:  # a commit never passed an event not yet delivered when it was read
        for (p, off), event_id in where.items():
            if off < offsets.get(p, -1):
                assert delivered[event_id] <= seen_at, (p, off)
    assert any(r.status >= 500 for r in receiver.requests)


def test_signatures_verify_with_both_rotation_secrets(kafka_config: KafkaConfig, effects_pg: PostgresConfig,
                                                      receiver: Receiver, unique: str, monkeypatch: Any) -> None:
    monkeypatch.setenv("KT_HOOK_SECRET", "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")
    monkeypatch.setenv("KT_HOOK_OLD", "an-older-plain-secret")
    topic = f"{unique}.events"
    create_topic(kafka_config, topic, 1)
    _, where, ends = publish(kafka_config, topic, keys=2, versions=3, partitions=1)
    run = start_effects(kafka_config, effects_pg, unique, topic, "webhook", webhook(
        receiver.url, secret_env="KT_HOOK_SECRET", previous_secret_env="KT_HOOK_OLD",  # type: ignore[attr-defined]
        headers={"x-tenant": "t1"}))
    try:
        wait_for(lambda: committed(kafka_config, run.runner.group_id, topic, 1) == ends, "commit to the end")
    finally:
        run.finish()
    reqs = receiver.successes()
    assert {r.event_id for r in reqs} == set(where.values())
    for r in reqs:
        h = {k.lower(): v for k, v in r.headers.items()}
        ts = int(h["webhook-timestamp"])
        assert h["webhook-id"] == r.event_id and h["x-tenant"] == "t1"
        assert h["content-type"] == "application/json"
        for secret in ("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "an-older-plain-secret"):
            assert verify(r.event_id, ts, r.body, h["webhook-signature"], secret)
        assert not verify(r.event_id, ts, r.body + b" ", h["webhook-signature"], "an-older-plain-secret")


def test_429_with_retry_after_is_honoured(kafka_config: KafkaConfig, effects_pg: PostgresConfig,
                                          receiver: Receiver, unique: str) -> None:
    topic = f"{unique}.events"
    create_topic(kafka_config, topic, 1)
    event = make_event("slow", 1)
    produce(kafka_config, topic, [(0, *encode(event))])

    async def throttle(req: Req) -> tuple[int, dict[str, str]] | None:
        first = sum(1 for r in receiver.requests if r.event_id == req.event_id) == 1
        return (429, {"Retry-After": "2"}) if first else None

    receiver.behaviour = throttle
    run = start_effects(kafka_config, effects_pg, unique, topic, "webhook",
                        webhook(receiver.url, backoff_initial_s=0.01))  # type: ignore[attr-defined]
    try:
        wait_for(lambda: committed(kafka_config, run.runner.group_id, topic, 1) == {0: 1}, "delivery")
    finally:
        run.finish()
    tries = [r for r in receiver.requests if r.event_id == event.event_id]
    assert [r.status for r in tries] == [429, 200]
    # without Retry-After the backoff here would be <= 10 ms; the server asked for 2 s
    assert tries[1].at - tries[0].answered_at >= 1.9
    shown = ops.show(effects_pg, event.event_id)
    assert shown[0]["status"] == "succeeded" and shown[0]["attempts"] == 2
    assert len(shown[0]["failed_attempts"]) == 1 and "429" in shown[0]["failed_attempts"][0]["error"]


def test_a_hung_receiver_times_out_without_a_rebalance(kafka_config: KafkaConfig, effects_pg: PostgresConfig,
                                                       receiver: Receiver, unique: str) -> None:
    """The hang (6 s per try) exceeds the group's session and rebalance timeouts (6 s in tests)."""
    topic = f"{unique}.events"
    create_topic(kafka_config, topic, 2)
    _, where, ends = publish(kafka_config, topic, keys=4, versions=3, partitions=2)
    hung = {r for r in where.values()}
    hung_id = sorted(hung)[0]

    async def hang(req: Req) -> tuple[int, dict[str, str]] | None:
        if req.event_id == hung_id and sum(1 for r in receiver.requests if r.event_id == hung_id) <= 2:
            await asyncio.sleep(30)
        return None

    receiver.behaviour = hang
    with capture_logs() as logs:
        run = start_effects(kafka_config, effects_pg, unique, topic, "webhook",
                            webhook(receiver.url, timeout_s=6.0))  # type: ignore[attr-defined]
        try:
            wait_for(lambda: committed(kafka_config, run.runner.group_id, topic, 2) == ends, "commit", 90)
        finally:
            run.finish()
    tries = [r for r in receiver.requests if r.event_id == hung_id]
    assert len(tries) == 3 and tries[-1].status == 200
    assert set(receiver.delivered_at()) == set(where.values())
    events = [e["event"] for e in logs]
    assert events.count("runner.partitions_assigned") == 1, "a hung target must not cost the group membership"
    assert events.count("runner.partitions_released") == 1  # only the final shutdown
    assert any("timed out" in str(f["error"]) for f in ops.show(effects_pg, hung_id)[0]["failed_attempts"])
