"""An aggregate's domain (initial / evolve / decide) loaded from its config, and its payload / state conversions."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kafold.config import AggregateConfig
from kafold.errors import ConfigError, KafoldError


class Rejected(KafoldError):
    """Raised by `decide` when the command is not allowed in the current state; the message is the reason."""


class InvalidCommand(KafoldError):
    """A command's type is unknown or its data does not fit the command class (a client error, dead-lettered)."""

    def __init__(self, message: str, reason: str = "invalid-command") -> None:
        super().__init__(message)
        self.reason = reason


class InvalidEvent(KafoldError):
    """An event decided by the domain cannot be stored (unknown class, not JSON-serializable)."""


def _resolve(ref: str, where: str) -> Callable[..., Any]:
    module_name, _, attr = ref.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError([f"{where}: cannot import module {module_name!r} of {ref!r}: {e}"]) from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError([f"{where}: {module_name!r} has no function {attr!r}"])
    return fn


@functools.lru_cache(maxsize=1024)
def _field_order(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls)) if dataclasses.is_dataclass(cls) else ()


@dataclass(frozen=True)
class AggregateDomain:
    """The pure functions of one aggregate type plus the type maps of its module.

    `event_types` / `command_types` map a type name (as stored on Kafka) to a class; when the module defines
    none, events and commands are plain dicts and the type name travels beside them. `rejections` are the
    exception classes whose raise from `decide` means "rejected" (kafold's `Rejected` plus every exception
    class defined in the decide module); any other exception from `decide` is a bug and is dead-lettered.
    """

    name: str
    initial: Callable[[], Any]
    evolve: Callable[[Any, Any], Any]
    decide: Callable[[Any, Any], list[Any]]
    event_types: Mapping[str, type]
    command_types: Mapping[str, type]
    rejections: tuple[type[BaseException], ...]
    state_to_json: Callable[[Any], Any]
    state_from_json: Callable[[Any], Any]

    @classmethod
    def load(cls, agg: AggregateConfig, python_path: list[str] | tuple[str, ...] = (),
             base: Path | None = None) -> AggregateDomain:
        """Resolve `initial`, `evolve`, `decide` (`module:function`) with `python_path` (relative to `base`)."""
        for p in reversed([str((base / p).resolve()) if base else p for p in python_path]):
            if p not in sys.path:
                sys.path.insert(0, p)
        where = f"aggregate {agg.name!r}"
        initial = _resolve(agg.initial, f"{where}: initial")
        evolve = _resolve(agg.evolve, f"{where}: evolve")
        decide = _resolve(agg.decide, f"{where}: decide")
        ev_mod, dec_mod = sys.modules[evolve.__module__], sys.modules[decide.__module__]
        event_types = getattr(ev_mod, "EVENT_TYPES", None) or getattr(dec_mod, "EVENT_TYPES", None) or {}
        command_types = getattr(dec_mod, "COMMAND_TYPES", None) or {}
        for label, types in (("EVENT_TYPES", event_types), ("COMMAND_TYPES", command_types)):
            if not isinstance(types, Mapping) or not all(isinstance(t, type) for t in types.values()):
                raise ConfigError([f"{where}: {label} must map type names to classes"])
        own: list[type[BaseException]] = [v for v in vars(dec_mod).values() if isinstance(v, type)
                                          and issubclass(v, Exception) and v.__module__ == dec_mod.__name__]
        rejections: tuple[type[BaseException], ...] = (Rejected, *(c for c in own if c is not Rejected))
        sample = initial()
        to_json = getattr(ev_mod, "state_to_json", None) or default_state_to_json
        from_json = getattr(ev_mod, "state_from_json", None) or default_state_from_json(sample)
        return cls(agg.name, initial, evolve, decide, dict(event_types), dict(command_types), rejections,
                   to_json, from_json)

    # ---- commands -----------------------------------------------------------------------------------------
    def command(self, type_name: str, data: dict[str, Any]) -> Any:
        """The domain command for `type_name` and its JSON data; InvalidCommand names what does not fit."""
        if not self.command_types:
            return {"type": type_name, **data}
        cls = self.command_types.get(type_name)
        if cls is None:
            raise InvalidCommand(f"unknown command type {type_name!r} (known: {', '.join(sorted(self.command_types))})",
                                 "unknown-type")
        return _build(cls, data, f"command {type_name}", InvalidCommand)

    # ---- events -------------------------------------------------------------------------------------------
    def event(self, type_name: str, payload: dict[str, Any]) -> Any:
        """The domain event for a stored envelope's type and payload (KeyError/TypeError when it does not fit)."""
        if not self.event_types:
            return {"type": type_name, **payload}
        return self.event_types[type_name](**payload)

    def event_payload(self, event: Any) -> tuple[str, dict[str, Any]]:
        """(type name, JSON payload) of a domain event; InvalidEvent when it is not a known event."""
        if isinstance(event, dict):
            body = dict(event)
            type_name = body.pop("type", None)
            if not isinstance(type_name, str) or (self.event_types and type_name not in self.event_types):
                raise InvalidEvent(f"decide returned a dict event without a known 'type': {type_name!r}")
            return type_name, body
        type_name = type(event).__name__
        if self.event_types.get(type_name) is not type(event):
            raise InvalidEvent(f"decide returned {type_name}, which is not in EVENT_TYPES")
        cls: type = type(event)
        order = _field_order(cls)
        if not order and not dataclasses.is_dataclass(cls):
            raise InvalidEvent(f"event {type_name} is not a dataclass")
        return type_name, {name: getattr(event, name) for name in order}


