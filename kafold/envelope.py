"""The one record shape for events on Kafka: key = aggregate id, routing headers, a strict JSON body."""

from __future__ import annotations

import calendar
import dataclasses
import enum
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


_VARIANT = "89ab" * 4  # a hex digit with its two high bits set to 10 (RFC 4122's variant), by the digit
_KAFOLD_PREFIX = KAFOLD_NAMESPACE.bytes  # read once: UUID.bytes converts at each call


def uuid5(namespace: uuid.UUID, name: str) -> str:
    """str(uuid.uuid5(namespace, name)), computed without uuid.UUID objects (~4x faster; derived ids are made per
    event on hot paths; tests/core/test_envelope.py pins the equality): the SHA-1's first 16 bytes in hex, the
    version digit (13th) set to 5 and the variant bits in the 17th."""
    prefix = _KAFOLD_PREFIX if namespace is KAFOLD_NAMESPACE else namespace.bytes
    x = hashlib.sha1(prefix + name.encode()).hexdigest()
    return f"{x[:8]}-{x[8:12]}-5{x[13:16]}-{_VARIANT[int(x[16], 16)]}{x[17:20]}-{x[20:32]}"


def derive_event_id(command_id: str, index: int) -> str:
    """The deterministic id of the `index`-th event (0-based) produced by handling command `command_id`:
    uuid5(KAFOLD_NAMESPACE, f"{command_id}/{index}")."""
    if not command_id or index < 0:
        raise ValueError("derive_event_id needs a non-empty command id and an index >= 0")
    return uuid5(KAFOLD_NAMESPACE, f"{command_id}/{index}")


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


_LAST_SECOND: list[tuple[int, str]] = [(-1, "")]  # one (second, text up to it) pair, swapped whole: thread-safe
_LAST_MS: list[tuple[int, str]] = [(-1, "")]  # the last answer, (ms, text), swapped whole: thread-safe


def format_epoch_ms(ms: int) -> str:
    """Epoch milliseconds as an envelope time (what `format_time` writes for that instant, ~10x faster): the
    runtime spells a time per command and converters one per record, and neighbours share their second (commands
    produced together often their millisecond: the last answer is kept)."""
    last_ms = _LAST_MS[0]
    if last_ms[0] == ms:
        return last_ms[1]
    seconds, milli = divmod(ms, 1000)
    last = _LAST_SECOND[0]
    if last[0] != seconds:
        t = time.gmtime(seconds)
        last = (seconds, f"{t.tm_year:04d}-{t.tm_mon:02d}-{t.tm_mday:02d}T{t.tm_hour:02d}:{t.tm_min:02d}:"
                         f"{t.tm_sec:02d}.")
        _LAST_SECOND[0] = last
    text = f"{last[1]}{milli:03d}000Z"
    _LAST_MS[0] = (ms, text)
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


def _text(name: str, value: Any, optional: bool) -> None:
    if value is None and optional:
        return
    if type(value) is not str:
        raise _Invalid(name, f"expected a string, got {_kind(value)}")
    if not value or len(value) > MAX_ID_CHARS:
        raise _Invalid(name, f"expected 1..{MAX_ID_CHARS} characters, got {len(value)}")


def _count(name: str, value: Any, optional: bool) -> None:
    if type(value) is not int:
        raise _Invalid(name, f"expected an integer, got {_kind(value)}")
    if value < 1:
        raise _Invalid(name, f"must be >= 1, got {value}")
    if value > COUNT_MAX:
        raise _Invalid(name, f"must be <= {COUNT_MAX} (64-bit signed), got {value}")


def _time(name: str, value: Any, optional: bool) -> None:
    if type(value) is not str or not value.endswith("Z"):
        raise _Invalid(name, "expected an ISO-8601 UTC string ending in 'Z'")
    try:
        datetime.fromisoformat(value)
    except ValueError:
        raise _Invalid(name, "not an ISO-8601 timestamp") from None


def _object(name: str, value: Any, optional: bool) -> None:
    if type(value) is not dict:
        raise _Invalid(name, f"expected a JSON object, got {_kind(value)}")


def _kind(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), type(value).__name__)


