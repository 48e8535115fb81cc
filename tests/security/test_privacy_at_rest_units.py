"""Personal data never at rest in clear, the parts checked in process (issue 51): what kafold keeps of an event the
intake opened (a dead letter, a parked effect, a `kafka` effect's derived event) holds the sealed value, an altered
key id is `decrypt-failed`, /ready shows no error message, and the commands that read protected events take
PostgreSQL from the dev stack like Kafka. End to end on Apache Kafka: test_privacy_at_rest.py."""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import os
from pathlib import Path
from typing import Any

import orjson
import pytest

from kafold import config, devstack, protect
from kafold.connectors.api import RawRecord, SinkRecord
from kafold.connectors.effects import ledger
from kafold.connectors.effects.drivers import KafkaEffect
from kafold.connectors.effects.settings import KafkaEffectConfig
from kafold.connectors.intake import Intake
from kafold.daemon.http import Ready
from kafold.envelope import Event, decode, encode
from kafold.errors import RecordError
from kafold.protect import PREFIX, Cipher, DecryptError, Forgotten, KeyRing, MemoryKeyStore, Protector, Rule

MASTER = os.urandom(32)
RULES = {("customer", "Registered"): Rule((("email",),), "aggregate_id")}
EMAIL = "ann.secret@example.com"
PLACEHOLDER = "[erased]"


@pytest.fixture
def protector(monkeypatch: pytest.MonkeyPatch) -> Protector:
    """The process's Protector (what `protect.active()` gives the intake, the ledger and the effects)."""
    p = Protector(RULES, KeyRing(Cipher(MASTER), MemoryKeyStore()), placeholder=PLACEHOLDER)
    monkeypatch.setitem(protect._ACTIVE, "default", p)
    return p


class Msg:
    """A consumed record as confluent-kafka hands it over."""

    def __init__(self, key: bytes | None, value: bytes | None, headers: Any) -> None:
        self._key, self._value, self._headers = key, value, headers

    def key(self) -> bytes | None:
        return self._key

    def value(self) -> bytes | None:
        return self._value

    def headers(self) -> Any:
        return self._headers

    def topic(self) -> str:
        return "customer.events"

    def partition(self) -> int:
        return 0

    def offset(self) -> int:
        return 7

    def timestamp(self) -> tuple[int, int]:
        return (1, 1_700_000_000_000)


def _registered(p: Protector, aid: str = "c-1") -> Event:
    return Event.new("Registered", "customer", aid, 1, p.seal("customer", "Registered", aid, {"email": EMAIL}))


def _with_key_id(token: str, key_id: bytes) -> str:
    blob = binascii.a2b_base64(token[len(PREFIX):].replace("-", "+").replace("_", "/"))
    return PREFIX + base64.urlsafe_b64encode(key_id + blob[len(key_id):]).decode()


# ---- an altered key id ----------------------------------------------------------------------------------------
def test_a_value_whose_key_id_was_altered_is_decrypt_failed_not_forgotten(protector: Protector) -> None:
    event = _registered(protector)
    event.payload["email"] = _with_key_id(event.payload["email"], b"\x01" * 8)
    with pytest.raises(RecordError) as e:
        protector.event(decode(*encode(event)), raw="the record")
    assert e.value.reason == "decrypt-failed" and "key id" in str(e.value)


def test_a_snapshot_state_whose_key_id_was_altered_is_a_decrypt_error_not_forgotten(protector: Protector) -> None:
    sealed = protector.seal_state("customer", "c-1", {"email": EMAIL})
    with pytest.raises(DecryptError):
        protector.open_state("customer", "c-1", _with_key_id(sealed, b"\x02" * 8))
    protector.ring.forget("c-1", "dpo")
    with pytest.raises(Forgotten):  # forgotten for real: no key to open it with
        protector.open_state("customer", "c-1", _with_key_id(sealed, b"\x02" * 8))


# ---- dead letters -----------------------------------------------------------------------------------------------
def test_a_dead_letter_of_an_opened_event_is_the_record_as_it_came_sealed(protector: Protector) -> None:
    key, value, headers = encode(_registered(protector))
    m = Msg(key, value, headers)
    record = Intake("customers", lambda _t: True, "dead-letter").record(m, m.topic(), 0, 7)
    assert record is not None and record.event.payload["email"] == EMAIL  # the task sees it opened
    raw = RawRecord.of(record)
    assert (raw.key, raw.value, raw.offset) == (key, value, 7)
    assert EMAIL.encode() not in (raw.value or b"")


def test_a_dead_letter_of_a_record_made_without_its_source_is_sealed_again(protector: Protector) -> None:
    opened = Event.new("Registered", "customer", "c-1", 1, {"email": EMAIL})
    raw = RawRecord.of(SinkRecord("customer.events", 0, 3, "c-1", opened))
    assert EMAIL.encode() not in (raw.value or b"")
    assert protector.event(decode(raw.key, raw.value, list(raw.headers))).payload["email"] == EMAIL


