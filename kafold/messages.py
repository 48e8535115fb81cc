"""The wire types of aggregates: the command envelope and the result record (see docs/aggregates.md), shared by
clients, the runtime and connectors."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgspec
import orjson

from kafold.envelope import MAX_BYTES, MAX_ID_CHARS, Headers, utc_now
from kafold.errors import DecodeError
from kafold.frozen import quick_init

H_COMMAND_TYPE = "kafold-command-type"
H_COMMAND_ID = "kafold-command-id"
H_AGGREGATE = "kafold-aggregate"
ACCEPTED, REJECTED = "accepted", "rejected"

_COMMAND_FIELDS = frozenset({"command_id", "type", "aggregate_type", "aggregate_id", "expected_version", "data",
                             "correlation_id", "issued_at"})


@quick_init
@dataclass(frozen=True, slots=True)
class Command:
    """A request to an aggregate. Key = aggregate id; `expected_version` None = no concurrency check."""

    command_id: str
    type: str
    aggregate_id: str
    data: dict[str, Any] = field(default_factory=dict)
    aggregate_type: str = ""
    expected_version: int | None = None
    correlation_id: str = ""
    issued_at: str = ""

    @classmethod
    def new(cls, aggregate_type: str, aggregate_id: str, type: str, data: dict[str, Any] | None = None, *,
            expected_version: int | None = None, command_id: str | None = None,
            correlation_id: str | None = None) -> Command:
        cid = command_id or str(uuid.uuid4())
        return cls(cid, type, aggregate_id, dict(data or {}), aggregate_type, expected_version,
                   correlation_id or cid, utc_now())

    def encode(self) -> tuple[bytes, bytes, Headers]:
        body = {"command_id": self.command_id, "type": self.type, "aggregate_type": self.aggregate_type,
                "aggregate_id": self.aggregate_id, "expected_version": self.expected_version, "data": self.data,
                "correlation_id": self.correlation_id or self.command_id, "issued_at": self.issued_at}
        headers: Headers = [(H_COMMAND_TYPE, self.type.encode()), (H_COMMAND_ID, self.command_id.encode()),
                            (H_AGGREGATE, self.aggregate_type.encode())]
        return self.aggregate_id.encode(), orjson.dumps(body), headers


def _bad(raw: Any, message: str, reason: str) -> DecodeError:
    return DecodeError(f"invalid command: {message}", raw=raw, reason=reason)


_ID = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_CHARS)]


class _Envelope(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    """decode_command's fast path: the envelope's rules checked in C as one msgspec decode. `data` is kept as its raw
    JSON and parsed by orjson, as the checked path parses the whole value, so the command's data is the same objects
    whichever path read it (orjson and msgspec differ on integers beyond 64 bits)."""

    command_id: _ID
    type: _ID
    aggregate_id: _ID
    data: msgspec.Raw
    aggregate_type: str = ""
    expected_version: Annotated[int, msgspec.Meta(ge=0)] | None = None
    correlation_id: str | None = None
    issued_at: str = ""


_ENVELOPE = msgspec.json.Decoder(_Envelope)
# Nesting a `data` of fewer openers than this cannot reach orjson's depth limit on the whole value (1024), which the
# checked path meets and the fast path's parse of `data` alone, one level shallower, would not.
_FAST_OPENERS = 512


def decode_command(key: bytes | None, value: bytes | None, *, raw: Any = None) -> Command:
    """The Command in a record; DecodeError names the defect (the record is then rejected and dead-lettered).

    Two paths, one answer: msgspec's decode of the envelope (`_decode_fast`, the common case, ~1 µs less a command),
    and on any doubt the checked path, which names the defect."""
    return _decode_fast(key, value) or _decode_checked(key, value, raw)


def _decode_fast(key: bytes | None, value: bytes | None) -> Command | None:
    """The Command `_decode_checked` gives, or None (then it names the defect). Accepts only what the checked path
    accepts, with the same values (tests/aggregates/test_domain_unit.py compares them on valid and broken ones)."""
    if value is None or len(value) > MAX_BYTES or key is None:
        return None
    try:
        e = _ENVELOPE.decode(value)
        raw_data = bytes(e.data)
        if raw_data.count(b"{") + raw_data.count(b"[") >= _FAST_OPENERS:
            return None
        data = orjson.loads(raw_data)
    except (msgspec.DecodeError, orjson.JSONDecodeError, RecursionError):  # ValidationError is a DecodeError; msgspec
        # raises RecursionError on deep nesting
        return None
    if type(data) is not dict or key.decode("utf-8", "replace") != e.aggregate_id:
        return None
    return Command(e.command_id, e.type, e.aggregate_id, data, e.aggregate_type, e.expected_version,
                   e.correlation_id or e.command_id, e.issued_at)


def _decode_checked(key: bytes | None, value: bytes | None, raw: Any) -> Command:
    """decode_command's checked path: each rule in turn, the first broken one named."""
    if value is None:
        raise _bad(raw, "value: missing", "missing-field")
    if len(value) > MAX_BYTES:
        raise _bad(raw, f"value: {len(value)} bytes exceeds {MAX_BYTES}", "too-large")
    try:
        body = orjson.loads(value)
    except orjson.JSONDecodeError as e:
        raise _bad(raw, f"value: not valid JSON ({e})", "bad-json") from None
    if type(body) is not dict:
        raise _bad(raw, "value: expected a JSON object", "wrong-type")
    if not _COMMAND_FIELDS.issuperset(body):
        raise _bad(raw, f"{sorted(k for k in body if k not in _COMMAND_FIELDS)[0]}: unknown field", "unknown-field")
    try:
        cid, type_, aid, data = body["command_id"], body["type"], body["aggregate_id"], body["data"]
    except KeyError as e:
        raise _bad(raw, f"{e.args[0]}: missing", "missing-field") from None
    if not (type(cid) is str and type(type_) is str and type(aid) is str  # one test for the common case
            and 0 < len(cid) <= MAX_ID_CHARS and 0 < len(type_) <= MAX_ID_CHARS and 0 < len(aid) <= MAX_ID_CHARS):
        for name, v in (("command_id", cid), ("type", type_), ("aggregate_id", aid)):  # the first wrong one, named
            if type(v) is not str or not v or len(v) > MAX_ID_CHARS:
                raise _bad(raw, f"{name}: expected a string of 1..{MAX_ID_CHARS} characters", "wrong-type")
    if type(data) is not dict:
        raise _bad(raw, "data: expected a JSON object", "wrong-type")
    ev = body.get("expected_version")
    if ev is not None and (type(ev) is not int or ev < 0):
        raise _bad(raw, "expected_version: expected an integer >= 0 or null", "wrong-type")
    agg_type, corr, at = body.get("aggregate_type", ""), body.get("correlation_id") or cid, body.get("issued_at", "")
    if type(agg_type) is not str or type(corr) is not str or type(at) is not str:
        raise _bad(raw, "aggregate_type, correlation_id, issued_at: expected strings", "wrong-type")
    if key is None or key.decode("utf-8", "replace") != aid:
        raise _bad(raw, "key: must be the aggregate id", "header-mismatch")
    return Command(cid, type_, aid, data, agg_type, ev, corr, at)


