"""The one record shape for events on Kafka: key = aggregate id, routing headers, a strict JSON body."""

from __future__ import annotations

import calendar
import dataclasses
import hashlib
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Annotated, Any

import msgspec
import orjson

from kafold.errors import DecodeError, FatalError

MAX_BYTES = 1_000_000
MAX_DEPTH = 32
# The integers a payload may hold: what orjson (and so `encode`) writes exactly. Beyond them JSON decoders round to
# a float; `decode` refuses such a payload (reason int-range) rather than hand on a silently changed number.
INT_MIN, INT_MAX = -(2**63), 2**64 - 1
# Versions are PostgreSQL bigints and Kafka offsets' width: above this a version is refused on both decode paths.
COUNT_MAX = 2**63 - 1
MAX_ID_CHARS = 256

H_TYPE = "kafold-type"
H_ID = "kafold-id"
H_VERSION = "kafold-version"
H_AGGREGATE = "kafold-aggregate"
ROUTING_HEADERS = (H_TYPE, H_ID, H_VERSION, H_AGGREGATE)

# Derived event ids are uuid5(KAFOLD_NAMESPACE, f"{command_id}/{index}"): a replayed command yields the
# same ids, so consumers can drop the duplicates.
KAFOLD_NAMESPACE = uuid.UUID("6b1f3c2e-8a4d-5e7f-9c0b-1d2e3f4a5b6c")

Headers = list[tuple[str, str | bytes | None]]  # the shape confluent-kafka produces and consumes


_NS = KAFOLD_NAMESPACE.bytes


def derive_event_id(command_id: str, index: int) -> str:
    """The deterministic id of the `index`-th event (0-based) produced by handling command `command_id`:
    str(uuid.uuid5(KAFOLD_NAMESPACE, f"{command_id}/{index}")), computed without uuid.UUID objects (~3x faster;
    tests/core/test_envelope.py pins the equality)."""
    if not command_id or index < 0:
        raise ValueError("derive_event_id needs a non-empty command id and an index >= 0")
    h = bytearray(hashlib.sha1(_NS + f"{command_id}/{index}".encode()).digest()[:16])
    h[6] = (h[6] & 0x0F) | 0x50  # version 5
    h[8] = (h[8] & 0x3F) | 0x80  # RFC 4122 variant
    x = h.hex()
    return f"{x[:8]}-{x[8:12]}-{x[12:16]}-{x[16:20]}-{x[20:]}"


def utc_now() -> str:
    """Now, as the envelope spells time: ISO-8601 UTC with microseconds and a `Z` suffix."""
    return format_time(datetime.now(UTC))


_LAST_EPOCH: list[tuple[str, int]] = [("", 0)]  # one (time, ms) pair, swapped whole: safe across threads


def epoch_ms(iso: str) -> int:
    """An envelope time (ISO-8601 UTC, as `utc_now` spells it) as epoch milliseconds. Replays meet runs of events
    with one time (a command's events share it), so the last answer is kept."""
    last = _LAST_EPOCH[0]
    if last[0] == iso:
        return last[1]
    moment = datetime.fromisoformat(iso)  # exact integer arithmetic: a float timestamp rounds 8.097 s down
    ms = calendar.timegm(moment.utctimetuple()) * 1000 + moment.microsecond // 1000
    _LAST_EPOCH[0] = (iso, ms)
    return ms


_LAST_FORMATTED: list[tuple[int, str]] = [(-1, "")]  # one (ms, text) pair, swapped whole: safe across threads


def format_epoch_ms(ms: int) -> str:
    """Epoch milliseconds as an envelope time (what `format_time` writes for that instant, ~10x faster; the
    runtime spells a time per command, and a batch's commands often share one millisecond)."""
    last = _LAST_FORMATTED[0]
    if last[0] == ms:
        return last[1]
    seconds, milli = divmod(ms, 1000)
    t = time.gmtime(seconds)
    text = (f"{t.tm_year:04d}-{t.tm_mon:02d}-{t.tm_mday:02d}T{t.tm_hour:02d}:{t.tm_min:02d}:{t.tm_sec:02d}"
            f".{milli:03d}000Z")
    _LAST_FORMATTED[0] = (ms, text)
    return text


