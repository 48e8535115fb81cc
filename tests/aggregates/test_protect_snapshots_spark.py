"""Spark snapshot runs (local mode) of an aggregate with a protected email, on Apache Kafka: the Spark tasks open
their own key rings (the master key from the environment they inherit, never from the job's spec or Spark conf),
fold with decryption and seal each state as the in-process run does. The snapshot topic's raw bytes never hold the
email in clear; restores equal the live state; after the subject is forgotten a restore gives the placeholder, and
a new Spark run rejects the forgotten snapshot (reason `forgotten`) and writes a new one that restores. The
configuration is tests.aggregates.test_protect_snapshots' (agg_support.protected_customer_toml with snapshots, here
with `engine = "spark"`)."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from kafold.config import KafkaConfig
from kafold.testing import free_port
from tests.aggregates.agg_support import (
    EMAILS,
    MASTER_VAR,
    PLACEHOLDER,
    customer_client,
    kafold_cli,
    live_state,
    master_key,
    protected_customer_toml,
    raw_bytes,
    ready_daemon,
    register,
    state_get,
)

pytestmark = [pytest.mark.integration, pytest.mark.spark]


def _spark_run(conf: Path) -> str:
    """`kafold snapshot run` with the configured engine (spark): its own JVM, started with this environment."""
    out = kafold_cli("snapshot", "run", "-c", str(conf), "--master", "local[2]", "--no-progress", check=True).stdout
    rows = [line.split() for line in out.splitlines() if line.startswith("customer ")]
    assert rows and rows[0][1] == "spark", out
    return out


@pytest.mark.timeout(900)
def test_spark_snapshots_of_a_protected_aggregate_are_sealed_and_forgotten(
        kafka_config: KafkaConfig, pg_url: str, unique: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("pyspark")
    master_key(monkeypatch)
    conf = tmp_path / "kafold.toml"
    # engine spark; a schema of its own: the session's PostgreSQL is shared, and other tests use the same
    # aggregate ids (their keys wrapped under another master key)
    conf.write_text(protected_customer_toml(kafka_config, pg_url, unique, free_port(), snapshots=True)
                    .replace('engine = "local"', 'engine = "spark"')
                    .replace("[postgres]\n", f'[postgres]\nschema = "spark_{uuid.uuid4().hex[:12]}"\n'))
    cfg, client = customer_client(conf, kafka_config)
    assert cfg.snapshots.engine == "spark"  # no longer refused with protect
    assert cfg.postgres.schema.startswith("spark_")
    agg = cfg.aggregates[0]
    try:
        with ready_daemon(conf) as d:
            register(client, EMAILS)
            assert all(r[0]["status"] == "accepted" for r in client.results.values())
            live = {cid: live_state(d, cid) for cid in EMAILS}
        assert live == {cid: {"email": email, "name": cid.upper()} for cid, email in EMAILS.items()}

        # a Spark run: the executors decrypted the events (the states hold the emails) and sealed the states
        _spark_run(conf)
        raw = raw_bytes(kafka_config, agg.topic("snapshot"))
        assert b"kfenc1:" in raw and b'"aggregate_id":"c-1"' in raw and b'"aggregate_id":"c-2"' in raw
        for email in EMAILS.values():
            assert email.encode() not in raw
        for cid in EMAILS:  # the restore opens the sealed state: it equals the live one
            got = state_get(conf, cid)
            assert got["state"] == live[cid] and got["obtained"]["snapshots_used_in_partition"] == 2

        # forget c-1 (the CLI, another process): its snapshot no longer opens, the restore folds its events
        forgot = kafold_cli("subjects", "forget", "c-1", "-c", str(conf), "--json", "--yes", timeout=120)
        assert forgot.returncode == 0 and '"key_deleted": true' in forgot.stdout, forgot.stdout + forgot.stderr
        forgotten = {"email": PLACEHOLDER, "name": "C-1"}
        got = state_get(conf, "c-1")
        assert got["state"] == forgotten and got["obtained"]["snapshots_used_in_partition"] == 1
        assert state_get(conf, "c-2")["state"] == live["c-2"]

        # a new Spark run after forget: its tasks reject c-1's sealed snapshot and fold c-1 from its events
        out = _spark_run(conf)
        assert "'forgotten': 1" in out, out
        for cid, want in (("c-1", forgotten), ("c-2", live["c-2"])):
            got = state_get(conf, cid)
            assert got["state"] == want and got["obtained"]["snapshots_used_in_partition"] == 2
    finally:
        client.close()
    raw = raw_bytes(kafka_config, agg.topic("snapshot"), agg.topic("events"))
    for email in EMAILS.values():
        assert email.encode() not in raw


@pytest.mark.timeout(900)
def test_on_a_standalone_cluster_executors_read_the_master_key_from_their_own_environment(
        kafka_config: KafkaConfig, pg_url: str, unique: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The job never ships the master key: a worker started without the variable fails the run, naming it; a
    worker started with it seals the states, which a restore opens."""
    pytest.importorskip("pyspark")
    from tests.snapshots import spark_cluster

    master = master_key(monkeypatch)
    conf = tmp_path / "kafold.toml"
    text = protected_customer_toml(kafka_config, pg_url, unique, free_port(), snapshots=True).replace(
        "[postgres]\n", f'[postgres]\nschema = "spark_{uuid.uuid4().hex[:12]}"\n')
    conf.write_text(text)
    cfg, client = customer_client(conf, kafka_config)
    agg = cfg.aggregates[0]
    try:
        with ready_daemon(conf) as d:
            register(client, EMAILS)
            assert all(r[0]["status"] == "accepted" for r in client.results.values())
            live = {cid: live_state(d, cid) for cid in EMAILS}
    finally:
        client.close()
    for with_key in (False, True):
        state_dir = tmp_path / f"spark-{with_key}"
        state_dir.mkdir()
        if not with_key:
            monkeypatch.delenv(MASTER_VAR)  # the worker (and so its executors) starts without it
        with spark_cluster.standalone(state_dir, workers=1) as cluster:
            monkeypatch.setenv(MASTER_VAR, master)  # the driver (`kafold snapshot run`) has it
            conf.write_text(text.replace('engine = "local"', f'engine = "spark"\nspark_master = "{cluster.master_url}"'
                                         f'\nspark_conf = {{ "spark.executor.memory" = "{spark_cluster.WORKER_MEMORY}",'
                                         ' "spark.executor.cores" = "1", "spark.task.maxFailures" = "1" }'))
            run = kafold_cli("snapshot", "run", "-c", str(conf), "--no-progress")
        if not with_key:
            assert run.returncode != 0 and f"{MASTER_VAR} is not set" in run.stdout + run.stderr, \
                run.stdout[-3000:] + run.stderr[-3000:]
            assert master not in run.stdout + run.stderr
            assert b"kfenc1:" not in raw_bytes(kafka_config, agg.topic("snapshot"))  # nothing written
            continue
        assert run.returncode == 0, run.stdout + run.stderr
        assert any(line.split()[:2] == ["customer", "spark"] for line in run.stdout.splitlines()), run.stdout
        raw = raw_bytes(kafka_config, agg.topic("snapshot"))
        assert b"kfenc1:" in raw and not any(email.encode() in raw for email in EMAILS.values())
        for cid in EMAILS:
            got = state_get(conf, cid)
            assert got["state"] == live[cid] and got["obtained"]["snapshots_used_in_partition"] == 2
