"""The `postgres-projection` connector's settings, declared once; cross-field checks name the offending key."""

from __future__ import annotations

import dataclasses
import enum
import re
from dataclasses import dataclass
from typing import Any

from kafold.connectors.projection.sql import check_type
from kafold.schema import setting
from kafold.sqlnames import check_identifier

ACTIONS = ("upsert", "update", "delete")
ENVELOPE_FIELDS = ("event_id", "type", "aggregate_type", "aggregate_id", "version", "occurred_at",
                   "correlation_id", "causation_id", "schema_version")
VERSION_COLUMN = "_kafold_version"
_REF = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class Dedup(enum.StrEnum):
    """How the live writer knows an event it applied already (docs/projections.md, "Deduplication")."""

    AUTO = "auto"  # VERSION when the version guard is on and the source gives versions, else TRACKING
    VERSION = "version"  # the row's version and tombstones; the checkpoint update fences other writers
    TRACKING = "tracking"  # a tracking record per event id: for a stream whose versions are offsets (none given)


@dataclass(frozen=True)
class OnEvent:
    """What one event type does to its row."""

    type: Any = setting(doc="Event type this rule handles, or a list of types sharing the rule (e.g. "
                        "[\"create\", \"update\", \"read\"] for Debezium; expanded to one rule each at load).")
    action: str = setting("upsert", doc="upsert: create or change the row; update: change it only if it "
                          "exists; delete: remove it.", choices=ACTIONS)
    set: dict[str, Any] = setting(factory=dict, doc="column = \"payload.path\" | envelope field | "
                                  "\"'literal'\" | number/boolean.")
    increment: dict[str, Any] = setting(factory=dict, doc="column = \"payload.path\": add the value to the "
                                        "column (a missing row counts from 0).")


@dataclass(frozen=True, kw_only=True)
class ProjectionConfig:
    table: str = setting(doc="Target table (created if missing, validated if present).")
    schema: str = setting("public", doc="Schema of the target table.")
    key_columns: list[str] = setting(doc="Columns forming the row key (primary key of a created table).")
    columns: dict[str, str] = setting(doc="column = \"SQL type\" for every column kafold writes, keys included.")
    key: dict[str, str] = setting(factory=dict, doc="key column = source (as in `set`); default: the single "
                                  "key column from aggregate_id.")
    on: list[OnEvent] = setting(factory=list, doc="Declarative mapping, one table per event type.")
    mapper: str = setting("", doc="`module:function(row: dict | None, event) -> dict | None` (None deletes); "
                          "instead of `on`.")
    mapper_types: list[str] = setting(factory=list, doc="Event types the mapper handles (empty: all).")
    version_guard: bool = setting(True, doc="Skip events whose aggregate version is <= the row's "
                                  f"`{VERSION_COLUMN}` (turn off when a row folds several aggregates: events are "
                                  "then applied in the order they arrive, held ones too, and a replayed one is "
                                  "applied on top of the row as it is).")
    hold_on_dead_letter: bool = setting(True, doc="Once an event of a row key is dead-lettered (schema-invalid, "
                                        "db-rejected), hold that key's later events behind it (dead letters with "
                                        "status `held`) until `kafold dlq replay` or `dlq discard` of it; other "
                                        "keys keep flowing.")
    create_table: bool = setting(True, doc="Create the table when it does not exist.")
    dedup: Dedup = setting(Dedup.AUTO, doc="How an event applied already is skipped: `auto` (the default): "
                           "`version` when the guard is on and the converter gives versions (kafold, debezium, or a "
                           "`version` source), else `tracking`; `tracking` by a tracking record per event id; "
                           "`version` by the row's version and a fenced checkpoint (no record per event, ~1/3 of "
                           "PostgreSQL's CPU an event less: docs/benchmarks.md; needs version_guard).")

    def __post_init__(self) -> None:
        bad = [f"on[{i}].type: expected an event type or a non-empty list of them, got {r.type!r}"
               for i, r in enumerate(self.on) if not _types_ok(r.type)]
        if bad:
            raise ValueError("; ".join(bad))
        if any(isinstance(r.type, list | tuple) for r in self.on):  # one rule per type from here on
            object.__setattr__(self, "on", [dataclasses.replace(r, type=t) for r in self.on
                                            for t in ([r.type] if isinstance(r.type, str) else r.type)])
        problems = list(_problems(self))
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def key_sources(self) -> dict[str, str]:
        return dict(self.key) if self.key else {self.key_columns[0]: "aggregate_id"}

    @property
    def handled_types(self) -> frozenset[str] | None:
        """The event types this projection handles; None = every type (a mapper without mapper_types)."""
        if self.mapper:
            return frozenset(self.mapper_types) or None
        return frozenset(rule.type for rule in self.on)