def format_time(moment: datetime) -> str:
    """An aware datetime as an envelope timestamp (`2024-05-01T12:00:00.000000Z`)."""
    if moment.tzinfo is None:
        raise ValueError("occurred_at must be timezone-aware")
    return moment.astimezone(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


class _Invalid(ValueError):
    """A field of an Event is wrong; `field` names it."""

    def __init__(self, field_name: str, message: str, reason: str = "wrong-type") -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.reason = reason


def _text(name: str, value: Any, optional: bool = False) -> None:
    if value is None and optional:
        return
    if type(value) is not str:
        raise _Invalid(name, f"expected a string, got {_kind(value)}")
    if not value or len(value) > MAX_ID_CHARS:
        raise _Invalid(name, f"expected 1..{MAX_ID_CHARS} characters, got {len(value)}")


def _count(name: str, value: Any) -> None:
    if type(value) is not int:
        raise _Invalid(name, f"expected an integer, got {_kind(value)}")
    if value < 1:
        raise _Invalid(name, f"must be >= 1, got {value}")
    if value > COUNT_MAX:
        raise _Invalid(name, f"must be <= {COUNT_MAX} (64-bit signed), got {value}")


def _kind(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), type(value).__name__)


@dataclass(frozen=True, slots=True)
class Event:
    """One event as stored on Kafka. Immutable: change it with dataclasses.replace (payload is read-only by
    convention). `occurred_at` is an ISO-8601 UTC string ending in `Z` (see `occurred_at_datetime`)."""

    event_id: str
    type: str
    aggregate_type: str
    aggregate_id: str
    version: int
    occurred_at: str
    correlation_id: str
    payload: dict[str, Any] = field(default_factory=dict)
    schema_version: int = 1
    causation_id: str | None = None

    def __post_init__(self) -> None:
        # Fast path (decode's hot loop): one expression that holds exactly when every check below passes; any
        # doubt falls through to the checks, which name the field.
        at, cause, m = self.occurred_at, self.causation_id, MAX_ID_CHARS
        if (type(self.event_id) is str and 0 < len(self.event_id) <= m and type(self.type) is str
                and 0 < len(self.type) <= m and type(self.aggregate_type) is str
                and 0 < len(self.aggregate_type) <= m and type(self.aggregate_id) is str
                and 0 < len(self.aggregate_id) <= m and type(self.correlation_id) is str
                and 0 < len(self.correlation_id) <= m
                and (cause is None or (type(cause) is str and 0 < len(cause) <= m))
                and type(self.version) is int and 1 <= self.version <= COUNT_MAX
                and type(self.schema_version) is int and 1 <= self.schema_version <= COUNT_MAX
                and type(self.payload) is dict and type(at) is str
                and at.endswith("Z")):
            try:
                datetime.fromisoformat(at)
                return
            except ValueError:
                pass
        self._check()

    def _check(self) -> None:
        """Every field check in order; raises _Invalid naming the first wrong field."""
        _text("event_id", self.event_id)
        _text("type", self.type)
        _text("aggregate_type", self.aggregate_type)
        _text("aggregate_id", self.aggregate_id)
        _count("version", self.version)
        _count("schema_version", self.schema_version)
        _text("correlation_id", self.correlation_id)
        _text("causation_id", self.causation_id, optional=True)
        if type(self.payload) is not dict:
            raise _Invalid("payload", f"expected a JSON object, got {_kind(self.payload)}")
        at = self.occurred_at
        if type(at) is not str or not at.endswith("Z"):
            raise _Invalid("occurred_at", "expected an ISO-8601 UTC string ending in 'Z'")
        try:
            datetime.fromisoformat(at)
        except ValueError:
            raise _Invalid("occurred_at", "not an ISO-8601 timestamp") from None

    @classmethod
    def new(cls, type: str, aggregate_type: str, aggregate_id: str, version: int, payload: dict[str, Any], *,
            event_id: str | None = None, correlation_id: str | None = None, causation_id: str | None = None,
            occurred_at: datetime | str | None = None, schema_version: int = 1) -> Event:
        """Build an event, filling a random id, correlation = own id, and now as `occurred_at`."""
        eid = event_id or str(uuid.uuid4())
        at = format_time(occurred_at) if isinstance(occurred_at, datetime) else (occurred_at or utc_now())
        return cls(eid, type, aggregate_type, aggregate_id, version, at, correlation_id or eid, payload,
                   schema_version, causation_id)

    @property
    def occurred_at_datetime(self) -> datetime:
        return datetime.fromisoformat(self.occurred_at)


