"""The issue's second sequence from outside, on the real daemon: `Deposit 1000` with an id, the daemon stops, a
snapshot run, the daemon starts again from the snapshot, the client retries: one decision, one event, and the
`accounts` projection in PostgreSQL equals the aggregate's state served over HTTP (with its version)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import psycopg

from kafold import config, topics
from kafold.config import KafkaConfig
from kafold.snapshot import kafka_io, record
from kafold.testing import free_port
from tests.aggregates.agg_support import Outside, accounts_projection_toml, bank_daemon_toml, events
from tests.daemon.daemon_support import get_json, state_path
from tests.support import wait_for

KAFOLD = str(Path(sys.executable).parent / "kafold")



def _config(path: Path, kafka: KafkaConfig, unique: str, table: str, port: int) -> Path:
    path.write_text(f"""
{bank_daemon_toml(kafka, unique, port)}
{accounts_projection_toml("accounts", unique + ".events", table)}
""")
    return path


def _daemon(conf: Path, pg_url: str, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "KAFOLD_POSTGRES__URL": pg_url}  # never in the file
    with open(log, "ab") as out:
        return subprocess.Popen([KAFOLD, "--log-format", "json", "daemon", "-c", str(conf)], stdout=out,
                                stderr=subprocess.STDOUT, env=env)


def _aggregate_live(port: int) -> bool:
    """The aggregate runtime is live (the projection may still wait for its first record: /ready says so)."""
    status, body = get_json(port, "/ready")
    return status == 200 or (status == 503 and not any("aggregate" in w for w in body["not_ready"]))


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0


def test_a_retry_after_a_snapshot_and_a_restart_is_decided_once_and_the_projection_agrees(
        kafka_config: KafkaConfig, pg_url: str, unique: str, tmp_path: Path) -> None:
    table, port = f"acc_{uuid.uuid4().hex[:10]}", free_port()
    conf = _config(tmp_path / "kafold.toml", kafka_config, unique, table, port)
    loaded = config.load_file(conf)
    agg = loaded.config.aggregates[0]
    assert topics.ensure(kafka_config, config.topic_map(loaded.config).values()).ok
    client = Outside(kafka_config, agg)
    log = tmp_path / "daemon.log"
    proc = _daemon(conf, pg_url, log)

    def row() -> tuple[int] | None:
        with psycopg.connect(pg_url) as conn:
            try:
                return conn.execute(f'SELECT balance FROM "{table}" WHERE account_id = %s', ("acc",)).fetchone()
            except psycopg.errors.UndefinedTable:
                return None

    try:
        wait_for(lambda: get_json(port, "/ready")[0] == 200, "the daemon ready (its projection on an empty topic)", 90)
        client.ask("open", "acc", "OpenAccount", {"owner": "bo"})
        first = client.ask("retry-2", "acc", "Deposit", {"amount": 1000})
        assert first["status"] == "accepted" and not first["duplicate"]
        wait_for(lambda: row() == (1000,), "the projection to show the deposit", 120)
        _stop(proc)
        run = subprocess.run([KAFOLD, "snapshot", "run", "-c", str(conf), "--engine", "local"],
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stdout + run.stderr
        reader = kafka_io.reader(kafka_config)
        try:
            snaps = [record.decode(k, v) for k, v, _ in kafka_io.records(reader, agg.topic("snapshot"), 0)
                     if not record.is_marker(k)]
        finally:
            reader.close()
        assert [s.aggregate_id for s in snaps] == ["acc"] and "retry-2" in {c[0] for c in snaps[0].commands}
        proc = _daemon(conf, pg_url, log)
        wait_for(lambda: _aggregate_live(port), "the aggregate live again", 90)
        again = client.ask("retry-2", "acc", "Deposit", {"amount": 1000})
        assert again["duplicate"] and (again["version"], again["event_ids"]) == (first["version"],
                                                                                first["event_ids"])
        status, served = get_json(port, "/aggregates/account/acc")
        assert status == 200 and served["state"]["balance"] == 1000 and served["version"] == 2, served

        client.ask("after", "acc", "Deposit", {"amount": 1})
        status, served = get_json(port, state_path("account", "acc", 3))
        assert status == 200 and (served["state"]["balance"], served["version"]) == (1001, 3), served
        wait_for(lambda: row() == (1001,), "the projection to agree with the aggregate", 120)
        caught_up = [json.loads(line) for line in log.read_text().splitlines()
                     if '"aggregate.caught_up"' in line]
        assert caught_up[-1]["snapshot_version"] is not None, caught_up[-1]  # restored from the snapshot
        _stop(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        client.close()
    evs = events(kafka_config, agg)
    assert [e["causation_id"] for e in evs] == ["open", "retry-2", "after"]