def _types_ok(tp: Any) -> bool:
    return (isinstance(tp, str) and bool(tp)) or (isinstance(tp, list | tuple) and bool(tp)
                                                  and all(isinstance(t, str) and t for t in tp))


def _problems(c: ProjectionConfig) -> list[str]:
    out: list[str] = []
    for where, name in (("table", c.table), ("schema", c.schema)):
        if (msg := check_identifier(name)) is not None:
            out.append(f"{where}: {msg}")
    for col, tp in c.columns.items():
        if (msg := check_identifier(col)) is not None:
            out.append(f"columns.{col}: {msg}")
        elif col == VERSION_COLUMN:
            out.append(f"columns.{col}: reserved for kafold's version guard")
        if not isinstance(tp, str) or (msg := check_type(tp)) is not None:
            out.append(f"columns.{col}: {msg if isinstance(tp, str) else 'expected an SQL type string'}")
    if not c.key_columns:
        out.append("key_columns: at least one key column is required")
    if c.dedup is Dedup.VERSION and not c.version_guard:
        out.append("dedup: `version` needs version_guard = true (a row folding several aggregates is tracked)")
    for col in c.key_columns:
        if col not in c.columns:
            out.append(f"key_columns: {col!r} is not in `columns`")
    if not c.key and len(c.key_columns) > 1:
        out.append("key: required when there are several key_columns (column = source)")
    for col, src in c.key.items():
        if col not in c.key_columns:
            out.append(f"key.{col}: not one of key_columns")
        elif (msg := check_source(src)) is not None:
            out.append(f"key.{col}: {msg}")
    missing = [col for col in c.key_columns if c.key and col not in c.key]
    if missing:
        out.append(f"key: no source for key column(s) {', '.join(missing)}")
    if bool(c.mapper) == bool(c.on):
        out.append("on / mapper: give exactly one of `on` (declarative rules) and `mapper` (a function)")
    if c.mapper and not _REF.match(c.mapper):
        out.append(f"mapper: expected `module:function`, got {c.mapper!r}")
    seen: set[str] = set()
    for i, rule in enumerate(c.on):
        where = f"on[{i}]"
        if rule.type in seen:
            out.append(f"{where}.type: {rule.type!r} has two rules")
        seen.add(rule.type)
        if rule.action == "delete" and (rule.set or rule.increment):
            out.append(f"{where}: a delete takes no `set` or `increment`")
        for kind, mapping in (("set", rule.set), ("increment", rule.increment)):
            for col, src in mapping.items():
                if col not in c.columns:
                    out.append(f"{where}.{kind}.{col}: unknown column (declare it in `columns`)")
                elif col in c.key_columns:
                    out.append(f"{where}.{kind}.{col}: key columns come from `key`")
                elif (msg := check_source(src, literal_ok=kind == "set")) is not None:
                    out.append(f"{where}.{kind}.{col}: {msg}")
    return out


def check_source(src: Any, *, literal_ok: bool = True) -> str | None:
    """None if `src` is a valid value source, else what is wrong with it."""
    if isinstance(src, bool | int | float):
        return None if literal_ok else "expected a payload path (\"payload.x\")"
    if not isinstance(src, str):
        return f"expected a string, number or boolean, got {type(src).__name__}"
    if src.startswith("payload.") and all(src.split(".")[1:]):
        return None
    if src in ENVELOPE_FIELDS:
        return None
    if len(src) >= 2 and src[0] == src[-1] == "'":
        return None if literal_ok else "a literal cannot be incremented"
    return (f"{src!r} is neither a payload path (\"payload.x.y\"), an envelope field "
            f"({', '.join(ENVELOPE_FIELDS)}) nor a quoted literal (\"'text'\")")


def resolved_dedup(config: ProjectionConfig, source_versions: bool) -> Dedup:
    """`config.dedup` with AUTO decided: by version only when the guard is on and the events' versions come from
    their source (a version derived from the offset makes a record produced twice a new version)."""
    if config.dedup is not Dedup.AUTO:
        return config.dedup
    return Dedup.VERSION if config.version_guard and source_versions else Dedup.TRACKING
