"""Schema-less Debezium values typed by the projection's declared columns (`schemas = false`).

A record without its Connect schema cannot tell JSON text or encoded bytes from plain text, but the projection
declares each column's type: a field mapped (`set`, `key`) as `payload.<field>` to a `json`/`jsonb` column is JSON
text that becomes the value it encodes, and one mapped to `bytea` is text in the declared `binary_handling_mode`
that becomes bytea's hex text (`\\x…`). The same values the schema path gives (connect_schema.py), so the payload
reads alike either way. A value that does not decode is a dead letter naming the field; the placeholder (an
unchanged TOASTed value) is left alone for the projection to keep the stored value.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable, Mapping
from typing import Any

from kafold.config import BinaryHandling
from kafold.connectors.convert.api import UNAVAILABLE
from kafold.connectors.convert.connect_schema import SchemaError, json_value

Decode = Callable[[Any], Any]
PAYLOAD = "payload."


def _binary(mode: BinaryHandling) -> Decode:
    """Text in Debezium's `binary.handling.mode` as bytea's hex text (`bytes` without a schema: JsonConverter's
    base64)."""
    mode = BinaryHandling(mode)

    def decode(v: Any) -> Any:
        if type(v) is not str:
            raise TypeError(f"expected {mode} text, got {type(v).__name__}")
        if mode is BinaryHandling.HEX:
            raw = bytes.fromhex(v)
        elif mode is BinaryHandling.BASE64_URL_SAFE:
            raw = base64.urlsafe_b64decode(v + "=" * (-len(v) % 4))
        else:
            raw = base64.b64decode(v, validate=True)
        return "\\x" + raw.hex()
    return decode


def kind(sql_type: str) -> str:
    """The decoding a declared column type asks for: `json`, `bytea`, or `` (the value as sent)."""
    base = sql_type.strip().lower()
    if base in ("json", "jsonb"):
        return "json"
    if base == "bytea":
        return "bytea"
    return ""


def field_decoders(projection: Mapping[str, Any], binary: BinaryHandling) -> dict[str, Decode]:
    """Per top-level payload field mapped to a json/jsonb or bytea column, its decoder (a field also mapped to a
    column of another type gets it that way too: the payload holds one reading). ValueError for a field mapped to
    both a JSON and a bytea column."""
    columns = projection.get("columns") or {}
    sources: list[tuple[str, Any]] = list((projection.get("key") or {}).items())
    for rule in projection.get("on") or []:
        if isinstance(rule, Mapping):
            sources += list((rule.get("set") or {}).items())
    kinds: dict[str, set[str]] = {}
    for column, spec in sources:
        tp = columns.get(column)
        if isinstance(spec, str) and spec.startswith(PAYLOAD) and "." not in spec[len(PAYLOAD):] \
                and isinstance(tp, str) and kind(tp):
            kinds.setdefault(spec[len(PAYLOAD):], set()).add(kind(tp))
    out: dict[str, Decode] = {}
    for name, found in kinds.items():
        if len(found) > 1:
            raise ValueError(f"payload field {name!r} is mapped to a JSON and to a bytea column: without schemas "
                             "it can be read one way only")
        out[name] = json_value if found == {"json"} else _binary(binary)
    return out


class ColumnTypes:
    """Decodes a schema-less row's fields by the declared types of the columns they are mapped to."""

    def __init__(self, decoders: dict[str, Decode]) -> None:
        self.decoders = decoders

    def __bool__(self) -> bool:
        return bool(self.decoders)

    def row(self, row: dict[str, Any], side: str) -> dict[str, Any]:
        """`row` (the `before`/`after` named by `side`) with each typed field decoded."""
        out = row
        for name, decode in self.decoders.items():
            v = row.get(name)
            if v is None or v == UNAVAILABLE:
                continue
            try:
                decoded = decode(v)
            except (ValueError, TypeError, binascii.Error) as e:
                raise SchemaError(f"{side}.{name}", f"{str(v)[:64]!r} does not decode for its declared column "
                                  f"type ({e})") from None
            if out is row:
                out = dict(row)
            out[name] = decoded
        return out
