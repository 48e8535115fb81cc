"""Personal data never at rest in clear, end to end on Apache Kafka (issue 51). A customer's events, their `email`
and `zip` protected, go to a projection (one row PostgreSQL refuses, quoting the value; the key's next event held
behind it) and a webhook whose receiver fails (the key parks). Then the subject is forgotten: the dead letters (table
and topic), the held event, the parked events and the error texts hold no clear value of it; `dlq discard` applies
the held event with the placeholder, `dlq replay --to topic` re-publishes sealed bytes, and `effects parked retry`
sends the placeholder. A value whose key id was altered is dead-lettered `decrypt-failed`. A fold error whose message
quotes an opened value shows on /status (behind the token, its quoted value redacted), not on /ready (open)."""

from __future__ import annotations

import base64
import os
import threading
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest
from confluent_kafka import Producer
from psycopg import sql

from kafold import config, db, protect, topics
from kafold.config import DaemonConfig, KafkaConfig, PostgresConfig
from kafold.connectors.registry import instantiate
from kafold.daemon.runner import SinkRunner
from kafold.envelope import Event, encode
from kafold.protect import Protector
from kafold.testing import free_port
from tests.aggregates.agg_support import PLACEHOLDER, PROTECTED, kafold_cli, raw_bytes
from tests.daemon.daemon_support import daemon_in_process
from tests.security.test_privacy_at_rest_units import _with_key_id
from tests.support import ROOT, kafka_toml, wait_for
from tests.support.receiver import Receiver, Req

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

MASTER_VAR = "KAFOLD_TEST_PRIVACY_AT_REST_MASTER"
OLD_EMAIL, NEW_EMAIL, STREET_ZIP = "ann.old.secret@example.com", "ann.new.secret@example.com", "SW1A 1AA"
CLEAR = (OLD_EMAIL, NEW_EMAIL, STREET_ZIP)


@dataclass
class World:
    conf: Path
    cfg: config.KafoldConfig
    pg: PostgresConfig
    kafka: KafkaConfig
    table: str
    hook: str
    ann: str  # the subject forgotten
    bob: str  # a live subject, whose second event's key id was altered
    receiver: Receiver
    failing: set[str]
    events: list[Event]
    protector: Protector  # the host's, handed to the tasks run in this process (TaskConfig.protector)


def _toml(kafka: KafkaConfig, pg_url: str, prefix: str, table: str, hook: str, url: str) -> str:
    return f"""
{kafka_toml(kafka)}
[daemon]
group_prefix = "{prefix}"
batch_max_wait_ms = 50

[postgres]
url = "{pg_url}"

[privacy]
master_key_env = "{MASTER_VAR}"
placeholder = "{PLACEHOLDER}"

[[aggregates]]
name = "customer"
initial = "{PROTECTED}:initial"
evolve = "{PROTECTED}:evolve"
decide = "{PROTECTED}:decide"
events_topic = "{prefix}.events"
commands_topic = "{prefix}.commands"
results_topic = "{prefix}.results"
snapshot_topic = "{prefix}.snapshots"

[[aggregates.protect]]
type = "Registered"
fields = ["email", "zip"]

[[aggregates.protect]]
type = "Moved"
fields = ["zip"]

[[aggregates.protect]]
type = "EmailChanged"
fields = ["email"]

[[connectors]]
name = "{table}"
class = "postgres-projection"
topics = ["{prefix}.events"]
[connectors.config]
table = "{table}"
key_columns = ["customer_id"]
[connectors.config.columns]
customer_id = "text"
email = "text"
zip = "integer"
[[connectors.config.on]]
type = "Registered"
set = {{ email = "payload.email", zip = "payload.zip" }}
[[connectors.config.on]]
type = "Moved"
action = "update"
set = {{ zip = "payload.zip" }}
[[connectors.config.on]]
type = "EmailChanged"
action = "update"
set = {{ email = "payload.email" }}

[[connectors]]
name = "{hook}"
class = "webhook"
topics = ["{prefix}.events"]
[connectors.config]
url = "{url}"
allow_http = true
max_age_s = 1.0
backoff_initial_s = 0.05
backoff_max_s = 0.2
request_poll_s = 0.2
"""