class Kind(enum.Enum):
    """What an envelope field holds: its check, and the type msgspec checks it as on decode's fast path."""

    # (the check naming the defect, msgspec's type for the fast decoder, the same rule as one fast expression on `{v}`)
    ID = (_text, Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_CHARS)],
          "type({v}) is str and 0 < len({v}) <= MAX_ID_CHARS")  # 1..MAX_ID_CHARS characters
    COUNT = (_count, Annotated[int, msgspec.Meta(ge=1, le=COUNT_MAX)],
             "type({v}) is int and 1 <= {v} <= COUNT_MAX")  # outside: the strict path names the defect
    TIME = (_time, str, "type({v}) is str and {v}.endswith('Z') and parses({v})")  # ISO-8601 UTC ending in Z
    OBJECT = (_object, dict[str, Any], "type({v}) is dict")  # a JSON object


def _spec(kind: Kind, *, optional: bool = False) -> dict[str, Any]:
    """A field's schema: its kind; `optional` fields may be absent from a body (their default) or null (ids)."""
    return {"kind": kind, "optional": optional}


@dataclass(frozen=True, slots=True)
class Event:
    """One event as stored on Kafka. Immutable: change it with dataclasses.replace (payload is read-only by
    convention). `occurred_at` is an ISO-8601 UTC string ending in `Z` (see `occurred_at_datetime`).

    The envelope's one schema: each field's metadata says what it holds (`Kind`); the construction checks, the
    fast decoder's msgspec struct, the lenient reader of folds and the encoded body are all derived from it."""

    event_id: str = field(metadata=_spec(Kind.ID))
    type: str = field(metadata=_spec(Kind.ID))
    aggregate_type: str = field(metadata=_spec(Kind.ID))
    aggregate_id: str = field(metadata=_spec(Kind.ID))
    version: int = field(metadata=_spec(Kind.COUNT))
    occurred_at: str = field(metadata=_spec(Kind.TIME))
    correlation_id: str = field(metadata=_spec(Kind.ID))
    payload: dict[str, Any] = field(default_factory=dict, metadata=_spec(Kind.OBJECT))
    schema_version: int = field(default=1, metadata=_spec(Kind.COUNT, optional=True))
    causation_id: str | None = field(default=None, metadata=_spec(Kind.ID, optional=True))

    def __post_init__(self) -> None:
        # One generated expression that holds exactly when every check passes; any doubt takes the checks in schema
        # order, the first wrong field raising _Invalid that names it.
        if not _valid(self):
            for name, kind, optional in _RULES:
                kind.value[0](name, getattr(self, name), optional)

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


_SCHEMA = dataclasses.fields(Event)
NAMES = tuple(f.name for f in _SCHEMA)  # in the order of the encoded body
_REQUIRED = tuple(f.name for f in _SCHEMA if not f.metadata["optional"])
_RULES = tuple((f.name, f.metadata["kind"], f.metadata["optional"]) for f in _SCHEMA)  # (name, Kind, optional)


_LAST_PARSED: list[str] = ["1970-01-01T00:00:00.000000Z"]  # the last time that parsed (one item: thread-safe)


def _parses(at: str) -> bool:
    """`at` is an ISO-8601 time. A command's events and neighbouring commands share their time (the runtime spells
    it once a millisecond, format_epoch_ms), so the last one that parsed is kept."""
    if at == _LAST_PARSED[0]:
        return True
    try:
        datetime.fromisoformat(at)
    except ValueError:
        return False
    _LAST_PARSED[0] = at
    return True


def _rule(name: str, kind: Kind, optional: bool, *, bare: bool = False) -> str:
    """A field's rule as an expression on `e.<name>`, or on the variable `name` itself when `bare` (an optional id
    may be None)."""
    v = name if bare else f"e.{name}"
    rule = kind.value[2].format(v=v)
    return f"({v} is None or ({rule}))" if optional and kind is Kind.ID else f"({rule})"
_REQUIRED_SET = frozenset(_REQUIRED)
_FIELDS = frozenset(NAMES)
# A wire default is the dataclass default of an optional field (payload's default is for `Event(...)` in code only).
_DEFAULTS = {f.name: f.default for f in _SCHEMA if f.metadata["optional"]}
_SET = tuple(Event.__dict__[name].__set__ for name in NAMES)  # the slots' own setters


