"""Pure mapping from events to rows: key extraction and the fold of one event into its row (no I/O but a warning).

Two values from converters are not data: an event of type TRUNCATE has the empty key `()` (the fold empties the
table, fold.py), and a `set` value UNAVAILABLE (Debezium's placeholder for an unchanged TOASTed column) leaves the
column as the row has it (a Debezium key change moves the old row to the new key first: rekey.py). A row that does
not exist yet (an insert, an update of a row the projection never had) cannot get that value back: the column stays
NULL and `projection.value_unavailable` is logged (the source table needs REPLICA IDENTITY FULL for Debezium to send
it).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from decimal import Decimal
from typing import Any

from kafold import logs
from kafold.connectors.convert.api import TRUNCATE, UNAVAILABLE
from kafold.connectors.projection.config import VERSION_COLUMN, ProjectionConfig
from kafold.envelope import Event
from kafold.errors import ConfigError, RecordError
from kafold.refs import import_ref

log = logs.get(__name__)

Row = dict[str, Any]
Mapper = Callable[[Row | None, Event], Row | None]
Source = Callable[[Event], Any]


class MappingError(RecordError):
    """An event does not fit the mapping (a payload path is missing, a value has the wrong kind)."""

    def __init__(self, message: str, *, raw: Any = None) -> None:
        super().__init__(message, raw=raw, reason="schema-invalid")


class _Unchanged:
    """The event leaves the row as it is (an `update` of a row that does not exist)."""


UNCHANGED = _Unchanged()


def source(spec: Any) -> Source:
    """A function reading one value from an event: `payload.a.b`, an envelope field, `'literal'` or a scalar."""
    if not isinstance(spec, str):
        return lambda _e: spec
    if spec.startswith("payload."):
        path = spec.split(".")[1:]

        def read(event: Event) -> Any:
            node: Any = event.payload
            for part in path:
                if type(node) is not dict or part not in node:
                    raise MappingError(f"event {event.event_id} ({event.type}): {spec} is missing")
                node = node[part]
            return node
        return read
    if len(spec) >= 2 and spec[0] == spec[-1] == "'":
        text = spec[1:-1]
        return lambda _e: text
    return lambda event: getattr(event, spec)


def load_mapper(ref: str) -> Mapper:
    """The function a `module:function` reference names (ConfigError naming the reference if it cannot)."""
    try:
        fn = import_ref(ref)
    except LookupError as e:
        raise ConfigError([f"mapper: cannot load {e}"]) from e
    if not callable(fn):
        raise ConfigError([f"mapper: {ref!r} is not callable"])
    return fn


def _add(current: Any, delta: Any, what: str, event: Event) -> Any:
    if type(delta) is int and (type(current) is int or current is None):  # the common case, checked exactly
        return delta if current is None else current + delta
    if isinstance(delta, bool) or not isinstance(delta, int | float | Decimal):
        raise MappingError(f"event {event.event_id} ({event.type}): {what} is not a number")
    if current is None:
        return delta
    if isinstance(current, Decimal) and isinstance(delta, float):
        delta = Decimal(repr(delta))
    return current + delta


class Mapping:
    """The compiled mapping of one projection: which events it handles, their keys, and the fold step."""

    def __init__(self, config: ProjectionConfig, mapper: Mapper | None = None) -> None:
        self.config = config
        self.columns = tuple(config.columns)
        self.key_columns = tuple(config.key_columns)
        self._keys = [source(config.key_sources[c]) for c in self.key_columns]
        self._types = config.handled_types
        self._mapper = mapper
        self._rules: dict[str, tuple[str, list[tuple[str, Source]], list[tuple[str, str, Source]]]] = {
            rule.type: (rule.action, [(c, source(s)) for c, s in rule.set.items()],
                        [(c, str(s), source(s)) for c, s in rule.increment.items()])
            for rule in config.on}
        self.guard = config.version_guard
        # Event types whose rule makes the whole row from the event alone (an upsert setting every column, no
        # increment): with the guard, such an event needs nothing of the stored row but its version (whole_rows.py).
        rest = set(self.columns) - set(self.key_columns)
        whole = [] if mapper is not None else config.on
        self.whole_types = frozenset(rule.type for rule in whole
                                     if rule.action == "upsert" and not rule.increment and rest <= set(rule.set))
        # Per whole type: its rule's readers, and where each written column (`written`) takes its value from in the
        # list `whole_row` makes of what they read, then the key, then the version (a key column from the key).
        self.written = (*self.columns, VERSION_COLUMN)
        # A rule whose every value is a top-level payload field (`payload.x`) reads them all with one itemgetter on
        # the payload (a batch's whole rows are most of a busy projection's reads); a field missing, or any other
        # rule, reads them one by one, which names the problem.
        self._whole: dict[str, tuple[list[Source], Callable[[list[Any]], tuple[Any, ...]], Any]] = {}
        for name in self.whole_types:
            rule = {r.type: r for r in config.on}[name]  # the one `_rules` keeps
            sets = self._rules[name][1]
            at = {c: i for i, (c, _) in enumerate(sets)}
            at.update({c: len(sets) + i for i, c in enumerate(self.key_columns)})
            at[VERSION_COLUMN] = len(sets) + len(self.key_columns)
            fields = [str(spec)[len("payload."):] for spec in rule.set.values()]
            flat = len(fields) > 1 and all(isinstance(spec, str) and spec.startswith("payload.") and "." not in f
                                           for spec, f in zip(rule.set.values(), fields, strict=True))
            self._whole[name] = ([read for _, read in sets], operator.itemgetter(*(at[c] for c in self.written)),
                                 operator.itemgetter(*fields) if flat else None)

    def handles(self, event_type: str) -> bool:
        # a truncate the converter was told to apply is never skipped as an unknown type
        return self._types is None or event_type in self._types or event_type == TRUNCATE

    def key(self, event: Event) -> tuple[Any, ...]:
        """The row key of `event` (`()`: a truncate, every row); MappingError if a key source is missing or null."""
        if event.type == TRUNCATE:
            return ()
        if len(self._keys) == 1:  # the common case, without a generator per event
            value = self._keys[0](event)
            if value is None:
                raise MappingError(f"event {event.event_id} ({event.type}): a key column would be null")
            return (value,)
        values = tuple([read(event) for read in self._keys])
        if None in values:
            raise MappingError(f"event {event.event_id} ({event.type}): a key column would be null")
        return values

    @property
    def copies_rows(self) -> bool:
        """Rules: a row is never changed in place, and json columns are only set (a mapper is the user's code)."""
        return self._mapper is None

    def is_stale(self, row: Row | None, event: Event) -> bool:
        """An older (or the same) aggregate version than the row already reflects: never overwrite newer."""
        return self.guard and row is not None and event.version <= (row.get(VERSION_COLUMN) or 0)

    def apply(self, row: Row | None, event: Event, key: tuple[Any, ...]) -> Row | _Unchanged | None:
        """The row after `event` (a new dict), None to delete it, or UNCHANGED."""
        if self._mapper is not None:
            return self._apply_mapper(row, event, key)
        action, sets, increments = self._rules[event.type]
        if action == "delete":
            return None if row is not None else UNCHANGED
        if action == "update" and row is None:
            return UNCHANGED
        new: Row = dict(row) if row is not None else dict.fromkeys(self.columns)
        for column, read in sets:
            value = read(event)
            if value.__class__ is str and value == UNAVAILABLE:
                if row is None:
                    log.warning("projection.value_unavailable", event_id=event.event_id, event_type=event.type,
                                column=column, table=self.config.table)
                continue
            new[column] = value
        for column, spec, read in increments:
            new[column] = _add(new.get(column), read(event), spec, event)
        new.update(zip(self.key_columns, key, strict=True))
        new[VERSION_COLUMN] = event.version
        return new

    def whole_row(self, event: Event, key: tuple[Any, ...]) -> tuple[Any, ...] | None:
        """The row `event` makes by itself when its type's rule sets every column (`whole_types`), as its values in
        the order of `written` (the version last: a batch's arrays are these rows' columns, whole_rows.py); None
        when it needs the stored row after all (a value UNAVAILABLE keeps the stored one). MappingError as in
        `apply`, which makes the same row as a dict."""
        reads, order, fields = self._whole[event.type]
        try:
            values = list(fields(event.payload)) if fields is not None else None
        except KeyError:  # the reads one by one name it
            values = None
        if values is not None:
            if UNAVAILABLE in values:  # JSON values: only the string itself equals it
                return None
        else:
            values = []
            for read in reads:
                value = read(event)
                if value.__class__ is str and value == UNAVAILABLE:
                    return None
                values.append(value)
        values.extend(key)
        values.append(event.version)
        return order(values)

    def _apply_mapper(self, row: Row | None, event: Event, key: tuple[Any, ...]) -> Row | _Unchanged | None:
        assert self._mapper is not None
        given = {c: row.get(c) for c in self.columns} if row is not None else None
        try:
            out = self._mapper(given, event)
        except RecordError:
            raise
        except Exception as e:  # the user's function failed on this event: dead-letter it, keep going
            raise MappingError(f"event {event.event_id} ({event.type}): mapper raised "
                               f"{type(e).__name__}: {e}") from e
        if out is None:
            return None if row is not None else UNCHANGED
        if not isinstance(out, dict):
            raise MappingError(f"event {event.event_id} ({event.type}): mapper returned "
                               f"{type(out).__name__}, expected dict or None")
        unknown = sorted(set(out) - set(self.columns))
        if unknown:
            raise MappingError(f"event {event.event_id} ({event.type}): mapper returned unknown column(s) "
                               f"{', '.join(unknown)}")
        new: Row = dict.fromkeys(self.columns)
        new.update(out)
        new.update(zip(self.key_columns, key, strict=True))
        new[VERSION_COLUMN] = event.version
        return new
