"""An aggregate's domain (initial / evolve / decide) loaded from its config, and its payload / state conversions."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import inspect
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
from msgspec import inspect as mi

from kafold import state_json, upcast
from kafold.codec import Codec, InvalidCommand, InvalidEvent, UnreadableEvent, check_class
from kafold.config import AggregateConfig, FoldErrorPolicy
from kafold.errors import ConfigError, KafoldError

__all__ = ["AggregateDomain", "InvalidCommand", "InvalidEvent", "Rejected", "UnreadableEvent"]


class Rejected(KafoldError):
    """Raised by `decide` when the command is not allowed in the current state; the message is the reason."""


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


@dataclass(frozen=True)
class AggregateDomain:
    """The pure functions of one aggregate type plus the type maps of its module.

    `codec` turns the module's event and command classes (`EVENT_TYPES` / `COMMAND_TYPES`, type name as stored
    on Kafka -> class) to and from JSON, for every path (kafold.codec); when the module defines none, events and
    commands are plain dicts and the type name travels beside them. `rejections` are the
    exception classes whose raise from `decide` means "rejected" (kafold's `Rejected` plus every exception
    class defined in the decide module); any other exception from `decide` is a bug and is dead-lettered.
    """

    name: str
    initial: Callable[[], Any]
    evolve: Callable[[Any, Any], Any]
    decide: Callable[[Any, Any], list[Any]]
    codec: Codec
    rejections: tuple[type[BaseException], ...]
    state_to_json: Callable[[Any], Any]
    state_from_json: Callable[[Any], Any]
    on_fold_error: FoldErrorPolicy = FoldErrorPolicy.STOP
    fingerprint: str = ""  # what the fold is (`fingerprint`): snapshots of another one are refused
    # Protected fields (kafold.protect): `protector` seals decide's events; `unseal(type, aggregate_id, payload)`
    # opens a stored payload before upcasters and evolve, on every read path (kafold.fold). None: nothing protected.
    protector: Any = None
    unseal: Callable[[str, str, dict[str, Any]], dict[str, Any]] | None = None

    def protected(self, protector: Any) -> AggregateDomain:
        """This domain sealing and opening its protected fields with `protector` (None: unchanged)."""
        if protector is None or protector.for_aggregate(self.name) is None:
            return self
        return dataclasses.replace(self, protector=protector, unseal=protector.for_aggregate(self.name))

    @property
    def event(self) -> Callable[..., Any]:
        """`event(type, payload, schema_version=1)`: the domain event of a stored envelope (upcast to today's
        shape); UnreadableEvent or UpcastError when it does not fit. The codec's own method (no extra call)."""
        return self.codec.event

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
        to_json = getattr(ev_mod, "state_to_json", None)
        if to_json is None and dataclasses.is_dataclass(sample):  # the default form must read back as written
            problems = check_class(type(sample), f"{where}: the state")
            if problems:
                raise ConfigError(problems)
        from_json = getattr(ev_mod, "state_from_json", None)
        # a dataclass state: its fields' types, a datetime's zone included (not built when the module has both)
        form = state_json.for_sample(sample) if to_json is None or from_json is None else None
        to_json = to_json or (form.to_json if form else default_state_to_json)
        from_json = from_json or (form.from_json if form else lambda data: data)
        # Refuses a field that would not read back, and an upcaster chain with a gap.
        codec = Codec(agg.name, event_types, command_types, upcast.build(agg.upcasters, f"aggregate {agg.name!r}"))
        printed = agg.fingerprint or fingerprint(evolve, codec, sample, agg.state_schema_version)
        return cls(agg.name, initial, evolve, decide, codec, rejections, to_json, from_json, agg.on_fold_error,
                   printed)

    # ---- commands and events: one codec for every path (kafold.codec) ---------------------------------------
    def command(self, type_name: str, data: dict[str, Any]) -> Any:
        """The domain command for `type_name` and its JSON data; InvalidCommand names what does not fit."""
        return self.codec.command(type_name, data)


def fingerprint(evolve: Callable[..., Any], codec: Codec, sample: Any, state_schema_version: int) -> str:
    """What the fold is, as a short hash (`auto-...`): the evolve module's source, the event classes' fields and
    types, the upcaster chain (its declarations and its functions' source) and the state's shape. Any change to
    them is a new fingerprint, so snapshots written by the old fold are refused and the partition refolded; an
    explicit `fingerprint` in the configuration overrides it for a change known to be compatible."""
    parts = [f"state_schema_version={state_schema_version}", _source(sys.modules[evolve.__module__])]
    parts += [f"event {name}: {mi.type_info(cls)!r}" for name, cls in sorted(codec.event_types.items())]
    parts += [f"upcaster {d}" for d in codec.upcaster.describe]
    parts += [_source(step) for _, step in sorted(codec.upcaster.steps.items(), key=lambda kv: kv[0])
              if getattr(step, "__module__", "") != upcast.__name__]
    state = mi.type_info(type(sample)) if dataclasses.is_dataclass(sample) else type(sample).__qualname__
    parts.append(f"state: {state!r}")
    return "auto-" + hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _source(obj: Any) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):  # no source file (a built-in, an interactive session): its name stands in
        return getattr(obj, "__qualname__", getattr(obj, "__name__", repr(obj)))


def default_state_to_json(state: Any) -> Any:
    """A state that is not a dataclass as JSON-ready builtins (msgspec: a datetime as ISO text, a tuple as an array,
    ...); read back as is. A dataclass state goes through kafold.state_json, which reads back its fields' types."""
    return msgspec.to_builtins(state, str_keys=True)