# ---- parked effects and the kafka effect -------------------------------------------------------------------------
def test_a_parked_event_is_stored_sealed_and_reads_as_the_placeholder_after_a_forget(protector: Protector) -> None:
    opened = protector.event(_registered(protector))
    assert opened.payload["email"] == EMAIL
    stored = ledger.parked_json(opened)
    assert EMAIL not in stored
    assert ledger.parked_event(ledger.parked_body(stored)).payload["email"] == EMAIL
    protector.ring.forget("c-1", "dpo")
    assert ledger.parked_event(ledger.parked_body(stored)).payload["email"] == PLACEHOLDER


def test_the_kafka_effect_writes_the_protected_fields_of_what_it_derives_sealed(protector: Protector) -> None:
    written: list[bytes] = []

    class Producer:
        def produce(self, topic: str, value: bytes, key: bytes, headers: Any, on_delivery: Any) -> None:
            written.append(value)
            on_delivery(None, None)

    effect = KafkaEffect(KafkaEffectConfig(topic="customer.copies"), config.KafkaConfig(bootstrap_servers="x:1"),
                         "copy")
    effect.producer = Producer()  # type: ignore[assignment]
    asyncio.run(effect.run(protector.event(_registered(protector))))
    assert len(written) == 1 and EMAIL.encode() not in written[0]
    copy = orjson.loads(written[0])
    assert copy["payload"]["email"].startswith(PREFIX)
    assert protector.unseal("customer", "Registered", "c-1", copy["payload"])["email"] == EMAIL


# ---- /ready --------------------------------------------------------------------------------------------------------
def test_ready_shows_why_a_part_is_not_ready_but_no_error_message() -> None:
    class Host:
        def ready_report(self) -> tuple[bool, dict[str, Any]]:
            return False, {"ready": False, "tasks": 1, "aggregates": 1, "not_ready": [
                {"aggregate": "customer", "reason": "fold error",
                 "partitions": [{"partition": 0, "fold_error": f"KeyError: {EMAIL}"}]},
                {"connector": "hook", "task": 0, "state": "RUNNING", "reason": "catching up",
                 "partitions": [{"topic": "customer.events", "partition": 1, "position": 4, "lag": 2}]}]}

    view = object.__new__(Ready)
    view.host = Host()  # type: ignore[assignment]
    view.json = lambda body, status: (body, status)  # type: ignore[method-assign,assignment]
    body, status = asyncio.run(view.get(None))  # type: ignore[arg-type]
    assert status == 503 and EMAIL not in orjson.dumps(body).decode()
    assert body["not_ready"] == [{"aggregate": "customer", "reason": "fold error", "partitions": [0]},
                                 {"connector": "hook", "task": 0, "state": "RUNNING", "reason": "catching up",
                                  "partitions": [1]}]


# ---- commands on the dev stack ---------------------------------------------------------------------------------------
PROTECTED_TOML = """
[privacy]
master_key_env = "KAFOLD_UNUSED_MASTER"

[[aggregates]]
name = "customer"
initial = "tests.aggregates.test_protect_daemon:initial"
evolve = "tests.aggregates.test_protect_daemon:evolve"
decide = "tests.aggregates.test_protect_daemon:decide"

[[aggregates.protect]]
type = "Registered"
fields = ["email"]
"""


class _Stop(Exception):
    pass


@pytest.mark.parametrize("command", ["state get", "snapshot run", "snapshot verify"])
def test_a_command_reading_protected_events_takes_postgresql_from_the_dev_stack(
        command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kafold.tools.commands import aggregate, snapshot

    conf = tmp_path / "kafold.toml"
    conf.write_text(PROTECTED_TOML)
    monkeypatch.setenv("KAFOLD_UNUSED_MASTER", base64.b64encode(MASTER).decode())
    stack = devstack.DevStack(tmp_path, "127.0.0.1:19092", "postgresql://kafold@127.0.0.1:15432/kafold", (),
                              None)  # type: ignore[arg-type]
    monkeypatch.setattr(devstack, "status", lambda _state_dir=None: stack)
    seen: list[config.KafoldConfig] = []

    def build(cfg: config.KafoldConfig, store: Any = None) -> None:
        seen.append(cfg)
        raise _Stop()  # what the command does with the keys is not this test's

    monkeypatch.setattr(protect, "build", build)
    args = argparse.Namespace(config=str(conf), aggregate="customer", id="c-1", url=None, master=None, sample=None,
                              version=None)
    handler = {"state get": aggregate.get_state, "snapshot run": snapshot.handle_run,
               "snapshot verify": snapshot.handle_verify}[command]
    with pytest.raises(_Stop):
        handler(args)
    assert seen[0].kafka.bootstrap_servers == stack.bootstrap_servers
    assert seen[0].postgres.url == stack.postgres_url
