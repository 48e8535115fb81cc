"""Kafka Connect JSON values decoded by the Connect schema their record carries (JsonConverter, schemas.enable).

Each value comes out as the JSON value PostgreSQL's input function of its column type reads exactly, so a payload
stays JSON (a webhook, a dead letter and `projection verify` see it as the table does):
- Connect `Decimal` (base64 two's complement, `parameters.scale`) and Debezium's `VariableScaleDecimal`: the
  number as a decimal string, every digit kept (never a float);
- dates, times and timestamps (Debezium's day counts and epoch ms/µs/ns, Connect's own): ISO-8601 text; a
  timestamp without a zone stays without one; Debezium's zoned and ISO strings pass as they are;
- `io.debezium.data.Json`: the value its text encodes (a jsonb column stores the document, not a string);
- bytes: PostgreSQL's bytea hex text (`\\x…`); `io.debezium.data.Bits`: the bit string (`0101`);
- `MicroDuration`: an interval's text (`N microseconds`); structs, arrays and maps walked field by field.
Debezium's unavailable-value placeholder (an unchanged TOASTed column; in its text, bytes or array form) comes out
as UNAVAILABLE, whatever the placeholder text configured, for the projection to keep the stored value.

A schema is compiled once into a decoder (a closure per field that needs one: a struct of plain fields decodes to
itself) and kept in a bounded cache keyed by the schema's JSON text, so a record pays a serialization and a lookup.
"""

from __future__ import annotations

import base64
import binascii
import datetime
from collections.abc import Callable
from typing import Any

import msgspec
import orjson

from kafold.config import UNAVAILABLE_PLACEHOLDER
from kafold.connectors.convert.api import UNAVAILABLE

Decode = Callable[[Any], Any]
_EPOCH = datetime.date(1970, 1, 1).toordinal()
_DAY_NS = 86_400 * 10**9
_NS = {"ms": 10**6, "us": 10**3, "ns": 1}  # nanoseconds a unit


