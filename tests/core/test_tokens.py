"""kafold.tokens: a token round-trips its positions; forged, truncated, foreign and newer tokens are refused with
BadToken naming the defect; coverage is decided per partition against committed next offsets."""

from __future__ import annotations

import base64
import zlib

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kafold import tokens
from kafold.tokens import BadToken

positions = st.dictionaries(
    st.tuples(st.text(st.characters(codec="utf-8"), min_size=1, max_size=40), st.integers(0, tokens.MAX_PARTITION)),
    st.integers(0, tokens.MAX_OFFSET), min_size=1, max_size=20)


def _raw(body: bytes, version: str = "kf1.") -> str:
    """A token around `body` with a correct checksum (what a forger who read the source would make)."""
    blob = body + zlib.adler32(body).to_bytes(4, "big")
    return version + base64.urlsafe_b64encode(blob).rstrip(b"=").decode()


@given(positions)
def test_a_token_names_exactly_its_positions(pos: dict[tuple[str, int], int]) -> None:
    token = tokens.encode(pos)
    assert token.startswith("kf1.") and tokens.parse(token) == pos


@given(positions, st.data())
def test_any_truncation_of_a_token_is_refused(pos: dict[tuple[str, int], int], data: st.DataObject) -> None:
    token = tokens.encode(pos)
    cut = data.draw(st.integers(0, len(token) - 1))
    with pytest.raises(BadToken):
        tokens.parse(token[:cut])


@given(positions, st.data())
def test_a_changed_character_is_refused(pos: dict[tuple[str, int], int], data: st.DataObject) -> None:
    token = tokens.encode(pos)
    i = data.draw(st.integers(len("kf1."), len(token) - 1))
    c = data.draw(st.sampled_from("AbQz09_-").filter(lambda c: c != token[i]))
    forged = token[:i] + c + token[i + 1:]
    try:
        parsed = tokens.parse(forged)
    except BadToken:
        return
    # Base64's last character carries unused bits: a change there may decode to the same bytes.
    assert i == len(token) - 1 and parsed == pos


@pytest.mark.parametrize(("token", "message"), [
    (None, "empty"),
    ("", "empty"),
    ("kf1", "not a kafold consistency token"),
    ("eyJhbGciOiJIUzI1NiJ9.e30.x", "not a kafold consistency token"),  # a JWT: foreign
    ("kafold:orders/0@12", "not a kafold consistency token"),
    ("kf2.eyJ0Ijp7IjAiOjF9fQ", "version 2, newer than this kafold reads"),
    ("kf17.AAAA", "version 17, newer"),
    ("kf0.AAAA", "unknown version 0"),
    ("kf1.", "truncated or altered"),
    ("kf1.!!!!", "not base64url"),
    ("kf1.abc+/def", "not base64url"),
    ("kf1.A", "not base64url"),
    ("kf1.AAAAAAAAAAA", "truncated or altered"),
    ("kf1." + "A" * 9000, "too long"),
    (_raw(b"not json"), "not JSON"),
    (_raw(b"[]"), "names no position"),
    (_raw(b"{}"), "names no position"),
    (_raw(b'{"t":{}}'), "no partitions"),
    (_raw(b'{"t":[1,2]}'), "no partitions"),
    (_raw(b'{"t":{"-1":3}}'), "partition '-1'"),
    (_raw(b'{"t":{"x":3}}'), "partition 'x'"),
    (_raw(b'{"t":{"99999999999":3}}'), "partition '99999999999'"),
    (_raw(b'{"t":{"' + b"7" * 5000 + b'":3}}'), "partition '7777"),  # past int()'s digit limit: not a 500
    (_raw(b'{"t":{"0":-1}}'), "offset -1"),
    (_raw(b'{"t":{"0":1.5}}'), "offset 1.5"),
    (_raw(b'{"t":{"0":true}}'), "offset True"),
    (_raw(b'{"t":{"0":"7"}}'), "offset '7'"),
    (_raw(b'{"t":{"0":9223372036854775808}}'), "offset 9223372036854775808"),  # past a Kafka offset
    (_raw(b'{"t":{"0":99999999999999999999}}'), r"offset 1e\+20"),  # past 64 bits: read as a float
])
def test_bad_tokens_are_refused_naming_the_defect(token: object, message: str) -> None:
    with pytest.raises(BadToken, match=message):
        tokens.parse(token)


def test_a_newer_version_is_refused_even_when_well_formed() -> None:
    future = "kf2." + tokens.encode({("t", 0): 5}).removeprefix("kf1.")
    with pytest.raises(BadToken, match="newer than this kafold reads"):
        tokens.parse(future)


def test_coverage_needs_every_partition_past_its_offset() -> None:
    pos = {("e", 0): 10, ("e", 3): 4}
    assert tokens.missing(pos, {}) == [("e", 0), ("e", 3)]
    assert tokens.missing(pos, {("e", 0): 10, ("e", 3): 5}) == [("e", 0)]  # next offset 10 has not read offset 10
    assert not tokens.covers({("e", 0): 11, ("e", 3): 4}, pos)
    assert tokens.covers({("e", 0): 11, ("e", 3): 5, ("other", 0): 0}, pos)


def test_merge_keeps_the_highest_offset_per_partition() -> None:
    a, b = tokens.encode({("e", 0): 10, ("e", 1): 2}), tokens.encode({("e", 0): 7, ("f", 0): 1})
    assert tokens.parse(tokens.merge(a, None, b) or "") == {("e", 0): 10, ("e", 1): 2, ("f", 0): 1}
    assert tokens.merge(None, None) is None


class _Delivered:
    def __init__(self, topic: str, partition: int, offset: int) -> None:
        self._at = (topic, partition, offset)

    def topic(self) -> str:
        return self._at[0]

    def partition(self) -> int:
        return self._at[1]

    def offset(self) -> int:
        return self._at[2]


def test_a_token_from_delivery_reports_names_the_last_offset_per_partition() -> None:
    token = tokens.of_messages([_Delivered("e", 0, 3), _Delivered("e", 0, 9), _Delivered("e", 1, 4),
                                _Delivered("e", 0, 5)])
    assert tokens.parse(token) == {("e", 0): 9, ("e", 1): 4}
    with pytest.raises(ValueError, match="no offset"):
        tokens.of_messages([_Delivered("e", 0, -1001)])


def test_the_wire_form_is_json_with_a_checksum() -> None:
    """The SQL function `kafold.covers` reads this form: pin it."""
    token = tokens.encode({("bank.events", 2): 41})
    blob = base64.urlsafe_b64decode(token.removeprefix("kf1.") + "==")
    assert orjson.loads(blob[:-4]) == {"bank.events": {"2": 41}}
    assert blob[-4:] == zlib.adler32(blob[:-4]).to_bytes(4, "big")


@given(st.text(st.characters(codec="utf-8"), min_size=1, max_size=40), st.integers(0, tokens.MAX_PARTITION),
       st.integers(0, tokens.MAX_OFFSET))
def test_the_fast_single_position_form_is_the_same_string(topic: str, partition: int, offset: int) -> None:
    assert tokens.encode_one(topic, partition, offset) == tokens.encode({(topic, partition): offset})