def _compiled(source: str, **namespace: Any) -> Any:
    """The function `source` defines (named `f`): the envelope's hot helpers are generated from the schema, unrolled,
    the way dataclasses writes a class's __init__, so the fields are spelled once (in `Event`) and cost no loop."""
    exec(source, namespace)
    return namespace["f"]


def _builder() -> Any:
    """`_build(source)`: an Event of the already validated fields of `source` (a fast-path body, or an Event), set
    through the slots' own setters without the frozen dataclass's per-field object.__setattr__ and __post_init__
    (~2 µs saved an event on decode's hot loop)."""
    sets = "".join(f"    s{i}(e, b.{name})\n" for i, name in enumerate(NAMES))
    return _compiled(f"def f(b):\n    e = new(Event)\n{sets}    return e\n", new=object.__new__, Event=Event,
                     **{f"s{i}": put for i, put in enumerate(_SET)})


_build = _builder()
# `_valid(event)`: True exactly when every field passes its check (Event.__post_init__'s fast path)
_valid = _compiled("def f(e):\n    return " + " and ".join(_rule(*check) for check in _RULES) + "\n",
                   parses=_parses, MAX_ID_CHARS=MAX_ID_CHARS, COUNT_MAX=COUNT_MAX)
# `_as_dict(event)`: the body's fields in schema order (a dict literal: twice as fast as orjson's own dataclass path)
_as_dict = _compiled("def f(e):\n    return {" + ", ".join(f"{n!r}: e.{n}" for n in NAMES) + "}\n")

# `_checked_body(*fields)`: the body of the Event these fields (in schema order) make, when every field passes its
# check; None on any doubt (Event(...) then names the defect). `_valid`'s rules, on the arguments themselves.
_checked_body = _compiled(
    "def f(" + ", ".join(f"v{i}" for i in range(len(NAMES))) + "):\n"
    "    if not (" + " and ".join(_rule(f"v{i}", kind, optional, bare=True) for i, (_, kind, optional)
                             in enumerate(_RULES)) + "):\n        return None\n"
    "    return {" + ", ".join(f"{n!r}: v{i}" for i, n in enumerate(NAMES)) + "}\n",
    parses=_parses, MAX_ID_CHARS=MAX_ID_CHARS, COUNT_MAX=COUNT_MAX)


def _struct(name: str, lenient: bool) -> type[msgspec.Struct]:
    """The envelope as a msgspec struct: strict (decode's fast path: every rule of `Event`'s checks but the time's,
    in C) or lenient (what a fold has always accepted: any value, unknown fields, only `LENIENT_REQUIRED` present)."""
    fields: list[Any] = []
    for f in _SCHEMA:
        kind, optional = f.metadata["kind"], f.metadata["optional"]
        if lenient:
            fields.append((f.name, Any, msgspec.NODEFAULT if f.name in LENIENT_REQUIRED else _DEFAULTS.get(f.name)))
        elif optional:
            fields.append((f.name, kind.value[1] | None if f.default is None else kind.value[1], f.default))
        else:
            fields.append((f.name, kind.value[1]))
    if lenient:  # the required ones first, as a struct wants them
        fields.sort(key=lambda x: len(x) == 3 and x[2] is not msgspec.NODEFAULT)
    return msgspec.defstruct(name, fields, forbid_unknown_fields=not lenient, gc=False, module=__name__)


# What a fold reads of an event no matter how loosely it was written: an event once folded stays foldable, though
# the envelope's decoder is stricter (unknown fields, version bounds, id lengths).
LENIENT_REQUIRED = frozenset({"type", "aggregate_id", "version", "payload"})
# msgspec keeps integers beyond 64 bits exact (orjson rounds them to floats); `_check_record` refuses them.
_BODY = msgspec.json.Decoder(_struct("Body", lenient=False))
_LENIENT = msgspec.json.Decoder(_struct("LenientBody", lenient=True))


def encode(event: Event, *, max_bytes: int = MAX_BYTES,
           max_depth: int = MAX_DEPTH) -> tuple[bytes, bytes, Headers]:
    """(key, value, headers) for producing `event`; refuses what `decode` would refuse (FatalError)."""
    return _record(_as_dict(event), event.event_id, event.type, event.aggregate_type, event.aggregate_id,
                   event.version, event.payload, max_bytes, max_depth)


