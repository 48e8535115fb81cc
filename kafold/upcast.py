"""Upcasters: old event shapes turned into the shape today's code expects, one schema version at a time.

A chain per event type: a step takes `(type, schema_version, payload)` and returns `(type, schema_version + 1,
payload)`, so an event written at v1 reaches today's version through every step in order. Steps are pure
functions referenced from TOML (`function = "module:fn"`), or declared (`rename_fields`, `add_fields`,
`rename_type`, `split_on` + `split_types`) for the common cases. The chains are checked when the configuration
loads: a type whose versions have a gap (a step from v1 and one from v3, none from v2) is refused, and so is a
step whose output another step of the same version already claims. `decide` writes every type at its newest
version (`newest`); readers upcast what is older (`Upcaster.apply`), in the one read path every consumer shares
(`kafold.fold.domain_event` for aggregates, the sink runner's intake for projections and effects).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kafold.errors import ConfigError, KafoldError
from kafold.refs import import_ref
from kafold.schema import setting

Step = Callable[[str, int, dict[str, Any]], tuple[str, int, dict[str, Any]]]


class UpcastError(KafoldError):
    """An upcaster step raised or returned something that is not the next version; names type and version."""

    reason = "upcast-failed"

    def __init__(self, type_name: str, version: int, error: BaseException | str) -> None:
        self.type_name, self.version = type_name, version
        detail = f"{type(error).__name__}: {error}" if isinstance(error, BaseException) else error
        super().__init__(f"upcasting {type_name} v{version} failed: {detail}")


@dataclass(frozen=True)
class UpcasterConfig:
    type: str = setting(doc="The event type this step reads (at `from_version`).")
    from_version: int = setting(1, doc="The schema version it reads; it writes `from_version + 1`.", minimum=1)
    function: str = setting("", doc="`module:function(type, version, payload) -> (type, version + 1, payload)`; "
                                    "or leave empty and declare the step with the keys below.")
    rename_fields: dict[str, str] = setting(factory=dict, doc="Payload fields renamed: {old = \"new\"}.")
    add_fields: dict[str, Any] = setting(factory=dict, doc="Payload fields added when absent, with their value.")
    remove_fields: list[str] = setting(factory=list, doc="Payload fields dropped.")
    rename_type: str = setting("", doc="The event's new type name.")
    split_on: str = setting("", doc="A payload field whose value chooses the new type (with `split_types`).")
    split_types: dict[str, str] = setting(factory=dict, doc="`split_on` value -> new type name.")


def _declared(cfg: UpcasterConfig) -> Step:
    """The step a declarative entry describes."""
    def step(type_name: str, version: int, payload: dict[str, Any]) -> tuple[str, int, dict[str, Any]]:
        out = {cfg.rename_fields.get(k, k): v for k, v in payload.items() if k not in cfg.remove_fields}
        for k, v in cfg.add_fields.items():
            out.setdefault(k, v)
        new_type = cfg.rename_type or type_name
        if cfg.split_on:
            chosen = payload.get(cfg.split_on)
            if not isinstance(chosen, str) or chosen not in cfg.split_types:
                raise ValueError(f"{cfg.split_on}={chosen!r} is none of {sorted(cfg.split_types)}")
            new_type = cfg.split_types[chosen]
        return new_type, version + 1, out
    return step


@dataclass(frozen=True)
class Upcaster:
    """The checked chains of one aggregate or connector: `apply` reads an old event as today's shape."""

    steps: Mapping[tuple[str, int], Step] = field(default_factory=dict)
    newest: Mapping[str, int] = field(default_factory=dict)  # type -> the schema version writers use
    describe: tuple[str, ...] = ()  # what the chain is, for the fold's fingerprint

    @property
    def empty(self) -> bool:
        return not self.steps

    def apply(self, type_name: str, version: int, payload: dict[str, Any]) -> tuple[str, int, dict[str, Any]]:
        """(type, version, payload) after every step that applies; UpcastError naming the step that failed."""
        steps = self.steps
        while (type_name, version) in steps:
            try:
                new_type, new_version, new_payload = steps[(type_name, version)](type_name, version, payload)
            except Exception as e:
                raise UpcastError(type_name, version, e) from e
            if new_version != version + 1 or not isinstance(new_type, str) or not isinstance(new_payload, dict):
                raise UpcastError(type_name, version, f"the step returned ({new_type!r}, {new_version!r}, "
                                  f"{type(new_payload).__name__}), expected (type, {version + 1}, dict)")
            type_name, version, payload = new_type, new_version, new_payload
        return type_name, version, payload

    def version_of(self, type_name: str) -> int:
        """The schema version `decide` writes for `type_name` (1 when no chain reaches it)."""
        return self.newest.get(type_name, 1)


NONE = Upcaster()


def build(configs: Iterable[UpcasterConfig], where: str) -> Upcaster:
    """The chains of `configs`, checked: each step resolves, no two steps read the same (type, version), and each
    type's steps start at v1 with no gap. ConfigError lists every problem, naming `where`."""
    problems: list[str] = []
    steps: dict[tuple[str, int], Step] = {}
    outputs: dict[str, set[int]] = {}
    describe: list[str] = []
    for i, cfg in enumerate(configs):
        at = f"{where}.upcasters[{i}]"
        key = (cfg.type, cfg.from_version)
        if key in steps:
            problems.append(f"{at}: a second step reads {cfg.type} v{cfg.from_version}")
            continue
        declared = bool(cfg.rename_fields or cfg.add_fields or cfg.remove_fields or cfg.rename_type or cfg.split_on)
        if cfg.function and declared:
            problems.append(f"{at}: give `function` or declarative keys, not both")
            continue
        if bool(cfg.split_on) != bool(cfg.split_types) or (cfg.split_on and cfg.rename_type):
            problems.append(f"{at}: `split_on` needs `split_types` (and no `rename_type`)")
            continue
        if cfg.function:
            try:
                step: Step = import_ref(cfg.function, callable_=True)
            except LookupError as e:
                problems.append(f"{at}.function: {e}")
                continue
            describe.append(f"{cfg.type}@{cfg.from_version}:{cfg.function}")
        elif declared:
            step = _declared(cfg)
            describe.append(f"{cfg.type}@{cfg.from_version}:{cfg!r}")
        else:
            problems.append(f"{at}: nothing to do (give `function` or a declarative key)")
            continue
        steps[key] = step
        targets = cfg.split_types.values() if cfg.split_on else [cfg.rename_type or cfg.type]
        for t in targets:
            outputs.setdefault(t, set()).add(cfg.from_version + 1)
    by_type: dict[str, set[int]] = {}
    for t, v in steps:
        by_type.setdefault(t, set()).add(v)
    for t, versions in sorted(by_type.items()):
        low, high = min(versions), max(versions)
        gaps = [v for v in range(low, high + 1) if v not in versions]
        if low != 1 and low not in outputs.get(t, set()):
            gaps.insert(0, low - 1)  # nothing turns an older event into t v<low>
        if gaps:
            problems.append(f"{where}.upcasters: event type {t!r} has no step from v{gaps[0]} (a gap in its "
                            f"chain: steps from {', '.join(f'v{v}' for v in sorted(versions))})")
    if problems:
        raise ConfigError(problems)
    newest: dict[str, int] = {t: max(vs) + 1 for t, vs in by_type.items()}
    for t, vs in outputs.items():
        newest[t] = max(newest.get(t, 1), *vs)
    return Upcaster(steps, newest, tuple(sorted(describe)))
