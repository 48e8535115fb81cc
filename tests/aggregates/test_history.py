"""An aggregate's history on Apache Kafka: `kafold events list`, `state get --version`, the history index (an aborted
transaction's row never served, a dropped index rebuilt) and the daemon's `GET /aggregates/{name}/{id}/events`."""

from __future__ import annotations

import functools
import json
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
import pytest

from kafold import config, db, kafka_clients, topics
from kafold.config import KafkaConfig
from kafold.envelope import Event, encode
from kafold.history import History, NotFound
from kafold.snapshot.fold import Domain
from kafold.testing import free_port
from kafold.tools import cli
from tests.aggregates.agg_support import (
    PLACEHOLDER,
    customer_client,
    master_key,
    protected_customer_toml,
    ready_daemon,
    register,
)
from tests.aggregates.agg_support import cart_daemon_toml as cart_toml
from tests.aggregates.cart_domain import Cart, Status
from tests.aggregates.test_upcast_daemon import UPCASTERS

pytestmark = pytest.mark.integration
AT = "2026-11-01T09:00:00Z"
LINES = [{"sku": "a", "price": "1.10"}, {"sku": "b", "price": "2"}]
MORE = [{"sku": "c", "price": "0.05"}]


def _cart(cart: str) -> list[Event]:
    """A cart's history in three schema versions (CartFilled v1 and ItemsAdded v2 are upcast), each caused by a
    command of its own."""
    def ev(kind: str, v: int, payload: dict[str, Any], sv: int = 1) -> Event:
        return Event.new(kind, "cart", cart, v, payload, schema_version=sv, causation_id=f"cmd-{cart}-{v}",
                         event_id=f"ev-{cart}-{v}", occurred_at=AT)
    return [ev("CartOpened", 1, {"opened_at": AT}), ev("CartFilled", 2, {"items": LINES}),
            ev("ItemsAdded", 3, {"lines": MORE}, 2), ev("ItemsAdded", 4, {"lines": MORE, "skus": ["c"]}, 3),
            ev("CheckedOut", 5, {"at": AT, "total": "3.20"})]


def _write(kafka: KafkaConfig, topic: str, unique: str) -> int:
    """Two carts' events interleaved, one transaction per version; then a transaction writing cart c-1's version 6
    that is aborted. The aborted record's offset."""
    producer = kafka_clients.producer(kafka, **{"transactional.id": f"{unique}-history"})
    producer.init_transactions(30)
    for a, b in zip(_cart("c-1"), _cart("c-2"), strict=True):
        producer.begin_transaction()
        for e in (a, b):
            key, value, headers = encode(e)
            producer.produce(topic, value, key, headers=headers)
        producer.commit_transaction(30)
    landed: list[int] = []
    producer.begin_transaction()
    key, value, headers = encode(Event.new("ItemsAdded", "cart", "c-1", 6, {"lines": MORE, "skus": ["c"]},
                                           schema_version=3, event_id="ev-aborted", occurred_at=AT))
    producer.produce(topic, value, key, headers=headers, on_delivery=lambda err, m: landed.append(m.offset()))
    producer.flush(30)
    producer.abort_transaction(30)
    return landed[0]


def _setup(kafka: KafkaConfig, pg_url: str, unique: str, tmp_path: Path) -> tuple[Path, str, int]:
    conf = tmp_path / "kafold.toml"
    conf.write_text(cart_toml(kafka, unique, free_port(), unique, UPCASTERS.format(section="aggregates"))
                    + f'\n[postgres]\nurl = "{pg_url}"\n')
    cfg = config.load_file(conf).config
    db.upgrade(cfg.postgres)
    assert topics.ensure(kafka, config.topic_map(cfg).values()).ok
    topic = cfg.aggregates[0].topic("events")
    return conf, topic, _write(kafka, topic, unique)


def _json(capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    """The command's JSON output (one line, or indented), among the in-process log lines."""
    lines = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(lines) if line == "{" or line.startswith('{"'))
    out: dict[str, Any] = json.JSONDecoder().raw_decode("\n".join(lines[start:]))[0]
    return out


def _history(conf: Path) -> History:
    loaded = config.load_file(conf)
    agg = loaded.config.aggregates[0]
    return History(loaded.config.kafka, loaded.config.postgres, agg,
                   Domain.load(agg, [str((loaded.base / p).resolve()) for p in loaded.config.daemon.python_path]))


