"""Crypto-shredding on Apache Kafka: a customer aggregate whose `email` is protected. The email never appears in
plain text in the events topic's raw bytes, the dead-letter topics or the daemon's log output; the projection and
the webhook see it in clear; after `forget`, the state, a rebuilt projection and new webhook bodies hold the
placeholder and nothing else changes; forgetting twice is harmless; a missing master key stops the start, named.
The domain functions below are the aggregate's (dict events, pure)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest

from kafold.config import KafkaConfig
from kafold.envelope import Event
from kafold.testing import free_port
from tests.aggregates.agg_support import (
    EMAILS,
    KAFOLD,
    MASTER_VAR,
    PLACEHOLDER,
    customer_client,
    customer_rows,
    live_state,
    master_key,
    own_schema,
    protected_customer_toml,
    raw_bytes,
    ready_daemon,
    register,
)
from tests.support import child_env, wait_for
from tests.support.receiver import Receiver


# ---- the aggregate (pure) ------------------------------------------------------------------------------
def initial() -> dict[str, Any]:
    return {}


def evolve(state: dict[str, Any], event: dict[str, Any]) -> dict[str, Any]:
    if event["type"] == "Registered":
        return {"email": event["email"], "name": event["name"]}
    return {**state, "name": event["name"]}


def decide(command: dict[str, Any], state: dict[str, Any]) -> list[dict[str, Any]]:
    if command["type"] == "Register":
        return [{"type": "Registered", "email": command["email"], "name": command["name"]}]
    return [{"type": "Renamed", "name": command["name"]}]


def customer_row(row: dict[str, Any] | None, event: Event) -> dict[str, Any] | None:
    p = event.payload
    if event.type == "Registered":
        return {"email": p["email"], "name": p["name"]}
    return {**(row or {}), "name": p["name"]}


# ---- the test ----------------------------------------------------------------------------------------------
def _bodies(receiver: Receiver) -> list[dict[str, Any]]:
    seen: dict[str, dict[str, Any]] = {}
    for r in receiver.successes():
        seen.setdefault(r.event_id, orjson.loads(r.body))
    return list(seen.values())


@pytest.mark.integration
@pytest.mark.timeout(900)
@pytest.mark.parametrize("task_processes", [False, True], ids=["threads", "task-processes"])
def test_protected_email_is_encrypted_everywhere_and_forgotten(
        kafka_config: KafkaConfig, pg_url: str, unique: str, tmp_path: Path, capfd: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch, task_processes: bool) -> None:
    master_key(monkeypatch)
    prefix, table, port, schema = unique, f"customers_{unique[-8:]}", free_port(), own_schema(unique)
    receiver = Receiver()
    conf = tmp_path / "kafold.toml"
    conf.write_text(protected_customer_toml(kafka_config, pg_url, prefix, port, table=table, hook=receiver.start(),
                                            task_processes=task_processes, schema=schema))
    cfg, client = customer_client(conf, kafka_config)
    agg = cfg.aggregates[0]
    try:
        with ready_daemon(conf) as d:
            register(client, EMAILS)
            assert all(r[0]["status"] == "accepted" for r in client.results.values())
            wait_for(lambda: len(customer_rows(pg_url, table)) == 2, "the projection's rows", 90)
            wait_for(lambda: len(_bodies(receiver)) == 2, "two webhook bodies", 90)
            assert customer_rows(pg_url, table) == {cid: (email, cid.upper()) for cid, email in EMAILS.items()}
            assert {b["payload"]["email"] for b in _bodies(receiver)} == set(EMAILS.values())
            assert live_state(d, "c-1")["email"] == EMAILS["c-1"]

            # forget c-1 through the HTTP API (its state is refolded), twice: harmless
            first = d.call("POST", "/subjects/c-1/forget")
            again = d.call("POST", "/subjects/c-1/forget")
            assert first[0] == 200 and first[1]["key_deleted"] is True
            assert again[0] == 200 and again[1]["key_deleted"] is False
            wait_for(lambda: d.get("/aggregates/customer/c-1")[1]["state"].get("email") == PLACEHOLDER,
                     "the forgotten state", 60)
            assert d.get("/aggregates/customer/c-1")[1]["state"] == {"email": PLACEHOLDER, "name": "C-1"}
            assert d.get("/aggregates/customer/c-2")[1]["state"]["email"] == EMAILS["c-2"]

            # new events of both after forget: webhook bodies are unchanged but for the placeholder
            client.send("rename-c1", "c-1", "Rename", {"name": "Ann"})
            client.send("rename-c2", "c-2", "Rename", {"name": "Bob"})
            client.wait()
            wait_for(lambda: len(_bodies(receiver)) == 4, "four webhook bodies", 90)
            assert live_state(d, "c-1", 2) == {"email": PLACEHOLDER, "name": "Ann"}
        # the CLI path, for the other subject
        forget = subprocess.run([KAFOLD, "subjects", "forget", "c-2", "-c", str(conf), "--actor", "dpo", "--json",
                                 "--yes"],
                                capture_output=True, text=True, timeout=120, env=child_env())
        assert forget.returncode == 0, forget.stdout + forget.stderr
        assert orjson.loads(forget.stdout)["key_deleted"] is True
        rebuild = subprocess.run([KAFOLD, "projection", "rebuild", table, "-c", str(conf)],
                                 capture_output=True, text=True, timeout=300, env=child_env())
        assert rebuild.returncode == 0, rebuild.stdout + rebuild.stderr
        assert customer_rows(pg_url, table) == {"c-1": (PLACEHOLDER, "Ann"), "c-2": (PLACEHOLDER, "Bob")}
        with psycopg.connect(pg_url) as conn:
            erasures = conn.execute(f"SELECT subject_hash, actor, key_existed FROM {schema}.erasures").fetchall()
        assert sorted(a for _, a, _ in erasures) == ["api-token", "api-token", "dpo"]
        assert all(not any(s in h for s in EMAILS) for h, _, _ in erasures)
    finally:
        client.close()
        receiver.stop()
    raw = raw_bytes(kafka_config, agg.topic("events"), agg.dlq_topic, "kafold.dlq." + table,
                    f"kafold.dlq.hook-{table}")
    logged = capfd.readouterr()
    assert "daemon.migrations_applied" in logged.out + logged.err  # the daemon's log output was captured
    for email in EMAILS.values():
        assert email.encode() not in raw
        assert email not in logged.out + logged.err
    assert b"kfenc1:" in raw  # the events are there, encrypted


@pytest.mark.integration
def test_a_missing_master_key_is_a_clear_start_up_error(
        kafka_config: KafkaConfig, pg_url: str, unique: str, tmp_path: Path) -> None:
    conf = tmp_path / "kafold.toml"
    conf.write_text(protected_customer_toml(kafka_config, pg_url, unique, free_port(), table="t_unused",
                                            hook="http://127.0.0.1:9/hook"))
    env = {k: v for k, v in child_env().items() if k != MASTER_VAR}
    run = subprocess.run([KAFOLD, "daemon", "-c", str(conf)], capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode != 0
    assert MASTER_VAR in run.stderr and "not set" in run.stderr
