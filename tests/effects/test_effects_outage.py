"""Outages of the receiver: transient failures are retried (not parked) for as long as they last within max_age,
the endpoint's circuit keeps a down endpoint at the probe rate, permanent failures and keys past max_age park, and
parked keys heal on the `parked_retry_every_s` schedule."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from kafold import kafka_clients
from kafold.config import KafkaConfig, PostgresConfig
from kafold.connectors.effects import ops
from kafold.envelope import encode
from kafold.testing import free_port
from kafold.tools import cli
from tests.effects.effects_support import daemon_config, start_effects
from tests.support import committed, create_topic, make_event, new_producer, produce, wait_for
from tests.support.daemons import daemon_thread
from tests.support.receiver import Receiver, Req


def _publish(kafka: KafkaConfig, topic: str, keys: list[str], versions: int) -> dict[int, int]:
    items = [(i % 2, *encode(make_event(k, v))) for v in range(1, versions + 1) for i, k in enumerate(keys)]
    coords = produce(kafka, topic, items)
    return {p: max(o for pp, o in coords if pp == p) + 1 for p in (0, 1)}


def _fast(url: str, **extra: Any) -> dict[str, Any]:
    # With these backoffs 8 attempts take about two seconds: an outage of several times that shows that transient
    # failures are bounded by max_age (no attempt limit by default), not by a count of attempts.
    return {"url": url, "allow_http": True, "backoff_initial_s": 0.05, "backoff_max_s": 0.5, "probe_max_s": 0.5,
            "request_poll_s": 0.2, "concurrency": 8, **extra}


def _outage(receiver: Receiver) -> list[bool]:
    """Make the receiver answer 503 while the returned flag's [0] is True."""
    down = [True]

    async def outage(req: Req) -> tuple[int, dict[str, str]] | None:
        return (503, {}) if down[0] else None

    receiver.behaviour = outage
    return down


def test_refused_connections_for_longer_than_the_old_budget_park_nothing_and_all_arrive_in_order(
        kafka_config: KafkaConfig, effects_pg: PostgresConfig, receiver: Receiver, unique: str) -> None:
    topic = f"{unique}.events"
    create_topic(kafka_config, topic, 2)
    port = receiver.port  # type: ignore[attr-defined]
    url = receiver.url  # type: ignore[attr-defined]
    receiver.stop()  # connection refused, as during a deploy of the receiving service
    keys = [f"k{i}" for i in range(10)]
    ends = _publish(kafka_config, topic, keys, 5)
    run = start_effects(kafka_config, effects_pg, unique, topic, "webhook", _fast(url))
    try:
        executor = lambda: run.runner.task.executor  # noqa: E731
        wait_for(lambda: hasattr(run.runner.task, "executor") and executor().status()["circuit"] != "closed",
                 "the circuit to open")
        time.sleep(8)  # four times what 8 attempts would last (see _fast)
        assert ops.parked(effects_pg, unique) == []
        assert committed(kafka_config, run.runner.group_id, topic, 2) in ({}, {0: 0, 1: 0})
        receiver.start(port)
        wait_for(lambda: committed(kafka_config, run.runner.group_id, topic, 2) == ends, "everything committed")
        assert executor().status()["circuit"] == "closed" and executor().status()["circuit_changes"] >= 2
    finally:
        run.finish()
    assert receiver.per_key() == {k: [1, 2, 3, 4, 5] for k in keys}
    assert ops.parked(effects_pg, unique) == []


