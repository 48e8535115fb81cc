"""Typed payloads: the domain's event and command classes to and from JSON, from their annotations (msgspec).

One codec per aggregate serves every path: `decide`'s events become JSON payloads through `payload`, and every
reader (the runtime's live path, its replay, `state get`, restore, snapshot runs in process and on Spark) turns a
stored payload back into the domain's event through `event`. A `datetime`, `date`, `Decimal`, `UUID`, `Enum`,
`tuple`, `frozenset`, nested dataclass or `Optional` comes back as the type its field declares, never as the list
or string JSON holds. A field type msgspec cannot map to JSON and back (an arbitrary class, a dict with non-string
keys) is refused when the aggregate loads, naming class, field and type. Commands are decoded the same way.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import msgspec
from msgspec import inspect as mi

from kafold.errors import ConfigError, KafoldError
from kafold.upcast import NONE, Upcaster


class InvalidCommand(KafoldError):
    """A command's type is unknown or its data does not fit the command class (a client error, dead-lettered)."""

    def __init__(self, message: str, reason: str = "invalid-command") -> None:
        super().__init__(message)
        self.reason = reason


class InvalidEvent(KafoldError):
    """An event decided by the domain cannot be stored (unknown class, not JSON-serializable)."""


class UnreadableEvent(KafoldError):
    """A stored event that the current code cannot turn into a domain event (unknown type, a payload that does
    not fit its class)."""


def _refusals(info: Any, path: str, seen: set[type]) -> list[tuple[str, str]]:
    """(field path, what cannot round-trip) under a msgspec type info."""
    if isinstance(info, mi.CustomType):
        return [(path, f"{info.cls.__module__}.{info.cls.__qualname__} has no JSON form")]
    if isinstance(info, mi.DictType):
        key = info.key_type
        out = [] if isinstance(key, mi.StrType | mi.AnyType | mi.EnumType | mi.LiteralType) else \
            [(path, "a dict whose keys are not strings (JSON object keys are)")]
        return out + _refusals(info.value_type, f"{path}[]", seen)
    if isinstance(info, mi.DataclassType | mi.StructType):
        if info.cls in seen:
            return []
        seen.add(info.cls)
        return [r for f in info.fields for r in _refusals(f.type, f"{path}.{f.name}" if path else f.name, seen)]
    if isinstance(info, mi.UnionType):
        return [r for t in info.types for r in _refusals(t, path, seen)]
    for attr in ("item_type",):
        if hasattr(info, attr):
            return _refusals(getattr(info, attr), f"{path}[]", seen)
    if isinstance(info, mi.TupleType):
        return [r for i, t in enumerate(info.item_types) for r in _refusals(t, f"{path}[{i}]", seen)]
    return []


def check_class(cls: type, where: str) -> list[str]:
    """Problems with `cls` as an event or command class: not a dataclass, or a field that cannot round-trip."""
    if not dataclasses.is_dataclass(cls):
        return [f"{where}: {cls.__qualname__} is not a dataclass"]
    try:
        info = mi.type_info(cls)
    except Exception as e:  # an annotation msgspec cannot read at all
        return [f"{where}: {cls.__qualname__}: {e}"]
    return [f"{where}: {cls.__qualname__}.{field}: {why}; it would not read back as written"
            for field, why in _refusals(info, "", set())]


def _explain(error: msgspec.ValidationError) -> str:
    """msgspec's message with the field named the way the rest of kafold names keys: `field 'lines[0].price': ...`."""
    message, _, path = str(error).partition(" - at `")
    path = path.rstrip("`").removeprefix("$").removeprefix(".")
    return f"field {path!r}: {message}" if path else message


_KINDS: dict[type, type] = {mi.StrType: str, mi.IntType: int, mi.FloatType: float, mi.BoolType: bool}


def _flat_fields(cls: type) -> tuple[tuple[str, type, bool], ...] | None:
    """(field, exact type, may be None) for a dataclass of unconstrained scalar fields only; None otherwise."""
    out = []
    for f in mi.type_info(cls).fields:  # type: ignore[attr-defined]
        info, optional = f.type, False
        if isinstance(info, mi.UnionType):
            rest = [t for t in info.types if not isinstance(t, mi.NoneType)]
            if len(rest) != 1 or len(info.types) != 2:
                return None
            info, optional = rest[0], True
        if type(info) not in _KINDS or any(getattr(info, k, None) is not None for k in (
                "gt", "ge", "lt", "le", "multiple_of", "pattern", "min_length", "max_length")):
            return None
        out.append((f.name, _KINDS[type(info)], optional))
    return tuple(out)