_REQUIRED = ("event_id", "type", "aggregate_type", "aggregate_id", "version", "occurred_at", "correlation_id",
             "payload")
_REQUIRED_SET = frozenset(_REQUIRED)
_FIELDS = frozenset((*_REQUIRED, "schema_version", "causation_id"))


def encode(event: Event, *, max_bytes: int = MAX_BYTES,
           max_depth: int = MAX_DEPTH) -> tuple[bytes, bytes, Headers]:
    """(key, value, headers) for producing `event`; refuses what `decode` would refuse (FatalError)."""
    body = {
        "event_id": event.event_id, "type": event.type, "aggregate_type": event.aggregate_type,
        "aggregate_id": event.aggregate_id, "version": event.version, "schema_version": event.schema_version,
        "occurred_at": event.occurred_at, "correlation_id": event.correlation_id,
        "causation_id": event.causation_id, "payload": event.payload,
    }
    try:
        value = orjson.dumps(body)
    except orjson.JSONEncodeError as e:
        raise FatalError(f"event {event.event_id}: payload is not JSON-serializable: {e}") from e
    if len(value) > max_bytes:
        raise FatalError(f"event {event.event_id}: encoded size {len(value)} exceeds {max_bytes} bytes")
    if _too_deep(value, event.payload, max_depth):
        raise FatalError(f"event {event.event_id}: payload nests deeper than {max_depth} levels")
    headers: Headers = [
        (H_TYPE, event.type.encode()), (H_ID, event.event_id.encode()),
        (H_VERSION, str(event.version).encode()), (H_AGGREGATE, event.aggregate_type.encode()),
    ]
    return event.aggregate_id.encode(), value, headers


def _too_deep(value: bytes, payload: Any, max_depth: int) -> bool:
    # Cheap pre-check: fewer brackets in the whole body than the limit means the payload cannot be too deep.
    if value.count(b"{") + value.count(b"[") <= max_depth:
        return False
    return _depth(payload, 1, max_depth) > max_depth


def _depth(node: Any, level: int, limit: int) -> int:
    if level > limit:
        return level
    deepest = level
    children = node.values() if type(node) is dict else node
    for child in children:
        if type(child) is dict or type(child) is list:
            deepest = max(deepest, _depth(child, level + 1, limit))
            if deepest > limit:
                break
    return deepest


def _fail(raw: Any, field_name: str, message: str, reason: str) -> DecodeError:
    return DecodeError(f"invalid kafold envelope: {field_name}: {message}", raw=raw, reason=reason)


def _routing(headers: Sequence[tuple[str, bytes | None]] | None, raw: Any) -> dict[str, str]:
    found: dict[str, str] = {}
    for name, val in headers or ():
        if name not in ROUTING_HEADERS:
            continue
        if name in found:
            raise _fail(raw, f"header {name}", "appears more than once", "header-mismatch")
        if val is None:
            raise _fail(raw, f"header {name}", "has no value", "missing-header")
        try:
            found[name] = val.decode("utf-8")
        except UnicodeDecodeError:
            raise _fail(raw, f"header {name}", "is not valid UTF-8", "bad-utf8") from None
    for name in ROUTING_HEADERS:
        if name not in found:
            raise _fail(raw, f"header {name}", "missing", "missing-header")
    return found


def _version_header(text: str, raw: Any) -> int:
    if not text.isascii() or not text.isdigit():
        raise _fail(raw, f"header {H_VERSION}", "expected a decimal integer", "wrong-type")
    return int(text)


def peek_headers(headers: Sequence[tuple[str, bytes | None]] | None, *,
                 raw: Any = None) -> tuple[str, str, int]:
    """(type, event id, version) from the routing headers alone, without decoding the value."""
    found = _routing(headers, raw)
    return found[H_TYPE], found[H_ID], _version_header(found[H_VERSION], raw)


_Id = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_CHARS)]
_Count = Annotated[int, msgspec.Meta(ge=1, le=COUNT_MAX)]  # outside: the strict path names the defect


