"""Integration: records whose bytes PostgreSQL's text cannot hold (NUL in a type, key, header or text field; invalid
UTF-8) among valid events, through a running daemon: the daemon keeps running, the valid events are projected, every
such record is a dead letter holding its original key, value and headers, and `kafold dlq list|show` print them with
no control character reaching the terminal."""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest

from kafold import db
from kafold.config import KafkaConfig, PostgresConfig
from kafold.connectors.dlq import stored_headers
from kafold.envelope import Event, Headers, encode
from tests.projection.projection_support import encoded, ends_of, fold, history, read_table, stored_offsets
from tests.security.hostile_corpus import produce_raw
from tests.support import ROOT, create_topic, kafka_toml, wait_for
from tests.support.daemons import daemon_thread

TERMINAL_ATTACK = "\x1b]0;title\x07\x1b[2J"
# Anything a terminal acts on: C0 controls but newline and tab, DEL, C1 controls.
CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


@dataclass(frozen=True)
class Case:
    name: str
    key: bytes | None
    value: bytes | None
    headers: Headers
    reason: str


def _retyped(event: Event, type_: str, *extra: tuple[str, bytes | None]) -> tuple[bytes | None, bytes | None, Headers]:
    """`event` with its type replaced in the body and in the kafold-type header (as a producer would write it)."""
    key, value, headers = encode(event)
    body = orjson.loads(value)
    body["type"] = type_
    return key, orjson.dumps(body), [(n, type_.encode() if n == "kafold-type" else v) for n, v in headers] + [*extra]


def cases() -> list[Case]:
    nul_owner = Event.new("AccountOpened", "account", "acc-953", 1, {"owner": "ada\u0000lovelace"})
    nul_key = Event.new("AccountOpened", "account", "acc-954\u0000", 1, {"owner": "ada"})
    attack = Event.new("Mystery", "account", TERMINAL_ATTACK, 1, {"note": TERMINAL_ATTACK})
    return [
        Case("nul-in-type", *_retyped(Event.new("X", "account", "acc-950", 1, {}), "Nope\u0000x"), "unknown-type"),
        Case("nul-in-type-and-headers", *_retyped(
            Event.new("X", "account", "acc-951", 1, {"n": "\u0000"}), "Nope\u0000y",
            ("x-trace", b"a\x00b"), ("x-binary", b"\xff\x00\xfe"), ("x-empty", None)), "unknown-type"),
        Case("nul-in-text-column", *encode(nul_owner), "db-rejected"),
        Case("nul-in-row-key", *encode(nul_key), "db-rejected"),
        Case("surrogate-in-type", *_surrogate(), "bad-json"),
        Case("invalid-utf8-type-header", *_retyped(Event.new("X", "account", "acc-956", 1, {}), "Nope\u0000z",
                                                   ("x-raw", b"\xc3\x28")), "unknown-type"),
        Case("terminal-attack", *_retyped(attack, "Mystery", ("x-esc", TERMINAL_ATTACK.encode())), "unknown-type"),
    ]


def _surrogate() -> tuple[bytes | None, bytes | None, Headers]:
    """A lone surrogate escaped in the JSON body's type, and its (invalid) UTF-8 form in the kafold-type header."""
    key, value, headers = encode(Event.new("Lone", "account", "acc-955", 1, {}))
    return (key, value.replace(b'"Lone"', b'"\\ud800"'),
            [(n, b"\xed\xa0\x80" if n == "kafold-type" else v) for n, v in headers])


def write_config(path: Path, kafka: KafkaConfig, pg: PostgresConfig, name: str, topic: str, table: str) -> Path:
    path.write_text(f"""
{kafka_toml(kafka)}
[postgres]
url = "{pg.url}"

[daemon]
group_prefix = "{name}"
http_port = 0
shutdown_grace_s = 4.0
batch_max_records = 20
batch_max_wait_ms = 100
python_path = ["{ROOT}"]

[[connectors]]
name = "{name}"
class = "postgres-projection"
topics = ["{topic}"]
on_unknown_type = "dead-letter"
[connectors.config]
table = "{table}"
key_columns = ["account_id"]
columns = {{account_id = "text", owner = "text", balance = "bigint", last_amount = "bigint", status = "text"}}
[[connectors.config.on]]
type = "AccountOpened"
set = {{owner = "payload.owner", status = "'open'", balance = 0}}
[[connectors.config.on]]
type = "MoneyDeposited"
action = "update"
increment = {{balance = "payload.amount"}}
set = {{last_amount = "payload.amount"}}
[[connectors.config.on]]
type = "AccountClosed"
action = "delete"
""")
    return path


