"""Users' Faust modules in the daemon (`[daemon] faust_modules`), on a real broker: their agent consumes in Faust's
own consumer group beside kafold's sink task, their timer ticks, their page answers behind the API token; a module
with no agent or table starts no Faust consumer, so the daemon joins no group but kafold's."""

from __future__ import annotations

from pathlib import Path

import pytest

from kafold.config import KafkaConfig
from kafold.envelope import encode
from kafold.kafka_clients import admin
from tests.daemon import faust_ext
from tests.daemon.daemon_plugins import RECEIVED
from tests.daemon.daemon_support import daemon_in_process, write_config
from tests.support import create_topic, free_port, make_event, produce, wait_for

PLUGIN = "tests.daemon.daemon_plugins:PluginConnector"


def _groups(kafka: KafkaConfig) -> set[str]:
    client = admin(kafka)  # kept until the answer is in: a collected client destroys its handle first
    listed = client.list_consumer_groups(request_timeout=15).result(timeout=30)
    assert not listed.errors, listed.errors
    return {g.group_id for g in listed.valid}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("with_agent", [True, False], ids=["agent", "timer-and-page-only"])
def test_a_users_faust_module_runs_beside_kafolds_tasks(
        kafka_config: KafkaConfig, unique: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        with_agent: bool) -> None:
    sink_topic, agent_topic = f"{unique}.events", f"{unique}.faust"
    create_topic(kafka_config, sink_topic)
    create_topic(kafka_config, agent_topic)
    monkeypatch.setattr(faust_ext, "TOPIC", agent_topic if with_agent else "")
    token = f"tok-{unique}"
    monkeypatch.setenv("KAFOLD_TEST_API_TOKEN", token)
    path = write_config(tmp_path, kafka_config, unique, sink_topic, port=free_port(), connector=PLUGIN,
                        daemon_extra='api_token_env = "KAFOLD_TEST_API_TOKEN"\n'
                                     'faust_modules = ["tests.daemon.faust_ext"]')
    event = make_event("a", 1)
    produce(kafka_config, sink_topic, [(0, *encode(event))])
    produce(kafka_config, agent_topic, [(0, b"k", f"for-faust-{i}".encode(), None) for i in range(3)])
    with daemon_in_process(path, token=token) as d:
        wait_for(lambda: [r.event for r in RECEIVED.get("sink", [])] == [event], "kafold's sink task", 120)
        wait_for(lambda: len(faust_ext.TICKS) >= 3, "the module's timer ticking")
        assert d.get("/faust-ext/seen", token=None)[0] == 401, "a user's page is behind the API token"
        if with_agent:
            want = [f"for-faust-{i}" for i in range(3)]
            wait_for(lambda: d.get("/faust-ext/seen")[1]["seen"] == want, "the module's agent consuming", 120)
            groups = _groups(kafka_config)
            assert {f"{unique}.sink", f"kafold-daemon-{unique}"} <= groups, groups
        else:
            status, body = d.get("/faust-ext/seen")
            assert status == 200 and body["seen"] == [] and body["ticks"] >= 3, (status, body)
            groups = _groups(kafka_config)
            assert f"{unique}.sink" in groups and f"kafold-daemon-{unique}" not in groups, groups
            assert d.host.worker is not None and d.host.worker.app.consumer is not None
            assert not d.host.worker.app.boot_strategy.enable_kafka_consumer