def encode_new(event_id: str, type: str, aggregate_type: str, aggregate_id: str, version: int, occurred_at: str,
               correlation_id: str, payload: dict[str, Any], schema_version: int = 1, causation_id: str | None = None,
               *, flat: bool = False) -> tuple[bytes, bytes, Headers]:
    """`encode(Event(event_id, ...))`, the same bytes, without building the Event (a frozen dataclass's
    construction cost as much as the encoding: the runtime writes one per decided event). Invalid fields raise
    as `Event(...)` does (ValueError naming the field), a payload `encode` refuses raises FatalError. `flat`: the
    payload is known to hold no dict or list (the codec's flat classes), so its nesting is not walked."""
    body = _checked_body(event_id, type, aggregate_type, aggregate_id, version, occurred_at, correlation_id, payload,
                         schema_version, causation_id)
    if body is None:  # some field is wrong: the Event's own checks name it
        return encode(Event(event_id, type, aggregate_type, aggregate_id, version, occurred_at, correlation_id,
                            payload, schema_version, causation_id))
    return _record(body, event_id, type, aggregate_type, aggregate_id, version, None if flat else payload,
                   MAX_BYTES, MAX_DEPTH)


def _record(body: dict[str, Any], event_id: str, type: str, aggregate_type: str, aggregate_id: str, version: int,
            payload: dict[str, Any] | None, max_bytes: int, max_depth: int) -> tuple[bytes, bytes, Headers]:
    """(key, value, headers) of a valid event's `body`; `payload` None: known flat, its nesting not walked."""
    try:
        value = orjson.dumps(body)
    except orjson.JSONEncodeError as e:
        raise FatalError(f"event {event_id}: payload is not JSON-serializable: {e}") from e
    if len(value) > max_bytes:
        raise FatalError(f"event {event_id}: encoded size {len(value)} exceeds {max_bytes} bytes")
    if payload is not None and _nesting(payload, 1, max_depth)[0] > max_depth:
        raise FatalError(f"event {event_id}: payload nests deeper than {max_depth} levels")
    headers: Headers = [
        (H_TYPE, type.encode()), (H_ID, event_id.encode()),
        (H_VERSION, str(version).encode()), (H_AGGREGATE, aggregate_type.encode()),
    ]
    return aggregate_id.encode(), value, headers


def body_json(event: Event) -> bytes:
    """The event's JSON body, every field of the schema (what `encode` writes and a webhook's `body = "event"`
    sends); raises orjson.JSONEncodeError on a payload that is not JSON."""
    return orjson.dumps(_as_dict(event))


def _nesting(node: Any, level: int, limit: int) -> tuple[int, list[str | int] | None]:
    """(How deep `node` (a dict or list at `level`) nests, counted no further than limit + 1; the keys leading to its
    first integer beyond 64 bits, outside what orjson (and so kafold's encode) writes exactly, or None). One walk
    for both record checks: a payload is usually flat, and a second pass over it (or over the value's bytes)
    cost a decode as much as msgspec's own parse (docs/benchmarks.md, envelope decode)."""
    deepest, wide = level, None
    for k, child in node.items() if type(node) is dict else enumerate(node):
        kind = type(child)
        if kind is int:
            if wide is None and not INT_MIN <= child <= INT_MAX:
                wide = [k]
        elif kind is dict or kind is list:
            if level >= limit:
                return limit + 1, wide
            depth, found = _nesting(child, level + 1, limit)
            if wide is None and found is not None:
                wide = [k, *found]
            if depth > deepest:
                deepest = depth
                if depth > limit:
                    return depth, wide
    return deepest, wide


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


def peek_body(value: bytes | None) -> Any | None:
    """The body's fields as the fast path checks them in C (every rule of `Event`'s checks but the time's), without
    building an Event; None on any doubt. Folds read events through it: attribute reads, no Event, no time parse."""
    try:
        return _BODY.decode(value)  # type: ignore[arg-type]
    except (msgspec.MsgspecError, ValueError, TypeError, RecursionError):  # RecursionError: hostile nesting
        return None


