"""Debezium's key change: the new key a delete of the old key names in its `__debezium.newkey` header.

An UPDATE of a primary key comes from Debezium as a delete of the old key (header `__debezium.newkey`: the new key)
and a create of the new key (header `__debezium.oldkey`), both at the change's log position. Under REPLICA IDENTITY
DEFAULT the create carries the unavailable-value placeholder for an unchanged TOASTed column, whose value is only in
the projection's old row: the delete's event names the new key (payload field NEW_KEY) so that the projection moves
the old row to it before the create applies (projection/rekey.py).

The header is written by the worker's `header.converter`: Connect's default (SimpleHeaderConverter) writes the key
struct as `Struct{id=50}`; JsonConverter as JSON, with or without its `{"schema", "payload"}` wrapper.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from kafold.connectors.convert.api import Headers

NEW_KEY = "__debezium.newkey"  # the header, and the delete's payload field holding the new key (an object)
_STRUCT = re.compile(r"^Struct\{(.*)\}$", re.S)
_INT = re.compile(r"^-?\d+$")


def aggregate_id_of(key: dict[str, Any]) -> str:
    """A Debezium key's aggregate id: its one value as text, several as sorted JSON."""
    return (str(next(iter(key.values()))) if len(key) == 1
            else orjson.dumps(key, option=orjson.OPT_SORT_KEYS).decode())


def header_value(headers: Headers, name: str) -> bytes | None:
    for k, v in headers or ():
        if k == name and v is not None:
            return v
    return None


def _scalar(text: str) -> Any:
    """A struct field of SimpleHeaderConverter's text: an integer as an int, anything else as its text."""
    return int(text) if _INT.match(text) else text


def parse_key(raw: bytes) -> Any:
    """The key a `__debezium.newkey` header holds: a JSON object (a wrapper's payload), or the fields of
    `Struct{a=1,b=x}`; None if it is neither."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        m = _STRUCT.match(raw.decode("utf-8", "replace"))
        if m is None:
            return None
        fields = [part.split("=", 1) for part in m.group(1).split(",")] if m.group(1) else []
        if any(len(f) != 2 for f in fields):
            return None  # a value with a comma or no `=`: not one this form can carry unambiguously
        return {name: _scalar(value) for name, value in fields}
    if type(body) is str:  # SimpleHeaderConverter quotes nothing; a JSON string holding JSON is StringConverter's
        return parse_key(body.encode())
    return body