class SchemaError(ValueError):
    """A value that does not decode by its schema; `path` names the field (`after.price`)."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"path {path!r}: {message}")
        self.path = path


def decimal_text(unscaled: int, scale: int) -> str:
    """`unscaled` * 10^-scale as plain decimal text, exactly (no float, no exponent, no context rounding)."""
    digits = str(abs(unscaled))
    if scale <= 0:
        text = digits + "0" * -scale if unscaled else "0"
    else:
        digits = digits.rjust(scale + 1, "0")
        text = f"{digits[:-scale]}.{digits[-scale:]}"
    return f"-{text}" if unscaled < 0 else text


def clock(ns: int) -> str:
    """A time of day (nanoseconds since midnight, 24:00:00 allowed as PostgreSQL does) as `HH:MM:SS[.fraction]`."""
    seconds, frac = divmod(ns, 10**9)
    minutes, s = divmod(seconds, 60)
    h, m = divmod(minutes, 60)
    text = f"{h:02d}:{m:02d}:{s:02d}"
    return f"{text}.{frac:09d}".rstrip("0") if frac else text


def day(days: int) -> str:
    return datetime.date.fromordinal(_EPOCH + days).isoformat()


def stamp(ns: int) -> str:
    """Nanoseconds since the epoch as an ISO timestamp without a zone."""
    days, rest = divmod(ns, _DAY_NS)
    return f"{day(days)}T{clock(rest)}"


def _bytes(text: Any) -> bytes:
    if type(text) is not str:
        raise ValueError(f"expected base64 text, got {type(text).__name__}")
    return base64.b64decode(text, validate=True)


class Compiler:
    """Compiles Connect schemas into decoders for one placeholder text; keeps at most `capacity` of them."""

    def __init__(self, placeholder: str = UNAVAILABLE_PLACEHOLDER, capacity: int = 256) -> None:
        self.placeholder = placeholder
        self.capacity = capacity
        self._cache: dict[bytes, Decode | None] = {}
        raw = placeholder.encode()
        # text; bytes as base64 (JsonConverter, binary.handling.mode base64), url-safe base64 and hex; a text array,
        # an int array (the placeholder's bytes), an hstore map
        self._unavailable: tuple[Any, ...] = (
            placeholder, base64.b64encode(raw).decode(), base64.urlsafe_b64encode(raw).decode(), raw.hex(),
            [placeholder], list(raw), {placeholder: placeholder})

    def decoder(self, schema: Any) -> Decode | None:
        """The decoder of `schema` (None: values decode to themselves), compiled on first sight."""
        key = orjson.dumps(schema)
        cache = self._cache
        if key in cache:
            return cache[key]
        dec = self.compile(schema, "$")
        if len(cache) >= self.capacity:  # a bound: schemas change rarely, so the oldest half is stale
            for old in list(cache)[: self.capacity // 2]:
                del cache[old]
        cache[key] = dec
        return dec

    def unavailable(self, value: Any) -> bool:
        """`value` is the placeholder in one of the forms Debezium writes it (text, base64 bytes, an array)."""
        return value in self._unavailable if type(value) in (str, list, dict) else False

    def compile(self, schema: Any, path: str) -> Decode | None:
        if type(schema) is not dict:
            return None
        kind, name = schema.get("type"), schema.get("name")
        leaf = self._leaf(name, kind, schema.get("parameters") or {}, path)
        if leaf is not None:
            return self._guarded(leaf, path, kind)
        if kind == "struct":
            return self._struct(schema.get("fields"), path)
        if kind == "array":
            items = self.compile(schema.get("items"), f"{path}[]")
            return self._guarded(self._array(items), path, kind) if items is not None else self._placeheld()
        if kind == "map":
            return self._map(self.compile(schema.get("keys"), f"{path}{{}}"),
                             self.compile(schema.get("values"), f"{path}{{}}"), path)
        if kind == "string" and self.placeholder != UNAVAILABLE:
            return self._placeheld()
        return None

    def _guarded(self, leaf: Decode, path: str, kind: Any) -> Decode:
        """`leaf` with the placeholder and errors handled: a value that fails names its path."""
        unavailable = self.unavailable

        def decode(value: Any) -> Any:
            if unavailable(value):
                return UNAVAILABLE
            try:
                return leaf(value)
            except (ValueError, TypeError, KeyError, OverflowError, binascii.Error) as e:
                raise SchemaError(path, f"{str(value)[:64]!r} is not a valid {kind} of its schema ({e})") from None
        return decode

    def _placeheld(self) -> Decode:
        unavailable = self.unavailable
        return lambda value: UNAVAILABLE if unavailable(value) else value

    def _struct(self, fields: Any, path: str) -> Decode | None:
        if type(fields) is not list:
            return None  # a struct schema without its fields: the values pass as they are
        special = [(f["field"], dec) for f in fields if type(f) is dict and "field" in f
                   and (dec := self.compile(f, f"{path}.{f['field']}".removeprefix("$."))) is not None]
        if not special:
            return None

        def decode(value: Any) -> Any:
            if type(value) is not dict:
                raise SchemaError(path, f"expected a struct (an object), got {type(value).__name__}")
            out = dict(value)
            for name, dec in special:
                v = out.get(name)
                if v is not None:
                    out[name] = dec(v)
            return out
        return decode

    @staticmethod
    def _array(items: Decode) -> Decode:
        return lambda value: [None if v is None else items(v) for v in value]

    def _map(self, keys: Decode | None, values: Decode | None, path: str) -> Decode | None:
        if keys is None and values is None:
            return None
        k = keys or (lambda v: v)
        v = values or (lambda x: x)

        def decode(value: Any) -> Any:
            if type(value) is dict:  # JsonConverter writes a map with string keys as an object
                return {key: None if x is None else v(x) for key, x in value.items()}
            if type(value) is list:  # and any other map as [key, value] pairs
                return [[k(p[0]), None if p[1] is None else v(p[1])] for p in value]
            raise SchemaError(path, f"expected a map, got {type(value).__name__}")
        return decode

    def _leaf(self, name: Any, kind: Any, params: dict[str, Any], path: str) -> Decode | None:
        """The decoder of a logical type (by schema name) or of bytes; None for anything else."""
        if name in ("org.apache.kafka.connect.data.Decimal",):
            try:
                scale = int(params.get("scale", 0))
            except (TypeError, ValueError):
                raise SchemaError(path, f"Decimal scale {params.get('scale')!r} is not an integer") from None
            return lambda v: decimal_text(int.from_bytes(_bytes(v), "big", signed=True), scale)
        if name == "io.debezium.data.VariableScaleDecimal":
            return lambda v: decimal_text(int.from_bytes(_bytes(v["value"]), "big", signed=True), int(v["scale"]))
        if name in ("io.debezium.time.Date", "org.apache.kafka.connect.data.Date"):
            return lambda v: day(_int(v))
        if name in ("io.debezium.time.Time", "org.apache.kafka.connect.data.Time"):
            return lambda v: clock(_int(v) * _NS["ms"])
        if name == "io.debezium.time.MicroTime":
            return lambda v: clock(_int(v) * _NS["us"])
        if name == "io.debezium.time.NanoTime":
            return lambda v: clock(_int(v))
        if name in ("io.debezium.time.Timestamp", "org.apache.kafka.connect.data.Timestamp"):
            return lambda v: stamp(_int(v) * _NS["ms"])
        if name == "io.debezium.time.MicroTimestamp":
            return lambda v: stamp(_int(v) * _NS["us"])
        if name == "io.debezium.time.NanoTimestamp":
            return lambda v: stamp(_int(v))
        if name == "io.debezium.time.MicroDuration":
            return lambda v: f"{_int(v)} microseconds"
        if name == "io.debezium.data.Json":
            return json_value
        if name == "io.debezium.data.Bits":
            return lambda v: _bits(_bytes(v), params.get("length"))
        if kind == "bytes":
            return lambda v: "\\x" + _bytes(v).hex()
        return None


def _int(v: Any) -> int:
    if type(v) is not int:
        raise TypeError(f"expected an integer, got {type(v).__name__}")
    return v


def json_value(v: Any) -> Any:
    if type(v) is not str:
        raise TypeError(f"expected JSON text, got {type(v).__name__}")
    try:  # msgspec, not orjson: integers beyond 64 bits come back exact, not as floats
        return msgspec.json.decode(v)
    except msgspec.DecodeError as e:
        raise ValueError(f"not JSON: {e}") from None


def _bits(raw: bytes, length: Any) -> str:
    """Debezium's little-endian bit bytes as PostgreSQL's bit text, most significant bit first."""
    n = int(length) if length is not None and str(length).isdigit() and int(length) <= len(raw) * 8 else len(raw) * 8
    return format(int.from_bytes(raw, "little"), f"0{n}b")[-n:] if n else ""