def test_a_down_endpoint_gets_probes_not_every_keys_retries_and_the_circuit_closes_when_it_answers(
        kafka_config: KafkaConfig, effects_pg: PostgresConfig, receiver: Receiver, unique: str) -> None:
    topic = f"{unique}.events"
    create_topic(kafka_config, topic, 2)
    keys = [f"k{i}" for i in range(20)]
    down = _outage(receiver)
    ends = _publish(kafka_config, topic, keys, 3)
    run = start_effects(kafka_config, effects_pg, unique, topic, "webhook", _fast(receiver.url))  # type: ignore[attr-defined]
    try:
        wait_for(lambda: len(receiver.requests) >= 20, "the first requests")
        time.sleep(2)  # the circuit opened long ago; the probes' backoff reached its cap
        before, t0 = len(receiver.requests), time.monotonic()
        time.sleep(5)
        during, span = len(receiver.requests) - before, time.monotonic() - t0
        # 20 keys retrying on their own (cap 0.5 s, full jitter) would send ~16 requests a second; the open
        # circuit sends one probe per probe_max_s at most (plus one in flight).
        assert during <= span / 0.5 + 2, f"{during} requests in {span:.1f}s while the endpoint was down"
        assert run.runner.task.executor.status()["circuit"] in ("open", "probing")
        down[0] = False
        wait_for(lambda: committed(kafka_config, run.runner.group_id, topic, 2) == ends, "everything committed")
        assert run.runner.task.executor.status()["circuit"] == "closed"
    finally:
        run.finish()
    assert receiver.per_key() == {k: [1, 2, 3] for k in keys}
    assert ops.parked(effects_pg, unique) == []


def test_4xx_parks_at_once_retry_after_is_honoured_max_age_parks_and_the_schedule_heals(
        kafka_config: KafkaConfig, effects_pg: PostgresConfig, receiver: Receiver, unique: str) -> None:
    topic, dlq = f"{unique}.events", f"kafold.dlq.{unique}"
    create_topic(kafka_config, topic, 2)
    create_topic(kafka_config, dlq, 1)
    broken = {"bad": 400, "dead": 503}
    told: list[str] = []

    async def behaviour(req: Req) -> tuple[int, dict[str, str]] | None:
        if req.key in broken:
            return broken[req.key], {}
        if req.key == "slow" and req.version == 1 and req.event_id not in told:
            told.append(req.event_id)
            return 503, {"Retry-After": "2"}
        return None

    receiver.behaviour = behaviour
    keys = ["ok", "bad", "slow", "dead"]
    _publish(kafka_config, topic, keys, 3)
    run = start_effects(kafka_config, effects_pg, unique, topic, "webhook", _fast(
        receiver.url, circuit_failure_ratio=0, max_age_s=4, parked_retry_every_s=3))  # type: ignore[attr-defined]
    try:
        wait_for(lambda: {"bad", "dead"} <= {r["key"] for r in ops.parked(effects_pg, unique)}, "two parked keys")
        parked = {r["key"]: r for r in ops.parked(effects_pg, unique)}
        assert "400" in parked["bad"]["error"] and "503" in parked["dead"]["error"]
        wait_for(lambda: receiver.per_key().get("slow") == [1, 2, 3], "the slow key")
        slow = sorted((r for r in receiver.requests if r.key == "slow" and r.version == 1), key=lambda r: r.at)
        assert len(slow) == 2 and slow[1].at - slow[0].at >= 1.9  # waited as told, no earlier
        bad_head = [r for r in receiver.requests if r.key == "bad"]
        assert bad_head and {r.version for r in bad_head} == {1}  # parked at once; its later events behind it
        dead_head = [r for r in receiver.requests if r.key == "dead"]
        assert len(dead_head) > 2 and {r.version for r in dead_head} == {1}  # retried, then parked past max_age
        assert receiver.per_key().get("ok") == [1, 2, 3]
        broken.clear()  # both receivers fixed: the schedule releases the keys without an operator
        wait_for(lambda: ops.parked(effects_pg, unique) == [], "the scheduled re-release")
    finally:
        run.finish()
    assert receiver.per_key() == {k: [1, 2, 3] for k in keys}