@functools.lru_cache(maxsize=1024)
def _spec(cls: type) -> tuple[frozenset[str], tuple[str, ...], tuple[tuple[str, tuple[type, ...]], ...]]:
    """(field names, required names, (name, allowed JSON types) for simply annotated fields) of a dataclass."""
    if not dataclasses.is_dataclass(cls):
        return frozenset(), (), ()
    fields = dataclasses.fields(cls)
    required = tuple(f.name for f in fields
                     if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
    checks = []
    for f in fields:
        spelled = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
        allowed = _SIMPLE.get(spelled)
        if allowed is not None:
            checks.append((f.name, allowed))
    return frozenset(f.name for f in fields), required, tuple(checks)


def _build(cls: type, data: dict[str, Any], what: str, error: type[InvalidCommand]) -> Any:
    names, required, checks = _spec(cls)
    if names:
        if not names.issuperset(data):
            raise error(f"{what}: unknown field {sorted(k for k in data if k not in names)[0]!r}", "invalid-command")
        for name in required:
            if name not in data:
                raise error(f"{what}: missing field {name!r}", "invalid-command")
        for name, allowed in checks:
            if name in data:
                value = data[name]
                if not isinstance(value, allowed) or (type(value) is bool and bool not in allowed):
                    raise error(f"{what}: field {name!r} expects {allowed[-1].__name__}, got "
                                f"{type(value).__name__}", "invalid-command")
    try:
        return cls(**data)
    except (TypeError, ValueError) as e:
        raise error(f"{what}: {e}", "invalid-command") from None


_SIMPLE: dict[str, tuple[type, ...]] = {"int": (int,), "str": (str,), "float": (int, float), "bool": (bool,),
                                        "dict": (dict,), "list": (list,)}


_STATE_FIELDS: dict[type, tuple[str, ...]] = {}
_PLAIN = frozenset({str, int, float, bool, type(None)})


def default_state_to_json(state: Any) -> Any:
    """A dataclass state as a dict of its fields (nested values converted like `dataclasses.asdict`), else as is."""
    names = _STATE_FIELDS.get(type(state))
    if names is None:
        if not dataclasses.is_dataclass(state) or isinstance(state, type):
            return state
        names = _STATE_FIELDS[type(state)] = tuple(f.name for f in dataclasses.fields(state))
    out = {name: getattr(state, name) for name in names}
    for value in out.values():  # flat states (the common case) need no deep copy
        if type(value) not in _PLAIN:
            return dataclasses.asdict(state)
    return out


def default_state_from_json(sample: Any) -> Callable[[Any], Any]:
    if dataclasses.is_dataclass(sample) and not isinstance(sample, type):
        state_cls = type(sample)
        return lambda data: state_cls(**data)
    return lambda data: data
