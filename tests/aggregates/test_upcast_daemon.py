"""A cart history written in v1 (CartFilled with `items`), v2 (ItemsAdded with `lines`) and v3 (today's
ItemsAdded with `skus`) on Apache Kafka, read by `kafold daemon` with the aggregate's upcaster chain: the aggregate's
state (live, and restored after a restart from a snapshot run: Spark for the old history, local for the native one),
the projection's rows, the webhook bodies and the rows of a rebuilt projection all equal those of the same history
written natively in v3; the next command is decided on it. The projection and the webhook declare no chain: they
take the aggregate's (one chain per topic); a `raw` webhook gets the events as they were written."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest

from kafold import config, topics
from kafold.config import KafkaConfig
from kafold.envelope import Event, encode
from kafold.testing import free_port
from tests.aggregates.agg_support import Outside, cart_daemon_toml
from tests.daemon.daemon_support import Running, daemon_in_process
from tests.support import child_env, produce, wait_for
from tests.support.receiver import Receiver

KAFOLD = str(Path(sys.executable).parent / "kafold")
M = "tests.aggregates.cart_domain"
LINES = [{"sku": "a", "price": "1.10"}, {"sku": "b", "price": "2"}]
MORE = [{"sku": "c", "price": "0.05"}]
AT = "2026-11-01T09:00:00Z"
UPCASTERS = """
[[{section}.upcasters]]
type = "CartFilled"
from_version = 1
rename_type = "ItemsAdded"
rename_fields = {{items = "lines"}}

[[{section}.upcasters]]
type = "ItemsAdded"
from_version = 2
function = "tests.core.test_upcast:skus_from_lines"
"""


def _history(cart: str, old: bool) -> list[Event]:
    opened = Event.new("CartOpened", "cart", cart, 1, {"opened_at": AT})
    last = Event.new("ItemsAdded", "cart", cart, 4, {"lines": MORE, "skus": ["c"], "note": "v3"}, schema_version=3)
    if old:
        return [opened, Event.new("CartFilled", "cart", cart, 2, {"items": LINES}),
                Event.new("ItemsAdded", "cart", cart, 3, {"lines": MORE}, schema_version=2), last]
    return [opened, Event.new("ItemsAdded", "cart", cart, 2, {"lines": LINES, "skus": ["a", "b"]}, schema_version=3),
            Event.new("ItemsAdded", "cart", cart, 3, {"lines": MORE, "skus": ["c"]}, schema_version=3), last]


def _config(path: Path, kafka: KafkaConfig, pg_url: str, prefix: str, port: int, table: str,
            hooks: dict[str, str]) -> Path:
    path.write_text(cart_daemon_toml(kafka, prefix, port, prefix, UPCASTERS.format(section="aggregates")) + f"""
[postgres]
url = "{pg_url}"

[[connectors]]
name = "hooks-{table}"
class = "webhook"
topics = ["{prefix}.events"]
[connectors.config]
url = "{hooks["upcast"]}"
allow_http = true

[[connectors]]
name = "raw-{table}"
class = "webhook"
topics = ["{prefix}.events"]
raw = true
[connectors.config]
url = "{hooks["raw"]}"
allow_http = true

[[connectors]]
name = "carts-{table}"
class = "postgres-projection"
topics = ["{prefix}.events"]
[connectors.config]
table = "{table}"
key_columns = ["cart_id"]
mapper = "{M}:cart_row"

