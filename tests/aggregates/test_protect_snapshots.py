"""Snapshots of an aggregate with a protected email, on Apache Kafka: the snapshot topic's raw bytes never hold the
email in clear (the state is sealed under the aggregate id's key); `kafold state get` and a daemon restart restore
the live state from the snapshot; after the subject is forgotten, a restore gives the placeholder (the sealed
snapshot does not open: the aggregate folds from its events), the other aggregate is unchanged, and a new snapshot
run works. The aggregate's domain is tests.aggregates.test_protect_daemon's."""

from __future__ import annotations

from pathlib import Path

import pytest

from kafold.config import KafkaConfig
from kafold.testing import free_port
from tests.aggregates.agg_support import (
    EMAILS,
    PLACEHOLDER,
    customer_client,
    kafold_cli,
    live_state,
    master_key,
    own_schema,
    protected_customer_toml,
    raw_bytes,
    ready_daemon,
    register,
    state_get,
)


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_snapshots_of_a_protected_aggregate_are_sealed_and_forgotten(
        kafka_config: KafkaConfig, pg_url: str, unique: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    master_key(monkeypatch)
    conf = tmp_path / "kafold.toml"
    conf.write_text(protected_customer_toml(kafka_config, pg_url, unique, free_port(), snapshots=True,
                                            schema=own_schema(unique)))
    cfg, client = customer_client(conf, kafka_config)
    agg = cfg.aggregates[0]
    try:
        with ready_daemon(conf) as d:
            register(client, EMAILS)
            assert all(r[0]["status"] == "accepted" for r in client.results.values())
            live = {cid: live_state(d, cid) for cid in EMAILS}
        assert live == {cid: {"email": email, "name": cid.upper()} for cid, email in EMAILS.items()}

        # a local snapshot run: the states are on the snapshot topic, sealed
        kafold_cli("snapshot", "run", "-c", str(conf), "--engine", "local", "--no-progress", check=True)
        raw = raw_bytes(kafka_config, agg.topic("snapshot"))
        assert b"kfenc1:" in raw and b'"aggregate_id":"c-1"' in raw
        for email in EMAILS.values():
            assert email.encode() not in raw

        # restores from the snapshot equal the live state: the CLI, then a daemon restart
        for cid in EMAILS:
            got = state_get(conf, cid)
            assert got["state"] == live[cid] and got["obtained"]["snapshots_used_in_partition"] == 2
        with ready_daemon(conf, "the daemon ready again") as d:
            assert {cid: live_state(d, cid) for cid in EMAILS} == live
            forgot = d.call("POST", "/subjects/c-1/forget")
            assert forgot[0] == 200 and forgot[1]["key_deleted"] is True

        # after forget: c-1's snapshot no longer opens, its restore folds the events (placeholder); c-2 unchanged
        forgotten = {"email": PLACEHOLDER, "name": "C-1"}
        got = state_get(conf, "c-1")
        assert got["state"] == forgotten and got["obtained"]["snapshots_used_in_partition"] == 1
        assert state_get(conf, "c-2")["state"] == live["c-2"]

        # a new snapshot run after forget works; its restore uses both snapshots again
        kafold_cli("snapshot", "run", "-c", str(conf), "--engine", "local", "--no-progress", check=True)
        for cid, want in (("c-1", forgotten), ("c-2", live["c-2"])):
            got = state_get(conf, cid)
            assert got["state"] == want and got["obtained"]["snapshots_used_in_partition"] == 2
        with ready_daemon(conf, "the daemon ready a third time") as d:
            assert d.get("/aggregates/customer/c-1")[1]["state"] == forgotten
            assert d.get("/aggregates/customer/c-2")[1]["state"] == live["c-2"]
    finally:
        client.close()
    raw = raw_bytes(kafka_config, agg.topic("snapshot"), agg.topic("events"))
    for email in EMAILS.values():
        assert email.encode() not in raw
