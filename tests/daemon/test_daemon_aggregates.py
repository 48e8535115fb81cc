"""The daemon hosts one aggregate runtime per [[aggregates]] and serves its state at /aggregates/{name}/{id}."""

from __future__ import annotations

from pathlib import Path

from kafold import config, topics
from kafold.client import CommandClient
from kafold.config import KafkaConfig
from kafold.testing import free_port
from tests.aggregates.agg_support import bank_daemon_toml
from tests.daemon.daemon_support import daemon_in_process
from tests.support import wait_for


def test_aggregate_state_is_served_once_the_runtime_is_live(
        tmp_path: Path, kafka_config: KafkaConfig, unique: str) -> None:
    path = tmp_path / "kafold.toml"
    path.write_text(bank_daemon_toml(kafka_config, unique, free_port()))
    loaded = config.load_file(path)
    assert topics.ensure(kafka_config, config.topic_map(loaded.config).values()).ok
    with daemon_in_process(path) as d:
        wait_for(lambda: d.get("/ready")[0] == 200, "the aggregate runtime to go live")
        assert d.get("/aggregates/account/acc-1")[0] == 404
        assert d.get("/aggregates/nope/acc-1") == (404, {"error_code": 404, "message": "Aggregate nope not found"})
        with CommandClient(kafka_config, loaded.config.aggregates[0]) as client:
            opening = client.command("acc-1", "OpenAccount", {"owner": "ada"})
            result = client.send(opening)
            assert result is not None and result.status == "accepted", result
            again = client.send(opening)  # a retry: answered with its first decision
            assert again is not None and again.duplicate and again.version == 1, again
        status, body = d.get("/aggregates/account/acc-1")
        assert status == 200 and body["aggregate"] == "account" and body["id"] == "acc-1"
        assert body["state"]["owner"] == "ada" and body["version"] == 1 and body["read_from"] == "memory"
        status, metrics = d.get("/metrics")
        assert status == 200 and 'kafold_aggregate_idempotency_ids{aggregate="account"} 1.0' in metrics
        assert 'kafold_aggregate_commands_total{aggregate="account",outcome="accepted"} 1.0' in metrics
        assert 'kafold_aggregate_commands_total{aggregate="account",outcome="duplicates"} 1.0' in metrics
        assert 'kafold_aggregate_commands_total{aggregate="account",outcome="refetched"} 0.0' in metrics