class _Body(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    """The envelope fields and the payload as msgspec checks and builds them in C, in one pass: decode's fast path.
    msgspec keeps integers beyond 64 bits exact (orjson rounds them to floats); `_check_record` refuses them."""

    event_id: _Id
    type: _Id
    aggregate_type: _Id
    aggregate_id: _Id
    version: _Count
    occurred_at: str
    correlation_id: _Id
    payload: dict[str, Any]
    schema_version: _Count = 1
    causation_id: _Id | None = None


_BODY = msgspec.json.Decoder(_Body)
_new_event = object.__new__
# The slots' own setters: the fast path fills an Event whose every field msgspec (and the checks below) already
# validated, without the frozen dataclass's per-field object.__setattr__ and __post_init__ (~2 µs an event).
_SET = tuple(Event.__dict__[name].__set__ for name in ("event_id", "type", "aggregate_type", "aggregate_id",
                                                      "version", "occurred_at", "correlation_id", "schema_version",
                                                      "causation_id", "payload"))


def peek_body(value: bytes | None) -> _Body | None:
    """The body's fields as the fast path checks them in C (every rule of `Event._check` but the time's), without
    building an Event; None on any doubt. Folds read events through it: attribute reads, no Event, no time parse."""
    try:
        return _BODY.decode(value)  # type: ignore[arg-type]
    except (msgspec.MsgspecError, ValueError, TypeError, RecursionError):  # RecursionError: hostile nesting
        return None


def _fast_body(value: bytes) -> Event | None:
    """The Event when the body is valid by every rule of `Event._check`; None on any doubt (the strict path then
    decides, and names the defect). Differential-tested against the strict path (tests/core/test_envelope.py)."""
    b = peek_body(value)
    if b is None:
        return None
    at, payload = b.occurred_at, b.payload
    if not at.endswith("Z"):
        return None
    try:
        datetime.fromisoformat(at)
    except ValueError:
        return None
    event = _new_event(Event)
    s = _SET
    s[0](event, b.event_id)
    s[1](event, b.type)
    s[2](event, b.aggregate_type)
    s[3](event, b.aggregate_id)
    s[4](event, b.version)
    s[5](event, at)
    s[6](event, b.correlation_id)
    s[7](event, b.schema_version)
    s[8](event, b.causation_id)
    s[9](event, payload)
    return event


def reshaped(event: Event, type_name: str, schema_version: int, payload: dict[str, Any]) -> Event:
    """`event` with another type, schema version and payload (an upcaster's output; kafold.upcast checks them),
    built through the slots as the fast path builds events: the other fields were validated when it was decoded."""
    if type(type_name) is not str or not 0 < len(type_name) <= MAX_ID_CHARS or type(payload) is not dict:
        return dataclasses.replace(event, type=type_name, schema_version=schema_version, payload=payload)  # names it
    out = _new_event(Event)
    s = _SET
    s[0](out, event.event_id)
    s[1](out, type_name)
    s[2](out, event.aggregate_type)
    s[3](out, event.aggregate_id)
    s[4](out, event.version)
    s[5](out, event.occurred_at)
    s[6](out, event.correlation_id)
    s[7](out, schema_version)
    s[8](out, event.causation_id)
    s[9](out, payload)
    return out


def decode(key: bytes | None, value: bytes | None, headers: Sequence[tuple[str, bytes | None]] | None, *,
           raw: Any = None, max_bytes: int = MAX_BYTES, max_depth: int = MAX_DEPTH) -> Event:
    """The Event in a Kafka record; any defect raises DecodeError naming the field and carrying `raw`."""
    event = _fast_body(value) if value is not None and len(value) <= max_bytes else None
    if event is None:
        event = _strict_body(value, raw, max_bytes)
    return _check_record(event, key, value, headers, raw, max_depth)  # type: ignore[arg-type]


def _strict_body(value: bytes | None, raw: Any, max_bytes: int) -> Event:
    """The body's Event by the step-by-step checks: the first defect raises DecodeError naming it."""
    if value is None:
        raise _fail(raw, "value", "missing (a tombstone is not an event)", "missing-field")
    if len(value) > max_bytes:
        raise _fail(raw, "value", f"{len(value)} bytes exceeds the {max_bytes}-byte limit", "too-large")
    try:
        body = orjson.loads(value)
    except orjson.JSONDecodeError as e:
        text = str(e)
        reason = ("bad-utf8" if "UTF-8" in text else "too-deep" if "recursion" in text or "depth" in text
                  else "bad-json")
        raise _fail(raw, "value", f"not valid JSON ({text})", reason) from None
    if type(body) is not dict:
        raise _fail(raw, "value", f"expected a JSON object, got {_kind(body)}", "wrong-type")
    if not _FIELDS.issuperset(body):
        extra = sorted(str(k) for k in body if k not in _FIELDS)[0]
        raise _fail(raw, extra, "unknown field", "unknown-field")
    if not body.keys() >= _REQUIRED_SET:
        missing = next(name for name in _REQUIRED if name not in body)
        raise _fail(raw, missing, "missing", "missing-field")
    if type(body.get("payload")) is dict:
        try:  # orjson rounds integers beyond 64 bits to floats: the payload again, exactly, as the fast path has it
            body["payload"] = msgspec.json.decode(value)["payload"]
        except (msgspec.MsgspecError, ValueError, RecursionError):
            pass  # deeper than msgspec goes: refused as too deep by _check_record
    try:
        event = Event(**body)
    except _Invalid as e:
        raise _fail(raw, e.field, str(e).partition(": ")[2], e.reason) from None
    return event


def _wide_int(node: Any) -> list[str | int] | None:
    """The keys leading to an integer in `node` (dict or list) beyond 64 bits, outside what orjson (and so kafold's
    encode) writes exactly; None when there is none."""
    for k, child in node.items() if type(node) is dict else enumerate(node):
        kind = type(child)
        if kind is int and not INT_MIN <= child <= INT_MAX:
            return [k]
        if kind is dict or kind is list:
            found = _wide_int(child)
            if found is not None:
                return [k, *found]
    return None


def _check_record(event: Event, key: bytes | None, value: bytes, headers: Sequence[tuple[str, bytes | None]] | None,
                  raw: Any, max_depth: int) -> Event:
    """The record-level rules around a valid body: nesting depth, key, routing headers."""
    if _too_deep(value, event.payload, max_depth):
        raise _fail(raw, "payload", f"nests deeper than {max_depth} levels", "too-deep")
    wide = _wide_int(event.payload)
    if wide is not None:  # JSON decoders (orjson among them) would round it to a float: refused, never rounded
        where = "payload" + "".join(f"[{k}]" if type(k) is int else f".{str(k)[:40]}" for k in wide)
        raise _fail(raw, where, "integer beyond 64 bits (send it as a string)", "int-range")
    # Fast path: kafold's own encoding (exactly the four routing headers, in order, bytes equal to the body's
    # fields, key equal to the aggregate id) is accepted by byte comparison; anything else takes the checks below.
    if headers is not None and len(headers) == 4 and key == event.aggregate_id.encode():
        (n0, v0), (n1, v1), (n2, v2), (n3, v3) = headers
        if (n0 == H_TYPE and n1 == H_ID and n2 == H_VERSION and n3 == H_AGGREGATE and v0 == event.type.encode()
                and v1 == event.event_id.encode() and v2 == str(event.version).encode()
                and v3 == event.aggregate_type.encode()):
            return event
    if key is None:
        raise _fail(raw, "key", "missing (must be the aggregate id)", "missing-field")
    try:
        key_text = key.decode("utf-8")
    except UnicodeDecodeError:
        raise _fail(raw, "key", "is not valid UTF-8", "bad-utf8") from None
    if key_text != event.aggregate_id:
        raise _fail(raw, "key", "does not match aggregate_id", "header-mismatch")
    found = _routing(headers, raw)
    if found[H_TYPE] != event.type:
        raise _fail(raw, f"header {H_TYPE}", "does not match type", "header-mismatch")
    if found[H_ID] != event.event_id:
        raise _fail(raw, f"header {H_ID}", "does not match event_id", "header-mismatch")
    if _version_header(found[H_VERSION], raw) != event.version:
        raise _fail(raw, f"header {H_VERSION}", "does not match version", "header-mismatch")
    if found[H_AGGREGATE] != event.aggregate_type:
        raise _fail(raw, f"header {H_AGGREGATE}", "does not match aggregate_type", "header-mismatch")
    return event
