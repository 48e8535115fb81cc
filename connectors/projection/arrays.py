"""One-dimensional PostgreSQL arrays in the binary format (`array_recv`), built from a column of Python values.

The one-statement upsert of whole rows (whole_rows.py) sends each column of a batch as one array. psycopg's own list
dumper runs in Python, element by element (most of what a batch cost the runner's thread after its decode:
docs/benchmarks.md), and a bigint column sent as text is parsed again by the server. These build a text[] or int8[]
array's bytes with a few C-level passes over the column instead, or return None when a value is not of the kind
they take (the caller then dumps the column the general way, which names the problem if there is one): a text
array takes str (no NUL character, which PostgreSQL text cannot hold) and None; an int8 array takes int (not bool:
psycopg would send True as `true`, which a bigint column refuses) within 64 bits, and None. The server receives the
values the general way would have sent, as its binary input functions read them (UTF-8 text: the caller checks the
session's encoding).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from itertools import chain, repeat

TEXT_OID, INT8_OID = 25, 20
TEXT_ARRAY_OID, INT8_ARRAY_OID = 1009, 1016
NULL = b"\xff\xff\xff\xff"  # an element's length -1: NULL
_HEAD = struct.Struct(">iiiii")  # dimensions, has nulls, element type; the one dimension's length, lower bound
_LENGTHS = [n.to_bytes(4, "big") for n in range(4096)]  # the usual lengths' prefixes, made once
_EIGHT = (8).to_bytes(4, "big")
_NONE, _STR, _INT = type(None), str, int


def _head(oid: int, count: int, nulls: bool) -> bytes:
    return _HEAD.pack(1, int(nulls), oid, count, 1) if count else _HEAD.pack(0, 0, oid, 0, 0)[:12]


def text_array(values: Sequence[str | None]) -> bytes | None:
    """`values` as a binary text[]; None unless each is a str without NUL (and UTF-8 encodable), or None."""
    kinds = set(map(type, values))
    if not kinds <= {_STR, _NONE}:
        return None
    nulls = _NONE in kinds
    if "\x00" in "".join([v for v in values if v is not None] if nulls else values):  # type: ignore[arg-type]
        return None
    try:
        if nulls:
            parts = [NULL if v is None else len(e := v.encode()).to_bytes(4, "big") + e for v in values]
            return _head(TEXT_OID, len(values), True) + b"".join(parts)
        encoded = [v.encode() for v in values]  # type: ignore[union-attr]
    except UnicodeEncodeError:  # a lone surrogate: the general way names it
        return None
    try:
        lengths = list(map(_LENGTHS.__getitem__, map(len, encoded)))
    except IndexError:  # a value of 4 KiB or more
        lengths = [len(e).to_bytes(4, "big") for e in encoded]
    return _head(TEXT_OID, len(values), False) + b"".join(chain.from_iterable(zip(lengths, encoded, strict=True)))


def int8_array(values: Sequence[int | None]) -> bytes | None:
    """`values` as a binary int8[] (bigint[]); None unless each is an int within 64 bits, or None."""
    kinds = set(map(type, values))
    if not kinds <= {_INT, _NONE}:
        return None
    try:
        if _NONE in kinds:
            parts = [NULL if v is None else _EIGHT + v.to_bytes(8, "big", signed=True) for v in values]
            return _head(INT8_OID, len(values), True) + b"".join(parts)
        count = len(values)
        pairs = chain.from_iterable(zip(repeat(8, count), values, strict=True))
        return _head(INT8_OID, count, False) + struct.pack(">" + "iq" * count, *pairs)
    except (OverflowError, struct.error):  # beyond 64 bits: the general way sends it, the server refuses it
        return None
