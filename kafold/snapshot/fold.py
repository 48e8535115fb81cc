"""The fold shared by restore, verify and the Spark job: an aggregate's domain functions and a tail folder.

Offset note: `Folder.fold` takes a partition's events in offset order. For an aggregate whose base snapshot
covers offset `o`, events below `o` are skipped (already in the state); an event whose version is not above the
aggregate's current version is a duplicate write and skipped too, so a replay never folds an event twice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from kafold import fold as reading
from kafold import logs
from kafold.config import AggregateConfig
from kafold.domain import AggregateDomain
from kafold.envelope import epoch_ms, utc_now
from kafold.snapshot.record import Encoded, Encoder, Snapshot
from kafold.snapshot.select import Identity

log = logs.get(__name__)


@dataclass(frozen=True)
class Domain:
    """initial / evolve and the payload and state conversions of one aggregate type, as the daemon loads them.

    Built by `kafold.domain.AggregateDomain.load`, the one loader: `EVENT_TYPES` found by the same rules (the evolve
    module's, else the decide module's; without one, events are dicts with their `type`), and the state stored as
    JSON through the evolve module's `state_to_json` / `state_from_json` when it defines them, otherwise a dataclass
    state through its fields and anything else as is. So a snapshot run folds exactly what the runtime folds.
    """

    identity: Identity
    initial: Callable[[], Any]
    evolve: Callable[[Any, Any], Any]
    event: Callable[[str, dict[str, Any]], Any]  # a stored event's type name and payload -> the domain event
    to_json: Callable[[Any], Any]
    from_json: Callable[[Any], Any]
    window_ms: int = 86_400_000  # the aggregate's idempotency window, which snapshots carry

    @classmethod
    def load(cls, agg: AggregateConfig, python_path: Sequence[str] = ()) -> Domain:
        d = AggregateDomain.load(agg, tuple(python_path))
        ident = Identity(agg.name, agg.fingerprint, agg.state_schema_version)
        return cls(ident, d.initial, d.evolve, d.event, d.state_to_json, d.state_from_json,
                   int(agg.idempotency_window_s * 1000))


# Entry layout (a list, for speed): [state or None, version, covered offset, changed, base state JSON or None,
# idempotency window: command id -> [command time ms, version after, events]]
STATE, VERSION, COVERED, CHANGED, BASE, WINDOW = range(6)


def _window(commands: Any) -> dict[str, list[int]]:
    return {c[0]: [c[1], c[2], c[3]] for c in commands}


# The most command ids one snapshot record carries: its value stays well under Kafka's default 1 MB record limit.
# A busier aggregate's snapshot carries the newest ids and a marker ["", t, 0, 0] saying ids decided before t are
# not carried; a restore reads them back from the events partition (daemon/aggregates/recovery.note_events).
MAX_SNAPSHOT_COMMANDS = 8000


def _commands(window: dict[str, list[int]], window_ms: int) -> list[list[Any]]:
    """A snapshot's `commands`: the window's ids within `window_ms` of the aggregate's latest command time."""
    if not window:
        return []
    cutoff = max(w[0] for w in window.values()) - window_ms
    kept: list[list[Any]] = [[cid, *w] for cid, w in window.items() if w[0] >= cutoff]
    if len(kept) <= MAX_SNAPSHOT_COMMANDS:
        return kept
    kept.sort(key=lambda c: c[1])
    newest = kept[-MAX_SNAPSHOT_COMMANDS:]
    return [["", newest[0][1], 0, 0], *newest]