@quick_init
@dataclass(frozen=True, slots=True)
class Result:
    """What became of a command: accepted (new version, event ids) or rejected (reason; version = current)."""

    command_id: str
    aggregate_id: str
    status: str
    version: int
    event_ids: tuple[str, ...] = ()
    reason: str | None = None
    correlation_id: str = ""
    duplicate: bool = False  # the command id was processed before; this repeats its outcome
    at: str = ""  # the command's time (ISO-8601 UTC), which the idempotency window counts from
    # Where the command's events landed (kafold.tokens: the offset of its last event): what a reader waits on to
    # see them (CommandClient.wait_visible). None when nothing was written (a rejection, no events), for a
    # duplicate whose first decision this runtime does not remember, and in results of daemons before tokens.
    token: str | None = None

    @property
    def accepted(self) -> bool:
        return self.status == ACCEPTED

    def encode(self, token: str | None = None) -> tuple[bytes, bytes, Headers]:
        """Key, value, headers; `token` given: written instead of `self.token` (the runtime learns it only at
        commit, and a copy of the result per command would cost more than the token itself). `event_ids` is a tuple:
        orjson writes it as the JSON array a list gives."""
        body = {"command_id": self.command_id, "aggregate_id": self.aggregate_id, "status": self.status,
                "version": self.version, "event_ids": self.event_ids, "reason": self.reason,
                "correlation_id": self.correlation_id, "duplicate": self.duplicate, "at": self.at,
                "token": self.token if token is None else token}
        return self.aggregate_id.encode(), orjson.dumps(body), [(H_COMMAND_ID, self.command_id.encode())]

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = orjson.loads(self.encode()[1])
        return data


def decode_result(value: bytes | None) -> Result:
    """A result record's value; a tombstone (None) raises as bytes that are no result do (orjson.JSONDecodeError)."""
    body = orjson.loads(value)  # type: ignore[arg-type]  # None raises, as documented above
    return Result(body["command_id"], body["aggregate_id"], body["status"], body["version"],
                  tuple(body.get("event_ids") or ()), body.get("reason"), body.get("correlation_id", ""),
                  bool(body.get("duplicate", False)), body.get("at") or "", body.get("token"))


def header(headers: Sequence[tuple[str, bytes | None]] | None, name: str) -> str | None:
    for k, v in headers or ():
        if k == name and v is not None:
            return v.decode("utf-8", "replace")
    return None
