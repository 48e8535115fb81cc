"""A dataclass state to and from its JSON form with its fields' declared types, a datetime's time zone included.

msgspec writes a datetime as RFC 3339 text: the wall time and the UTC offset, to the minute. That reads back exactly
for a naive datetime and for a fixed offset of whole minutes (`datetime.timezone`), the common case, written as
msgspec writes it. It does not for a datetime in a named zone (`zoneinfo.ZoneInfo`): it would read back at a fixed
offset, equal as an instant, but an `evolve` that then does wall-clock arithmetic on it (a day later, the next local
midnight) would step across a DST change differently from the live state, so a state from the local store, a
snapshot or `state get` would stop being the one a full replay gives. Nor does an offset with seconds (local mean
time before 1900; msgspec rounds it, moving the instant). Those are written as `isoformat()` (the offset to the
second) followed, for a ZoneInfo, by its key in brackets: `2024-10-27T02:30:00+01:00[Europe/Paris]` (the RFC 9557
suffix, Java's ZonedDateTime text); they read back as the same wall time in that zone, with the fold that gives
the written offset (the hour a DST change repeats), or at that fixed offset. Another tzinfo class (dateutil, pytz)
reads back as its offset at that instant, as before.

Costs: writing a state whose type declares datetimes checks each of them (attributes, no copy) and, only when one is
in a zone or at a second offset, walks the state's builtins once more; reading one tries msgspec first and only on
its refusal marks the zoned texts. A state type without datetimes is msgspec's to_builtins / convert, nothing more.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any
from zoneinfo import ZoneInfo

import msgspec
from msgspec import inspect as mi

Check = Callable[[Any], bool]
Mark = Callable[[Any], Any]
_ITEMS = (mi.ListType, mi.VarTupleType, mi.SetType, mi.FrozenSetType)
_RECORDS = (mi.DataclassType, mi.StructType, mi.NamedTupleType, mi.TypedDictType)  # fields by name
_MINUTE = timedelta(minutes=1)
_SECONDS_OFFSET = re.compile(r"[+-]\d\d:\d\d:\d\d(\.\d+)?$")  # an offset msgspec cannot read


def _exact(at: datetime) -> bool:
    """Whether msgspec's RFC 3339 text of `at` reads back as `at` itself."""
    zone = at.tzinfo
    return zone is None or (type(zone) is timezone and not at.utcoffset() % _MINUTE)  # type: ignore[operator]


def text(at: datetime) -> str:
    """`at` as JSON text that reads back as itself (see the module docstring)."""
    if _exact(at):
        out: str = msgspec.to_builtins(at)
        return out
    key = getattr(at.tzinfo, "key", None) if isinstance(at.tzinfo, ZoneInfo) else None
    return at.isoformat() + (f"[{key}]" if key else "")


def parse(value: str) -> datetime:
    """A datetime written by `text`."""
    if not value.endswith("]"):
        return datetime.fromisoformat(value)
    written, _, key = value[:-1].partition("[")
    at = datetime.fromisoformat(written)
    zone = ZoneInfo(key)
    for fold in (0, 1):
        local = at.replace(tzinfo=zone, fold=fold)
        if local.utcoffset() == at.utcoffset():
            return local
    return at.astimezone(zone)  # an offset the zone's rules no longer give that wall time: the instant is kept


