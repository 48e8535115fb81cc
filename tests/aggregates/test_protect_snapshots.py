"""Snapshots of an aggregate with a protected email, on Apache Kafka: the snapshot topic's raw bytes never hold the
email in clear (the state is sealed under the aggregate id's key); `kafold state get` and a daemon restart restore
the live state from the snapshot; after the subject is forgotten, a restore gives the placeholder (the sealed
snapshot does not open: the aggregate folds from its events), the other aggregate is unchanged, and a new snapshot
run works. The aggregate's domain is tests.aggregates.test_protect_daemon's."""

from __future__ import annotations

import base64
import os
import subprocess
from pathlib import Path
from typing import Any

import orjson
import pytest

from kafold import config, topics
from kafold.config import KafkaConfig
from kafold.testing import free_port
from tests.aggregates.test_idempotency import Outside
from tests.aggregates.test_protect_daemon import EMAILS, KAFOLD, MASTER_VAR, PLACEHOLDER, _raw_bytes
from tests.daemon.daemon_support import daemon_in_process
from tests.support import ROOT, child_env, kafka_toml, wait_for

M = "tests.aggregates.test_protect_daemon"


def _config(path: Path, kafka: KafkaConfig, pg_url: str, prefix: str, port: int) -> Path:
    path.write_text(f"""
{kafka_toml(kafka)}
[daemon]
group_prefix = "{prefix}"
http_port = {port}
python_path = ["{ROOT}"]
batch_max_wait_ms = 50

[postgres]
url = "{pg_url}"

[privacy]
master_key_env = "{MASTER_VAR}"
placeholder = "{PLACEHOLDER}"

[snapshots]
enabled = true
engine = "local"

[[aggregates]]
name = "customer"
initial = "{M}:initial"
evolve = "{M}:evolve"
decide = "{M}:decide"
partitions = 1
events_topic = "{prefix}.events"
commands_topic = "{prefix}.commands"
results_topic = "{prefix}.results"
snapshot_topic = "{prefix}.snapshots"

[[aggregates.protect]]
type = "Registered"
fields = ["email"]
subject = "aggregate_id"
""")
    return path


def _kafold(*args: str) -> subprocess.CompletedProcess[str]:
    run = subprocess.run([KAFOLD, *args], capture_output=True, text=True, timeout=300, env=child_env())
    assert run.returncode == 0, run.stdout + run.stderr
    return run


def _state_get(conf: Path, aid: str) -> dict[str, Any]:
    out: dict[str, Any] = orjson.loads(_kafold("state", "get", "customer", aid, "-c", str(conf)).stdout)
    return out


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_snapshots_of_a_protected_aggregate_are_sealed_and_forgotten(
        kafka_config: KafkaConfig, pg_url: str, unique: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MASTER_VAR, base64.b64encode(os.urandom(32)).decode())
    conf = _config(tmp_path / "kafold.toml", kafka_config, pg_url, unique, free_port())
    loaded = config.load_file(conf)
    assert topics.ensure(kafka_config, config.topic_map(loaded.config).values()).ok
    agg = loaded.config.aggregates[0]
    client = Outside(kafka_config, agg)
    try:
        with daemon_in_process(conf) as d:
            wait_for(lambda: d.get("/ready")[0] == 200, "the daemon ready", 120)
            for cid, email in EMAILS.items():
                client.send(f"reg-{cid}", cid, "Register", {"email": email, "name": cid.upper()})
            client.wait()
            assert all(r[0]["status"] == "accepted" for r in client.results.values())
            live = {cid: d.get(f"/aggregates/customer/{cid}")[1]["state"] for cid in EMAILS}
        assert live == {cid: {"email": email, "name": cid.upper()} for cid, email in EMAILS.items()}

        # a local snapshot run: the states are on the snapshot topic, sealed
        _kafold("snapshot", "run", "-c", str(conf), "--engine", "local", "--no-progress")
        raw = _raw_bytes(kafka_config, agg.topic("snapshot"))
        assert b"kfenc1:" in raw and b'"aggregate_id":"c-1"' in raw
        for email in EMAILS.values():
            assert email.encode() not in raw

        # restores from the snapshot equal the live state: the CLI, then a daemon restart
        for cid in EMAILS:
            got = _state_get(conf, cid)
            assert got["state"] == live[cid] and got["obtained"]["snapshots_used_in_partition"] == 2
        with daemon_in_process(conf) as d:
            wait_for(lambda: d.get("/ready")[0] == 200, "the daemon ready again", 120)
            assert {cid: d.get(f"/aggregates/customer/{cid}")[1]["state"] for cid in EMAILS} == live
            forgot = d.call("POST", "/subjects/c-1/forget")
            assert forgot[0] == 200 and forgot[1]["key_deleted"] is True

        # after forget: c-1's snapshot no longer opens, its restore folds the events (placeholder); c-2 unchanged
        forgotten = {"email": PLACEHOLDER, "name": "C-1"}
        got = _state_get(conf, "c-1")
        assert got["state"] == forgotten and got["obtained"]["snapshots_used_in_partition"] == 1
        assert _state_get(conf, "c-2")["state"] == live["c-2"]

        # a new snapshot run after forget works; its restore uses both snapshots again
        _kafold("snapshot", "run", "-c", str(conf), "--engine", "local", "--no-progress")
        for cid, want in (("c-1", forgotten), ("c-2", live["c-2"])):
            got = _state_get(conf, cid)
            assert got["state"] == want and got["obtained"]["snapshots_used_in_partition"] == 2
        with daemon_in_process(conf) as d:
            wait_for(lambda: d.get("/ready")[0] == 200, "the daemon ready a third time", 120)
            assert d.get("/aggregates/customer/c-1")[1]["state"] == forgotten
            assert d.get("/aggregates/customer/c-2")[1]["state"] == live["c-2"]
    finally:
        client.close()
    raw = _raw_bytes(kafka_config, agg.topic("snapshot"), agg.topic("events"))
    for email in EMAILS.values():
        assert email.encode() not in raw