@dataclass
class Scenario:
    """The module's run, done once: what went in and where each record ended."""

    name: str
    topic: str
    table: str
    config: Path
    good: list[Event]
    cases: list[Case]
    coords: dict[str, tuple[int, int]]


@pytest.fixture(scope="module")
def outcome(kafka_config: KafkaConfig, pg_config: PostgresConfig, tmp_path_factory: pytest.TempPathFactory
            ) -> Scenario:
    name = f"kt.untranslatable.{uuid.uuid4().hex[:8]}"
    topic, table = f"{name}.events", f"acc_{uuid.uuid4().hex[:10]}"
    create_topic(kafka_config, topic, partitions=2)
    create_topic(kafka_config, f"kafold.dlq.{name}")
    good = history(accounts=6, deposits=3)
    half = len(good) // 2
    hostile = cases()
    # Every hostile record sits in partition 0, between valid events of both partitions.
    items = [*encoded(good[:half], 2), *[(0, c.key, c.value, c.headers) for c in hostile], *encoded(good[half:], 2)]
    coords = produce_raw(kafka_config, topic, items)
    path = write_config(tmp_path_factory.mktemp("untranslatable") / "kafold.toml", kafka_config, pg_config, name,
                        topic, table)
    with daemon_thread(path) as (_, thread):
        ends = ends_of(coords)

        def done() -> bool:
            assert thread.is_alive(), "the daemon exited"
            try:
                return stored_offsets(pg_config, name, topic) == ends
            except Exception:  # the daemon has not migrated yet
                return False

        wait_for(done, f"stored offsets {ends}", 120)
        assert thread.is_alive(), "the daemon exited"
    return Scenario(name, topic, table, path, good, hostile,
                   dict(zip((c.name for c in hostile), coords[half:half + len(hostile)], strict=True)))


def _dead(pg: PostgresConfig, name: str) -> dict[tuple[int, int], dict[str, Any]]:
    from psycopg.rows import dict_row

    with db.connect(pg, row_factory=dict_row) as conn:
        rows = conn.execute('SELECT * FROM kafold.dead_letters WHERE connector = %s', (name,)).fetchall()
    return {(r["partition"], r["offset"]): r for r in rows}


def test_the_valid_events_around_them_are_projected(outcome: Scenario, pg_config: PostgresConfig) -> None:
    assert read_table(pg_config, outcome.table) == fold(outcome.good)


def test_each_record_is_a_dead_letter_holding_its_original_bytes(outcome: Scenario, pg_config: PostgresConfig
                                                                 ) -> None:
    dead = _dead(pg_config, outcome.name)
    assert len(dead) == len(outcome.cases)
    for case in outcome.cases:
        row = dead[outcome.coords[case.name]]
        assert (case.name, row["reason"]) == (case.name, case.reason)
        assert row["key"] == case.key and row["value"] == case.value, case.name
        assert stored_headers(row["headers"]) == [(n, v.encode() if isinstance(v, str) else v)
                                                  for n, v in case.headers], case.name
        for column in ("error_message", "error_class", "reason"):
            assert "\x00" not in row[column]


def test_a_nul_bound_for_a_text_column_is_refused_with_a_clear_reason(outcome: Scenario,
                                                                      pg_config: PostgresConfig) -> None:
    dead = _dead(pg_config, outcome.name)
    for name in ("nul-in-text-column", "nul-in-row-key"):
        message = dead[outcome.coords[name]]["error_message"]
        assert "NUL" in message, message


def _main(*argv: str) -> int:
    from kafold.tools import cli

    args = cli.build_parser().parse_args(list(argv))  # cli.main without its logging set-up (pytest owns stderr)
    return int(args.handler(args))


def test_dlq_list_shows_them_with_no_control_character(outcome: Scenario, capsys: pytest.CaptureFixture[str]) -> None:
    assert _main("dlq", "list", "-c", str(outcome.config), "--connector", outcome.name) == 0
    out = capsys.readouterr().out
    assert f"{len(outcome.cases)} dead letter(s)" in out
    assert not CONTROL.findall(out), CONTROL.findall(out)


def test_dlq_show_prints_each_with_its_control_characters_escaped(
        outcome: Scenario, pg_config: PostgresConfig, capsys: pytest.CaptureFixture[str]) -> None:
    dead = _dead(pg_config, outcome.name)
    for case in outcome.cases:
        row = dead[outcome.coords[case.name]]
        assert _main("dlq", "show", "-c", str(outcome.config), str(row["id"])) == 0
        out = capsys.readouterr().out
        assert not CONTROL.findall(out), (case.name, CONTROL.findall(out))
        if case.name == "terminal-attack":
            assert "\\x1b]0;title\\x07\\x1b[2J" in out
        if case.name == "nul-in-type":
            assert "Nope\\x00x" in out