class Codec:
    """Events and commands of one aggregate between the domain's classes and JSON (see the module docstring).
    Without classes (no EVENT_TYPES / COMMAND_TYPES), events and commands are dicts carrying their `type`."""

    def __init__(self, aggregate: str, event_types: Mapping[str, type], command_types: Mapping[str, type],
                 upcaster: Upcaster = NONE) -> None:
        problems = [p for label, types in (("EVENT_TYPES", event_types), ("COMMAND_TYPES", command_types))
                    for name, cls in types.items()
                    for p in check_class(cls, f"aggregate {aggregate!r}: {label}[{name!r}]")]
        if problems:
            raise ConfigError(problems)
        self.event_types, self.command_types, self.upcaster = dict(event_types), dict(command_types), upcaster
        self._steps = upcaster.steps if not upcaster.empty else None
        self._names = {cls: name for name, cls in self.event_types.items()}
        self._flat = {cls: flat for cls in self.event_types.values() if (flat := _flat_fields(cls)) is not None}
        self._fields = {cls: frozenset(f.name for f in dataclasses.fields(cls)) for cls in self.command_types.values()}

    # ---- events -----------------------------------------------------------------------------------------
    def payload(self, event: Any) -> tuple[str, dict[str, Any]]:
        """(type name, JSON payload) of a domain event; InvalidEvent when it is not a known event or does not
        fit JSON."""
        if isinstance(event, dict):
            body = dict(event)
            type_name = body.pop("type", None)
            if not isinstance(type_name, str) or (self.event_types and type_name not in self.event_types):
                raise InvalidEvent(f"decide returned a dict event without a known 'type': {type_name!r}")
        else:
            type_name = self._names.get(type(event))
            if type_name is None:
                raise InvalidEvent(f"decide returned {type(event).__name__}, which is not in EVENT_TYPES")
            body = event
        try:
            out = msgspec.to_builtins(body, str_keys=True)
        except (TypeError, ValueError) as e:
            raise InvalidEvent(f"event {type_name} does not fit JSON: {e}") from None
        return type_name, out

    def written(self, event: Any) -> tuple[str, dict[str, Any], bool]:
        """`payload(event)`, and whether reading that payload back gives `event` itself: true for a class whose
        fields are all str, int, float or bool (or None where Optional) holding exactly those types (finite
        floats). The runtime then evolves `event` without decoding the bytes it writes (the same value, cheaper);
        anything else is read back (a tuple, a datetime, an int in a float field would come back otherwise)."""
        flat = self._flat.get(type(event))
        if flat is not None:
            payload: dict[str, Any] = {}
            for name, kind, optional in flat:
                value: Any = getattr(event, name)
                if (type(value) is not kind and not (optional and value is None)) or (
                        kind is float and not math.isfinite(value)):  # type: ignore[arg-type]  # no NaN in JSON
                    break
                payload[name] = value
            else:
                return self._names[type(event)], payload, True
        type_name, payload = self.payload(event)
        return type_name, payload, False

    def event(self, type_name: str, payload: dict[str, Any], schema_version: int = 1) -> Any:
        """The domain event for a stored type name, JSON payload and schema version, upcast to today's shape;
        UnreadableEvent when it does not fit, UpcastError when a step fails."""
        if self._steps is not None and (type_name, schema_version) in self._steps:
            type_name, schema_version, payload = self.upcaster.apply(type_name, schema_version, payload)
        if not self.event_types:
            return {"type": type_name, **payload}
        cls = self.event_types.get(type_name)
        if cls is None:
            raise UnreadableEvent(f"unknown event type {type_name!r} (EVENT_TYPES has "
                                  f"{', '.join(sorted(self.event_types))})")
        try:
            return msgspec.convert(payload, cls)
        except msgspec.ValidationError as e:
            raise UnreadableEvent(f"event {type_name}: {_explain(e)}") from None

    # ---- commands ---------------------------------------------------------------------------------------
    def command(self, type_name: str, data: dict[str, Any]) -> Any:
        """The domain command for `type_name` and its JSON data; InvalidCommand names what does not fit."""
        if not self.command_types:
            return {"type": type_name, **data}
        cls = self.command_types.get(type_name)
        if cls is None:
            raise InvalidCommand(f"unknown command type {type_name!r} (known: {', '.join(sorted(self.command_types))})",
                                 "unknown-type")
        names = self._fields[cls]
        if not names.issuperset(data):
            raise InvalidCommand(f"command {type_name}: unknown field {sorted(k for k in data if k not in names)[0]!r}")
        try:
            return msgspec.convert(data, cls)
        except msgspec.ValidationError as e:
            raise InvalidCommand(f"command {type_name}: {_explain(e)}") from None
        except (TypeError, ValueError) as e:  # the class's own __post_init__ refused the values
            raise InvalidCommand(f"command {type_name}: {e}") from None
