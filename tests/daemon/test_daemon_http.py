"""The daemon's HTTP surface on a real broker: /ready, /metrics, the Connect-style REST API, pause/resume, auth."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from confluent_kafka import Producer
from prometheus_client.parser import text_string_to_metric_families

from kafold import kafka_clients
from kafold.config import KafkaConfig
from kafold.envelope import Event, encode
from kafold.testing import free_port
from tests.daemon.daemon_plugins import GATES, RECEIVED
from tests.daemon.daemon_support import daemon_in_process, write_config
from tests.support import committed, create_topic, make_event, produce, wait_for

PLUGIN = "tests.daemon.daemon_plugins:PluginConnector"


def produce_one_by_one(kafka: KafkaConfig, topic: str, events: list[Event], partition: int = 0) -> None:
    # One produce request per record: the embedded broker's ListOffsets reports only the last batch's base
    # offset + 1, so single-record batches keep it exact and an early "caught up" would show below.
    producer = Producer(kafka_clients.librdkafka(kafka))
    for e in events:
        key, value, headers = encode(e)
        producer.produce(topic, value=value, key=key, headers=headers, partition=partition)
        assert producer.flush(15) == 0


def metric_samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def test_ready_is_503_until_every_partition_caught_up_then_200(
        tmp_path: Path, kafka_config: KafkaConfig, unique: str) -> None:
    topic = f"{unique}.events"
    create_topic(kafka_config, topic)
    old = datetime.now(UTC) - timedelta(hours=1)
    events = [Event.new("ThingHappened", "thing", "a", v, {"n": v}, occurred_at=old) for v in range(1, 21)]
    produce_one_by_one(kafka_config, topic, events)
    GATES[unique] = threading.Semaphore(0)
    path = write_config(tmp_path, kafka_config, unique, topic, port=free_port(), connector=PLUGIN,
                        config_toml=f'{{ gate = "{unique}" }}')
    with daemon_in_process(path) as d:
        wait_for(lambda: d.runner.counts["assignments"] > 0, "the assignment")
        handled = 0
        while handled < len(events):
            status, body = d.get("/ready")
            assert status == 503, f"ready after {handled} of {len(events)} records: {body}"
            assert body["ready"] is False and body["not_ready"][0]["connector"] == "sink"
            GATES[unique].release()
            wait_for(lambda h=handled: len(RECEIVED.get("sink", [])) > h, "the next batch")
            handled = len(RECEIVED["sink"])
            if handled == 5:  # first batch done, 15 behind: lag in records and in event time is visible
                wait_for(lambda: [p.position for p in d.runner.progress.snapshot.values()] == [5],
                         "the progress after the first batch")
                text = d.get("/metrics")[1]
                labels = (("connector", "sink"), ("partition", "0"), ("topic", topic))
                assert metric_samples(text, "kafold_consumer_lag_records")[labels] == 15
                assert metric_samples(text, "kafold_consumer_lag_seconds")[labels] >= 3600
                assert metric_samples(text, "kafold_partition_caught_up")[labels] == 0
        wait_for(lambda: d.get("/ready")[0] == 200, "/ready to turn 200")
        status, body = d.get("/ready")
        assert body == {"ready": True, "not_ready": [], "tasks": 1, "aggregates": 0}
        assert [r.offset for r in RECEIVED["sink"]] == list(range(20))
        text = d.get("/metrics")[1]
        assert metric_samples(text, "kafold_events_processed_total") == {(("connector", "sink"), ("task", "0")): 20}
        labels = (("connector", "sink"), ("partition", "0"), ("topic", topic))
        assert metric_samples(text, "kafold_consumer_lag_records")[labels] == 0
        assert metric_samples(text, "kafold_consumer_lag_seconds")[labels] == 0
        assert metric_samples(text, "kafold_batch_duration_seconds_count")[(("connector", "sink"), ("task", "0"))] >= 4
        state = metric_samples(text, "kafold_task_state")
        assert state[(("connector", "sink"), ("state", "RUNNING"), ("task", "0"))] == 1


def test_connect_endpoints_return_kafka_connect_json_shapes(
        tmp_path: Path, kafka_config: KafkaConfig, unique: str) -> None:
    topic = f"{unique}.events"
    create_topic(kafka_config, topic, partitions=2)
    produce(kafka_config, topic, [(v % 2, *encode(make_event("a", v))) for v in range(1, 7)])
    path = write_config(tmp_path, kafka_config, unique, topic, port=free_port(), config_toml='{ level = "debug" }')
    with daemon_in_process(path) as d:
        wait_for(lambda: committed(kafka_config, f"{unique}.sink", topic, 2) == {0: 3, 1: 3}, "the commits")
        assert d.get("/connectors") == (200, ["sink"])
        status, info = d.get("/connectors/sink")
        assert status == 200 and set(info) == {"name", "config", "tasks", "type"}
        assert info["name"] == "sink" and info["type"] == "sink"
        assert info["tasks"] == [{"connector": "sink", "task": 0}]
        status, conf = d.get("/connectors/sink/config")
        assert status == 200 and conf == info["config"]
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in conf.items())
        assert conf["connector.class"] == "log" and conf["topics"] == topic and conf["tasks.max"] == "1"
        status, st = d.get("/connectors/sink/status")
        assert status == 200 and set(st) == {"name", "connector", "tasks", "type"}
        assert st["connector"] == {"state": "RUNNING", "worker_id": d.host.worker_id}
        assert st["tasks"] == [{"id": 0, "state": "RUNNING", "worker_id": d.host.worker_id}]
        status, offsets = d.get("/connectors/sink/offsets")
        assert status == 200 and set(offsets) == {"offsets"}
        assert offsets["offsets"] == [
            {"partition": {"kafka_topic": topic, "kafka_partition": p}, "offset": {"kafka_offset": 3}}
            for p in (0, 1)]
        status, tasks = d.get("/connectors/sink/tasks")
        assert status == 200 and tasks[0]["id"] == {"connector": "sink", "task": 0}
        status, expanded = d.get("/connectors?expand=status&expand=info")
        assert status == 200 and expanded["sink"]["status"]["name"] == "sink" and "info" in expanded["sink"]
        for p in ("/connectors/nope", "/connectors/nope/status", "/connectors/nope/offsets"):
            assert d.get(p) == (404, {"error_code": 404, "message": "Connector nope not found"})
        old_runner = d.runner
        status, body = d.call("POST", "/connectors/sink/restart?includeTasks=true")
        assert status == 202 and body["name"] == "sink" and body["tasks"][0]["state"] == "RESTARTING"
        wait_for(lambda: d.runner is not old_runner and d.runner.counts["assignments"] > 0, "the restarted task")
        assert d.get("/connectors/sink/status")[1]["tasks"][0]["state"] == "RUNNING"
        second = d.runner
        assert d.call("POST", "/connectors/sink/restart") == (204, None)
        # Stop only after that restart's task joined its group: leaving in the middle of a first join can stall
        # the group on the embedded broker (docs/brokers.md), and the daemon would miss its grace period.
        wait_for(lambda: d.runner is not second and d.runner.counts["assignments"] > 0, "the second restart")


def test_pause_stops_consumption_without_a_rebalance_and_resume_continues(
        tmp_path: Path, kafka_config: KafkaConfig, unique: str) -> None:
    topic = f"{unique}.events"
    create_topic(kafka_config, topic)
    produce(kafka_config, topic, [(0, *encode(make_event("a", v))) for v in range(1, 4)])
    path = write_config(tmp_path, kafka_config, unique, topic, port=free_port(), connector=PLUGIN)
    with daemon_in_process(path) as d:
        wait_for(lambda: len(RECEIVED.get("sink", [])) == 3, "the first records")
        assert d.call("PUT", "/connectors/sink/pause") == (202, None)
        wait_for(lambda: d.get("/connectors/sink/status")[1]["connector"]["state"] == "PAUSED", "PAUSED")
        assert d.get("/connectors/sink/status")[1]["tasks"][0]["state"] == "PAUSED"
        produce(kafka_config, topic, [(0, *encode(make_event("a", v))) for v in range(4, 9)])
        polls = d.runner.counts["polls"]
        # The consumer keeps polling while paused (so it stays in the group); 20 polls of 100 ms see nothing.
        wait_for(lambda: d.runner.counts["polls"] >= polls + 20, "more polls while paused")
        assert len(RECEIVED["sink"]) == 3
        assert d.call("PUT", "/connectors/sink/resume") == (202, None)
        wait_for(lambda: len(RECEIVED["sink"]) == 8, "the records produced while paused")
        assert [r.event.version for r in RECEIVED["sink"]] == list(range(1, 9))
        assert d.runner.counts["assignments"] == 1, "pause/resume must not cause a rebalance"
        assert d.get("/connectors/sink/status")[1]["connector"]["state"] == "RUNNING"
        wait_for(lambda: committed(kafka_config, f"{unique}.sink", topic, 1) == {0: 8}, "the commit")


@pytest.mark.parametrize("via", ["env", "file"])
def test_with_a_token_every_endpoint_but_health_and_ready_needs_it(
        tmp_path: Path, kafka_config: KafkaConfig, unique: str, monkeypatch: pytest.MonkeyPatch, via: str) -> None:
    topic = f"{unique}.events"
    create_topic(kafka_config, topic)
    token = f"s3cret-{unique}"
    if via == "env":
        monkeypatch.setenv("KAFOLD_TEST_API_TOKEN", token)
        extra = 'api_token_env = "KAFOLD_TEST_API_TOKEN"'
    else:
        secret = tmp_path / "token"
        secret.write_text(token + "\n")
        secret.chmod(0o600)
        extra = f'api_token_file = "{secret}"'
    path = write_config(tmp_path, kafka_config, unique, topic, port=free_port(), daemon_extra=extra)
    with daemon_in_process(path, token=token) as d:
        assert d.get("/health", token=None)[0] == 200
        assert d.get("/ready", token=None)[0] in (200, 503)  # public: probes carry no secret
        for p in ("/metrics", "/connectors", "/connectors/sink/status", "/connectors/sink/offsets"):
            status, body = d.get(p, token=None)
            assert status == 401 and body["error_code"] == 401, p
            assert d.get(p, token="wrong")[0] == 401, p
        assert d.call("PUT", "/connectors/sink/pause", token=None)[0] == 401
        assert d.runner.api_paused is False
        assert d.get("/connectors") == (200, ["sink"])
        assert d.get("/metrics")[0] == 200


def test_an_api_reachable_beyond_localhost_without_a_token_is_warned_about(
        kafka_config: KafkaConfig, unique: str, tmp_path: Path) -> None:
    from structlog.testing import capture_logs

    topic = f"{unique}.events"
    create_topic(kafka_config, topic, 1)
    for host, warned in (("0.0.0.0", True), ("127.0.0.1", False)):
        path = write_config(tmp_path, kafka_config, f"{unique}{int(warned)}", topic, port=free_port(),
                            daemon_extra=f'http_host = "{host}"')
        with capture_logs() as logs, daemon_in_process(path):
            wait_for(lambda logs=logs: any(e["event"] == "daemon.started" for e in logs), "the daemon to start")
        warnings = [e for e in logs if e["event"] == "daemon.api_unprotected"
                    and "listens beyond localhost without a token" in e["reason"]]
        assert bool(warnings) is warned, host
