"""Units: the text helpers behind always-writable dead letters and escaped terminal output."""

from __future__ import annotations

import re

import pytest

from kafold.connectors.dlq import headers_json, pg_text, stored_headers
from kafold.connectors.effects.ledger import parked_body, parked_json
from kafold.envelope import Event, body_json
from kafold.terminal import visible

CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def test_visible_escapes_every_control_character_and_keeps_the_rest() -> None:
    every = "".join(map(chr, range(0x00, 0xa0))) + "é€\u202e\u2028\ud800"
    shown = visible(every)
    assert not CONTROL.findall(shown) and "\n" not in shown and "\t" not in shown
    assert visible("\x1b]0;title\x07\x1b[2J") == "\\x1b]0;title\\x07\\x1b[2J"
    assert visible("\x9b\x7f\u202e\ud800") == "\\x9b\\x7f\\u202e\\ud800"
    assert visible("plain text, é €") == "plain text, é €"
    assert visible("a\nb\tc\x00", lines=True) == "a\nb\tc\\x00"
    assert visible(42) == "42"


def test_pg_text_is_encodable_and_free_of_nul_and_unchanged_otherwise() -> None:
    assert pg_text("Nope\x00x") == "Nope\\x00x"
    assert pg_text("A\ud800B") == "A\\ud800B"
    assert pg_text("ordinary é") == "ordinary é"
    for text in ("\x00", "\ud800\udfff", "x\x00\ud800"):
        out = pg_text(text)
        assert "\x00" not in out
        out.encode("utf-8")  # psycopg can send it


@pytest.mark.parametrize("headers", [
    [("kafold-type", b"Nope\x00x"), ("x-binary", b"\xff\x00\xfe"), ("x-empty", None), ("x-text", b"ok")],
    [("bad\x00name", b"v"), ("surrogate\udcff", b"\xed\xa0\x80"), ("x", b"")],
])
def test_headers_round_trip_through_json_that_jsonb_accepts(headers: list[tuple[str, bytes | None]]) -> None:
    stored = headers_json(headers)
    text = repr(stored)
    assert "\x00" not in text and "\\x00" not in text  # no NUL reaches jsonb, in a name or a value
    assert stored_headers(stored) == headers


def test_stored_headers_leave_out_kafolds_own() -> None:
    assert stored_headers(headers_json([("kafold-dlq-reason", b"x"), ("a", b"b")])) == [("a", b"b")]


def test_a_parked_event_with_a_nul_is_stored_as_base64_and_read_back_exactly() -> None:
    event = Event.new("Nope\x00x", "thing", "k\x00", 1, {"note": "a\x00b", "nested": ["\x00"]})
    stored = parked_json(event)
    assert "\\u0000" not in stored and stored.startswith('{"base64"')
    assert parked_body(stored) == body_json(event)
    plain = Event.new("Fine", "thing", "k", 1, {"note": "ok"})
    assert parked_json(plain) == body_json(plain).decode() and parked_body(parked_json(plain)) == body_json(plain)


def test_kafold_status_tables_show_a_state_quoting_a_record_escaped() -> None:
    from kafold.tools.commands import status

    row = {"connector": "c", "task": 0, "topic": "t", "partition": 0, "committed": 1, "end_offset": 2, "lag": 1,
           "lag_seconds": None, "state": "failed: key \x1b]0;title\x07\x1b[2J"}
    out = status.table([row])
    assert not CONTROL.findall(out) and "\\x1b]0;title\\x07\\x1b[2J" in out