class Folder:
    """Folds one events partition on top of base snapshots; keeps per-aggregate state, version and coverage."""

    def __init__(self, domain: Domain, bases: dict[bytes, Snapshot] | None = None) -> None:
        self.domain = domain
        self.entries: dict[bytes, list[Any]] = {
            key: [None, s.version, s.offset, False, s.state, _window(s.commands)] for key, s in (bases or {}).items()}
        self.read = 0        # events seen
        self.folded = 0      # events applied
        self.skipped = 0     # covered by a snapshot or duplicate versions
        self.bad = 0         # could not be decoded or applied; left out of every state
        self.first_bad: list[tuple[int, str]] = []

    def fold(self, offsets: Sequence[int], keys: Sequence[bytes | None], values: Sequence[bytes | None]) -> None:
        """Apply one batch of events (parallel sequences, offset order)."""
        entries, read, make, evolve = self.entries, reading.fields, self.domain.event, self.domain.evolve
        initial, from_json = self.domain.initial, self.domain.from_json
        folded = skipped = 0
        # Hot loop: entry indexes are literals (STATE=0, VERSION=1, COVERED=2, CHANGED=3, BASE=4).
        for offset, key, value in zip(offsets, keys, values, strict=True):
            entry = entries.get(key)  # type: ignore[arg-type]
            if entry is None:
                entry = entries[key] = [None, 0, 0, False, None, {}]  # type: ignore[index]
            elif offset < entry[2]:
                skipped += 1
                continue
            try:
                body = read(value)
                version = body.version
                if version <= entry[1] or type(version) is not int:
                    if type(version) is not int:
                        raise TypeError("version is not an integer")
                    skipped += 1
                    continue
                if body.aggregate_id.encode() != key:
                    raise ValueError("key does not match aggregate_id")
                event = make(body.type, body.payload)
                state = entry[0]
                if state is None:
                    base = entry[4]
                    state = initial() if base is None else from_json(base)
                entry[0] = evolve(state, event)
                cause = body.causation_id
                if cause:
                    seen = entry[5].get(cause)
                    if seen is None:
                        entry[5][cause] = [epoch_ms(body.occurred_at), version, 1]
                    else:
                        seen[1] = version
                        seen[2] += 1
            except Exception as e:  # a bad event is left out of the state, counted and logged per batch
                self._bad(offset, key, e)
                continue
            entry[1] = version
            entry[3] = True
            folded += 1
        self.read += len(offsets)
        self.folded += folded
        self.skipped += skipped

    def _bad(self, offset: int, key: bytes | None, error: Exception) -> None:
        self.bad += 1
        if len(self.first_bad) < 5:
            self.first_bad.append((offset, type(error).__name__))
        if key is not None and self.entries.get(key) == [None, 0, 0, False, None, {}]:
            del self.entries[key]  # nothing usable for it yet

    def fold_messages(self, batches: Iterable[tuple[list[int], list[bytes | None], list[bytes | None]]]) -> None:
        for offsets, keys, values in batches:
            self.fold(offsets, keys, values)

    def state(self, key: bytes) -> Any:
        """The domain state of one aggregate (converting a base snapshot's JSON on first use)."""
        entry = self.entries[key]
        if entry[STATE] is None:
            entry[STATE] = self.domain.initial() if entry[BASE] is None else self.domain.from_json(entry[BASE])
        return entry[STATE]

    def states(self) -> dict[str, tuple[Any, int]]:
        """Every aggregate with at least one event folded: id -> (domain state, version)."""
        return {key.decode(): (self.state(key), e[VERSION]) for key, e in self.entries.items() if e[VERSION] > 0}

    def snapshots(self, partition: int, end: int, refresh_lag: int | None = None) -> Iterable[Snapshot]:
        """Snapshots at `end` for aggregates changed by this fold (and for unchanged ones whose snapshot lags
        `end` by more than `refresh_lag` offsets: same state and version, moved forward, which is still true
        because they have no events in between)."""
        ident, created_at = self.domain.identity, utc_now()  # one time for the run
        for key, state_json, version, commands in self._due(end, refresh_lag):
            yield Snapshot(ident.aggregate_type, key.decode(), state_json, version, partition, end,
                           ident.fingerprint, ident.state_schema_version, created_at, "", commands)

    def encoded_snapshots(self, partition: int, end: int, refresh_lag: int | None = None) -> Iterator[Encoded]:
        """`snapshots(...)` as the (key, value, headers) records to produce (`Snapshot.encode`'s bytes)."""
        ident = self.domain.identity
        encoder = Encoder(ident.aggregate_type, partition, end, ident.fingerprint, ident.state_schema_version,
                          utc_now())
        encode = encoder.encode
        for key, state_json, version, commands in self._due(end, refresh_lag):
            yield encode(key.decode(), state_json, version, commands)

    def _due(self, end: int, refresh_lag: int | None) -> Iterator[tuple[bytes, Any, int, list[list[Any]]]]:
        to_json, window_ms = self.domain.to_json, self.domain.window_ms
        for key, e in self.entries.items():
            if e[CHANGED]:
                yield key, to_json(e[STATE]), e[VERSION], _commands(e[WINDOW], window_ms)
            elif refresh_lag is not None and e[BASE] is not None and end - e[COVERED] > refresh_lag:
                yield key, e[BASE], e[VERSION], _commands(e[WINDOW], window_ms)

    def log_bad(self, partition: int) -> None:
        if self.bad:
            log.warning("snapshot.bad_events", aggregate=self.domain.identity.aggregate_type, partition=partition,
                        bad=self.bad, first=self.first_bad, action="left out of the state")