def test_the_circuit_state_is_on_metrics_and_in_kafold_status(
        kafka_config: KafkaConfig, effects_pg: PostgresConfig, receiver: Receiver, unique: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    topic = f"{unique}.events"
    create_topic(kafka_config, topic, 2)
    down = _outage(receiver)
    ends = _publish(kafka_config, topic, [f"k{i}" for i in range(20)], 2)
    port = free_port()
    url = receiver.url  # type: ignore[attr-defined]
    effect = (f'{{ url = "{url}", allow_http = true, backoff_initial_s = 0.05, backoff_max_s = 0.5, '
              'probe_max_s = 0.5 }')
    path = daemon_config(tmp_path / "kafold.toml", kafka_config, effects_pg.url, effects_pg.schema, unique, topic,
                         "webhook", effect, port=port)
    endpoint = f'endpoint="http://127.0.0.1:{receiver.port}"'  # type: ignore[attr-defined]

    def metric(name: str, label: str = "") -> float | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
                text = resp.read().decode()
        except OSError:  # the HTTP server is not up yet
            return None
        for line in text.splitlines():
            if line.startswith(name + "{") and endpoint in line and label in line:
                return float(line.rsplit(" ", 1)[1])
        return None

    def status() -> list[dict[str, Any]]:
        capsys.readouterr()  # the daemon's log lines so far
        assert cli.main(["status", "-c", str(path), "--json"]) == 0
        line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("{") and '"effects":' in x)
        return list(json.loads(line)["effects"])

    with daemon_thread(path) as (_, thread):
        wait_for(lambda: metric("kafold_effect_circuit_open") == 1.0, "the circuit open on /metrics")
        rows = status()
        assert [(r["connector"], r["circuit"] in ("open", "probing")) for r in rows] == [("only", True)]
        assert rows[0]["in_flight"] == 40 and rows[0]["parked_keys"] == 0
        assert cli.main(["status", "-c", str(path)]) == 0
        assert "CIRCUIT" in capsys.readouterr().out
        down[0] = False
        wait_for(lambda: committed(kafka_config, f"{unique}.only", topic, 2) == ends, "everything committed")
        assert metric("kafold_effect_circuit_open") == 0.0 and (metric("kafold_effect_circuit_changes_total") or 0) >= 2
        # the outage's attempts failed and were retried; every event then succeeded (none parked)
        assert (metric("kafold_effect_failed_attempts_total") or 0) > 0
        assert metric("kafold_effect_events_total", 'outcome="parked"') == 0.0
        assert (metric("kafold_effect_events_total", 'outcome="succeeded"') or 0) > 0
        assert [r["circuit"] for r in status()] == ["closed"]
        assert thread.is_alive()


def test_events_held_while_waiting_are_bounded_fetching_pauses_without_a_rebalance_and_the_lag_shows_it(
        kafka_config: KafkaConfig, effects_pg: PostgresConfig, receiver: Receiver, unique: str) -> None:
    topic = f"{unique}.events"
    create_topic(kafka_config, topic, 2)
    down = _outage(receiver)
    keys = [f"k{i}" for i in range(50)]
    ends = _publish(kafka_config, topic, keys, 6)  # 300 events
    limit, batch = 40, 50
    run = start_effects(kafka_config, effects_pg, unique, topic, "webhook",
                        _fast(receiver.url, max_in_flight=limit), batch=batch)  # type: ignore[attr-defined]
    try:
        task = lambda: run.runner.task  # noqa: E731
        wait_for(lambda: task().status().get("fetch_paused") is True, "fetching paused")
        held: list[int] = []
        for _ in range(15):  # the endpoint stays down: the task holds at most one batch past the limit
            held.append(task().status()["in_flight"])
            time.sleep(0.2)
        assert max(held) <= limit + batch, held
        # Arriving while paused: not fetched, but in the lag. One record per produce request: the embedded
        # broker's ListOffsets reports the last batch's base offset + 1, exact for single-record batches. One
        # producer flushed after each record (a producer per record spent most of this test starting producers).
        producer = new_producer(kafka_config)
        try:
            coords = [c for v in (7, 8) for i, k in enumerate(keys)
                      for c in produce(kafka_config, topic, [(i % 2, *encode(make_event(k, v)))], producer)]
        finally:
            kafka_clients.close_producer(producer, 15)  # each record was flushed (and checked) by produce
        ends = {p: max(o for pp, o in coords if pp == p) + 1 for p in (0, 1)}
        wait_for(lambda: sum(p.lag or 0 for p in run.runner.progress.snapshot.values()) >= 400 - limit - batch,
                 "the lag of the records not fetched", 30)
        assert all(p.paused for p in run.runner.progress.snapshot.values())
        down[0] = False
        wait_for(lambda: committed(kafka_config, run.runner.group_id, topic, 2) == ends, "everything committed")
        assert task().status()["fetch_paused"] is False
        assert run.runner.counts["assignments"] == 1 and run.runner.counts["rejoins"] == 0  # no rebalance
    finally:
        run.finish()
    assert receiver.per_key() == {k: list(range(1, 9)) for k in keys}
