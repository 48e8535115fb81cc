"""The event envelope: encode/decode round-trips, and every defect is a DecodeError naming the field."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kafold.envelope import (
    MAX_BYTES,
    Event,
    decode,
    derive_event_id,
    encode,
    encode_new,
    peek_headers,
)
from kafold.errors import DecodeError, FatalError

ids = st.text(min_size=1, max_size=40)
json_scalars = st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.text() | st.floats(
    allow_nan=False, allow_infinity=False)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
    st.text(max_size=8), inner, max_size=4), max_leaves=20)
moments = st.datetimes(min_value=datetime(1970, 1, 1), max_value=datetime(9999, 1, 1), timezones=st.just(UTC))

events = st.builds(
    Event, event_id=ids, type=ids, aggregate_type=ids, aggregate_id=ids, version=st.integers(1, 2**40),
    occurred_at=moments.map(lambda d: d.isoformat().replace("+00:00", "Z")), correlation_id=ids,
    payload=st.dictionaries(st.text(max_size=10), json_values, max_size=6), schema_version=st.integers(1, 9),
    causation_id=st.none() | ids)


@given(events)
def test_encode_then_decode_returns_an_equal_event(event: Event) -> None:
    key, value, headers = encode(event)
    assert decode(key, value, headers) == event
    assert peek_headers(headers) == (event.type, event.event_id, event.version)


def sample() -> Event:
    return Event.new("MoneyDeposited", "account", "acc-1", 3, {"amount": 5}, event_id="e-1",
                     occurred_at=datetime(2024, 5, 1, 12, tzinfo=UTC))


def good() -> tuple[bytes, bytes, list[tuple[str, bytes]]]:
    return encode(sample())


def body_with(**changes: Any) -> bytes:
    body = orjson.loads(good()[1])
    for k, v in changes.items():
        if v is dataclasses.MISSING:
            del body[k]
        else:
            body[k] = v
    return orjson.dumps(body)


def headers_with(name: str, value: bytes | None, drop: bool = False) -> list[tuple[str, bytes | None]]:
    out: list[tuple[str, bytes | None]] = [(k, v) for k, v in good()[2] if k != name]
    return out if drop else [*out, (name, value)]


def test_the_envelope_has_the_documented_key_headers_and_body() -> None:
    key, value, headers = good()
    assert key == b"acc-1"
    assert headers == [("kafold-type", b"MoneyDeposited"), ("kafold-id", b"e-1"), ("kafold-version", b"3"),
                       ("kafold-aggregate", b"account")]
    assert orjson.loads(value) == {
        "event_id": "e-1", "type": "MoneyDeposited", "aggregate_type": "account", "aggregate_id": "acc-1",
        "version": 3, "schema_version": 1, "occurred_at": "2024-05-01T12:00:00.000000Z",
        "correlation_id": "e-1", "causation_id": None, "payload": {"amount": 5}}


def test_derived_event_ids_are_deterministic_and_distinct_per_index() -> None:
    assert derive_event_id("cmd-1", 0) == derive_event_id("cmd-1", 0)
    assert len({derive_event_id("cmd-1", 0), derive_event_id("cmd-1", 1), derive_event_id("cmd-2", 0)}) == 3


BAD_DEEP = orjson.loads(body_with())
BAD_DEEP["payload"] = {"a": orjson.loads(b"[" * 40 + b"1" + b"]" * 40)}

CASES: dict[str, tuple[Any, Any, Any, str, str]] = {
    # name: (key, value, headers, field named in the message, reason)
    "tombstone": (b"acc-1", None, good()[2], "value", "missing-field"),
    "over-size": (b"acc-1", b" " * 1_000_001, good()[2], "value", "too-large"),
    "not json": (b"acc-1", b"{nope", good()[2], "value", "bad-json"),
    "bad utf-8 in value": (b"acc-1", b'{"a": "\xff"}', good()[2], "value", "bad-utf8"),
    "not an object": (b"acc-1", b"[1]", good()[2], "value", "wrong-type"),
    "unknown field": (b"acc-1", body_with(extra=1), good()[2], "extra", "unknown-field"),
    "missing field": (b"acc-1", body_with(version=dataclasses.MISSING), good()[2], "version",
                      "missing-field"),
    "version is a string": (b"acc-1", body_with(version="3"), good()[2], "version", "wrong-type"),
    "version is a bool": (b"acc-1", body_with(version=True), good()[2], "version", "wrong-type"),
    "version is zero": (b"acc-1", body_with(version=0), good()[2], "version", "wrong-type"),
    "empty type": (b"acc-1", body_with(type=""), good()[2], "type", "wrong-type"),
    "payload is a list": (b"acc-1", body_with(payload=[1]), good()[2], "payload", "wrong-type"),
    "time not UTC": (b"acc-1", body_with(occurred_at="2024-05-01T12:00:00+02:00"), good()[2], "occurred_at",
                     "wrong-type"),
    "time not a time": (b"acc-1", body_with(occurred_at="yesterdayZ"), good()[2], "occurred_at",
                        "wrong-type"),
    "causation not a string": (b"acc-1", body_with(causation_id=5), good()[2], "causation_id", "wrong-type"),
    "too deep": (b"acc-1", orjson.dumps(BAD_DEEP), good()[2], "payload", "too-deep"),
    "integer beyond 64 bits": (b"acc-1", good()[1].replace(b'"payload":{', b'"payload":{"n":18446744073709551616,'),
                               good()[2], "payload.n", "int-range"),
    "negative integer beyond 64 bits, nested": (
        b"acc-1", good()[1].replace(b'"payload":{', b'"payload":{"l":[0,{"n":-9223372036854775809}],'),
        good()[2], "payload.l[1].n", "int-range"),
    "no key": (None, good()[1], good()[2], "key", "missing-field"),
    "key not utf-8": (b"\xff", good()[1], good()[2], "key", "bad-utf8"),
    "key is another aggregate": (b"acc-2", good()[1], good()[2], "key", "header-mismatch"),
    "type header missing": (b"acc-1", good()[1], headers_with("kafold-type", None, drop=True),
                            "header kafold-type", "missing-header"),
    "type header differs": (b"acc-1", good()[1], headers_with("kafold-type", b"Other"), "header kafold-type",
                            "header-mismatch"),
    "id header differs": (b"acc-1", good()[1], headers_with("kafold-id", b"e-2"), "header kafold-id",
                          "header-mismatch"),
    "version header differs": (b"acc-1", good()[1], headers_with("kafold-version", b"4"),
                               "header kafold-version", "header-mismatch"),
    "version header not a number": (b"acc-1", good()[1], headers_with("kafold-version", b"x"),
                                    "header kafold-version", "wrong-type"),
    "aggregate header differs": (b"acc-1", good()[1], headers_with("kafold-aggregate", b"loan"),
                                 "header kafold-aggregate", "header-mismatch"),
    "header not utf-8": (b"acc-1", good()[1], headers_with("kafold-type", b"\xff"), "header kafold-type",
                         "bad-utf8"),
    "header twice": (b"acc-1", good()[1], [*good()[2], ("kafold-id", b"e-1")], "header kafold-id",
                     "header-mismatch"),
    "no headers": (b"acc-1", good()[1], None, "header kafold-type", "missing-header"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_defect_raises_decode_error_naming_the_field_and_carrying_the_raw_record(case: str) -> None:
    key, value, headers, field, reason = CASES[case]
    raw = object()
    with pytest.raises(DecodeError) as info:
        decode(key, value, headers, raw=raw)
    assert f": {field}: " in str(info.value)
    assert info.value.raw is raw
    assert info.value.reason == reason


def test_decode_error_messages_never_carry_payload_values() -> None:
    with pytest.raises(DecodeError) as info:
        decode(b"acc-1", body_with(payload={"card": "4111-SECRET"}, version="x"), good()[2])
    assert "SECRET" not in str(info.value)


def test_limits_are_adjustable() -> None:
    key, value, headers = good()
    with pytest.raises(DecodeError, match="exceeds the 10-byte limit"):
        decode(key, value, headers, max_bytes=10)
    assert decode(key, orjson.dumps(BAD_DEEP), headers, max_depth=64).payload == BAD_DEEP["payload"]


def test_encode_refuses_what_decode_would_refuse() -> None:
    with pytest.raises(FatalError, match="deeper"):
        encode(dataclasses.replace(sample(), payload=BAD_DEEP["payload"]))
    with pytest.raises(FatalError, match="JSON"):
        encode(dataclasses.replace(sample(), payload={"n": 2**70}))


def test_events_validate_their_fields_on_construction() -> None:
    with pytest.raises(ValueError, match="version"):
        dataclasses.replace(sample(), version=0)
    with pytest.raises(ValueError, match="occurred_at"):
        Event.new("T", "a", "1", 1, {}, occurred_at=datetime(2024, 1, 1))  # naive: refused


def test_peek_headers_reads_routing_without_the_value() -> None:
    assert peek_headers(good()[2]) == ("MoneyDeposited", "e-1", 3)
    with pytest.raises(DecodeError, match="kafold-version"):
        peek_headers(headers_with("kafold-version", None, drop=True))


# ---- the fast path (msgspec) must agree with the strict path on every body --------------------------------------
_FIELD_VALUES = (st.none() | st.booleans() | st.integers(-2**80, 2**80) | st.floats(allow_nan=False)
                 | st.text(max_size=300) | st.sampled_from(["", "x", "2024-05-01T12:00:00Z", "2024-05-01T12:00:00",
                                                            "2024-13-01T12:00:00Z", "Z", "1.0"])
                 | st.dictionaries(st.text(max_size=5), st.integers(-2**70, 2**70) | st.text(max_size=5), max_size=3)
                 | st.lists(st.integers(), max_size=3))


def _raw_json(pairs: list[tuple[str, Any]]) -> bytes:
    """A JSON object from pairs, keeping duplicate keys and integers beyond 64 bits (json, not orjson)."""
    import json
    return ("{" + ",".join(f"{json.dumps(k)}:{json.dumps(v)}" for k, v in pairs) + "}").encode()


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(changes=st.lists(st.tuples(st.sampled_from(["event_id", "type", "aggregate_type", "aggregate_id", "version",
                                                   "occurred_at", "correlation_id", "payload", "schema_version",
                                                   "causation_id", "extra"]), _FIELD_VALUES), max_size=3),
       drop=st.sets(st.sampled_from(["payload", "schema_version", "causation_id", "version"]), max_size=2),
       duplicate=st.booleans())
def test_fast_and_strict_body_paths_agree(changes: list[tuple[str, Any]], drop: set[str], duplicate: bool) -> None:
    from kafold.envelope import _fast_body, _strict_body

    base = orjson.loads(encode(sample())[1])
    pairs = [(k, v) for k, v in base.items() if k not in drop]
    for name, value in changes:
        if duplicate:
            pairs.append((name, value))  # a repeated key: both paths must take the same one
        else:
            pairs = [(k, value if k == name else v) for k, v in pairs] + ([] if name in base else [(name, value)])
    body = _raw_json(pairs)
    fast = _fast_body(body)
    try:
        strict = _strict_body(body, None, MAX_BYTES)
    except DecodeError:
        assert fast is None, f"fast path accepted what the strict path refuses: {body[:200]!r}"
        return
    assert fast is None or fast == strict


def test_both_paths_keep_big_integers_exact_and_agree_on_escapes() -> None:
    from kafold.envelope import INT_MAX, INT_MIN, _fast_body, _strict_body

    value = encode(sample())[1]
    big = b'"payload":{"f":1.5,"big":123456789012345678901234567890,'
    fast, strict = _fast_body(value.replace(b'"payload":{', big, 1)), _strict_body(
        value.replace(b'"payload":{', big, 1), None, MAX_BYTES)
    assert fast is not None and fast == strict and fast.payload["big"] == 123456789012345678901234567890
    for old, new in [(b'"payload":{', b'"payload":{"s":"\\u00e9\\ud83d\\ude00",'),
                     (b'"payload":{', b'"payload":{"s":"\\ud800",'),
                     (b'"type":', b'"type":"Other","type":')]:
        body = value.replace(old, new, 1)
        try:
            strict = _strict_body(body, None, MAX_BYTES)
        except DecodeError:
            assert _fast_body(body) is None
            continue
        fast = _fast_body(body)
        assert fast is None or fast == strict
    # the edges of what encode writes exactly come through decode unchanged
    edge = dataclasses.replace(sample(), payload={"lo": INT_MIN, "hi": INT_MAX, "l": [INT_MAX, {"x": INT_MIN}]})
    assert decode(*encode(edge)) == edge


@given(event=events)
def test_fast_path_takes_every_valid_event(event: Event) -> None:
    from kafold.envelope import _fast_body

    assert _fast_body(encode(event)[1]) == event  # None here would mean every record pays for the strict path


def _fields(event: Event) -> list[Any]:
    return [getattr(event, f.name) for f in dataclasses.fields(Event)]


@given(event=events)
def test_encode_new_writes_the_bytes_encode_writes(event: Event) -> None:
    assert encode_new(*_fields(event)) == encode(event)
    flat = {k: v for k, v in event.payload.items() if type(v) is not dict and type(v) is not list}
    assert encode_new(*_fields(dataclasses.replace(event, payload=flat)), flat=True) == encode(
        dataclasses.replace(event, payload=flat))


@settings(max_examples=300)
@given(name=st.sampled_from([f.name for f in dataclasses.fields(Event)]), value=_FIELD_VALUES)
def test_encode_new_refuses_what_the_event_refuses_naming_the_same_field(name: str, value: Any) -> None:
    fields = dict(zip([f.name for f in dataclasses.fields(Event)], _fields(sample()), strict=True))
    fields[name] = value
    try:
        event = Event(*fields.values())
    except ValueError as e:
        with pytest.raises(ValueError) as raised:
            encode_new(*fields.values())
        assert str(raised.value) == str(e)
        return
    try:
        expected = encode(event)
    except FatalError as e:
        with pytest.raises(FatalError) as refused:
            encode_new(*fields.values())
        assert str(refused.value) == str(e)
        return
    assert encode_new(*fields.values()) == expected


def test_encode_new_refuses_a_deep_or_non_json_payload_as_encode_does() -> None:
    for payload, match in ((BAD_DEEP["payload"], "deeper"), ({"n": 2**70}, "JSON")):
        with pytest.raises(FatalError, match=match):
            encode_new(*_fields(dataclasses.replace(sample(), payload=payload)))


def test_epoch_ms_reads_envelope_times_and_repeats_the_last_answer() -> None:
    from kafold.envelope import epoch_ms

    assert epoch_ms("2026-01-01T00:00:00.000000Z") == 1_767_225_600_000
    assert epoch_ms("2026-01-01T00:00:00.500000Z") == 1_767_225_600_500
    assert epoch_ms("2026-01-01T00:00:00.500000Z") == 1_767_225_600_500
    assert epoch_ms("2026-01-01T00:00:00.000000Z") == 1_767_225_600_000


@given(st.integers(0, 253_402_300_799_999))
def test_format_epoch_ms_writes_what_format_time_writes(ms: int) -> None:
    from datetime import UTC, datetime

    from kafold.envelope import epoch_ms, format_epoch_ms, format_time

    text = format_epoch_ms(ms)
    assert text == format_time(datetime.fromtimestamp(ms / 1000, UTC).replace(microsecond=ms % 1000 * 1000))
    assert epoch_ms(text) == ms


@pytest.mark.parametrize("too_big", [2**63, 2**64 - 1, 2**64])
def test_a_version_beyond_a_signed_64_bit_integer_is_refused_by_both_paths(too_big: int) -> None:
    from kafold.envelope import COUNT_MAX, _fast_body, _strict_body

    value = encode(sample())[1]
    version = orjson.loads(value)["version"]
    assert _fast_body(value.replace(b'"version":%d' % version, b'"version":%d' % COUNT_MAX)) is not None
    forged = value.replace(b'"version":%d' % version, b'"version":%d' % too_big)
    assert _fast_body(forged) is None
    with pytest.raises(DecodeError, match="version: "):
        _strict_body(forged, None, MAX_BYTES)
