"""Integration: an effect connector given events whose id, type, key, payload and error text PostgreSQL's text and
jsonb cannot hold (NUL) keeps delivering the other keys and commits to the end; such a key parks in order and,
released, re-runs its events exactly as they were; `kafold effects` prints them with no control character."""

from __future__ import annotations

import re
import uuid
from pathlib import Path

import orjson
import pytest

from kafold import db
from kafold.config import KafkaConfig, PostgresConfig
from kafold.connectors.dlq import pg_text
from kafold.connectors.effects import ops
from kafold.envelope import Event, Headers, encode
from tests.effects.effects_support import start_effects
from tests.security import nul_effect
from tests.support import committed, create_topic, make_event, produce, wait_for

ATTACK = "\x1b]0;title\x07\x1b[2J"
CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")
KEY = "k\u0000" + ATTACK


def _hostile(version: int, **payload: object) -> tuple[bytes | None, bytes | None, Headers]:
    """An event of KEY whose id and type hold a NUL (body and routing headers alike)."""
    key, value, headers = encode(Event.new("X", "thing", KEY, version, dict(payload)))
    body = orjson.loads(value)
    body.update(type="Nope\u0000x", event_id=f"id\u0000{version}-{uuid.uuid4().hex[:6]}")
    fixed = {"kafold-type": body["type"].encode(), "kafold-id": body["event_id"].encode()}
    return key, orjson.dumps(body), [(n, fixed.get(n, v)) for n, v in headers]


@pytest.fixture
def pg(pg_url: str) -> PostgresConfig:
    pgc = PostgresConfig(url=pg_url, schema=f"kt_untr_{uuid.uuid4().hex[:8]}")
    db.upgrade(pgc)
    return pgc


def test_nul_in_id_type_key_payload_and_error_parks_in_order_and_releases_exactly(
        kafka_config: KafkaConfig, pg: PostgresConfig, unique: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    topic = f"{unique}.events"
    create_topic(kafka_config, topic, 1)
    create_topic(kafka_config, f"kafold.dlq.{unique}", 1)
    nul_effect.RAN.clear()
    nul_effect.FAILING["on"] = True
    hostile = [_hostile(1, note="a\u0000b"), _hostile(2, fail=True, note="x\u0000" + ATTACK),
               _hostile(3, note="\u0000")]
    good = [make_event(f"good-{i}", 1) for i in range(4)]
    items = [(0, *encode(good[0])), *[(0, *h) for h in hostile], *[(0, *encode(e)) for e in good[1:]]]
    coords = produce(kafka_config, topic, items)
    settings = {"function": "tests.security.nul_effect:run", "request_poll_s": 0.2}
    run = start_effects(kafka_config, pg, unique, topic, "python", settings)
    try:
        # The ledger takes every row (else its writer retries for ever and no offset moves): the end is committed.
        wait_for(lambda: committed(kafka_config, run.runner.group_id, topic, 1) == {0: coords[-1][1] + 1},
                 "the commit past the parked key")
        assert not run.runner.failed, run.runner.error
    finally:
        run.finish()
    assert {e.event_id for e in good} <= {e.event_id for e in nul_effect.RAN}
    stored_key = pg_text(KEY)
    (parked,) = ops.parked(pg, unique)
    assert parked["key"] == stored_key and parked["events"] == 2 and "refused" in parked["error"]
    assert "\x00" not in parked["error"] and "\x00" not in parked["head_event_id"]
    first = orjson.loads(hostile[0][1] or b"")
    assert ops.show(pg, pg_text(first["event_id"]))[0]["status"] == "succeeded"

    conf = tmp_path / "kafold.toml"
    conf.write_text(f'[kafka]\nbootstrap_servers = "{kafka_config.bootstrap_servers}"\n'
                    f'[postgres]\nurl = "{pg.url}"\nschema = "{pg.schema}"\n')
    capsys.readouterr()  # the runner's log lines
    assert _main("effects", "parked", "list", "-c", str(conf)) == 0
    assert _main("effects", "show", "-c", str(conf), parked["head_event_id"]) == 0
    out = capsys.readouterr().out
    assert not CONTROL.findall(out), CONTROL.findall(out)
    assert "\\x1b]0;title\\x07\\x1b[2J" in out and "\\x00" in out

    # The cause is fixed; a restarted task finds the key parked and, asked, runs its events again as they were.
    nul_effect.FAILING["on"] = False
    run = start_effects(kafka_config, pg, unique, topic, "python", settings)
    try:
        assert ops.request(pg, stored_key, "retry", unique) == unique
        assert ops.wait(pg, unique, stored_key, 60) is ops.WaitOutcome.RELEASED
    finally:
        run.finish()
    mine = [e for e in nul_effect.RAN if e.aggregate_id == KEY]
    assert [orjson.loads(h[1] or b"") for h in hostile] == [orjson.loads(_body(e)) for e in mine]


def _body(event: Event) -> bytes:
    return encode(event)[1] or b""


def _main(*argv: str) -> int:
    from kafold.tools import cli

    args = cli.build_parser().parse_args(list(argv))  # cli.main without its logging set-up (pytest owns stderr)
    return int(args.handler(args))