[connectors.config.columns]
cart_id = "text"
status = "text"
skus = "text"
lines = "integer"
total = "text"
""")
    return path


def _rows(pg_url: str, table: str) -> list[tuple[Any, ...]]:
    try:
        with psycopg.connect(pg_url) as conn:
            query = f'SELECT cart_id, status, skus, lines, total FROM "{table}" ORDER BY cart_id'
            return conn.execute(query).fetchall()
    except psycopg.errors.UndefinedTable:
        return []


def _bodies(receiver: Receiver) -> list[tuple[str, int, Any]]:
    """(type, schema_version, payload) of each event delivered, once each, in delivery order."""
    seen: dict[str, tuple[str, int, Any]] = {}
    for r in receiver.successes():
        doc = orjson.loads(r.body)
        seen.setdefault(r.event_id, (doc["type"], doc["schema_version"], doc["payload"]))
    return list(seen.values())


def _ready(d: Running) -> bool:
    """Everything is ready: the aggregate live, and the projection and the webhooks caught up. After the restart the
    events topic ends with a transaction's commit marker (the CheckOut's), which the sink runner must step past
    (daemon/runner.py `_past_markers`), or it would stay one offset short and never ready."""
    return d.get("/ready")[0] == 200


@pytest.mark.timeout(1200)
def test_a_history_in_three_versions_reads_as_the_same_history_in_v3(
        kafka_config: KafkaConfig, pg_url: str, unique: str, tmp_path: Path) -> None:
    results: dict[str, Any] = {}
    for kind in ("native", "old"):
        prefix, table, port = f"{unique}.{kind}", f"carts_{kind}_{unique[-8:]}", free_port()
        topic = f"{prefix}.events"
        receivers = {"upcast": Receiver(), "raw": Receiver()}
        hooks = {name: r.start() for name, r in receivers.items()}
        conf = _config(tmp_path / f"{kind}.toml", kafka_config, pg_url, prefix, port, table, hooks)
        loaded = config.load_file(conf)
        assert topics.ensure(kafka_config, config.topic_map(loaded.config).values()).ok
        produce(kafka_config, topic, [(0, *encode(e)) for e in _history("c1", old=kind == "old")])
        client = Outside(kafka_config, loaded.config.aggregates[0])
        try:
            with daemon_in_process(conf) as d:
                wait_for(lambda: _ready(d), f"{kind}: the aggregate live", 120)
                state = d.get("/aggregates/cart/c1")[1]["state"]
                wait_for(lambda table=table: len(_rows(pg_url, table)) == 1, f"{kind}: the projection's row", 90)
                checkout = client.ask(f"{kind}-out", "c1", "CheckOut", {"at": "2026-11-01T10:00:00Z"})
                for name, r in receivers.items():
                    wait_for(lambda r=r: len(_bodies(r)) == 5, f"{kind}: the {name} webhook's five bodies", 90)
            engine = "spark" if kind == "old" else "local"
            run = subprocess.run([KAFOLD, "snapshot", "run", "-c", str(conf), "--engine", engine],
                                 capture_output=True, text=True, timeout=600, env=child_env())
            assert run.returncode == 0, run.stdout + run.stderr
            with daemon_in_process(conf) as d:  # restored from the snapshot
                wait_for(lambda: _ready(d), f"{kind}: the aggregate live after the snapshot", 120)
                restored = d.get("/aggregates/cart/c1")[1]
                wait_for(lambda table=table: _rows(pg_url, table)[0][1] == "checked-out", f"{kind}: row updated", 90)
        finally:
            client.close()
            for r in receivers.values():
                r.stop()
        rebuild = subprocess.run([KAFOLD, "projection", "rebuild", f"carts-{table}", "-c", str(conf)],
                                 capture_output=True, text=True, timeout=300, env=child_env())
        assert rebuild.returncode == 0, rebuild.stdout + rebuild.stderr
        results[kind] = {"state": state, "checkout": (checkout["status"], checkout["version"]),
                         "restored": restored["state"], "version": restored["version"],
                         "rows": _rows(pg_url, table), "hooks": _bodies(receivers["upcast"]),
                         "raw": _bodies(receivers["raw"])}
    raw = {kind: results[kind].pop("raw") for kind in results}
    assert results["old"] == results["native"]
    assert [(t, v) for t, v, _ in raw["old"]][:4] == [("CartOpened", 1), ("CartFilled", 1), ("ItemsAdded", 2),
                                                     ("ItemsAdded", 3)]
    assert raw["old"][1][2] == {"items": LINES}  # as written, not upcast
    assert raw["native"] == results["native"]["hooks"]  # a history already in v3: raw and upcast bodies agree
    assert results["native"]["checkout"] == ("accepted", 5)
    assert results["native"]["rows"] == [("c1", "checked-out", "a,b,c,c", 4, "3.20")]
    assert list(results["native"]["state"]["skus"]) == ["a", "b", "c", "c"]