@contextmanager
def _running(cfg: config.KafoldConfig, name: str, protector: Protector) -> Iterator[SinkRunner]:
    """One connector's SinkRunner in a thread of this process, handed `protector` as the daemon hands its own."""
    settings = next(c for c in cfg.connectors if c.name == name)
    connector = instantiate(settings, Path("."))
    task = connector.task_configs(1)[0].with_services(postgres=cfg.postgres, protector=protector)
    runner = SinkRunner(connector, task, kafka=cfg.kafka,
                        daemon=DaemonConfig(group_prefix=cfg.daemon.group_prefix, batch_max_wait_ms=50,
                                            shutdown_grace_s=5))
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    try:
        yield runner
    finally:
        runner.stop()
        thread.join(60)


def _sealed(p: Protector, type_name: str, aid: str, version: int, payload: dict[str, Any]) -> Event:
    return Event.new(type_name, "customer", aid, version, p.seal("customer", type_name, aid, payload))


def _count(pg: PostgresConfig, query: str, *params: Any) -> int:
    with psycopg.connect(pg.url, autocommit=True) as conn:
        row = conn.execute(query, params).fetchone()
    return int(row[0]) if row else 0


@pytest.fixture(scope="module")
def world(kafka_config: KafkaConfig, pg_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    u = uuid.uuid4().hex[:8]
    prefix, table, hook = f"kt.privacy-at-rest.{u}", f"priv_{u}", f"hook-{u}"
    ann, bob = f"{u}-ann", f"{u}-bob"
    failing = {ann}

    async def behaviour(req: Req) -> tuple[int, dict[str, str]] | None:
        return (500, {}) if req.key in failing else None

    receiver = Receiver(behaviour)
    conf = tmp_path_factory.mktemp("privacy") / "kafold.toml"
    with ExitStack() as stack:
        mp = stack.enter_context(pytest.MonkeyPatch.context())
        mp.setenv(MASTER_VAR, base64.b64encode(os.urandom(32)).decode())  # the CLI's children inherit it
        conf.write_text(_toml(kafka_config, pg_url, prefix, table, hook, receiver.start()))
        stack.callback(receiver.stop)
        cfg = config.load_file(conf).config
        assert topics.ensure(kafka_config, config.topic_map(cfg).values()).ok
        db.upgrade(cfg.postgres)  # the key and erasure tables, before the first sealed write
        protector = protect.build(cfg)
        assert protector is not None
        altered = _sealed(protector, "EmailChanged", bob, 2, {"email": "bob.altered@example.com"})
        altered.payload["email"] = _with_key_id(altered.payload["email"], b"\x07" * 8)
        events = [
            _sealed(protector, "Registered", ann, 1, {"email": OLD_EMAIL, "zip": 1000}),
            _sealed(protector, "Moved", ann, 2, {"zip": STREET_ZIP}),  # PostgreSQL refuses it, quoting the value
            _sealed(protector, "EmailChanged", ann, 3, {"email": NEW_EMAIL}),  # held behind it
            _sealed(protector, "Registered", bob, 1, {"email": "bob@example.com", "zip": 2000}),
            altered,
        ]
        producer = Producer({"bootstrap.servers": kafka_config.bootstrap_servers})
        for e in events:
            key, value, headers = encode(e)
            producer.produce(f"{prefix}.events", value=value, key=key, headers=headers)
        assert producer.flush(30) == 0
        world = World(conf, cfg, cfg.postgres, kafka_config, table, hook, ann, bob, receiver, failing, events,
                      protector)
        with _running(cfg, table, protector) as projection, _running(cfg, hook, protector) as hooks:
            wait_for(lambda: projection.failed or _count(  # a fresh topic: the next offsets add up to its records
                world.pg, "SELECT coalesce(sum(next_offset), 0) FROM kafold.checkpoints WHERE connector = %s",
                table) == len(events), "the projection at the end of the topic", 60)
            assert not projection.failed, projection.error
            wait_for(lambda: hooks.failed or _count(
                world.pg, "SELECT count(*) FROM kafold.effect_parked WHERE connector = %s", hook) == 3,
                "ann's events parked", 60)
            assert not hooks.failed, hooks.error
        protector.ring.forget(ann, "test")
        yield world


def _dead(w: World) -> list[dict[str, Any]]:
    from psycopg.rows import dict_row

    with psycopg.connect(w.pg.url, autocommit=True, row_factory=dict_row) as conn:
        return list(conn.execute("SELECT * FROM kafold.dead_letters WHERE connector = %s ORDER BY reason",
                                 (w.table,)).fetchall())


def _clear_in(text: str | bytes) -> list[str]:
    data = text.encode() if isinstance(text, str) else text
    return [c for c in CLEAR if c.encode() in data]


def test_after_a_forget_no_dead_letter_parked_event_or_error_text_holds_a_clear_value(world: World) -> None:
    dead = _dead(world)
    for d in dead:
        assert _clear_in(orjson.dumps({k: (bytes(v).decode("latin-1") if isinstance(v, bytes | memoryview) else v)
                                       for k, v in d.items()}, default=str)) == []
    with psycopg.connect(world.pg.url, autocommit=True) as conn:
        parked = conn.execute("SELECT event::text, error FROM kafold.effect_parked WHERE connector = %s",
                              (world.hook,)).fetchall()
    assert len(parked) == 3 and _clear_in(repr(parked)) == []
    raw = raw_bytes(world.kafka, f"kafold.dlq.{world.table}", f"kafold.dlq.{world.hook}")
    assert _clear_in(raw) == [] and b"kfenc1:" in raw
    for d in dead:
        shown = kafold_cli("dlq", "show", str(d["id"]), "-c", str(world.conf), check=True, timeout=60)
        assert _clear_in(shown.stdout) == []
    shown = kafold_cli("effects", "show", world.events[0].event_id, "-c", str(world.conf), check=True, timeout=60)
    assert world.hook in shown.stdout and _clear_in(shown.stdout) == []
    assert [(d["reason"], d["status"]) for d in dead] == [("db-rejected", "new"), ("decrypt-failed", "new"),
                                                          ("held", "held")]
    assert "invalid input syntax for type integer" in dead[0]["error_message"]


def test_a_value_whose_key_id_was_altered_is_dead_lettered_decrypt_failed_not_read_as_forgotten(
        world: World) -> None:
    dead = {d["reason"]: d for d in _dead(world)}
    assert "decrypt-failed" in dead, sorted(dead)
    assert "altered" in dead["decrypt-failed"]["error_message"]
    with psycopg.connect(world.pg.url, autocommit=True) as conn:
        email = conn.execute(sql.SQL("SELECT email FROM public.{} WHERE customer_id = %s").format(
            sql.Identifier(world.table)), (world.bob,)).fetchone()
    assert email == ("bob@example.com",)  # not the placeholder: bob was not forgotten


def test_discard_applies_the_held_event_with_the_placeholder_and_replay_to_topic_republishes_it_sealed(
        world: World) -> None:
    head = next(d for d in _dead(world) if d["reason"] == "db-rejected")
    out = kafold_cli("dlq", "discard", str(head["id"]), "-c", str(world.conf), check=True, timeout=60)
    assert "applied" in out.stdout, out.stdout
    with psycopg.connect(world.pg.url, autocommit=True) as conn:
        email = conn.execute(sql.SQL("SELECT email FROM public.{} WHERE customer_id = %s").format(
            sql.Identifier(world.table)), (world.ann,)).fetchone()
    assert email == (PLACEHOLDER,)
    topic = world.cfg.aggregates[0].topic("events")
    before = len(raw_bytes(world.kafka, topic))
    kafold_cli("dlq", "replay", str(head["id"]), "--to", "topic", "-c", str(world.conf), check=True, timeout=60)
    republished = raw_bytes(world.kafka, topic)
    assert len(republished) > before and _clear_in(republished) == []


def test_a_parked_retry_after_a_forget_sends_the_placeholder(world: World) -> None:
    with _running(world.cfg, world.hook, world.protector):
        world.failing.clear()
        out = kafold_cli("effects", "parked", "retry", world.ann, "-c", str(world.conf), "--wait", "30",
                         timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr
    sent = [orjson.loads(r.body) for r in world.receiver.successes() if r.key == world.ann]
    assert sorted(b["version"] for b in sent) == [1, 2, 3]
    assert all(_clear_in(r.body) == [] for r in world.receiver.requests if r.key == world.ann and r.status == 200)
    assert {b["payload"].get("email") for b in sent if b["type"] != "Moved"} == {PLACEHOLDER}


# ---- /ready without the token ----------------------------------------------------------------------------------
# The aggregate of the /ready test (dict events, pure): a `zip` that is no number stops the fold, and the error's
# message quotes it (the opened value).
def initial() -> dict[str, Any]:
    return {}


def evolve(state: dict[str, Any], event: dict[str, Any]) -> dict[str, Any]:
    return {**state, "zip": int(event["zip"])}


def decide(command: dict[str, Any], state: dict[str, Any]) -> list[dict[str, Any]]:
    return []


def test_ready_without_the_token_shows_no_fold_error_message(
        kafka_config: KafkaConfig, pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    u = uuid.uuid4().hex[:8]
    prefix, token = f"kt.privacy-ready.{u}", f"token-{u}"
    monkeypatch.setenv(MASTER_VAR, base64.b64encode(os.urandom(32)).decode())
    monkeypatch.setenv("KAFOLD_TEST_PRIVACY_TOKEN", token)
    conf = tmp_path / "kafold.toml"
    conf.write_text(f"""
{kafka_toml(kafka_config)}
[daemon]
group_prefix = "{prefix}"
http_port = {free_port()}
api_token_env = "KAFOLD_TEST_PRIVACY_TOKEN"
python_path = ["{ROOT}"]

[postgres]
url = "{pg_url}"

[privacy]
master_key_env = "{MASTER_VAR}"

[[aggregates]]
name = "customer"
initial = "{__name__}:initial"
evolve = "{__name__}:evolve"
decide = "{__name__}:decide"
partitions = 1
events_topic = "{prefix}.events"
commands_topic = "{prefix}.commands"
results_topic = "{prefix}.results"
snapshot_topic = "{prefix}.snapshots"

[[aggregates.protect]]
type = "Moved"
fields = ["zip"]
""")
    cfg = config.load_file(conf).config
    assert topics.ensure(kafka_config, config.topic_map(cfg).values()).ok
    db.upgrade(cfg.postgres)
    protector = protect.build(cfg)
    assert protector is not None
    key, value, headers = encode(_sealed(protector, "Moved", f"{u}-ann", 1, {"zip": STREET_ZIP}))
    producer = Producer({"bootstrap.servers": kafka_config.bootstrap_servers})
    producer.produce(f"{prefix}.events", value=value, key=key, headers=headers)
    assert producer.flush(30) == 0
    with daemon_in_process(conf, token) as d:
        wait_for(lambda: "cannot fold the event" in orjson.dumps(d.get("/status")[1]).decode(),
                 "the fold error on /status (behind the token)", 60)
        # even there the error quotes no opened value: evolve's message is redacted for a protected aggregate
        assert STREET_ZIP not in orjson.dumps(d.get("/status")[1]).decode()
        status, body = d.get("/ready", token=None)
    assert status == 503 and body["not_ready"] == [{"aggregate": "customer", "reason": "fold error",
                                                    "partitions": [0]}]
    assert STREET_ZIP not in orjson.dumps(body).decode()