def _texts(value: Any) -> Any:
    """msgspec builtins with the datetimes left in (builtin_types) turned into `text`."""
    if isinstance(value, datetime):
        return text(value)
    if isinstance(value, dict):
        return {k: _texts(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_texts(v) for v in value]
    return value


def _inexact(v: Any) -> bool:
    if type(v) is not datetime:
        return isinstance(v, datetime) and not _exact(v)
    zone = v.tzinfo  # inline `_exact`: this runs for every datetime field of every state written
    return zone is not None and (type(zone) is not timezone or bool(v.utcoffset() % _MINUTE))  # type: ignore[operator]


def _finder(info: Any, made: dict[type, Check | None]) -> Check | None:
    """A check for a value of type `info`: does it hold a datetime that is not `_exact`? None: it cannot. Loops, not
    generators: it runs for every state written (a few attribute reads for a state of a few datetime fields)."""
    if isinstance(info, mi.DateTimeType):
        return _inexact
    if isinstance(info, _RECORDS):
        cls = info.cls
        if cls in made:  # a recursive type: its check, once made
            return lambda v: (made[cls] or _never)(v)
        made[cls] = None
        fields = tuple((f.name, c) for f in info.fields if (c := _finder(f.type, made)) is not None)
        kind: type = dict if isinstance(info, mi.TypedDictType) else cls
        get: Callable[[Any, str], Any] = _item if kind is dict else getattr

        def holds(v: Any) -> bool:
            if not isinstance(v, kind):
                return False
            for name, check in fields:  # noqa: SIM110  # a loop: any() over a generator costs twice as much here
                if check(get(v, name)):
                    return True
            return False
        made[cls] = holds if fields else None
        return made[cls]
    if isinstance(info, _ITEMS):
        item = _finder(info.item_type, made)
        return None if item is None else lambda v: isinstance(v, list | tuple | set | frozenset) and any(map(item, v))
    if isinstance(info, mi.TupleType):
        parts = [(i, c) for i, t in enumerate(info.item_types) if (c := _finder(t, made)) is not None]
        return (lambda v: isinstance(v, tuple | list) and any(c(v[i]) for i, c in parts if i < len(v))) \
            if parts else None
    if isinstance(info, mi.DictType):
        value = _finder(info.value_type, made)
        return None if value is None else lambda v: isinstance(v, dict) and any(map(value, v.values()))
    if isinstance(info, mi.UnionType):
        options = [c for t in info.types if (c := _finder(t, made)) is not None]
        if len(options) == 1:  # `datetime | None`: each check refuses the shapes it is not for
            return options[0]
        return (lambda v: any(c(v) for c in options)) if options else None
    return None


def _never(_: Any) -> bool:
    return False


def _item(value: dict[str, Any], key: str) -> Any:
    return value.get(key)


def _marker(info: Any, made: dict[type, Mark | None]) -> Mark | None:
    """A function turning the `text`s msgspec refuses (a zone, a second offset) in JSON of type `info` into
    datetimes, which msgspec.convert takes as they are; None: that type holds no datetime."""
    if isinstance(info, mi.DateTimeType):
        return lambda v: parse(v) if isinstance(v, str) and (v.endswith("]") or _SECONDS_OFFSET.search(v)) else v
    if isinstance(info, _RECORDS):
        cls = info.cls
        if cls in made:
            return lambda v: (made[cls] or (lambda x: x))(v)
        made[cls] = None
        if isinstance(info, mi.NamedTupleType):  # an array, field by position
            parts = {i: m for i, f in enumerate(info.fields) if (m := _marker(f.type, made)) is not None}
            made[cls] = _positions(parts) if parts else None
            return made[cls]
        fields = [(f.encode_name, m) for f in info.fields if (m := _marker(f.type, made)) is not None]
        made[cls] = (lambda v: {**v, **{n: m(v[n]) for n, m in fields if n in v}} if isinstance(v, dict) else v) \
            if fields else None
        return made[cls]
    if isinstance(info, _ITEMS):
        item = _marker(info.item_type, made)
        return None if item is None else lambda v: [item(x) for x in v] if isinstance(v, list) else v
    if isinstance(info, mi.TupleType):
        parts = {i: m for i, t in enumerate(info.item_types) if (m := _marker(t, made)) is not None}
        return _positions(parts) if parts else None
    if isinstance(info, mi.DictType):
        value = _marker(info.value_type, made)
        return None if value is None else lambda v: {k: value(x) for k, x in v.items()} if isinstance(v, dict) else v
    if isinstance(info, mi.UnionType):
        options = [m for t in info.types if (m := _marker(t, made)) is not None]
        if not options:
            return None

        def each(v: Any) -> Any:
            for m in options:  # each one changes only the shape it is for (msgspec allows one of each in a union)
                v = m(v)
            return v
        return each
    return None


def _positions(parts: dict[int, Mark]) -> Mark:
    return lambda v: [parts[i](x) if i in parts else x for i, x in enumerate(v)] if isinstance(v, list) else v


class StateJson:
    """The JSON form of one dataclass state type (see the module docstring)."""

    def __init__(self, cls: type) -> None:
        info = mi.type_info(cls)
        self.cls = cls
        self.check = _finder(info, {})
        self.mark = _marker(info, {})

    def to_json(self, state: Any) -> Any:
        if self.check is None or not self.check(state):
            return msgspec.to_builtins(state, str_keys=True)
        return _texts(msgspec.to_builtins(state, str_keys=True, builtin_types=(datetime,)))

    def from_json(self, data: Any) -> Any:
        try:
            return msgspec.convert(data, self.cls)
        except msgspec.ValidationError:
            if self.mark is None:
                raise
            return msgspec.convert(self.mark(data), self.cls)


def for_sample(sample: Any) -> StateJson | None:
    """The JSON form of `sample`'s type when it is a dataclass instance; None otherwise."""
    return StateJson(type(sample)) if dataclasses.is_dataclass(sample) and not isinstance(sample, type) else None
