"""The cart domain (a tuple, a datetime, a Decimal, an Enum, a nested dataclass) in `kafold daemon` on Apache Kafka,
driven from outside (plain confluent-kafka commands, HTTP state reads): the outcomes and `GET /aggregates/cart/..`
equal those of the same commands decided without any restart (test_one_fold's pure model), while the aggregates
are evicted from a one-entry cache and reloaded, the daemon is killed -9 and restarted, restored from a local
snapshot run, and its partitions move to another instance of the group. And a stored event the code cannot fold:
the partition is not ready and says why; under `on_fold_error = "dead-letter"` it is parked on the aggregate's
dead-letter topic and the rest flows."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import OFFSET_BEGINNING, TopicPartition

from kafold import config, kafka_clients, topics
from kafold.config import KafkaConfig
from kafold.envelope import Event, encode
from kafold.testing import free_port
from tests.aggregates.agg_support import Outside, cart_daemon_toml
from tests.aggregates.test_one_fold import T0, _run
from tests.daemon.daemon_support import daemon_in_process, get_json, state_path
from tests.support import child_env, produce, wait_for

KAFOLD = str(Path(sys.executable).parent / "kafold")


def _config(path: Path, kafka: KafkaConfig, unique: str, port: int, extra: str = "") -> Path:
    path.write_text(cart_daemon_toml(kafka, unique, port, unique, f"cache_max_aggregates = 1\n{extra}"))
    return path


def _at(hours: float) -> str:
    return (T0 + timedelta(hours=hours)).isoformat()


def _lines(*items: tuple[str, str]) -> dict[str, Any]:
    return {"lines": [{"sku": s, "price": p} for s, p in items]}


# (cart, command, data) in rounds; between rounds: evictions happen throughout (one-entry cache), then a kill -9,
# then a snapshot run and a restart that restores from it.
ROUNDS: list[list[tuple[str, str, dict[str, Any]]]] = [
    [("c1", "OpenCart", {"at": _at(0)}), ("c2", "OpenCart", {"at": _at(0.5)}),
     ("c1", "AddItems", _lines(("a", "1.10"), ("b", "2.20"))), ("c2", "AddItems", _lines(("x", "9.99"))),
     ("c1", "AddItems", {**_lines(("c", "0.05")), "note": "gift"})],
    [("c1", "AddItems", _lines(("d", "10"))), ("c1", "CheckOut", {"at": _at(1)}),
     ("c2", "AddItems", _lines(("y", "0.01")))],
    [("c2", "AddItems", _lines(("z", "3"))), ("c2", "CheckOut", {"at": _at(40)}),
     ("c1", "AddItems", _lines(("e", "1")))],
    [("c3", "OpenCart", {"at": _at(50)}), ("c3", "AddItems", _lines(("q", "4.50"), ("r", "0.5"))),
     ("c2", "AddItems", _lines(("w", "1"))), ("c3", "CheckOut", {"at": _at(51)})],
]


def _daemon(conf: Path, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen([KAFOLD, "--log-format", "json", "daemon", "-c", str(conf)], stdout=out,
                                stderr=subprocess.STDOUT, env=child_env())


@pytest.mark.timeout(600)
def test_typed_state_survives_eviction_kill_and_snapshot_restore(kafka_config: KafkaConfig, unique: str,
                                                                 tmp_path: Path) -> None:
    port, other_port = free_port(), free_port()
    conf = _config(tmp_path / "kafold.toml", kafka_config, unique, port)
    other = _config(tmp_path / "other.toml", kafka_config, unique, other_port)  # the same group, another instance
    loaded = config.load_file(conf)
    agg = loaded.config.aggregates[0]
    assert topics.ensure(kafka_config, config.topic_map(loaded.config).values()).ok
    plan = [(cart, (kind, data)) for r in ROUNDS for cart, kind, data in r]
    model_outcomes, model_states = _run(plan, {})  # no restart at all
    client = Outside(kafka_config, agg)
    log = tmp_path / "daemon.log"
    outcomes: list[tuple[str, str | None]] = []
    versions: dict[str, int] = {}  # cart -> the last version its results name: the reads wait for it
    proc = _daemon(conf, log)
    try:
        i = 0
        for r, commands in enumerate(ROUNDS):
            wait_for(lambda port=port: get_json(port, "/ready")[0] == 200, f"round {r}: the daemon ready", 120)
            for cart, kind, data in commands:
                result = client.ask(f"cmd-{i}", cart, kind, data)
                outcomes.append((result["status"], result.get("reason")))
                versions[cart] = max(versions.get(cart, 0), result.get("version") or 0)
                i += 1
            if r == 0:
                proc.send_signal(signal.SIGKILL)
                proc.wait(30)
            elif r == 1:
                proc.send_signal(signal.SIGTERM)
                assert proc.wait(60) == 0
                run = subprocess.run([KAFOLD, "snapshot", "run", "-c", str(conf), "--engine", "local"],
                                     capture_output=True, text=True, timeout=300, env=child_env())
                assert run.returncode == 0, run.stdout + run.stderr
            elif r == 2:  # another instance joins, this one leaves: every partition moves to it
                moved = _daemon(other, tmp_path / "other.log")
                wait_for(lambda: get_json(other_port, "/ready")[0] == 200, "the other instance ready", 120)
                proc.send_signal(signal.SIGTERM)
                assert proc.wait(60) == 0
                proc, port = moved, other_port
            if r < 2:
                proc = _daemon(conf, log)
        served = {cart: get_json(port, state_path("cart", cart, versions[cart])) for cart in ("c1", "c2", "c3")}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        client.close()
    assert outcomes == model_outcomes, "the same commands, decided across restarts, must get the same outcomes"
    assert [o[0] for o in outcomes].count("rejected") == 2  # c1's, then c2's AddItems after their checkouts
    for cart, (status, body) in served.items():
        assert status == 200, (cart, status, body)
        assert body["state"] == json.loads(json.dumps(model_states[cart])), (cart, body["state"])
    caught_up = [json.loads(line) for line in log.read_text().splitlines() if '"aggregate.caught_up"' in line]
    assert caught_up[-1]["snapshot_version"] is not None, caught_up[-1]  # the last start restored from it
    assert "aggregate.fold_failed" not in log.read_text() + (tmp_path / "other.log").read_text()


def _bad_event(unique: str) -> tuple[int, bytes, bytes, Any]:
    """An ItemsAdded an older version of the code wrote: a price the Decimal field cannot read."""
    ev = Event.new("ItemsAdded", "cart", "c9", 2, {"skus": ["q"], "lines": [{"sku": "q", "price": "lots"}]})
    return (0, *encode(ev))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("policy", ["stop", "dead-letter"])
def test_an_event_the_fold_cannot_apply_is_never_skipped_silently(kafka_config: KafkaConfig, unique: str,
                                                                 tmp_path: Path, policy: str) -> None:
    port = free_port()
    conf = _config(tmp_path / "kafold.toml", kafka_config, unique, port, f'on_fold_error = "{policy}"')
    loaded = config.load_file(conf)
    agg = loaded.config.aggregates[0]
    assert topics.ensure(kafka_config, config.topic_map(loaded.config).values()).ok
    opened = Event.new("CartOpened", "cart", "c9", 1, {"opened_at": _at(0)})
    bad = _bad_event(unique)
    produce(kafka_config, agg.topic("events"), [(0, *encode(opened)), bad])
    with daemon_in_process(conf) as d:
        if policy == "stop":
            def says_why() -> bool:
                status, body = d.get("/ready")
                return status == 503 and any(w.get("reason") == "fold error" for w in body["not_ready"])

            wait_for(says_why, "/ready naming the fold error", 90)
            stopped = next(w for w in d.get("/ready")[1]["not_ready"] if w.get("reason") == "fold error")
            assert stopped["partitions"] == [0]  # /ready, open to all, names where; the error is behind the token
            assert d.get("/aggregates/cart/c9")[0] == 503  # no state served from a fold that stopped
            rows = d.get("/status")[1]["aggregates"]  # what `kafold status` prints
            assert [r["phase"] for r in rows] == ["STOPPED"], rows
            why = rows[0]["fold_error"]
            assert "offset 1" in why and "'ItemsAdded'" in why and "price" in why, why
            return
        wait_for(lambda: d.get("/ready")[0] == 200, "the aggregate live past the parked event", 90)
        status, body = d.get("/aggregates/cart/c9")
        assert status == 200 and body["version"] == 1 and body["state"]["status"] == "open", body
    reader = kafka_clients.consumer(kafka_config, f"{unique}.dlq-reader")
    try:
        reader.assign([TopicPartition(agg.dlq_topic, 0, OFFSET_BEGINNING)])
        parked = [m for m in reader.consume(100, 10) if m.error() is None]
    finally:
        reader.close()
    mine = [(m.key(), m.value(), dict(m.headers() or [])) for m in parked if m.key() == b"c9"]
    assert len(mine) == 1 and mine[0][1] == bad[2], mine
    assert mine[0][2]["kafold-dlq-reason"] == b"fold-error"
