"""A daemon whose only connector is an effect starts on an empty database: it applies kafold's migrations first."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
from confluent_kafka import Consumer

from kafold import config, kafka_clients
from kafold.config import KafkaConfig
from kafold.daemon.host import DaemonHost
from kafold.envelope import Event, decode, encode
from tests.effects.effects_support import daemon_config
from tests.support import committed, create_topic, make_event, produce, wait_for
from tests.support.daemons import daemon_thread
from tests.support.receiver import Receiver


@pytest.fixture
def empty_db(pg_url: str) -> Iterator[str]:
    """The URL of a database created for this test, with nothing in it."""
    name = f"kt_fresh_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    parts = urlsplit(pg_url)
    yield urlunsplit(parts._replace(path=f"/{name}"))
    # Dropped once the daemon's connections are gone (never forced: the server is shared by the session's tests);
    # a database still in use is left to the session's throwaway server.
    deadline = time.monotonic() + 10
    while True:
        try:
            with psycopg.connect(pg_url, autocommit=True) as conn:
                conn.execute(f"DROP DATABASE IF EXISTS {name}")
            return
        except psycopg.errors.ObjectInUse:
            if time.monotonic() > deadline:
                return
            time.sleep(0.2)


def _tables(url: str) -> set[str]:
    with psycopg.connect(url) as conn:
        return {r[0] for r in conn.execute("SELECT table_name FROM information_schema.tables "
                                           "WHERE table_schema = 'kafold'")}


@pytest.mark.parametrize(("kind", "processes"), [("webhook", False), ("kafka", False), ("python", False),
                                                 ("webhook", True)])
def test_an_effect_only_daemon_starts_on_an_empty_database_and_delivers(
        kind: str, processes: bool, tmp_path: Path, kafka_config: KafkaConfig, empty_db: str, receiver: Receiver,
        unique: str, monkeypatch: pytest.MonkeyPatch) -> None:
    topic, out = f"{unique}.events", f"{unique}.derived"
    create_topic(kafka_config, topic)
    assert _tables(empty_db) == set()
    events = [make_event("a", v) for v in range(1, 4)]
    produce(kafka_config, topic, [(0, *encode(e)) for e in events])
    url = receiver.url  # type: ignore[attr-defined]
    effect = {"webhook": f'{{ url = "{url}", allow_http = true }}',
              "kafka": f'{{ topic = "{out}" }}',
              "python": '{ function = "tests.effects.forward_effect:forward" }'}[kind]
    if kind == "kafka":
        create_topic(kafka_config, out)
    monkeypatch.setenv("KT_FORWARD_URL", url)
    path = daemon_config(tmp_path / "kafold.toml", kafka_config, empty_db, "kafold", unique, topic, kind, effect,
                         task_processes=processes)
    with daemon_thread(path) as (_, thread):
        wait_for(lambda: committed(kafka_config, f"{unique}.only", topic, 1) == {0: 3} or not thread.is_alive(),
                 "the effects' commit")
        assert thread.is_alive(), "the daemon exited"
    assert {"alembic_version", "effect_ledger", "effect_parked", "effect_parked_keys"} <= _tables(empty_db)
    if kind == "kafka":
        assert sorted(e.causation_id or "" for e in _read(kafka_config, out, 3)) == sorted(
            e.event_id for e in events)
    else:
        assert receiver.per_key() == {"a": [1, 2, 3]}


def _read(kafka: KafkaConfig, topic: str, n: int) -> list[Event]:
    consumer = Consumer(kafka_clients.librdkafka(kafka, **{"group.id": f"{topic}.reader",
                                                           "auto.offset.reset": "earliest"}))
    consumer.subscribe([topic])
    got: list[Event] = []
    try:
        wait_for(lambda: bool(got.extend(decode(m.key(), m.value(), m.headers()) for m in consumer.consume(10, 0.5)
                                         if not m.error())) or len(got) >= n, "derived events")
    finally:
        consumer.close()
    return got


def test_without_migrations_an_empty_database_is_a_clear_error_naming_the_fix(
        tmp_path: Path, kafka_config: KafkaConfig, empty_db: str, receiver: Receiver, unique: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    topic = f"{unique}.events"
    create_topic(kafka_config, topic)
    url = receiver.url  # type: ignore[attr-defined]
    path = daemon_config(tmp_path / "kafold.toml", kafka_config, empty_db, "kafold", unique, topic, "webhook",
                         f'{{ url = "{url}", allow_http = true }}', migrate=False)
    loaded = config.load_file(path)
    assert DaemonHost(loaded.config, loaded.base).run() == 1  # the task fails; the daemon fails fast
    out = capsys.readouterr().out
    assert "tables are missing in schema" in out and "run `kafold db upgrade` or set postgres.migrate_on_start" in out
    assert _tables(empty_db) == set()
