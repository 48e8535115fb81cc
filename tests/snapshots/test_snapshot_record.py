"""The snapshot record format: round trip, checksum, clear errors naming the field."""

from __future__ import annotations

import orjson
import pytest

from kafold.errors import DecodeError
from kafold.snapshot import record
from kafold.snapshot.record import ChecksumError, Marker, Snapshot

SNAP = Snapshot("account", "acc-1", {"status": "open", "balance": 500}, 3, 1, 42, "v1", 1)


def test_snapshot_round_trips_with_checksum_over_canonical_encoding() -> None:
    key, value, headers = SNAP.encode()
    got = record.decode(key, value)
    assert key == b"acc-1" and headers == [(record.H_KIND, record.KIND_SNAPSHOT)]
    assert got._replace(created_at="", checksum="") == SNAP
    body = orjson.loads(value)
    assert got.checksum == record.checksum(body) and got.checksum.startswith("sha256:")
    reordered = orjson.dumps(dict(reversed(list(body.items()))))  # key order does not change the checksum
    assert record.decode(key, reordered).checksum == got.checksum


def test_a_changed_state_fails_the_checksum() -> None:
    key, value, _ = SNAP.encode()
    tampered = value.replace(b'"balance":500', b'"balance":900')
    with pytest.raises(ChecksumError, match="checksum"):
        record.decode(key, tampered)


def test_a_changed_checksum_fails_in_the_layout_encode_writes() -> None:
    """encode appends the checksum to the canonical bytes (read back by a fast path): a wrong one still fails."""
    key, value, _ = SNAP.encode()
    assert value.endswith(b'"checksum":"' + orjson.loads(value)["checksum"].encode() + b'"}')
    digit = value[-3:-2]
    broken = value[:-3] + (b"0" if digit != b"0" else b"1") + value[-2:]
    with pytest.raises(ChecksumError, match="checksum"):
        record.decode(key, broken)


@pytest.mark.parametrize(("value", "message"), [
    (b"not json", "value: not valid JSON"),
    (b"[1]", "value: expected a JSON object"),
    (None, "value: missing"),
])
def test_malformed_values_name_the_problem(value: bytes | None, message: str) -> None:
    with pytest.raises(DecodeError, match=message):
        record.decode(b"acc-1", value)


def test_missing_field_and_key_mismatch_are_named() -> None:
    key, value, _ = SNAP.encode()
    body = orjson.loads(value)
    del body["version"]
    with pytest.raises(DecodeError, match="version: missing or unknown field"):
        record.decode(key, orjson.dumps(body))
    with pytest.raises(DecodeError, match="key: does not match aggregate_id"):
        record.decode(b"acc-2", value)


def test_marker_round_trips_under_its_reserved_key() -> None:
    key, value, headers = Marker("account", 3, 99, "v1", 1).encode()
    assert record.is_marker(key) and not record.is_marker(b"acc-1")
    assert record.decode_marker(key, value).offset == 99
    assert headers == [(record.H_KIND, record.KIND_MARKER)]
