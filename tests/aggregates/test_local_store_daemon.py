"""A daemon with `state_dir`: GET /aggregates/{name}/{id} and `kafold state get --url` answer for an aggregate that
left the cache, from the local state store, and /metrics shows the store's disk use."""

from __future__ import annotations

import json
from pathlib import Path

from kafold import config, topics
from kafold.client import CommandClient
from kafold.config import KafkaConfig
from kafold.testing import free_port
from tests.aggregates.agg_support import bank_daemon_toml, kafold_cli
from tests.daemon.daemon_support import daemon_in_process
from tests.support import wait_for


def test_state_of_an_evicted_aggregate_is_read_from_the_store(tmp_path: Path, kafka_config: KafkaConfig,
                                                                unique: str) -> None:
    port = free_port()
    path = tmp_path / "kafold.toml"
    toml = bank_daemon_toml(kafka_config, unique, port, daemon_extra=f'state_dir = "{tmp_path / "state"}"')
    path.write_text(toml.replace('partitions = 1\n', 'partitions = 1\ncache_max_aggregates = 1\n'))
    loaded = config.load_file(path)
    assert topics.ensure(kafka_config, config.topic_map(loaded.config).values()).ok
    with daemon_in_process(path) as d:
        wait_for(lambda: d.get("/ready")[0] == 200, "the aggregate runtime to go live")
        with CommandClient(kafka_config, loaded.config.aggregates[0]) as client:
            client.send_many([client.command(f"acc-{i}", "OpenAccount", {"owner": f"o{i}"}) for i in range(5)])
            client.send(client.command("acc-0", "Deposit", {"amount": 12}))
            client.send_many([client.command(f"acc-{i}", "Deposit", {"amount": 1}) for i in range(1, 5)])
        # acc-0 leaves the cache once the last batch's store write and trim are done (just after its results)
        wait_for(lambda: d.get("/aggregates/account/acc-0")[1].get("read_from") == "store", "acc-0 read from disk")
        status, body = d.get("/aggregates/account/acc-0")
        assert status == 200 and body["read_from"] == "store", body
        assert body["state"]["balance"] == 12 and body["version"] == 2
        cli = kafold_cli("state", "get", "account", "acc-0", "-c", str(path), "--url", f"http://127.0.0.1:{port}",
                         check=True)
        assert json.loads(cli.stdout)["state"]["balance"] == 12
        status, metrics = d.get("/metrics")
        line = next(x for x in metrics.splitlines() if x.startswith("kafold_aggregate_local_store_bytes{"))
        assert status == 200 and float(line.split()[-1]) > 0
