"""Consistency tokens: where writes landed in Kafka, as an opaque string a reader can wait on (read-your-writes).

A token names, per (topic, partition), the offset of the last record a caller wrote there. A consumer *covers* it
once its committed position (the next offset it will read) is past that offset on every partition named: for a
projection, the checkpoint it stores in PostgreSQL in the same transaction as its rows, so the rows then include
the writes. Offsets only grow, so a covered token stays covered.

Wire form: `kf1.` + base64url (no padding) of the JSON `{"topic": {"partition": offset, ...}, ...}` followed by
its Adler-32, 4 bytes big-endian (caught: truncation, a changed character, a token of another kind; cheap: one is
made per command result in the aggregate runtime's hot path, about 5x faster than SHA-256 would be). The SQL
function `kafold.covers(connector, token)` (migration 0005) reads the same form. Tokens are not secrets and are
not signed: a well-formed token naming some other offset can only make a reader wait (or time out).
"""

from __future__ import annotations

import base64
import binascii
import re
import zlib
from collections.abc import Iterable, Mapping
from functools import lru_cache
from typing import Any

import orjson

from kafold.errors import KafoldError

VERSION = 1
PREFIX = f"kf{VERSION}."
CHECK_BYTES = 4
MAX_CHARS = 8192  # far above any honest token (a few hundred partitions); refused before any decoding
MAX_OFFSET = 2**63 - 1
MAX_PARTITION = 2**31 - 1
_VERSIONED = re.compile(r"kf([0-9]{1,6})\.")
_B64URL = re.compile(r"[A-Za-z0-9_-]*")
_URLSAFE = bytes.maketrans(b"+/", b"-_")

Positions = dict[tuple[str, int], int]  # (topic, partition) -> offset of the last record written there


class BadToken(KafoldError):
    """A string that is not a consistency token this kafold reads (forged, truncated, foreign, newer version)."""


def encode(positions: Mapping[tuple[str, int], int]) -> str:
    """The token of `positions` ((topic, partition) -> offset of the last record written)."""
    if not positions:
        raise ValueError("a token names at least one position")
    body: dict[str, dict[str, int]] = {}
    for (topic, partition), offset in sorted(positions.items()):
        if not topic or not 0 <= partition <= MAX_PARTITION or not 0 <= offset <= MAX_OFFSET:
            raise ValueError(f"not a record's position: {topic!r}[{partition}]@{offset}")
        body.setdefault(topic, {})[str(partition)] = offset
    raw = orjson.dumps(body)
    blob = raw + _check(raw)
    return PREFIX + base64.urlsafe_b64encode(blob).rstrip(b"=").decode()


def encode_one(topic: str, partition: int, offset: int) -> str:
    """`encode({(topic, partition): offset})`, the same string, about four times faster: one per command result
    in the aggregate runtime's hot path."""
    if not 0 <= partition <= MAX_PARTITION or not 0 <= offset <= MAX_OFFSET:
        raise ValueError(f"not a record's position: {topic!r}[{partition}]@{offset}")
    raw = b"%s%d\":%d}}" % (_topic_json(topic), partition, offset)
    blob = binascii.b2a_base64(raw + _check(raw), newline=False)
    return PREFIX + blob.translate(_URLSAFE).rstrip(b"=").decode()


def _check(raw: bytes) -> bytes:
    return zlib.adler32(raw).to_bytes(CHECK_BYTES, "big")


@lru_cache(maxsize=256)
def _topic_json(topic: str) -> bytes:
    if not topic:
        raise ValueError("not a record's position: no topic")
    return b"{" + orjson.dumps(topic) + b':{"'


def parse(token: object) -> Positions:
    """The positions a token names; BadToken saying what is wrong with it (never another exception)."""
    if not isinstance(token, str) or not token:
        raise BadToken("empty consistency token")
    if len(token) > MAX_CHARS:
        raise BadToken(f"consistency token too long ({len(token)} characters, at most {MAX_CHARS})")
    versioned = _VERSIONED.match(token)
    if versioned is None:
        raise BadToken(f"not a kafold consistency token (expected one starting with {PREFIX!r})")
    version = int(versioned.group(1))
    if version > VERSION:
        raise BadToken(f"consistency token of version {version}, newer than this kafold reads ({VERSION}): "
                       "upgrade the reader")
    if version != VERSION:
        raise BadToken(f"not a kafold consistency token (unknown version {version})")
    text = token[versioned.end():]
    if not _B64URL.fullmatch(text) or len(text) % 4 == 1:
        raise BadToken("malformed consistency token (not base64url)")
    try:
        blob = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        raise BadToken("malformed consistency token (not base64url)") from None
    raw, check = blob[:-CHECK_BYTES], blob[-CHECK_BYTES:]
    if len(blob) <= CHECK_BYTES or _check(raw) != check:
        raise BadToken("consistency token truncated or altered (its checksum does not match)")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise BadToken("malformed consistency token (its body is not JSON)") from None
    return _positions(body)


def _positions(body: Any) -> Positions:
    if type(body) is not dict or not body:
        raise BadToken("malformed consistency token (it names no position)")
    out: Positions = {}
    for topic, parts in body.items():
        if not topic or type(parts) is not dict or not parts:
            raise BadToken(f"malformed consistency token (topic {topic!r}: no partitions)")
        for p, offset in parts.items():
            if not digits(p, MAX_PARTITION):
                raise BadToken(f"malformed consistency token (topic {topic!r}: partition {p!r})")
            if type(offset) is not int or not 0 <= offset <= MAX_OFFSET:
                raise BadToken(f"malformed consistency token ({topic}[{p}]: offset {offset!r})")
            out[(topic, int(p))] = offset
    return out


def digits(text: str, maximum: int) -> bool:
    """True when `text` is an ASCII decimal integer from 0 to `maximum`. The length is checked before `int()`: a
    string of thousands of digits makes `int()` raise (or, without CPython's digit limit, take quadratic time)."""
    return (text.isascii() and text.isdigit() and len(text) <= len(str(maximum))
            and int(text) <= maximum)


def merge(*tokens: str | None) -> str | None:
    """One token covering every given one (the highest offset per partition); None when all are None."""
    merged: Positions = {}
    for token in tokens:
        if token is not None:
            for tp, offset in parse(token).items():
                merged[tp] = max(offset, merged.get(tp, -1))
    return encode(merged) if merged else None


def of_messages(messages: Iterable[Any]) -> str:
    """The token of delivered records: confluent-kafka `Message`s from delivery reports (topic, partition,
    offset), e.g. collected by `kafold.client.Landed`."""
    positions: Positions = {}
    for m in messages:
        tp, offset = (m.topic(), m.partition()), m.offset()
        if offset < 0:
            raise ValueError(f"{tp[0]}[{tp[1]}]: the record has no offset (not delivered, or no delivery report)")
        positions[tp] = max(offset, positions.get(tp, -1))
    return encode(positions)


def missing(positions: Mapping[tuple[str, int], int], next_offsets: Mapping[tuple[str, int], int]
            ) -> list[tuple[str, int]]:
    """The partitions of `positions` a consumer at `next_offsets` (committed next offset per partition) has not
    passed yet; empty = covered."""
    return [tp for tp, offset in positions.items() if next_offsets.get(tp, -1) <= offset]


def covers(next_offsets: Mapping[tuple[str, int], int], positions: Mapping[tuple[str, int], int]) -> bool:
    """True when a consumer whose committed next offsets are `next_offsets` has read past every position."""
    return not missing(positions, next_offsets)