def test_the_history_lists_events_with_their_command_pages_and_folds_to_each_version(
        kafka_config: KafkaConfig, pg_url: str, unique: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """`events list` shows each event's type, version, schema version, time, id and causing command, its data
    upcast; pages link on; the state at version N is the fold of the first N events (datetime, Decimal, tuple)."""
    conf, _, _ = _setup(kafka_config, pg_url, unique, tmp_path)
    assert cli.main(["events", "index", "-c", str(conf), "cart", "--json"]) == 0
    assert _json(capsys)["partitions"][0]["events_indexed"] == 10
    assert cli.main(["events", "list", "-c", str(conf), "cart", "c-1", "--json"]) == 0
    page = _json(capsys)
    evs = page["events"]
    assert [(e["version"], e["type"], e["schema_version"], e["command_id"], e["event_id"]) for e in evs] == [
        (1, "CartOpened", 1, "cmd-c-1-1", "ev-c-1-1"), (2, "CartFilled", 1, "cmd-c-1-2", "ev-c-1-2"),
        (3, "ItemsAdded", 2, "cmd-c-1-3", "ev-c-1-3"), (4, "ItemsAdded", 3, "cmd-c-1-4", "ev-c-1-4"),
        (5, "CheckedOut", 1, "cmd-c-1-5", "ev-c-1-5")]
    assert evs[1]["data"]["skus"] == ["a", "b"] and evs[2]["data"]["skus"] == ["c"]  # upcast, as the fold reads them
    assert all(e["occurred_at"] == AT for e in evs) and page["next_version"] is None

    assert cli.main(["events", "list", "-c", str(conf), "cart", "c-1", "--limit", "2", "--json"]) == 0
    first = _json(capsys)
    assert [e["version"] for e in first["events"]] == [1, 2] and first["next_version"] == 3
    assert cli.main(["events", "list", "-c", str(conf), "cart", "c-1", "--from-version", "3", "--limit", "2",
                     "--json"]) == 0
    second = _json(capsys)
    assert [e["version"] for e in second["events"]] == [3, 4] and second["next_version"] == 5
    assert cli.main(["events", "list", "-c", str(conf), "cart", "c-1"]) == 0  # the table
    table = capsys.readouterr().out
    assert "CartFilled" in table and "cmd-c-1-5" in table

    h = _history(conf)
    try:
        events = [h.domain.event(e.type, e.payload, e.schema_version) for e in _cart("c-1")]
        for n in range(1, 6):
            state, version = h.state_at("c-1", n)
            assert version == n
            assert state == functools.reduce(h.domain.evolve, events[:n], h.domain.initial())
        at3 = h.state_at("c-1", 3)[0]
        assert isinstance(at3, Cart) and at3.status is Status.OPEN and at3.skus == ("a", "b", "c")
        assert at3.total == Decimal("3.15") and at3.opened_at is not None and at3.opened_at.tzinfo is not None
    finally:
        h.close()
    assert cli.main(["state", "get", "-c", str(conf), "cart", "c-1", "--version", "2"]) == 0
    got = _json(capsys)
    assert got["version"] == 2 and got["state"]["skus"] == ["a", "b"] and Decimal(got["state"]["total"]) == \
        Decimal("3.10")
    assert cli.main(["state", "get", "-c", str(conf), "cart", "c-1", "--version", "6"]) == 1  # the aborted one


def test_an_index_row_of_an_aborted_transaction_is_never_served_and_a_dropped_index_is_rebuilt(
        kafka_config: KafkaConfig, pg_url: str, unique: str, tmp_path: Path) -> None:
    """A row naming the aborted record (as a writer indexing beside its transaction would leave) is checked against
    the record, dropped and not served; the index dropped is rebuilt on the next read, the same."""
    conf, topic, aborted = _setup(kafka_config, pg_url, unique, tmp_path)
    h = _history(conf)
    try:
        before = h.events("c-1").events
        assert [e["version"] for e in before] == [1, 2, 3, 4, 5]  # the index built on first use
        with psycopg.connect(pg_url, autocommit=True) as conn:
            conn.execute('INSERT INTO kafold.event_index (topic, aggregate_id, version, partition, "offset", '
                         "event_id) VALUES (%s, 'c-1', 6, 0, %s, 'ev-aborted')", (topic, aborted))
        assert [e["version"] for e in h.events("c-1").events] == [1, 2, 3, 4, 5]
        assert [r.version for r in h.index.rows(topic, "c-1")] == [1, 2, 3, 4, 5]  # the bad row dropped
        with pytest.raises(NotFound):
            h.state_at("c-1", 6)

        h.index.drop(topic)
        assert h.index.rows(topic, "c-1") == [] and h.index.mark(topic, 0) is None
        assert h.events("c-1").events == before
        assert h.events("c-2").events[-1]["version"] == 5
    finally:
        h.close()


def test_the_daemon_serves_pages_and_states_at_a_version_with_protected_fields_opened_then_erased(
        kafka_config: KafkaConfig, pg_url: str, unique: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """GET /aggregates/customer/{id}/events pages with a `next` link; the email shows in clear while its key exists,
    as the placeholder once the subject is forgotten, in the events and in the state at a version."""
    master_key(monkeypatch)
    conf = tmp_path / "kafold.toml"
    conf.write_text(protected_customer_toml(kafka_config, pg_url, unique, free_port()))
    _, client = customer_client(conf, kafka_config)
    who = f"{unique[-8:]}-cust"
    try:
        with ready_daemon(conf) as d:
            register(client, {who: "ann.secret@example.com"})
            client.send("rename-1", who, "Rename", {"name": "Ann"})
            client.wait()
            status, page = d.get(f"/aggregates/customer/{who}/events?limit=1")
            assert status == 200, page
            assert [(e["version"], e["type"], e["command_id"]) for e in page["events"]] == [(1, "Registered",
                                                                                            f"reg-{who}")]
            assert page["events"][0]["data"]["email"] == "ann.secret@example.com"
            status, rest = d.get(page["next"])
            assert status == 200 and [e["type"] for e in rest["events"]] == ["Renamed"] and rest["next"] is None
            status, at1 = d.get(f"/aggregates/customer/{who}?version=1")
            assert status == 200 and at1["state"] == {"email": "ann.secret@example.com", "name": who.upper()}
            assert d.get(f"/aggregates/customer/{who}?version=3")[0] == 404
            assert d.get(f"/aggregates/customer/{who}/events?limit=0")[0] == 400

            assert d.call("POST", f"/subjects/{who}/forget")[0] == 200
            status, page = d.get(f"/aggregates/customer/{who}/events")
            assert status == 200 and page["events"][0]["data"]["email"] == PLACEHOLDER
            assert d.get(f"/aggregates/customer/{who}?version=1")[1]["state"]["email"] == PLACEHOLDER
    finally:
        client.close()
