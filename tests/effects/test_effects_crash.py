"""kill -9 of the daemon: at-least-once loses nothing (exactly once after dedup by webhook-id); at-most-once never
repeats an effect and loses at most what was in flight."""

from __future__ import annotations

import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from kafold.config import KafkaConfig, PostgresConfig
from kafold.envelope import encode
from tests.support import child_env, committed, create_topic, make_event, produce, wait_for
from tests.support.receiver import Receiver, Req

EFFECT = "tests.effects.crash_effect:record"  # a python effect that dies on a marked event
SESSION_MS = 2000  # a killed member leaves the group after this; short so 20+ restarts fit in the time budget


def spawn(kafka: KafkaConfig, pg: PostgresConfig, name: str, topic: str, cls: str, config: dict[str, Any],
          env: dict[str, str] | None = None, batch: int = 100) -> subprocess.Popen[bytes]:
    spec = {"bootstrap": kafka.bootstrap_servers, "pg_url": pg.url, "schema": pg.schema, "name": name,
            "topic": topic, "class": cls, "config": config, "group_prefix": "kt", "batch": batch,
            "session_ms": SESSION_MS}
    return subprocess.Popen([sys.executable, "-m", "tests.effects.effects_proc", orjson.dumps(spec).decode()],
                            env=child_env(env),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def kill9(proc: subprocess.Popen[bytes]) -> None:
    proc.kill()
    proc.wait(10)


@pytest.mark.slow
@pytest.mark.apache_kafka
def test_kill_9_at_random_points_loses_nothing_and_dedups_to_exactly_once(
        kafka_config: KafkaConfig, effects_pg: PostgresConfig, receiver: Receiver, unique: str) -> None:
    topic = f"{unique}.events"
    create_topic(kafka_config, topic, 3)
    events = [make_event(f"k{k}", v) for v in range(1, 61) for k in range(40)]  # 2,400 events, 40 keys
    coords = produce(kafka_config, topic, [(int(e.aggregate_id[1:]) % 3, *encode(e)) for e in events])
    ends = {p: max(o for pp, o in coords if pp == p) + 1 for p in range(3)}

    async def slowish(req: Req) -> tuple[int, dict[str, str]] | None:
        import asyncio

        await asyncio.sleep(0.004)  # keeps deliveries going across many kills
        return (500, {}) if random.random() < 0.03 else None

    receiver.behaviour = slowish
    config = {"url": receiver.url, "allow_http": True, "concurrency": 8, "backoff_initial_s": 0.02,  # type: ignore[attr-defined]
              "max_attempts": 1000, "ledger_flush_ms": 50}
    rng = random.Random(4)
    kills = 0
    for _ in range(22):
        proc = spawn(kafka_config, effects_pg, unique, topic, "webhook", config)
        try:
            proc.wait(rng.uniform(1.0, 4.0))  # a random point: joining, delivering, committing, or idle
            raise AssertionError("the daemon exited on its own")
        except subprocess.TimeoutExpired:
            kill9(proc)
            kills += 1
    proc = spawn(kafka_config, effects_pg, unique, topic, "webhook", config)
    try:
        wait_for(lambda: committed(kafka_config, f"kt.{unique}", topic, 3) == ends, "commit to the end", 120)
    finally:
        proc.terminate()
        proc.wait(30)
    assert kills >= 20
    received = [r.event_id for r in receiver.successes()]
    assert set(received) == {e.event_id for e in events}  # at least once; deduplicated: exactly once
    firsts: dict[str, list[int]] = {}
    seen: set[str] = set()
    for r in receiver.successes():
        if r.event_id not in seen:
            seen.add(r.event_id)
            firsts.setdefault(r.key, []).append(r.version)
    assert all(v == sorted(v) for v in firsts.values())  # first deliveries in per-key order


@pytest.mark.slow
def test_at_most_once_a_crash_between_commit_and_effect_never_repeats_one(
        kafka_config: KafkaConfig, effects_pg: PostgresConfig, unique: str, tmp_path: Path) -> None:
    topic = f"{unique}.events"
    create_topic(kafka_config, topic, 1)
    events = [make_event(f"k{i % 5}", i // 5 + 1, crash=i in (40, 130, 215)) for i in range(300)]
    produce(kafka_config, topic, [(0, *encode(e)) for e in events])
    effect_log = tmp_path / "effects.log"
    config = {"function": EFFECT, "delivery": "at-most-once", "concurrency": 4, "max_in_flight": 10}
    env = {"KT_EFFECT_LOG": str(effect_log)}
    crashes = 0
    for _ in range(3):  # each run dies at the next marked event, which must never run again afterwards
        proc = spawn(kafka_config, effects_pg, unique, topic, "python", config, env, batch=10)
        code = proc.wait(60)
        assert code == -9, f"the daemon exited with {code}, not by a marked event's SIGKILL"
        crashes += 1
    proc = spawn(kafka_config, effects_pg, unique, topic, "python", config, env, batch=10)
    try:
        wait_for(lambda: committed(kafka_config, f"kt.{unique}", topic, 1) == {0: 300}, "commit to the end", 60)
    finally:
        proc.terminate()
        assert proc.wait(30) == 0, "a marked event ran again: at-most-once repeated an effect"
    ran = effect_log.read_text().split()
    assert len(ran) == len(set(ran)), "an effect ran twice"
    crashed = {e.event_id for e in events if e.payload["crash"]}
    assert crashes == 3 and not crashed & set(ran)
    lost = {e.event_id for e in events} - set(ran) - crashed
    # lost = committed (handed over) with a crashing event but not yet run: bounded by max_in_flight + a batch
    assert len(lost) <= 3 * (10 + 10)
    assert len(ran) >= 300 - 3 - len(lost)


def test_at_most_once_holds_records_whose_commit_failed(effects_pg: PostgresConfig, kafka_config: KafkaConfig,
                                                        unique: str, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner's commit of the offered offsets failed (e.g. a rebalance): the effects must not run until a
    commit covering them succeeds — run uncommitted, a crash would run them again."""
    from kafold.config import ConnectorConfig
    from kafold.connectors.api import SinkRecord, TopicPartition
    from kafold.connectors.registry import instantiate
    from tests.support import LocalContext

    effect_log = tmp_path / "effects.log"
    monkeypatch.setenv("KT_EFFECT_LOG", str(effect_log))
    settings = ConnectorConfig(name=unique, connector_class="python", topics=["t"],
                               config={"function": EFFECT, "delivery": "at-most-once"})
    connector = instantiate(settings, Path("."))
    task = connector.task_class()
    ctx = LocalContext(unique)
    tp = TopicPartition("t", 0)
    ctx.assigned = {tp}
    task.start(connector.task_configs(1)[0].with_services(kafka_config, effects_pg), ctx)
    try:
        task.open([tp])
        events = [make_event("k", v) for v in (1, 2)]
        task.put([SinkRecord("t", 0, i, "k", e) for i, e in enumerate(events)])
        assert task.pre_commit({tp: 2}) == {tp: 2}  # at-most-once: offered for commit before running
        task.put([])  # the runner calls in again, but its commit failed: ctx.committed is still empty
        time.sleep(0.5)
        assert not effect_log.exists(), "an effect ran although its offset was never committed"
        assert task.pre_commit({tp: 2}) == {tp: 2}  # offered again
        ctx.committed[tp] = 2  # this time the commit went through
        task.put([])
        wait_for(lambda: effect_log.exists() and len(effect_log.read_text().split()) == 2, "both effects ran", 30)
        assert effect_log.read_text().split() == [e.event_id for e in events]
    finally:
        task.close([tp])
        task.stop()