def lenient_body(value: bytes | None) -> Any:
    """The body's fields as a fold reads them when `peek_body` declined: any values (the fold checks what it uses),
    unknown fields ignored; raises (msgspec.MsgspecError, TypeError) when it is no JSON object with
    `LENIENT_REQUIRED`."""
    return _LENIENT.decode(value)  # type: ignore[arg-type]


def _fast_body(value: bytes) -> Event | None:
    """The Event when the body is valid by every rule of `Event`'s checks; None on any doubt (the strict path then
    decides, and names the defect). Differential-tested against the strict path (tests/core/test_envelope.py)."""
    b = _valid_body(value)
    return None if b is None else _build(b)


def _valid_body(value: bytes) -> Any | None:
    """`_fast_body`'s checks without the Event: the body (`peek_body`'s struct), or None on any doubt."""
    b = peek_body(value)
    if b is None:
        return None
    at = b.occurred_at
    if not at.endswith("Z"):
        return None
    try:
        datetime.fromisoformat(at)
    except ValueError:
        return None
    return b


_RESHAPED = tuple(_SET[NAMES.index(name)] for name in ("type", "schema_version", "payload"))


def reshaped(event: Event, type_name: str, schema_version: int, payload: dict[str, Any]) -> Event:
    """`event` with another type, schema version and payload (an upcaster's output; kafold.upcast checks them),
    built through the slots as the fast path builds events: the other fields were validated when it was decoded."""
    if type(type_name) is not str or not 0 < len(type_name) <= MAX_ID_CHARS or type(payload) is not dict:
        return dataclasses.replace(event, type=type_name, schema_version=schema_version, payload=payload)  # names it
    out = _build(event)
    set_type, set_version, set_payload = _RESHAPED
    set_type(out, type_name)
    set_version(out, schema_version)
    set_payload(out, payload)
    return out


_SET_PAYLOAD = _SET[NAMES.index("payload")]


def adopt_payload(event: Event, payload: dict[str, Any]) -> Event:
    """`event` itself with `payload` in place of its own, for a reader that has just decoded it and holds its only
    reference (the sink intake opening protected fields): a copy (`reshaped`) cost a fifth of the opening. Nothing
    else may call it: an Event is immutable once shared."""
    _SET_PAYLOAD(event, payload)
    return event


def decode(key: bytes | None, value: bytes | None, headers: Sequence[tuple[str, bytes | None]] | None, *,
           raw: Any = None, max_bytes: int = MAX_BYTES, max_depth: int = MAX_DEPTH) -> Event:
    """The Event in a Kafka record; any defect raises DecodeError naming the field and carrying `raw`."""
    body = record_body(key, value, headers, raw=raw, max_bytes=max_bytes, max_depth=max_depth)
    if body is not None:
        return _build(body)
    event = _strict_body(value, raw, max_bytes)
    return _check_record(event, key, value, headers, raw, max_depth)  # type: ignore[arg-type]


def record_body(key: bytes | None, value: bytes | None, headers: Sequence[tuple[str, bytes | None]] | None, *,
                 raw: Any = None, max_bytes: int = MAX_BYTES, max_depth: int = MAX_DEPTH) -> Any | None:
    """`decode`'s fast path without the Event: the record's body (a msgspec struct with the Event's fields, the very
    values `decode`'s Event would hold) when the record is valid by every rule `decode` applies; None when the body
    is in doubt (then `decode`'s strict path decides and names the defect); DecodeError, as `decode` raises it, for
    a valid body in a wrong record (nesting, 64-bit range, key, routing headers). A reader that needs only some
    fields of many events (a projection's whole rows, connectors/projection/whole_batch.py) reads them from it."""
    if value is None or len(value) > max_bytes:
        return None
    body = _valid_body(value)
    if body is None:
        return None
    return _check_record(body, key, value, headers, raw, max_depth)


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


def _check_record(event: Event, key: bytes | None, value: bytes, headers: Sequence[tuple[str, bytes | None]] | None,
                  raw: Any, max_depth: int) -> Event:
    """The record-level rules around a valid body: nesting depth, key, routing headers."""
    depth, wide = _nesting(event.payload, 1, max_depth)
    if depth > max_depth:
        raise _fail(raw, "payload", f"nests deeper than {max_depth} levels", "too-deep")
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
