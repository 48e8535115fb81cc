"""The snapshot record format: round trip, checksum, clear errors naming the field."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kafold.errors import DecodeError
from kafold.snapshot import record
from kafold.snapshot.record import ChecksumError, Marker, Snapshot

SNAP = Snapshot("account", "acc-1", {"status": "open", "balance": 500}, 3, 1, 42, "v1", 1, "", "",
                [["cmd-1", 1_767_225_600_000, 3, 1]])


def test_snapshot_round_trips_with_checksum_over_canonical_encoding() -> None:
    key, value, headers = SNAP.encode()
    got = record.decode(key, value)
    assert key == b"acc-1" and headers == [(record.H_KIND, record.KIND_SNAPSHOT)]
    assert got._replace(created_at="", checksum="") == SNAP
    body = orjson.loads(value)
    assert got.checksum == record.checksum(body) and got.checksum.startswith("sha256:")
    reordered = orjson.dumps(dict(reversed(list(body.items()))))  # key order does not change the checksum
    assert record.decode(key, reordered).checksum == got.checksum


def test_a_state_with_an_integer_beyond_64_bits_is_written_and_read_back_exactly() -> None:
    """A Python int has no bound and a state may hold one (orjson refuses to write it and would read it back as a
    float): both writers seal it, and it reads back as the same int, the checksum checked either way."""
    big = 2**80 + 7
    state = {"total": big, "rate": 1.5, "parts": [-big, 3], "nested": {"b": big, "a": "x"}}
    snap = SNAP._replace(state=state)
    key, value, _ = snap.encode()
    assert b"1208925819614629174706183" in value
    got = record.decode(key, value)
    assert got.state == state and type(got.state["total"]) is int and got.checksum == record.checksum(got.body())
    encoder = record.Encoder("account", 1, 42, "v1", 1, got.created_at)
    assert encoder.encode("acc-1", state, 3, SNAP.commands) == (key, value, _)
    reordered = orjson.dumps({k: v for k, v in reversed(list(orjson.loads(value.replace(b"%d" % big, b"0")).items()))})
    with pytest.raises(ChecksumError):  # the same content with the int changed: the canonical check fails
        record.decode(key, reordered)


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


def _strict(key: bytes, value: bytes) -> Snapshot | str:
    """What the strict path (every check spelled out) says: the snapshot, or the error's reason."""
    try:
        body = record._body(key, value, record._SNAPSHOT_FIELDS, None)
    except DecodeError as e:
        return e.reason
    if key != body["aggregate_id"].encode():
        return "header-mismatch"
    del body["format"]
    return Snapshot(**body)


_ids = st.text(min_size=1, max_size=12)
_states = st.recursive(st.none() | st.booleans() | st.integers(-10**12, 10**12) | st.text(max_size=8),
                       lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                     max_size=3), max_leaves=8)


@settings(max_examples=300, deadline=None)
@given(aid=_ids, state=_states, version=st.integers(0, 10**9), partition=st.integers(0, 500),
       offset=st.integers(0, 10**12), flip=st.integers(0, 10**6), byte=st.integers(0, 255))
def test_the_fast_path_agrees_with_the_strict_one(aid: str, state: object, version: int, partition: int,
                                                  offset: int, flip: int, byte: int) -> None:
    """Any snapshot `encode` writes decodes on the fast path exactly as on the strict one; with any one byte changed,
    the fast path either gives what the strict path gives or leaves the record to it (never a different answer)."""
    snap = Snapshot("account", aid, state, version, partition, offset, "fp-1", 2, "2026-11-23T00:00:00.000000Z")
    key, value, _ = snap.encode()
    fast = record._decode_written(key, value)
    assert fast is not None and fast == _strict(key, value) == record.decode(key, value)
    changed = bytearray(value)
    changed[flip % len(value)] = byte
    fast_changed = record._decode_written(key, bytes(changed))
    assert fast_changed is None or fast_changed == _strict(key, bytes(changed))


@settings(max_examples=300, deadline=None)
@given(aid=_ids, state=_states, version=st.integers(0, 10**9), partition=st.integers(0, 500),
       offset=st.integers(0, 10**12), atype=_ids, fingerprint=_ids, schema=st.integers(0, 1000),
       created=st.text(max_size=30),
       commands=st.lists(st.tuples(_ids, st.integers(0, 2**50), st.integers(0, 10**9), st.integers(0, 100)).map(list),
                         max_size=5))
def test_the_run_encoder_writes_the_bytes_snapshot_encode_writes(aid: str, state: object, version: int,
                                                                 partition: int, offset: int, atype: str,
                                                                 fingerprint: str, schema: int,
                                                                 created: str, commands: list[list[object]]
                                                                 ) -> None:
    """Runs encode their snapshots from a template (record.Encoder); any snapshot comes out byte for byte as
    `Snapshot.encode` writes it, so it checksums and decodes the same."""
    snap = Snapshot(atype, aid, state, version, partition, offset, fingerprint, schema, created or "t", "", commands)
    encoded = record.Encoder(atype, partition, offset, fingerprint, schema, created or "t").encode(
        aid, state, version, commands)
    assert encoded == snap.encode()
    assert record.decode(*encoded[:2]) == snap._replace(checksum=record.decode(*snap.encode()[:2]).checksum)
