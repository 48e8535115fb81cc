"""The `json` converter: a plain JSON record as an Event, its fields taken from JSON paths, headers or the record.

Sources (option values in `[connectors.convert]`):
- `"meta.id"`: a dotted path into the JSON value (`a.b.0` indexes a list); `"$"` is the whole value;
- `"header:name"`: the record header `name` (utf-8);
- `"@key"`, `"@topic"`, `"@partition"`, `"@offset"`, `"@timestamp"`: the record's own coordinates;
- `"'Literal'"`: a constant (for `type`).
Defaults: id = a uuid5 of topic/partition/offset (a redelivered record, same offset, dedups); type = the topic;
key = the record key (utf-8); version = offset + 1 (the version guard orders by the partition); time = the record's
timestamp. A value that is not an object becomes the payload `{"value": v}`.
"""

from __future__ import annotations

import uuid
from typing import Any

import orjson

from kafold.connectors.convert.api import ConvertError, Headers, ValueFormat, where
from kafold.envelope import Event, format_epoch_ms, utc_now, uuid5

NAMESPACE = uuid.UUID("6f1c3b0e-5b8a-4f0e-9a55-6b6166f1d000")  # kafold's uuid5 namespace for derived event ids
COORDS = ("@key", "@topic", "@partition", "@offset", "@timestamp")


class JsonFormat:
    """JSON bytes as a Python value (orjson)."""

    def load(self, topic: str, data: bytes, *, is_key: bool) -> Any:
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError as e:
            raise ConvertError(f"topic {topic!r}: the record {'key' if is_key else 'value'} is not valid JSON "
                               f"({e})") from None


def check_source(src: str) -> str | None:
    """None if `src` is a valid source, else what is wrong with it."""
    if not isinstance(src, str) or not src:
        return "expected a non-empty string"
    if src.startswith("@") and src not in COORDS:
        return f"unknown record coordinate {src!r} (one of {', '.join(COORDS)})"
    if src.startswith("header:") and not src[7:]:
        return "expected header:<name>"
    if src != "$" and not src.startswith(("@", "header:", "'")) and not all(src.removeprefix("$.").split(".")):
        return f"empty step in path {src!r}"
    return None


def steps(path: str) -> tuple[str, ...]:
    return () if path == "$" else tuple(path.removeprefix("$.").split("."))


MISSING = object()


def lookup(value: Any, path: tuple[str, ...]) -> Any:
    """The value at `path`, or MISSING."""
    node = value
    for step in path:
        if isinstance(node, dict):
            node = node.get(step, MISSING)
        elif isinstance(node, list) and step.isdigit() and int(step) < len(node):
            node = node[int(step)]
        else:
            return MISSING
        if node is MISSING:
            return node
    return node


def header(headers: Headers, name: str) -> str | None:
    for k, v in headers or ():
        if k == name and v is not None:
            return v.decode("utf-8", "replace")
    return None


class JsonConverter:
    """Maps a decoded value onto an Event by the configured sources (see the module docstring)."""

    def __init__(self, options: Any, fmt: ValueFormat | None = None) -> None:
        self.fmt: ValueFormat = fmt if fmt is not None else JsonFormat()
        self.sources = {name: getattr(options, name) for name in ("id", "type", "key", "version", "time")}
        # each JSON path split once here, not once per record
        self.paths = {src: steps(src) for src in self.sources.values() if src}
        self.aggregate_type = options.aggregate_type

    def source(self, name: str, src: str, body: Any, key: bytes | None, headers: Headers, topic: str,
               partition: int, offset: int, timestamp_ms: int | None, raw: Any) -> Any:
        if src.startswith("'"):
            return src.strip("'")
        if src.startswith("header:"):
            got: Any = header(headers, src[7:])
        elif src == "@key":
            got = key.decode("utf-8", "replace") if key is not None else None
        elif src == "@topic":
            got = topic
        elif src == "@partition":
            got = partition
        elif src == "@offset":
            got = offset
        elif src == "@timestamp":
            got = timestamp_ms
        else:
            got = lookup(body, self.paths[src])
            if got is MISSING:
                raise ConvertError(f"{where(topic, partition, offset)}: {name} path {src!r} is missing", raw=raw)
        if got is None:
            raise ConvertError(f"{where(topic, partition, offset)}: {name} source {src!r} is empty", raw=raw)
        return got

    def event(self, key: bytes | None, value: bytes | None, headers: Headers, *, topic: str, partition: int,
              offset: int, timestamp_ms: int | None, raw: Any) -> Event:
        at = where(topic, partition, offset)
        if value is None:
            raise ConvertError(f"{at}: no value (a tombstone carries no event)", raw=raw)
        try:
            body = self.fmt.load(topic, value, is_key=False)
        except ConvertError as e:
            raise ConvertError(f"{at}: {e}", raw=raw, reason=e.reason) from None
        got: dict[str, Any] = {}
        for name, src in self.sources.items():
            if src:
                got[name] = self.source(name, src, body, key, headers, topic, partition, offset, timestamp_ms, raw)
        event_id = str(got["id"]) if "id" in got else uuid5(NAMESPACE, f"{topic}/{partition}/{offset}")
        aggregate_id = str(got["key"]) if "key" in got else (
            key.decode("utf-8", "replace") if key is not None else "")
        if not aggregate_id:
            raise ConvertError(f"{at}: no key (the record has no key and no `key` source is set)", raw=raw)
        version = got.get("version", offset + 1)
        if type(version) is str and version.isdigit():
            version = int(version)
        if type(version) is not int or version < 1:
            raise ConvertError(f"{at}: version source {self.sources['version']!r} gave {version!r}, "
                               "expected an integer >= 1", raw=raw)
        occurred = got.get("time", timestamp_ms)
        try:
            occurred_at = (format_epoch_ms(occurred) if type(occurred) is int else str(occurred) if occurred
                           else utc_now())
            return Event(event_id=event_id, type=str(got.get("type", topic)), aggregate_type=self.aggregate_type
                         or topic, aggregate_id=aggregate_id, version=version, occurred_at=occurred_at,
                         correlation_id=event_id, payload=body if type(body) is dict else {"value": body})
        except ValueError as e:  # envelope checks (kafold.envelope._Invalid names the field)
            raise ConvertError(f"{at}: {e}", raw=raw) from None
